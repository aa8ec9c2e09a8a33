"""Task-graph configs (pipeopt.graph_config): data parallelism with scheduled collectives
through `pipeopt solve / compare`, v2 files that simulate, plot and trace, and the errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from pipeopt.cli import main
from pipeopt.config import ConfigError, read_yaml
from pipeopt.core.validate import check
from pipeopt.graph_config import (
    DDP_BUCKET_BYTES,
    graph_loader,
    load_dataparallel,
    load_graph_config,
    load_moe_graph,
)
from pipeopt.graphio import load_any
from pipeopt.solvers.graph import compare_graph, solve_graph
from pipeopt.workloads import dataparallel as dpw

ROOT = Path(__file__).resolve().parents[1]

#: 2 stages, 4 micro-batches, 2 replicas in two datacenters over a 1 GB/s WAN (10 ms).
EXPLICIT = {
    "pipeline": {"devices": 2, "microbatches": 4},
    "stages": {"forward": 0.1, "backward_input": 0.1, "backward_weight": 0.1,
               "activation_memory": 1.0},
    "data_parallel": {"replicas": 2, "grad_bytes": 1.0e9, "param_bytes": 0.5e9,
                      "latency": 1.0e-5, "bandwidth": 1.0e11, "datacenters": [0, 1],
                      "wan": {"latency": 0.01, "bandwidth": 1.0e9},
                      "delayed_reduction": True, "iterations": 2},
    "solver": {"method": "greedy", "time_limit": 5},
}


def _write(tmp_path: Path, data: dict[str, object], name: str = "dp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_dispatch_is_keyed_by_the_document() -> None:
    assert graph_loader(EXPLICIT) is load_dataparallel
    model = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    assert graph_loader(model) is load_dataparallel
    for chain in ("uniform.yaml", "gpt_small.yaml", "inference.yaml", "async.yaml"):
        assert graph_loader(read_yaml(ROOT / "examples" / chain)) is None, chain
    scalar = {**model, "training": {**model["training"], "collectives": "scalar"}}
    assert graph_loader(scalar) is None
    assert graph_loader(read_yaml(ROOT / "examples/moe.yaml")) is load_moe_graph


def test_explicit_form_builds_the_graph_by_hand() -> None:
    """1 GB of gradients over the 1 GB/s WAN between 2 replicas: a reduce-scatter of
    10 ms + 1/2 * 1e9 / 1e9 = 0.51 s; an all-gather of 0.5 GB 0.26 s."""
    cfg = load_graph_config(EXPLICIT, "dp.yaml")
    dp, g = cfg.work.dp, cfg.work.graph
    assert dp.delayed and dp.iterations == 2 and dp.crosses_datacenters
    assert cfg.work.hand_made == ("1f1b", "zb-h1", "1f1b:pipelined", "zb-h1:pipelined")
    idx = {x: i for i, x in enumerate(g.label)}
    assert g.duration[idx["i0.RS 0"]] == pytest.approx(0.51)
    assert g.duration[idx["i1.AG 1"]] == pytest.approx(0.26)
    assert g.networks == ("wan",)
    assert cfg.work.problem.grad_reduce == (0.0, 0.0)


def test_solve_writes_v2_that_simulates_plots_and_traces(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, EXPLICIT)
    out = tmp_path / "dp.json"
    assert main(["solve", str(path), "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "iteration" in text and "= makespan / 2 iterations" in text
    assert "delayed one step" in text
    sched = load_any(out)
    assert check(sched) == []  # type: ignore[arg-type]
    assert dict(sched.graph.meta)["iterations"] == 2  # type: ignore[union-attr]
    assert main(["solve", str(path), "-q", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["iteration_time"] == pytest.approx(doc["makespan"] / 2)
    assert doc["periodic_bound"] <= doc["iteration_time"] + 1e-9
    assert main(["simulate", str(out)]) == 0
    assert main(["plot", str(out), "-o", str(tmp_path / "dp.png"), "--dpi", "30"]) == 0
    assert (tmp_path / "dp.png").stat().st_size > 0
    assert main(["trace", str(out), "-o", str(tmp_path / "trace.json")]) == 0
    events = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in (events["traceEvents"] if isinstance(events, dict)
                                     else events)}
    assert "i0.RS 0" in names and "i1.AG 1" in names


def test_compare_ranks_every_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    path = _write(tmp_path, EXPLICIT)
    assert main(["compare", str(path), "--methods", "1f1b,zb-h1,zb-h1:pipelined,greedy",
                 "--json", "-q"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"1f1b", "zb-h1", "zb-h1:pipelined", "greedy"}
    best = min(r["iteration_time"] for r in rows.values() if r["fits"])
    for r in rows.values():
        assert r["iteration_time"] == pytest.approx(r["makespan"] / 2)
        assert r["ratio"] == pytest.approx(r["iteration_time"] / best)
    assert main(["compare", str(path), "--methods", "zb-h1,greedy", "-q"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["method", "s/iteration", "vs"]


def test_compare_plot_draws_every_method(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``compare --plot`` of a task-graph config: one panel per method on a common time
    axis, the over-limit one titled in red, written after the table."""
    from pipeopt.plot import render_graph_compare
    from pipeopt.solvers.graph import compare_graph

    path = _write(tmp_path, EXPLICIT)
    out = tmp_path / "cmp.png"
    assert main(["compare", str(path), "--methods", "1f1b,zb-h1", "-q", "--plot",
                 str(out)]) == 0
    assert f"written {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = compare_graph(load_graph_config(EXPLICIT, "dp.yaml").work, ["1f1b", "zb-h1"],
                         time_limit=3, workers=1)
    scheds = [r.schedule for r in rows]
    fig = render_graph_compare(scheds, fits=[True, False], values=[r.value for r in rows],
                               dpi=30)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert len(titles) == 2 and titles[1].startswith("OVER MEMORY LIMIT")
    assert "x1.000 of best" in titles[0]
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()  # one time axis
    with pytest.raises(ValueError, match="fits / values: expected 2 entries"):
        render_graph_compare(scheds, fits=[True])
    assert main(["compare", str(path), "--methods", "1f1b", "--plot",
                 str(tmp_path / "x.txt")]) == 2  # a bad suffix before any method runs


