"""Data-parallel collectives issued by the executor in the schedule's order (issue 13, item 5):
the plan read from a schedule of the data-parallel graph (pure), and replays on 4 gloo ranks
(2 stages x 2 replicas) whose final weights equal one-process training with the same update
delay, with every rank's compute ops and collective launches in the schedule's order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipeopt.cli import main
from pipeopt.core.schedule import GraphSchedule
from pipeopt.executor.collectives import graph_run
from pipeopt.executor.procs import ExecutorError, RunConfig
from pipeopt.graph_config import load_graph_config
from pipeopt.graphio import dump_graph_schedule
from pipeopt.solvers.graph import solve_graph

#: 2 stages x 2 replicas in two datacenters; ZeRO-1 (reduce-scatter + all-gather) in 2
#: buckets per stage, one step late, 3 iterations. A reduction bucket takes 0.135 s on the
#: WAN (ring reduce-scatter of 0.5 GB at 2 GB/s over 2 replicas plus 10 ms), more than an op
#: (0.1 s): the WAN runs the two stages' buckets one after the other, beside the other
#: stage's work and the next iteration's first ops.
ZERO = {
    "pipeline": {"devices": 2, "microbatches": 4},
    "stages": {"forward": 0.1, "backward_input": 0.1, "backward_weight": 0.1,
               "activation_memory": 1.0},
    "data_parallel": {"replicas": 2, "grad_bytes": 1.0e9, "latency": 1.0e-5,
                      "bandwidth": 1.0e10, "datacenters": [0, 1],
                      "wan": {"latency": 0.01, "bandwidth": 2.0e9},
                      "reduction": "reduce_scatter", "delayed_reduction": True,
                      "iterations": 3, "buckets": 2},
}
#: The same replicas with a synchronous all-reduce (the next iteration waits for it).
SYNC = {**ZERO, "data_parallel": {**ZERO["data_parallel"], "reduction": "all_reduce",
                                  "delayed_reduction": False, "iterations": 2}}


def _schedule(cfg: dict[str, object], method: str = "zb-h1") -> GraphSchedule:
    return solve_graph(load_graph_config(cfg).work, method, time_limit=5)


def _schedule_order(sched: GraphSchedule, replica: int, device: int) -> list[str]:
    """Rank (replica, device)'s compute ops (``iteration:op``; a bucketed W once, at its first
    piece) and its stage's collectives (``launch LABEL``) by start time, a collective before a
    compute op that starts with it: what the executor's log must read."""
    g, p = sched.graph, sched.graph.devices // 2
    events = []
    for t, label in enumerate(g.label):
        c = re.fullmatch(r"(?:i(\d+)\.)?r(\d)\.(\w+?)(/b\d+)?", label)
        if c and g.device[t] == replica * p + device and c[4] in (None, "/b0"):
            events.append((sched.start[t], 1, f"{int(c[1] or 0)}:{c[3]}"))
        elif g.device[t] == -1 and re.search(rf"(AR|RS|AG) {device}\b", label):
            events.append((sched.start[t], 0, f"launch {label}"))
    return [e[2] for e in sorted(events)]


# ----- pure: the plan ---------------------------------------------------------------------------
def test_plan_places_the_delayed_reduction_inside_the_next_iteration() -> None:
    """ZB-H1 with the delayed ZeRO-1 reduction: stage 1's reduce-scatter of iteration 0 starts
    during its device's iteration 1 (after its second op there), and stage 0's all-gather of
    iteration 2 during iteration 1; every rank launches its stage's collectives in their start
    order."""
    sched = _schedule(ZERO)
    plan = graph_run(sched)
    assert (plan.replicas, plan.iterations, plan.delay, plan.reduction, plan.buckets) == (
        2, 3, 2, "reduce_scatter", (2, 2))
    assert [len(o) for o in plan.orders[0][0]] == [12, 12]  # F, B, W of 4 micro-batches
    where = {(c.label, d): (s, n) for d in range(2) for s, n, c in plan.launches[0][d]}
    assert where[("i0.RS 1.b1", 1)] == (1, 2)
    assert where[("i2.AG 0", 0)][0] == 1
    assert where[("i0.AG 0", 0)] == (0, 0)
    for d in range(2):
        want = [x for x in _schedule_order(sched, 0, d) if x.startswith("launch")]
        assert [f"launch {c.label}" for _, _, c in plan.launches[0][d]] == want
        assert [c.label for _, _, c in plan.launches[1][d]] == [
            c.label for _, _, c in plan.launches[0][d]]


