"""Export to torch.distributed.pipelining's compute-only CSV, and PyTorch running it."""

from __future__ import annotations

import pytest

from pipeopt.executor.export import (
    export_torch,
    to_torch_csv,
    to_torchtitan_toml,
    torch_actions,
)
from pipeopt.problem import uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError
from pipeopt.solvers import solve


def test_split_backward_exports_i_and_w() -> None:
    sched = solve(uniform_problem(2, 2), "zb-h1")
    assert to_torch_csv(sched).splitlines() == ["0F0,0F1,0I0,0W0,0I1,0W1",
                                                "1F0,1I0,1F1,1I1,1W0,1W1"]


def test_fused_backward_exports_b() -> None:
    sched = solve(uniform_problem(2, 2, virtual_stages=2), "interleaved-1f1b")
    rows = torch_actions(sched)
    assert not sched.problem.split_backward
    assert all(cell[-2] in "FB" for row in rows for cell in row)
    assert sorted(c for row in rows for c in row if c.startswith("3")) == ["3B0", "3B1", "3F0",
                                                                          "3F1"]


def test_invalid_schedule_is_not_exported() -> None:
    sched = solve(uniform_problem(2, 2), "zb-h1")
    # every op moved to time 0: dependencies broken
    broken = Schedule(sched.problem, "x", tuple(o._replace(start=0.0, end=o.end - o.start)
                                                 for o in sched.ops))
    with pytest.raises(ScheduleError, match="invalid schedule"):
        to_torch_csv(broken)


def test_torch_parser_reads_every_cell_back() -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import _Action

    sched = solve(uniform_problem(4, 8, virtual_stages=2, placement="vshape"), "zb-v")
    for row in torch_actions(sched):
        assert [str(_Action.from_str(c)) for c in row] == row


def test_cli_export(tmp_path, capsys) -> None:
    from pipeopt.cli import main
    from pipeopt.io import dump_schedule

    src, out = tmp_path / "s.json", tmp_path / "s.csv"
    sched = solve(uniform_problem(2, 2), "1f1b")
    dump_schedule(sched, src)
    assert main(["export", str(src), "--to", "torch", "-o", str(out)]) == 0
    assert out.read_text() == to_torch_csv(sched)
    assert "written" in capsys.readouterr().out


@pytest.mark.torch
def test_pytorch_runtime_runs_exported_schedules(tmp_path) -> None:
    """The CSV, read by PyTorch's own parser, holds exactly the actions the executor hands to
    ``_PipelineScheduleRuntime``; those runs match one-process training (2 gloo ranks)."""
    pytest.importorskip("torch")
    from pipeopt.executor._torch import parse_action, rows_to_actions
    from pipeopt.executor.export import schedule_rows
    from pipeopt.executor.launch import RunConfig, run_pipelines

    scheds = [solve(uniform_problem(2, 4), "zb-h1"),
              solve(uniform_problem(2, 4, virtual_stages=2), "interleaved-1f1b"),
              solve(uniform_problem(2, 4, virtual_stages=2, placement="vshape"), "zb-v")]
    for i, s in enumerate(scheds):
        path = tmp_path / f"{i}.csv"
        export_torch(s, path)
        rows = [[parse_action(c) for c in line.split(",")]
                for line in path.read_text().splitlines()]
        assert rows == list(rows_to_actions(schedule_rows(s)[0]).values())
    jobs = [(s, RunConfig(model="tiny-gpt", check=True)) for s in scheds]
    for s, res in zip(scheds, run_pipelines(jobs), strict=True):
        assert res.grads_match, f"{s.method}: {res.max_abs_grad_diff}"
        assert res.losses == pytest.approx(res.reference_losses, rel=1e-5)