def test_search_is_never_worse_than_the_hand_made_schedules() -> None:
    cfg = load_graph_config(EXPLICIT, "dp.yaml")
    rows = compare_graph(cfg.work, time_limit=3, workers=1)
    hand = min(r.value for r in rows if r.method in cfg.work.hand_made and r.fits
               and r.schedule is not None and r.schedule.graph == cfg.work.graph)
    auto = solve_graph(cfg.work, "auto", time_limit=3, workers=1)
    cp = solve_graph(cfg.work, "cpsat", time_limit=3, workers=1)
    assert check(auto) == [] and check(cp) == []
    assert dpw.iteration_time(cp) <= hand + 1e-9
    assert dpw.iteration_time(auto) <= min(r.value for r in rows if r.value) + 1e-9


def test_model_form_example_has_buckets_and_crosses_the_wan() -> None:
    """examples/dp_cross_dc.yaml: per stage, its layers' parameters x 2 bytes of gradients in
    25 MiB-or-larger buckets of whole layers, backward order, shares of the last W."""
    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    cfg = load_graph_config(data, "dp_cross_dc.yaml")
    dp, prob = cfg.work.dp, cfg.work.problem
    rows = dict(prob.meta)["stage_costs"]
    for k, row in enumerate(rows):
        assert dp.grad_bytes[k] == pytest.approx(row["params"] * 2.0)
        assert math.fsum(dp.bucket_bytes[k]) == pytest.approx(dp.grad_bytes[k])
        assert math.fsum(dp.bucket_share[k]) == pytest.approx(1.0)
        # every bucket but the last (the first layers) holds at least the cap
        assert all(b >= DDP_BUCKET_BYTES for b in dp.bucket_bytes[k][:-1])
    assert dp.crosses_datacenters and all(dp.ring_wan)
    # the ring's bottleneck is the 100 Gbit/s WAN tier of the example, 5 ms (plus the hops
    # inside each node on the way: 7 us)
    assert {c.bandwidth for c in dp.ring_cost} == {12.5e9}
    assert all(0.005 <= c.latency < 0.0051 for c in dp.ring_cost)
    assert dp.delayed and dp.iterations == 3 and dp.reduction == "reduce_scatter"
    # ZeRO-1 with the delay: a second gradient buffer and a second parameter copy per stage
    assert dp.buffer_memory == pytest.approx(tuple(2 * g for g in dp.grad_bytes))