def test_plan_refuses_an_order_that_mixes_iterations_on_a_device() -> None:
    """1F1B pipelined over the iterations (no flush) runs iteration 1's forward before
    iteration 0's backward on a device: one step per iteration cannot replay it."""
    with pytest.raises(ExecutorError, match=r"runs .* of iteration 0 after an op of iteration "
                                            r"1: .*pipelined order needs weight stashing"):
        graph_run(_schedule(ZERO, "1f1b:pipelined"))


def test_buckets_cut_the_parameters_in_backward_order() -> None:
    torch = pytest.importorskip("torch")
    from pipeopt.executor.runtime import bucket_params

    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 20)]
    # last first: 20 | 10, 10 (cut where half of the 40 elements are in)
    assert bucket_params(ps, 2) == [[ps[2]], [ps[1], ps[0]]]
    assert bucket_params(ps, 4) == [[ps[2]], [], [ps[1]], [ps[0]]]


def test_the_delayed_reference_is_not_the_synchronous_one() -> None:
    """Control for the replay checks below: one step of delay moves the final weights by far
    more than the tolerance, so a replay that matched the synchronous reference would fail."""
    pytest.importorskip("torch")
    from pipeopt.executor.check import compare_grads, reference_run

    prob = graph_run(_schedule(ZERO)).problem
    cfg = RunConfig(model="mlp", steps=3, lr=0.05, optimizer="adamw")  # as the ZeRO-1 replay
    late = reference_run(prob, cfg, replicas=2, delay=2)["weights"]
    sync = reference_run(prob, cfg, replicas=2)["weights"]
    now = reference_run(prob, cfg, replicas=2, delay=1)["weights"]
    assert compare_grads(now, sync).max_abs_grad_diff == 0.0
    assert compare_grads(late, sync).max_abs_grad_diff > 1e-2


def test_compare_replicas_checks_every_replica_and_names_the_worst() -> None:
    """Each replica must hold the reference's weights: one replica off is a mismatch named
    with its replica, even when replica 0 is exact."""
    from pipeopt.executor.check import compare_replicas

    ref = {0: {"w": np.ones(3)}, 1: {"v": np.zeros(2)}}
    off = {0: {"w": np.ones(3)}, 1: {"v": np.array([0.0, 1e-3])}}
    assert compare_replicas([ref, ref], ref).ok
    bad = compare_replicas([ref, off], ref)
    assert not bad.ok and bad.worst == "1.v (replica 1)" and bad.compared == 4
    assert bad.max_abs_grad_diff == pytest.approx(1e-3)
    assert compare_replicas([off], ref).worst == "1.v"  # one replica: no suffix


def test_the_float64_reference_runs_in_float64() -> None:
    """``dtype="float64"`` casts the model and the data of the reference (what ``--check`` of
    a graph replay runs in); an unknown dtype is refused with the field's name."""
    pytest.importorskip("torch")
    from pipeopt.executor.check import reference_run

    prob = graph_run(_schedule(SYNC)).problem
    ref = reference_run(prob, RunConfig(model="mlp", steps=1, optimizer="adamw",
                                        dtype="float64"), replicas=2)
    assert {w.dtype for stage in ref["weights"].values() for w in stage.values()} == {
        np.dtype("float64")}
    with pytest.raises(ValueError, match="dtype: expected float32 or float64, got 'fp8'"):
        RunConfig(dtype="fp8")


def test_run_refuses_flags_the_replay_does_not_take(tmp_path: Path, capsys) -> None:
    path = tmp_path / "dp.json"
    dump_graph_schedule(_schedule(SYNC), path)
    for flags, phrase in ((["--clip-grad-norm", "1"], "--clip-grad-norm: is not supported"),
                          (["--steps", "3"], "--steps: the schedule holds 2 iteration"),
                          (["--data-parallel", "3"], "--data-parallel: the schedule has 2"),
                          (["--costs-out", str(tmp_path / "m.json")], "--costs-out: ")):
        assert main(["run", str(path), *flags]) == 2
        assert phrase in capsys.readouterr().err
    dump_graph_schedule(_schedule(ZERO, "1f1b:pipelined"), path)
    assert main(["run", str(path)]) == 2
    assert "pipelined order needs weight stashing" in capsys.readouterr().err