# ----- torchtitan and Megatron-LM -----------------------------------------------------------
def _model_plan(devices=4, v=1, placement="loop", method="1f1b", layers=8, mbs=2, **extra):
    """A schedule of a small transformer (embedding, ``layers`` blocks, head) solved from the
    model form, with an explicit stage split when ``stage_layers`` is given."""
    from pipeopt.config import parse_config

    data = {"pipeline": {"devices": devices, "microbatches": 8, "virtual_stages": v,
                         "placement": placement, "split_backward": method.startswith("zb")},
            "model": {"layers": layers, "hidden": 256, "heads": 4, "seq_len": 128,
                      "vocab": 1000, "micro_batch_size": mbs},
            "cluster": {"gpu": "A100-80GB", "gpus_per_node": 8}, **extra}
    return solve(parse_config(data).problem, method)


def _blocks_per_stage(parts):
    """Stage split back from torchtitan's module names: (embedding, blocks, head) per stage."""
    return [("tok_embeddings" in p, [int(n.split(".")[1]) for n in p if n.startswith("layers.")],
             p[-2:] == ["norm", "output"]) for p in parts]


def test_torchtitan_toml_parses_back_to_the_plan() -> None:
    import tomllib

    sched = _model_plan(training={"stage_layers": [3, 2, 2, 3]})
    doc = tomllib.loads(to_torchtitan_toml(sched, "plans/s.csv"))
    par = doc["parallelism"]
    assert par["pipeline_parallel_degree"] == 4
    assert par["pipeline_parallel_schedule_csv"] == "plans/s.csv"
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert doc["training"]["local_batch_size"] == 8 * 2  # 8 micro-batches of 2 sequences
    # Layers [embedding, block0, block1], [block2, block3], [block4, block5], [block6, block7,
    # head]: the head is torchtitan's final norm and output projection.
    assert par["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"],
        ["layers.4", "layers.5"], ["layers.6", "layers.7", "norm", "output"]]