def test_model_form_without_buckets_has_one_per_stage() -> None:
    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    training = {k: v for k, v in data["training"].items() if k != "bucket_bytes"}
    cfg = load_graph_config({**data, "training": {**training, "iterations": 1,
                                                  "delayed_reduction": False}})
    assert all(len(b) == 1 for b in cfg.work.dp.bucket_bytes)
    assert cfg.work.hand_made == ("1f1b", "zb-h1")


@pytest.mark.parametrize(("change", "message"), [
    ({"data_parallel": {**EXPLICIT["data_parallel"], "reduction": "ring"}},  # type: ignore
     "data_parallel.reduction: "),
    ({"data_parallel": {**EXPLICIT["data_parallel"], "replicas": 1}},  # type: ignore
     "data_parallel.replicas: "),
    ({"data_parallel": {k: v for k, v in EXPLICIT["data_parallel"].items()  # type: ignore
                        if k != "wan"}}, "data_parallel.wan: missing"),
    ({"data_parallel": {**EXPLICIT["data_parallel"], "grad_bytes": [1.0]}},  # type: ignore
     r"data_parallel.grad_bytes: expected 2 values \(one per stage\), got 1"),
    ({"data_parallel": {**EXPLICIT["data_parallel"], "datacenters": [0]}},  # type: ignore
     "data_parallel.datacenters: expected 2 values"),
    ({"data_parallel": {**EXPLICIT["data_parallel"], "iterations": 99}},  # type: ignore
     "data_parallel.iterations: "),
    ({"data_parallel": {**EXPLICIT["data_parallel"], "colour": 1}},  # type: ignore
     "data_parallel.colour"),
    ({"pipeline": {"devices": 2, "microbatches": 4, "virtual_stages": 2}},
     "data_parallel: scheduled collectives need one stage per device"),
    ({"stages": {**EXPLICIT["stages"], "grad_reduce": 0.5}},  # type: ignore[dict-item]
     r"stages.grad_reduce: must be 0 \(or left out\) with data_parallel:"),
])
def test_explicit_errors_name_the_key(change: dict[str, object], message: str) -> None:
    from pipeopt.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_graph_config({**EXPLICIT, **change}, "dp.yaml")