# ----- replays on 4 gloo ranks ------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.slow
def test_synchronous_bucketed_all_reduce_matches_one_process_training() -> None:
    """All-reduce in 2 buckets per stage, the next iteration waiting for it: after 2 steps the
    weights equal one-process SGD on the whole batch (|a - b| <= 1e-5 + 1e-5 |b|), and each
    rank ran its ops and launched its collectives in the schedule's order."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import run_graph

    sched = _schedule(SYNC)
    res = run_graph(graph_run(sched), RunConfig(model="mlp", steps=2, check=True))
    assert res.compared == "weights" and res.grads_match, res.worst_param
    assert (res.dtype, res.rtol, res.atol) == ("float64", 1e-8, 1e-8)  # the check's precision
    assert res.max_abs_grad_diff is not None and res.max_abs_grad_diff < 1e-12
    for rank, log in enumerate(res.collectives):
        assert log == _schedule_order(sched, *divmod(rank, 2)), rank
    assert sum(x.startswith("launch") for x in res.collectives[0]) == 4  # 2 iterations x 2
    assert np.isclose(res.predicted_step_time, sched.makespan / 2)


@pytest.mark.torch
@pytest.mark.slow
def test_run_of_the_delayed_zero1_schedule_matches_the_delayed_reference(
        tmp_path: Path, capsys) -> None:
    """``pipeopt run`` of the ZB-H1 schedule above (ZeRO-1, one step late, AdamW): the final
    weights of every replica equal one-process AdamW whose step t applies step t - 1's
    gradients (the last ones after the run), both in float64, within 1e-8 + 1e-8 |b|; the
    order of each rank's ops and collective launches is the schedule's, reductions of
    iteration 0 among iteration 1's ops."""
    pytest.importorskip("torch")
    sched = _schedule(ZERO)
    path = tmp_path / "dp.json"
    dump_graph_schedule(sched, path)
    capsys.readouterr()
    assert main(["run", str(path), "--model", "mlp", "--check", "--json", "--optimizer",
                 "adamw", "--lr", "0.05"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["grads_match"] and doc["compared"] == "weights" and doc["ranks"] == 4
    assert doc["dtype"] == "float64" and doc["tolerance"] == {"rtol": 1e-8, "atol": 1e-8}
    assert doc["max_abs_grad_diff"] < 1e-12
    for rank, log in enumerate(doc["collectives"]):
        assert log == _schedule_order(sched, *divmod(rank, 2)), rank
    log = doc["collectives"][1]
    assert log.index("launch i0.RS 1.b1") > log.index("1:1F0")


@pytest.mark.torch
@pytest.mark.slow
def test_check_fails_when_a_replica_skips_its_all_reduce(tmp_path: Path, capsys,
                                                          monkeypatch) -> None:
    """The check must fail on a wrong replay under AdamW: replica 1's stage-1 rank applies
    its own gradients of iteration 0 in place of the all-reduced average (the collective
    still runs). Its weights leave the reference by about lr, replica 0's much less, so the
    run exits 1 with MISMATCH naming replica 1 (only replica 0 was compared before)."""
    pytest.importorskip("torch")
    from pipeopt.executor.procs import Fault

    path = tmp_path / "dp.json"
    dump_graph_schedule(_schedule(SYNC), path)
    plain = RunConfig.from_args
    monkeypatch.setattr(RunConfig, "from_args", classmethod(
        lambda cls, args, **kw: plain(args, fault=Fault(rank=3, mode="skip_reduce"), **kw)))
    capsys.readouterr()
    assert main(["run", str(path), "--model", "mlp", "--check", "--steps", "2",
                 "--optimizer", "adamw", "--lr", "0.05"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("weight diff"))
    assert "MISMATCH: |a - b| <= 1e-08 + 1e-08 |b| elementwise, every replica, float64" in line
    assert "(replica 1)" in line
    assert float(line.split()[2]) > 1e-3  # about lr, five orders above the tolerance


@pytest.mark.torch
@pytest.mark.slow
def test_check_fails_when_a_replica_sends_scaled_gradients() -> None:
    """ZeRO-1, one step late, AdamW: replica 0's stage-0 rank sends its gradients of
    iteration 0 doubled into the reduce-scatter. Every replica then holds the same wrong
    weights (the all-gather spreads them), and the check fails on them."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import run_graph
    from pipeopt.executor.procs import Fault

    res = run_graph(graph_run(_schedule(ZERO)), RunConfig(
        model="mlp", steps=2, check=True, optimizer="adamw", lr=0.05,
        fault=Fault(rank=0, mode="scale_grads", factor=2.0)))
    assert not res.grads_match and res.max_abs_grad_diff is not None
    assert res.max_abs_grad_diff > 1e-4, res.max_abs_grad_diff



def test_run_says_it_does_not_replay_moe_schedules(tmp_path: Path, capsys) -> None:
    from pipeopt.graphio import FORMAT_V2

    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"format": FORMAT_V2, "graph": {"meta": {"workload": "moe"}}}),
                    encoding="utf-8")
    assert main(["run", str(path)]) == 2
    assert "does not replay MoE blocks and their all-to-all" in capsys.readouterr().err