def test_torchtitan_places_looped_and_v_shaped_stages() -> None:
    import tomllib

    loop = tomllib.loads(to_torchtitan_toml(_model_plan(2, 2, "loop", "interleaved-1f1b"),
                                            "s.csv"))["parallelism"]
    assert loop["pipeline_parallel_schedule"] == "Interleaved1F1B"
    vee = _model_plan(2, 2, "vshape", "zb-v")
    par = tomllib.loads(to_torchtitan_toml(vee, "s.csv"))["parallelism"]
    assert par["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    # torchtitan's v-shape gives rank r stages (r, 2p-1-r), as the plan: the stage split is
    # listed in stage order, every block exactly once.
    split = _blocks_per_stage(par["module_fqns_per_model_part"])
    assert [b for _, blocks, _ in split for b in blocks] == list(range(8))
    assert split[0][0] and split[-1][2]
    assert vee.problem.stage_device == (0, 1, 1, 0)


def _megatron_parser():
    import argparse

    p = argparse.ArgumentParser()
    for flag in ("--pipeline-model-parallel-size", "--num-layers", "--micro-batch-size",
                 "--global-batch-size", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers"):
        p.add_argument(flag, type=int)
    p.add_argument("--pipeline-model-parallel-layout", type=str)
    return p


def _megatron_layout(text):
    """Megatron's layout grammar, read independently: stages split at '|', 't*N' repeats."""
    import re

    out = []
    for stage in text.split("|"):
        n = sum(int(k or 1) for k in re.findall(r"t(?:\*(\d+))?", stage))
        out.append(("E" in stage, n, "L" in stage))
    return out


def test_megatron_first_last_flags_parse_back() -> None:
    import shlex

    from pipeopt.executor.export import to_megatron_args

    sched = _model_plan(training={"stage_layers": [2, 3, 3, 2]})  # blocks 1, 3, 3, 1
    ns = _megatron_parser().parse_args(shlex.split(to_megatron_args(sched)))
    assert (ns.pipeline_model_parallel_size, ns.num_layers) == (4, 8)
    assert ns.decoder_first_pipeline_num_layers == 1
    assert ns.decoder_last_pipeline_num_layers == 1
    assert ns.pipeline_model_parallel_layout is None
    # Megatron splits the rest evenly over the middle stages: (8 - 1 - 1) / 2 = 3 each.
    assert (ns.micro_batch_size, ns.global_batch_size) == (2, 16)


def test_megatron_layout_when_the_middle_is_uneven_or_interleaved() -> None:
    import shlex

    from pipeopt.executor.export import to_megatron_args

    sched = _model_plan(training={"stage_layers": [3, 3, 2, 2]})  # blocks 2, 3, 2, 1
    ns = _megatron_parser().parse_args(shlex.split(to_megatron_args(sched)))
    assert ns.decoder_first_pipeline_num_layers is None
    assert ns.pipeline_model_parallel_layout == "Et*2|t*3|t*2|tL"
    assert _megatron_layout(ns.pipeline_model_parallel_layout) == [
        (True, 2, False), (False, 3, False), (False, 2, False), (False, 1, True)]
    # Two stages per rank, looped: 4 stages in stage order, stage s on rank s mod 2.
    inter = _model_plan(2, 2, "loop", "interleaved-1f1b", training={"stage_layers": [1, 3, 3, 3]})
    ns = _megatron_parser().parse_args(shlex.split(to_megatron_args(inter)))
    assert ns.pipeline_model_parallel_size == 2
    assert _megatron_layout(ns.pipeline_model_parallel_layout) == [
        (True, 0, False), (False, 3, False), (False, 3, False), (False, 2, True)]


def test_exports_refuse_what_the_target_cannot_express() -> None:
    from pipeopt.executor.export import ExportError, to_megatron_args

    vee = _model_plan(2, 2, "vshape", "zb-v")
    with pytest.raises(ExportError, match=r"^megatron: the v-shape placement .* rank s mod p"):
        to_megatron_args(vee)
    four = _model_plan(2, 4, "vshape", "greedy")
    with pytest.raises(ExportError, match=r"^torchtitan: a v-shape of 4 stages per rank"):
        to_torchtitan_toml(four, "x.csv")
    explicit = solve(uniform_problem(2, 2), "1f1b")
    for target, fn in (("torchtitan", lambda s: to_torchtitan_toml(s, "x.csv")),
                       ("megatron", to_megatron_args)):
        with pytest.raises(ExportError, match=rf"^{target}: the schedule carries no layer "
                                              "partition"):
            fn(explicit)
    from pipeopt.config import parse_config

    layered = parse_config({
        "pipeline": {"devices": 2, "microbatches": 2},
        "model": {"layer_costs": [{"name": "x", "count": 4, "forward": 1.0}]},
        "cluster": {"gpus_per_node": 2}}).problem
    with pytest.raises(ExportError, match=r"^megatron: the plan's layers are not a "
                                          "transformer's"):
        to_megatron_args(solve(layered, "1f1b"))


def test_cli_export_torchtitan_and_megatron(tmp_path, capsys) -> None:
    import tomllib

    from pipeopt.cli import main
    from pipeopt.io import dump_schedule

    src = tmp_path / "s.json"
    sched = _model_plan()
    dump_schedule(sched, src)
    toml, csv_ = tmp_path / "p.toml", tmp_path / "p.csv"
    assert main(["export", str(src), "--to", "torchtitan", "--csv", str(csv_),
                 "-o", str(toml)]) == 0
    assert csv_.read_text() == to_torch_csv(sched)
    par = tomllib.loads(toml.read_text())["parallelism"]
    assert par["pipeline_parallel_schedule_csv"] == str(csv_)
    capsys.readouterr()
    assert main(["export", str(src), "--to", "megatron"]) == 0
    assert capsys.readouterr().out.startswith("--pipeline-model-parallel-size 4 --num-layers 8")
    assert main(["export", str(src), "--to", "torchtitan"]) == 2
    assert "--csv: needed with --to torchtitan" in capsys.readouterr().err
    assert main(["export", str(src), "--to", "megatron", "--csv", str(csv_)]) == 2
    assert "--csv: only used with --to torchtitan" in capsys.readouterr().err