@pytest.mark.parametrize(("training", "message"), [
    ({"reduction": "ring"}, "training.reduction: "),
    ({"data_parallel": 1}, "training.data_parallel: scheduled collectives need >= 2 replicas"),
    ({"bucket_bytes": -1}, "training.bucket_bytes: "),
    ({"iterations": 0}, "training.iterations: "),
    ({"delayed_reduction": "yes"}, "training.delayed_reduction: "),
])
def test_model_form_errors_name_the_key(training: dict[str, object], message: str) -> None:
    from pipeopt.errors import ConfigError

    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    with pytest.raises(ConfigError, match=message):
        load_graph_config({**data, "training": {**data["training"], **training}})


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, EXPLICIT)
    assert main(["solve", str(path), "--method", "zb-v"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeopt: error: --method: unknown method 'zb-v'") and "1f1b" in err
    assert main(["solve", str(path), "--objective", "span"]) == 2
    assert "--objective: a task-graph config" in capsys.readouterr().err
    bad = _write(tmp_path, {**EXPLICIT, "solver": {"method": "gpipe"}}, "bad.yaml")
    assert main(["solve", str(bad)]) == 2
    assert "solver.method: unknown method 'gpipe'" in capsys.readouterr().err
    over = _write(tmp_path, {**EXPLICIT, "memory": {"limit": 1.5}}, "over.yaml")
    assert main(["solve", str(over), "--method", "1f1b"]) == 2
    assert "exceeds the limit" in capsys.readouterr().err


def test_standard_input_is_read_once_and_solved(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A task-graph config on standard input (read once by the one entry point) takes the
    task-graph route, as the same file does."""
    import io

    data = yaml.safe_dump({**EXPLICIT, "data_parallel": {**EXPLICIT["data_parallel"],
                                                         "iterations": 1}}).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["solve", "-", "--method", "zb-h1", "--json"]) == 0
    piped = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["compare", "-", "--methods", "1f1b,zb-h1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["1f1b", "zb-h1"]
    assert rows[1]["iteration_time"] == pytest.approx(piped["iteration_time"])


def test_docs_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/collectives.md's Python example runs and prints one line per method."""
    import re

    text = (ROOT / "docs/collectives.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    exec(compile(code.group(1).replace("time_limit=5", "time_limit=1"), "collectives.md",
                 "exec"), {"__name__": "_doc"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert [x.split()[0] for x in lines] == ["1f1b", "zb-h1", "zb-h1:pipelined", "greedy",
                                             "cpsat"]
    # the benchmark's 1 GB WAN case: the delayed hand-made ZB-H1 takes 3.48 s per iteration
    assert lines[1].split()[1] == "3.480"


def test_model_form_with_virtual_stages_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scheduled collectives are built per stage on its own device: v > 1 is refused with the
    key that asked for them, before any search."""
    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    path = _write(tmp_path, {**data, "pipeline": {**data["pipeline"], "virtual_stages": 2}})
    assert main(["solve", str(path), "--method", "1f1b"]) == 2
    assert capsys.readouterr().err == (
        "pipeopt: error: training.collectives: scheduled collectives need one stage per device "
        "(pipeline.virtual_stages: 1), got 2\n")


def test_cpsat_and_auto_start_from_the_forward_backward_passes() -> None:
    """cpsat and auto first run forward-backward passes over the hand-made schedules on the
    search's graph: what they return is never longer than what the passes gave; a graph with
    tails gets none (its objective has no mirror image)."""
    from pipeopt.core.justify import improve
    from pipeopt.solvers.graph import _hand_made, _justified

    work = load_graph_config(EXPLICIT, "dp.yaml").work
    hand = [_hand_made(work, n) for n in work.hand_made]
    same = [h for h in hand if h.graph == work.graph and not check(h)]
    assert same
    passes = min(improve(work.graph, h).objective for h in same)
    assert passes <= min(h.objective for h in same) + 1e-12
    for method in ("cpsat", "auto"):
        found = solve_graph(work, method, time_limit=3, workers=1)
        assert check(found) == [] and found.objective <= passes + 1e-9
    tailed = work.graph.replace(tail=(0.5, *work.graph.tail[1:]))
    assert _justified(tailed, [], 1e18) == []
    assert _justified(tailed, same, 1e18) == []


def test_tree_all_reduce_from_both_forms(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``algorithm: tree`` (explicit) / ``collective_algorithm: tree`` (model form) times the
    all-reduce by the binomial tree: 2 replicas over the 10 ms, 1 GB/s WAN, 1 GB: 2 rounds of
    0.01 + 1 s = 2.02 s (the ring: 2 x 0.01 + 2 x 1/2 x 1 s = 1.02 s). The reduce-scatter has
    no tree: refused by the key's name."""
    sec = {**EXPLICIT["data_parallel"], "reduction": "all_reduce",  # type: ignore[dict-item]
           "algorithm": "tree"}
    cfg = load_graph_config({**EXPLICIT, "data_parallel": sec}, "dp.yaml")
    g = cfg.work.graph
    idx = {x: i for i, x in enumerate(g.label)}
    assert g.duration[idx["i0.AR 0"]] == pytest.approx(2.02)
    assert dict(cfg.facts)["collectives"].startswith("all-reduce (tree)")
    ring = load_graph_config({**EXPLICIT, "data_parallel": {**sec, "algorithm": "ring"}}, "x")
    assert ring.work.graph.duration[idx["i0.AR 0"]] == pytest.approx(1.02)
    with pytest.raises(ConfigError, match=r"^data_parallel\.algorithm: tree is modelled for "
                                          r"the all-reduce only"):
        load_graph_config({**EXPLICIT, "data_parallel": {**sec, "reduction": "reduce_scatter"}},
                          "x")
    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    path = _write(tmp_path, {**data, "training": {**data["training"],
                                                  "collective_algorithm": "tree"}})
    assert main(["solve", str(path), "--method", "1f1b"]) == 2
    assert capsys.readouterr().err.startswith(
        "pipeopt: error: training.collective_algorithm: tree is modelled for the all-reduce "
        "only")
    tree = {**data["training"], "collective_algorithm": "tree", "reduction": "all_reduce"}
    assert load_graph_config({**data, "training": tree}, "x").work.dp.algorithm == "tree"
