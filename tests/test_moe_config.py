"""The MoE config (pipeopt.moe_config), examples/moe.yaml and `pipeopt solve / simulate / plot /
trace` on an MoE schedule (schedule JSON v2 with all-to-all tasks on network resources)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeopt.cli import main
from pipeopt.core.validate import check
from pipeopt.costs import moe as cm
from pipeopt.costs.collectives import all_to_all_time
from pipeopt.errors import ConfigError
from pipeopt.graphio import load_any
from pipeopt.moe_config import MoERun, load_moe, parse_moe
from pipeopt.solvers import moe as sm
from pipeopt.solvers.graph import compare_graph, solve_graph
from pipeopt.trace import NETWORK_PID
from pipeopt.workload_config import workload_kind

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe.yaml"


def small() -> dict[str, Any]:
    """examples/moe.yaml cut to 2 blocks on 2 stages and 3 micro-batches."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["layers"] = 2
    data["workload"].update(stages=2, microbatches=3, time_limit=1.5)
    return data


def test_the_example_is_priced_by_the_cost_model() -> None:
    cfg = load_moe(EXAMPLE)
    pipe = cfg.pipeline
    assert pipe.devices == 8 and pipe.microbatches == 16 and cfg.method == "search"
    rate = 989.4e12 * 0.5  # H100 bf16 peak x efficiency
    blk = pipe.stages[3][0]
    assert blk.experts.forward == pytest.approx(2 * 4096 * 6 * 4096 * 14336 / rate)
    buf = 2 * 4096 * 4096 * 2
    assert blk.dispatch == pytest.approx(all_to_all_time(8, buf, 5e-6, 25e9))
    assert pipe.memory_limit[0] == pytest.approx(81_559 * 2**20 * 0.9)
    assert workload_kind(yaml.safe_load(EXAMPLE.read_text())) == "moe"


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["model"].pop("moe"), "model.moe: missing or not a mapping"),
    (lambda d: d["model"]["moe"].update(top_k=9), "model.moe.top_k: must be <= experts"),
    (lambda d: d["model"]["moe"].update(routing="x"), "model.moe.routing"),
    (lambda d: d["model"]["moe"].update(expert_parallel=3),
     "model.moe.expert_parallel: must divide experts"),
    (lambda d: d["model"]["moe"].update(experts=0), "model.moe.experts"),
    (lambda d: d["workload"].update(method="fast"),
     "workload.method: must be one of 1f1b, 1f1b+overlap, zb-h1"),
    (lambda d: d["workload"].update(method="search", overlap=True),
     "workload.overlap: overlaps a hand-made schedule's all-to-all"),
    (lambda d: d["workload"].update(split_backward=False, method="zb-h1"),
     "workload.method: must be one of 1f1b, 1f1b+overlap, gpipe, gpipe+overlap, search"),
    (lambda d: d["workload"].update(gpu="H300"), "workload.gpu: unknown GPU 'H300'"),
    (lambda d: d["workload"].update(stages=3), "workload.stages: 3 stages need at least"),
    (lambda d: d["workload"].update(stages=[1, 2]), "workload.stages: expected 2 counts"),
    (lambda d: d["workload"].update(microbatches=0), "workload.microbatches"),
    (lambda d: d["workload"].pop("expert_network"), "workload.expert_network"),
    (lambda d: d["workload"].update(memory_fraction=0.001),
     "workload.stages: stage 0's parameters need"),
    (lambda d: d["model"].update(tensor_parallel=2),
     "model.tensor_parallel: the MoE pipeline workload is modelled without"),
])
def test_config_errors_name_the_key(change: Any, message: str) -> None:
    data = copy.deepcopy(small())
    change(data)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_moe(data, "t.yaml")


def test_the_search_is_a_graph_method_and_beats_the_baselines() -> None:
    cfg = parse_moe(small())
    assert cfg.method == "search" and cfg.baselines == ("1f1b", "1f1b+overlap", "zb-h1",
                                                         "zb-h1+overlap")
    run = MoERun(cfg.pipeline)
    found = solve_graph(run, "search", time_limit=1.5)
    assert check(found) == [] and found.graph == run.graph
    assert found.lower_bound is not None and found.lower_bound <= found.objective + 1e-12
    rows = compare_graph(run, cfg.baselines)
    assert [r.method for r in rows] == list(cfg.baselines)
    assert all(r.schedule is not None and r.fits for r in rows)
    # the search offers ZB-H1's order on its graph before any time check: never worse
    assert found.objective <= rows[2].schedule.objective + 1e-12  # type: ignore[union-attr]
    over = parse_moe({**small(), "workload": {**small()["workload"], "method": "zb-h1",
                                              "overlap": True}})
    assert over.method == "zb-h1+overlap"


