"""pipeline.mode: async through the config, the Python API and the command line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pipeopt.cli import main
from pipeopt.config import ConfigError, load_config, parse_config
from pipeopt.problem import uniform_problem
from pipeopt.schedules import NotApplicable
from pipeopt.schedules.periodic import async_pattern, check_periodic
from pipeopt.solvers import UnknownMethod, compare_async, solve, solve_async

ROOT = Path(__file__).resolve().parents[1]
ASYNC = str(ROOT / "examples" / "async.yaml")


def config(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "pipeline": {"devices": 3, "microbatches": 6, "mode": "async"},
        "stages": {"forward": 1.0, "backward_input": 2.0, "backward_weight": 0.5,
                   "activation_memory": 1.0},
        "memory": {"weight_bytes": [3.0, 2.0, 1.0]},
    }
    for key, val in changes.items():
        section, name = key.split("__")
        if val is None:
            doc[section].pop(name, None)
        else:
            doc[section][name] = val
    return doc


def test_async_mode_and_weight_bytes_reach_the_config() -> None:
    cfg = parse_config(config())
    assert cfg.extra("mode") == "async"
    assert cfg.extra("weight_bytes") == (3.0, 2.0, 1.0)
    assert parse_config(config(memory__weight_bytes=4.0)).extra("weight_bytes") == (4.0,) * 3
    assert cfg.extra("replicas") == (1, 1, 1)
    assert parse_config(config(pipeline__replicas=[1, 3, 1])).extra("replicas") == (1, 3, 1)
    sync = parse_config(config(pipeline__mode=None, memory__weight_bytes=None))
    assert sync.extra("mode") is None  # synchronous stays the default


@pytest.mark.parametrize(("changes", "phrase"), [
    ({"memory__weight_bytes": None}, "memory.weight_bytes: pipeline.mode: async needs"),
    ({"pipeline__mode": "sync"}, "memory.weight_bytes: used only with pipeline.mode: async"),
    ({"memory__weight_bytes": [1.0, 2.0]}, "memory.weight_bytes: expected 3 values"),
    ({"memory__weight_bytes": -1.0}, "memory.weight_bytes: must be a finite number >= 0"),
    ({"pipeline__virtual_stages": 2}, "pipeline.virtual_stages: pipeline.mode: async runs one"),
    ({"pipeline__microbatch_scale": [1, 2, 1, 1, 1, 1]}, "pipeline.microbatch_scale"),
    ({"pipeline__mode": "asynchronous"}, "pipeline.mode"),
    ({"pipeline__replicas": [1, 0, 1]}, "pipeline.replicas[1]: must be an integer >= 1"),
    ({"pipeline__replicas": [1, 2]}, "pipeline.replicas: expected 3 values"),
    ({"pipeline__mode": "sync", "memory__weight_bytes": None, "pipeline__replicas": 2},
     "pipeline.replicas: used only with pipeline.mode: async"),
])
def test_bad_async_configs_name_the_key(changes: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        parse_config(config(**changes))


def test_solve_async_matches_the_hand_made_pattern_and_checks_memory() -> None:
    prob = uniform_problem(3, 6, 1.0, 2.0, 0.5)
    s = solve_async(prob, "pipedream", (3.0, 2.0, 1.0))
    assert s.period == pytest.approx(3.5)
    assert s.weight_versions == (3, 2, 1)
    assert s == async_pattern(prob, "pipedream", (3.0, 2.0, 1.0))
    # Stage 0 of PipeDream holds 3 activations and 2 extra versions of 3 bytes: 9 > 8.
    tight = prob.replace(memory_limit=(8.0, None, None))
    with pytest.raises(NotApplicable, match=r"memory\.limit\[0\]: pipedream needs 9"):
        solve_async(tight, "pipedream", (3.0, 2.0, 1.0))
    found = solve_async(tight, "auto", (3.0, 2.0, 1.0))  # auto: the periodic search
    assert found.method == "periodic" and found.over_memory() == []
    assert check_periodic(found) == []
    with pytest.raises(UnknownMethod, match=r"set pipeline\.mode: async"):
        solve(prob, "pipedream")
    with pytest.raises(UnknownMethod, match="synchronous method"):
        solve_async(prob, "1f1b")
    with pytest.raises(UnknownMethod, match="did you mean 'pipemare'"):
        solve_async(prob, "pipemar")


def test_compare_async_ranks_by_period_with_sync_rows() -> None:
    prob = uniform_problem(3, 6, 1.0, 2.0, 0.5)
    rows = compare_async(prob, (1.0,) * 3, ["pipedream", "periodic"], ["1f1b"])
    by = {r.method: r for r in rows}
    assert by["pipedream"].period == pytest.approx(3.5)
    assert by["pipedream"].staleness == 2 and by["pipedream"].weight_versions == 3
    # 1F1B (fused backward) of m = 6 on p = 3: (m + p - 1) (F + B + W) = 8 x 3.5 = 28 s.
    assert by["1f1b"].period == pytest.approx(28.0 / 6)
    assert by["1f1b"].ratio == pytest.approx((28.0 / 6) / 3.5)
    assert rows[-1].method == "1f1b"


def test_cli_solve_writes_the_periodic_json(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "async.json"
    assert main(["solve", ASYNC, "-o", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "period" in printed and "weight versions" in printed
    doc = json.loads(out.read_text())
    cfg = load_config(ASYNC)
    s = solve_async(cfg.problem, "periodic", cfg.extra("weight_bytes"))
    assert doc["format"] == "pipeopt-periodic" and doc["period"] == pytest.approx(s.period)
    assert [st["weight_versions"] for st in doc["stages"]] == list(s.weight_versions)
    assert [st["staleness"] for st in doc["stages"]] == list(s.staleness)
    assert len(doc["tasks"]) == 12 and all(0 <= t["offset"] < doc["period"] for t in doc["tasks"])
    assert doc["period"] >= doc["lower_bound"] - 1e-12
    assert main(["solve", ASYNC, "--method", "pipedream", "--json", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "pipedream" and summary["period"] > doc["period"]
    assert main(["solve", ASYNC, "--method", "1f1b", "-q"]) == 2
    assert "--method: '1f1b' is a synchronous method" in capsys.readouterr().err


def test_cli_compare_async_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", ASYNC, "--methods", "pipedream,periodic,1f1b", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["periodic", "pipedream", "1f1b"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["throughput"] == pytest.approx(
        1 / rows[0]["period"])


def test_the_python_example_of_docs_async_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "async.md").read_text(encoding="utf-8")
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/async.md", "exec"), {"__name__": "_doc"})
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("4.175 (4, 3, 2, 1) (4, 3, 2, 1) (3, 2, 1, 0)")
    assert second == "3.5 3.5 (7, 5, 3, 1)"


def test_periodic_json_round_trips_and_is_checked(tmp_path: Path) -> None:
    from pipeopt.workloads.periodic import PeriodicError, PeriodicSchedule

    prob = uniform_problem(3, 6, 1.0, 2.0, 0.5).replace(memory_limit=(9.0, None, None))
    s = solve_async(prob, "periodic", (1.0, 2.0, 3.0), replicas=(1, 2, 1))
    doc = json.loads(json.dumps(s.to_dict()))
    back = PeriodicSchedule.from_dict(doc)
    assert back == s and back.replicas == (1, 2, 1) and back.weight_bytes == (1.0, 2.0, 3.0)
    bad = dict(doc, period="fast")
    with pytest.raises(PeriodicError, match="period: expected"):
        PeriodicSchedule.from_dict(bad)
    with pytest.raises(PeriodicError, match=r"tasks\[0\]\.start: missing"):
        PeriodicSchedule.from_dict(dict(doc, tasks=[{"kind": "F", "stage": 0}]))
    with pytest.raises(PeriodicError, match="format"):
        PeriodicSchedule.from_dict(dict(doc, format="pipeopt.schedule"))


def test_cli_plots_a_periodic_schedule_and_refuses_a_broken_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "async.json"
    assert main(["solve", ASYNC, "-o", str(out), "-q"]) == 0
    png = tmp_path / "async.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out.read_text())
    doc["period"] = doc["period"] / 2  # the unrolled copies now overlap
    out.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(tmp_path / "b.png")]) == 2
    assert "invalid periodic schedule" in capsys.readouterr().err


def test_cli_traces_and_simulates_a_periodic_schedule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "async.json"
    assert main(["solve", ASYNC, "-o", str(out), "-q"]) == 0
    cfg = load_config(ASYNC)
    s = solve_async(cfg.problem, "periodic", cfg.extra("weight_bytes"))
    trace = tmp_path / "async.trace.json"
    assert main(["trace", str(out), "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    one = [e for e in events if e["name"] == "one period"]
    assert len(one) == 1 and one[0]["dur"] == pytest.approx(s.period * 1e6)
    # The activations counter of each stage reaches the steady-state peak and never more.
    for k in range(4):
        acts = [e["args"]["activations"] for e in events
                if e["ph"] == "C" and e["name"] == f"memory stage {k}"]
        assert max(acts) == pytest.approx(s.activation_memory[k])
        assert {e["args"]["weight versions"] for e in events
                if e["ph"] == "C" and e["name"] == f"memory stage {k}"} == {s.weight_memory[k]}
    capsys.readouterr()
    assert main(["simulate", str(out), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["valid"] is True and verdict["period"] == pytest.approx(s.period)
    doc = json.loads(out.read_text())
    doc["tasks"][4]["start"] = 0.0  # B of stage 0 before its inputs
    out.write_text(json.dumps(doc))
    assert main(["simulate", str(out), "--json"]) == 2
    bad = json.loads(capsys.readouterr().out)
    assert bad["valid"] is False and "before its input" in bad["error"]


def test_cpsat_with_2bw_and_pipemare_weights_keeps_memory() -> None:
    # Limit 4 with static 1, activations 1 and weight copies 1: 2BW fits 2 in flight
    # (1 + 2 + 1), PipeMare 3 (1 + 3); both below PipeDream's 3 on stage 0.
    prob = uniform_problem(3, 6, 1.0, 2.0, 0.5, latency=0.5).replace(
        memory_limit=(4.0,) * 3, static_memory=(1.0,) * 3)
    for method in ("periodic-cpsat-2bw", "periodic-cpsat-pipemare"):
        s = solve_async(prob, method, (1.0,) * 3, time_limit=5)
        assert s.over_memory() == [] and check_periodic(s) == []
        assert s.period >= s.lower_bound - 1e-9
        search = solve_async(prob, method.replace("-cpsat", ""), (1.0,) * 3)
        assert s.period <= search.period + 1e-9


# ----- PipeDream's planner from a config (pipedream:) ------------------------------------------
PLANNER = ROOT / "examples" / "pipedream.yaml"


def _planner_doc() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(PLANNER.read_text())


def test_planner_config_is_the_python_example() -> None:
    """examples/pipedream.yaml holds examples/pipedream_planner.py's profile: the same plan,
    the same chain problem, replicas and weight bytes per stage."""
    import runpy

    from pipeopt.partition.pipedream import Level, plan, plan_problem

    example = runpy.run_path(str(ROOT / "examples" / "pipedream_planner.py"))
    layers = example["vgg_like"]()
    levels = [Level(4, 10e9), Level(2, 1.25e9)]
    want = plan(layers, levels)
    prob, reps = plan_problem(layers, want, microbatches=16)
    cfg = load_config(str(PLANNER))
    assert cfg.extra("mode") == "async" and cfg.extra("replicas") == reps == (4, 3, 1)
    assert dict(cfg.extra("pipedream_plan"))["config"] == want.config() == "4-3-1"
    assert cfg.problem.forward == pytest.approx(prob.forward)
    assert cfg.problem.backward_weight == pytest.approx(prob.backward_weight)
    assert cfg.problem.message_size == pytest.approx(prob.message_size)
    assert cfg.problem.bandwidth == prob.bandwidth
    # conv1..conv6, conv7..conv10, conv11..fc8: their fp32 weights
    assert cfg.extra("weight_bytes") == pytest.approx((4.6108e6, 2.636e7, 5.252e8))


def test_cli_solve_prints_the_plan_4_3_1(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner example's structure through the command line: the convolutions replicated
    on 4 and 3 GPUs, the weight-heavy classifier on one; the period search on the plan reaches
    the planner's estimate (12.9 ms, the resource bound)."""
    assert main(["solve", str(PLANNER)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan          pipedream 4-3-1 on 8 devices (4 x 10 GB/s, then "
                          "2 x 1.25 GB/s)")
    assert "  stage 0: layers conv1..conv6 on 4 devices" in out
    assert "  stage 2: layers conv11..fc8 on 1 device\n" in out
    assert main(["solve", str(PLANNER), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["config"] == "4-3-1" and doc["plan"]["devices"] == 8
    assert [s["replicas"] for s in doc["stages"]] == [4, 3, 1]
    assert doc["plan"]["period"] == pytest.approx(0.0129)
    assert doc["period"] == pytest.approx(doc["plan"]["period"], rel=1e-9)
    assert main(["solve", str(PLANNER), "--method", "pipedream", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["period"] == pytest.approx(0.019096)  # 19.10 ms
    assert main(["compare", str(PLANNER), "--methods", "pipedream,periodic"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan          pipedream 4-3-1") and "\nperiodic   async" in out


@pytest.mark.parametrize(("change", "phrase"), [
    (lambda d: d["pipeline"].update(mode="sync"), "pipedream: PipeDream's planner plans an "
     "asynchronous pipeline; set pipeline.mode: async"),
    (lambda d: d["pipeline"].update(devices=6), "pipeline.devices: must be the levels' 8 "
     "devices (4 x 2), got 6"),
    (lambda d: d.update(stages={"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}),
     "stages: not with pipedream:"),
    (lambda d: d["pipeline"].update(replicas=2), "pipeline.replicas: not with pipedream:"),
    (lambda d: d.update(memory={"weight_bytes": 1.0}), "memory.weight_bytes: not with "
     "pipedream:"),
    (lambda d: d.update(memory={"limit": [1.0, 2.0]}), "memory.limit: one value with "
     "pipedream:"),
    (lambda d: d["pipedream"]["layers"].update(weight_bytes=[1.0, 2.0]),
     "pipedream.layers.weight_bytes: expected 16 values (one per layer), got 2"),
    (lambda d: d["pipedream"]["layers"]["forward"].__setitem__(2, -1.0),
     "pipedream.layers.forward[2]: must be a finite number >= 0 (s), got -1.0"),
    (lambda d: d["pipedream"]["layers"].update(names=["a"]),
     "pipedream.layers.names: expected 16 names"),
    (lambda d: d["pipedream"]["levels"][0].update(units=0), "pipedream.levels[0].units"),
    (lambda d: d["pipedream"]["levels"][1].update(bandwidth=0), "pipedream.levels[1].bandwidth"),
    (lambda d: d["pipedream"]["layers"].update(fwd=1.0),
     "pipedream.layers.fwd: unknown key; did you mean 'forward'?"),
    (lambda d: d["pipedream"]["layers"].update(forward=[1e-3] * 400),
     "pipedream.layers: 400 layers on levels of [4, 2] units are too many for the planner"),
])
def test_bad_planner_configs_name_the_key(change: Any, phrase: str) -> None:
    doc = _planner_doc()
    change(doc)
    if len(doc["pipedream"]["layers"]["forward"]) == 400:  # the other columns alike
        doc["pipedream"]["layers"] = {"forward": [1e-3] * 400, "backward_input": 1e-3,
                                      "backward_weight": 1e-3, "output_bytes": 1.0,
                                      "weight_bytes": 1.0}
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert phrase in str(err.value)



def test_replica_bandwidth_gives_the_all_reduce_by_hand(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    # Stage 1 (weights 2 bytes) on 2 replicas joined by 0.5 bytes/s: a ring all-reduce of
    # 2 (2 - 1) / 2 * 2 / 0.5 = 4 s every 2 micro-batches, 2 s per micro-batch, under the
    # 3.5 s of stage 1's work: the period does not move. At 0.1 bytes/s: 20 s, 10 s each.
    cfg = parse_config(config(pipeline__replicas=[1, 2, 1], pipeline__replica_bandwidth=0.5))
    assert cfg.extra("sync_s") == pytest.approx((0.0, 4.0, 0.0))
    slow = parse_config(config(pipeline__replicas=[1, 2, 1], pipeline__replica_bandwidth=0.1))
    s = solve_async(slow.problem, "periodic", slow.extra("weight_bytes"),
                    replicas=slow.extra("replicas"), sync_s=slow.extra("sync_s"))
    assert s.period == pytest.approx(10.0) and s.lower_bound == pytest.approx(10.0)
    with pytest.raises(ConfigError, match=r"pipeline\.replica_bandwidth: used only with "
                                          r"pipeline\.mode: async"):
        parse_config(config(pipeline__mode="sync", memory__weight_bytes=None,
                            pipeline__replica_bandwidth=1.0))
    with pytest.raises(ConfigError, match=r"pipeline.replica_bandwidth\[1\]: must be > 0"):
        parse_config(config(pipeline__replica_bandwidth=[1.0, 0.0, 1.0]))


def test_cli_prints_the_replica_sync(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    import yaml

    path = tmp_path / "rep.yaml"
    path.write_text(yaml.safe_dump(config(pipeline__replicas=[1, 2, 1],
                                          pipeline__replica_bandwidth=0.1)))
    assert main(["solve", str(path)]) == 0
    out = capsys.readouterr().out
    assert "period        10 s per micro-batch" in out
    assert "replica sync  stage 1 20 s every 2 micro-batches" in out


# ----- PipeDream's planner on mixed GPUs (pipedream.device_types) ------------------------------
HETERO = ROOT / "examples" / "pipedream_hetero.yaml"


def _hetero_doc() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(HETERO.read_text())


def test_cli_solve_prints_the_hetero_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/pipedream_hetero.yaml: one node of 4 V100s (speed 1) and one of 4 A100s
    (speed 2.5). The A100s take conv1..conv9 (76.8 ms of V100 work per micro-batch / 2.5 / 4
    replicas = 7.68 ms), the V100s the rest (conv10..conv12: 16.5 ms / 3 = 5.5 ms; the
    classifier on one: 3.78 ms); the cut after conv9 sends 6.4 MB over 1.25 GB/s (5.12 ms).
    The same profile on two V100 nodes: 12.9 ms (examples/pipedream.yaml)."""
    assert main(["solve", str(HETERO)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan          pipedream 4-3-1 on 8 devices (4 x 10 GB/s, then "
                          "2 x 1.25 GB/s): estimated 0.00768 s per micro-batch")
    assert "  type v100: 4 devices, speed 1, 16 GB each\n" in out
    assert "  type a100: 4 devices, speed 2.5, 40 GB each\n" in out
    assert "  stage 0: layers conv1..conv9 on 4 a100 devices\n" in out
    assert "  stage 1: layers conv10..conv12 on 3 v100 devices\n" in out
    assert "  stage 2: layers conv13..fc8 on 1 v100 device\n" in out
    assert main(["solve", str(HETERO), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["period"] == pytest.approx(0.00768)
    assert doc["period"] == pytest.approx(0.00768, rel=1e-9)  # the search reaches the plan
    assert [s["type"] for s in doc["plan"]["stages"]] == ["a100", "v100", "v100"]
    assert doc["plan"]["types"] == [
        {"name": "v100", "devices": 4, "speed": 1.0, "memory": 1.6e10, "own_profile": False},
        {"name": "a100", "devices": 4, "speed": 2.5, "memory": 4.0e10, "own_profile": False}]
    homogeneous = load_config(str(PLANNER))
    assert dict(homogeneous.extra("pipedream_plan"))["period"] == pytest.approx(0.0129)


def test_hetero_config_problem_has_each_types_speed_and_memory() -> None:
    cfg = load_config(str(HETERO))
    prob = cfg.problem
    # conv1..conv9 on the A100s: 25.6 ms of V100 forward / 2.5
    assert prob.forward[0] == pytest.approx(0.0256 / 2.5)
    assert prob.forward[1] == pytest.approx(0.0037 + 0.0009 + 0.0009)  # V100: as profiled
    assert prob.memory_limit == (4.0e10, 1.6e10, 1.6e10)
    # static memory: memory.static (0) + one copy of each stage's weights
    assert prob.static_memory == pytest.approx(cfg.extra("weight_bytes"))
    assert cfg.extra("replicas") == (4, 3, 1)


def test_hetero_memory_moves_the_classifier_to_the_fast_gpus() -> None:
    """V100s of 0.3 GB cannot hold fc6's 412 MB of weights, so the A100s take it: 3 A100s
    on conv1..conv9 (76.8 / 2.5 / 3 = 10.24 ms), the fourth on conv10..fc6, the V100s on
    fc7 and fc8 (every device is used)."""
    doc = _hetero_doc()
    doc["pipedream"]["device_types"]["v100"]["memory"] = 3e8
    cfg = parse_config(doc)
    plan = dict(cfg.extra("pipedream_plan"))
    assert plan["period"] == pytest.approx(0.01024)
    # the period search on the plan stays within each type's memory and reaches the estimate
    s = solve_async(cfg.problem, "periodic", cfg.extra("weight_bytes"),
                    replicas=cfg.extra("replicas"), sync_s=cfg.extra("sync_s"))
    assert s.over_memory() == [] and s.period == pytest.approx(0.01024, rel=1e-6)
    assert cfg.problem.memory_limit == (4e10, 4e10, 3e8, 3e8)
    names = doc["pipedream"]["layers"]["names"]
    fc6 = [s for s in plan["stages"]
           if names.index(s[0]) <= names.index("fc6") <= names.index(s[1])]
    assert fc6 == [("conv10", "fc6", 1, "a100")]
    doc["pipedream"]["device_types"]["v100"].pop("memory")
    doc["memory"] = {"limit": 3e8}  # memory.limit stands for a type without its own
    assert dict(parse_config(doc).extra("pipedream_plan"))["stages"] == plan["stages"]
    doc["pipedream"]["device_types"]["a100"]["memory"] = 1e8
    with pytest.raises(ConfigError, match="memory: no plan of the layers uses every device"):
        parse_config(doc)


@pytest.mark.parametrize(("change", "phrase"), [
    (lambda d: d["pipedream"]["levels"][1].update(types={"v100": 1, "h100": 1}),
     "pipedream.levels[1].types.h100: unknown device type (pipedream.device_types has v100, "
     "a100)"),
    (lambda d: d["pipedream"]["device_types"]["a100"].update(speed=0),
     "pipedream.device_types.a100.speed"),
    (lambda d: d["pipedream"]["device_types"]["a100"].update(speed=-2.0),
     "pipedream.device_types.a100.speed"),
    (lambda d: d["pipedream"]["device_types"]["v100"].update(memory=0),
     "pipedream.device_types.v100.memory"),
    (lambda d: d["pipedream"].update(device_types={}), "pipedream.device_types"),
    (lambda d: d["pipedream"]["levels"][1].update(types={"v100": 1, "a100": 2}),
     "pipedream.levels[1].types: 3 units by type, but pipedream.levels[1].units is 2"),
    (lambda d: d["pipedream"]["levels"][1].update(types={"v100": 0, "a100": 2}),
     "pipedream.levels[1].types.v100"),
    (lambda d: d["pipedream"]["levels"][1].update(types={"a100": 2}),
     "pipedream.device_types.v100: no units of this type in pipedream.levels[1].types"),
    (lambda d: d["pipedream"]["levels"][1].pop("types"),
     "pipedream.levels[1].types: missing; with pipedream.device_types"),
    (lambda d: d["pipedream"].pop("device_types"),
     "pipedream.levels[1].types: names device types, but pipedream.device_types is missing"),
    (lambda d: d["pipedream"]["levels"][0].update(types={"v100": 4}),
     "pipedream.levels[0].types: only the top level's units (levels[1]) have device types"),
    (lambda d: d["pipeline"].update(devices=12), "pipeline.devices: must be the levels' 8 "
     "devices (4 v100 + 4 a100), got 12"),
    (lambda d: d["pipedream"]["device_types"]["a100"].update(levels=[{"units": 8,
                                                                       "bandwidth": 1e11}]),
     "pipeline.devices: must be the levels' 12 devices (4 v100 + 8 a100), got 8"),
    (lambda d: d["pipedream"]["device_types"]["a100"].update(fast=True),
     "pipedream.device_types.a100.fast: unknown key"),
    (lambda d: d["pipedream"]["device_types"]["a100"].update(
        levels=[{"units": 4, "bandwidth": 1e10, "types": {"a100": 4}}]),
     "pipedream.device_types.a100.levels[0].types: only the top level's units"),
    (lambda d: d["pipedream"].update(layers={
        "forward": [1e-3], "backward_input": 1e-3, "backward_weight": 1e-3,
        "output_bytes": 1.0, "weight_bytes": 1.0}),
     "pipedream.device_types: 1 layers cannot use every device type"),
])
def test_bad_hetero_configs_name_the_key(change: Any, phrase: str) -> None:
    doc = _hetero_doc()
    change(doc)
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert phrase in str(err.value)


def test_a100_nodes_of_8_plan_with_their_own_levels() -> None:
    """A type's own inner levels: the A100 node holds 8 GPUs (12 devices in all); the plan
    uses all of them and puts the A100 stages first, as above."""
    doc = _hetero_doc()
    doc["pipedream"]["device_types"]["a100"]["levels"] = [{"units": 8, "bandwidth": 1e10}]
    doc["pipeline"]["devices"] = 12
    plan = dict(parse_config(doc).extra("pipedream_plan"))
    assert plan["devices"] == 12
    assert sum(r for _, _, r, t in plan["stages"] if t == "a100") == 8
    assert plan["stages"][0][3] == "a100"


def test_hetero_plan_follows_the_methods_weight_versions(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Every GPU of 0.45 GB: fc6's 412 MB of weights fit once (PipeMare: one version; plan
    4-2-1-1, conv12..fc6 on one V100) but not twice (2BW: two versions everywhere). Stashing
    keeps one version only on the last stage (one micro-batch in flight), which would hold
    fc6..fc8 (496 MB); on any earlier stage fc6 has at least 2 in flight, so 2 versions. The
    plan is made for the method's policy, also when --method overrides solver.method."""
    import yaml

    doc = _hetero_doc()
    for ty in doc["pipedream"]["device_types"].values():
        ty["memory"] = 4.5e8
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["solve", str(path), "--method", "periodic-pipemare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["config"] == "4-2-1-1" and out["plan"]["period"] == pytest.approx(7.68e-3)
    assert max(out["peak_memory"]) <= 4.5e8
    for method in ("periodic", "periodic-2bw"):
        assert main(["solve", str(path), "--method", method]) == 2
        assert "memory: no plan of the layers uses every device" in capsys.readouterr().err


def test_every_node_false_may_leave_a_slow_device_idle(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """Layers of 1, 1 and 6 s (F + B + W) on a device 10x slower than the profile's and one
    2x faster: with both, 10 s per micro-batch (the slow one on the first layer); the fast
    one alone, 4 s (tests/test_pipedream_planner.py computes both by hand)."""
    import yaml

    doc = {"pipeline": {"devices": 2, "microbatches": 4, "mode": "async"},
           "pipedream": {"device_types": {"slow": {"speed": 0.1}, "fast": {"speed": 2.0}},
                         "levels": [{"units": 2, "bandwidth": 1e3,
                                     "types": {"slow": 1, "fast": 1}}],
                         "layers": {"forward": [0.5, 0.5, 3.0],
                                    "backward_input": [0.25, 0.25, 1.5],
                                    "backward_weight": [0.25, 0.25, 1.5],
                                    "output_bytes": 1.0, "weight_bytes": 1.0}},
           "solver": {"method": "periodic"}}
    assert dict(parse_config(doc).extra("pipedream_plan"))["period"] == pytest.approx(10.0)
    doc["pipedream"]["every_node"] = False
    path = tmp_path / "idle.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["solve", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan          pipedream 1 on 1 device (2 x 1e-06 GB/s; 1 left "
                          "idle): estimated 4 s per micro-batch")
    assert "  stage 0: layers layer0..layer2 on 1 fast device\n" in out
    assert "period        4 s per micro-batch" in out
    assert main(["solve", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["idle_devices"] == 1 and plan["devices"] == 1
    doc["pipedream"]["every_node"] = "no"
    with pytest.raises(ConfigError, match=r"pipedream\.every_node"):
        parse_config(doc)


def test_planner_work_by_hand() -> None:
    """layers^3 x sum of units^2 per type (its node levels and its nodes), times all the
    devices for a type with a memory limit; the top level's table layers^2 x prod(nodes + 1)
    x sum(nodes), times the devices when idle nodes are allowed under a limit."""
    from pipeopt.config import planner_work
    from pipeopt.partition.pipedream import DeviceType, Level

    a = DeviceType("a", 2, (Level(4, 1e10),))  # 2 nodes of 4: 8 devices
    b = DeviceType("b", 1)  # one device
    assert planner_work(10, [a, b], False) == 1e3 * (16 + 4) + 1e3 * 1 + 1e2 * 3 * 2 * 3
    limited = [DeviceType("a", 2, (Level(4, 1e10),), memory=1e9), b]
    assert planner_work(10, limited, True) == 1e3 * 20 * 9 + 1e3 * 1 + 1800
    assert planner_work(10, limited, True, every_node=False) == 1e3 * 20 * 9 + 1e3 + 1800 * 9
    one = DeviceType("gpu", 2, (Level(4, 1e10),))  # the homogeneous count of before
    assert planner_work(16, [one], False) == 16 ** 3 * (4 ** 2 + 2 ** 2)


def test_a_types_own_profile_from_the_config(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    """An A100 profile of its own: the convolutions 2.5x faster than on the V100, the fully
    connected layers (memory-bound) no faster. The problem's stage times are the profile's;
    the plan is the speed-2.5 one where the A100s run only convolutions (conv1..conv9 here),
    so the estimate is the same 7.68 ms."""
    import yaml

    doc = _hetero_doc()
    lay = doc["pipedream"]["layers"]
    a100 = doc["pipedream"]["device_types"]["a100"]
    a100.pop("speed")
    for key in ("forward", "backward_input", "backward_weight"):
        a100[key] = [t / 2.5 for t in lay[key][:13]] + lay[key][13:]
    cfg = parse_config(doc)
    plan = dict(cfg.extra("pipedream_plan"))
    assert plan["period"] == pytest.approx(0.00768)
    assert plan["stages"][0] == ("conv1", "conv9", 4, "a100")
    assert cfg.problem.forward[0] == pytest.approx(sum(lay["forward"][:9]) / 2.5)
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["solve", str(path)]) == 0
    assert "  type a100: 4 devices, its own layer times, 40 GB each\n" in capsys.readouterr().out
    a100["speed"] = 2.0
    with pytest.raises(ConfigError, match=r"pipedream\.device_types\.a100\.speed: not with its "
                                          "own profile"):
        parse_config(doc)
    a100.pop("speed")
    a100.pop("backward_weight")
    with pytest.raises(ConfigError, match=r"pipedream\.device_types\.a100\.backward_weight: "
                                          "missing"):
        parse_config(doc)
    a100["backward_weight"] = [1e-3] * 3
    with pytest.raises(ConfigError, match=r"pipedream\.device_types\.a100\.backward_weight: "
                                          "expected 16 values"):
        parse_config(doc)
    a100["backward_weight"] = -1.0
    with pytest.raises(ConfigError, match=r"pipedream\.device_types\.a100\.backward_weight: "
                                          "must be a finite number >= 0"):
        parse_config(doc)