def test_cli_solve_simulate_plot_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    cfg = tmp_path / "moe.yaml"
    cfg.write_text(yaml.safe_dump(small()))
    out = tmp_path / "moe.json"
    assert main(["solve", str(cfg), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "iteration" in text and "zb-h1+overlap" in text and f"written       {out}" in text
    sched = load_any(out)
    assert check(sched) == []  # type: ignore[arg-type]
    assert sched.graph.networks == ("a2a 0", "a2a 1")  # type: ignore[union-attr]
    assert main(["simulate", str(out)]) == 0
    png = tmp_path / "moe.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0 and png.stat().st_size > 0
    trace = tmp_path / "moe.trace.json"
    assert main(["trace", str(out), "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    a2a = [e for e in events if e.get("pid") == NETWORK_PID and e.get("ph") == "X"]
    assert len(a2a) == 2 * 3 * 4  # stages x micro-batches x (D, C, dC, dD)
    capsys.readouterr()
    assert main(["solve", str(cfg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["baselines"]) == {"1f1b", "1f1b+overlap", "zb-h1", "zb-h1+overlap"}


def test_capacity_factor_in_the_config_reaches_the_costs() -> None:
    data = small()
    data["model"]["moe"]["capacity_factor"] = 1.5
    pipe = parse_moe(data).pipeline
    spec = cm.MoESpec(experts=8, top_k=2, expert_ffn=14336, expert_parallel=8)
    base = parse_moe(small()).pipeline
    assert pipe.stages[1][0].experts.forward == pytest.approx(
        1.5 * base.stages[1][0].experts.forward)
    assert spec.capacity_factor is None


def test_cli_method_flag_overrides_the_config(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "moe.yaml"
    cfg.write_text(yaml.safe_dump(small()))
    assert main(["solve", str(cfg), "--method", "1f1b"]) == 0
    assert capsys.readouterr().out.startswith("method        1f1b\n")
    assert main(["solve", str(cfg), "--method", "greedy"]) == 0  # the core's, on MoE too
    assert capsys.readouterr().out.startswith("method        greedy\n")
    assert main(["solve", str(cfg), "--method", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeopt: error: --method: unknown method 'fast'") and "search" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**small(), "workload": {**small()["workload"],
                                                           "method": "fast"}}))
    assert main(["solve", str(bad)]) == 2
    assert "pipeopt: error: workload.method: must be one of" in capsys.readouterr().err


def test_moe_run_has_the_graph_workload_shape() -> None:
    """MoERun plugs into pipeopt.solvers.graph (graph_config's workloads): its hand-made
    schedules are those of pipeopt.solvers.moe, and compare_graph ranks them with the core
    greedy and CP-SAT."""
    pipe = parse_moe(small()).pipeline
    run = MoERun(pipe)
    assert run.hand_made == ("1f1b", "1f1b+overlap", "zb-h1", "zb-h1+overlap", "zb-h2",
                             "zb-h2+overlap", "gpipe", "gpipe+overlap")
    assert run.searches == ("search",)
    zb = solve_graph(run, "zb-h1")
    assert zb.objective == pytest.approx(sm.hand_made(pipe, "zb-h1").objective)
    over = solve_graph(run, "1f1b+overlap")
    fused = dataclasses.replace(pipe, split_backward=False)
    assert over.objective == pytest.approx(
        sm.hand_made(fused, "1f1b", overlap=True).objective)
    rows = compare_graph(run, ["zb-h1", "zb-h1+overlap", "greedy"], time_limit=2)
    assert sorted(r.method for r in rows) == ["greedy", "zb-h1", "zb-h1+overlap"]
    assert all(r.schedule is not None and check(r.schedule) == [] for r in rows)
    assert min(r.ratio for r in rows if r.ratio is not None) == pytest.approx(1.0)


def test_auto_runs_the_search_beside_the_hand_made_schedules() -> None:
    """auto on an MoE workload: its own search among the candidates, the shortest that fits;
    never longer than a hand-made schedule that fits."""
    run = MoERun(parse_moe(small()).pipeline)
    best = solve_graph(run, "auto", time_limit=2)
    assert best.method.startswith("auto:") and check(best) == []
    rows = compare_graph(run, run.hand_made)
    fitting = [r.schedule.objective for r in rows if r.fits and r.schedule is not None]
    assert fitting and best.objective <= min(fitting) + 1e-12
    assert best.lower_bound is not None and best.lower_bound <= best.objective + 1e-12
