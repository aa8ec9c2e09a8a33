"""The async replay (pipeopt.executor.periodic): device orders and weight versions by hand, and
every micro-batch's gradient of a multi-process gloo run against a one-process reference with
the same weight versions."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeopt.cli import main
from pipeopt.executor.periodic import (
    replay_messages,
    replay_orders,
    replay_sequence,
    version_plan,
)
from pipeopt.executor.procs import ExecutorError
from pipeopt.problem import Op, uniform_problem
from pipeopt.schedules.periodic import async_pattern
from pipeopt.solvers import solve_async

ROOT = Path(__file__).resolve().parents[1]
P, M = 4, 4  # four stages; iterations of four micro-batches


def _sched(method: str, **kw: object):
    return solve_async(uniform_problem(P, M, f=1.0, b=2.0, w=0.5, **kw), method,
                       weight_bytes=(1.0,) * P)


def test_device_orders_are_1f1b_async_by_hand() -> None:
    orders = replay_orders(_sched("pipedream"), 8)
    # device 0 keeps p = 4 in flight: F0..F3, then B(j) W(j) F(j + 4); the last stage is
    # synchronous (F B W per micro-batch)
    assert [str(op) for op in orders[0][:10]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0W0",
                                                  "0F4", "0B1", "0W1", "0F5"]
    assert [str(op) for op in orders[3][:6]] == ["3F0", "3B0", "3W0", "3F1", "3B1", "3W1"]
    assert all(len(o) == 3 * 8 for o in orders)


def test_messages_follow_their_producers_in_the_sequence() -> None:
    """Each forward's output goes down the chain and each backward's input gradient up it,
    keyed by the op that sends it, in the sequence's order, between the ranks of
    ``rank_of`` (a replicated middle stage: micro-batch j on its replica j mod 2)."""
    from pipeopt.executor.periodic import rank_of

    s = async_pattern(uniform_problem(3, 4, f=1.0, b=2.0, w=0.5), "pipedream", (1.0,) * 3,
                      replicas=(1, 2, 1))
    seq = replay_sequence(s, 4)
    msgs = replay_messages(s, seq)
    # per micro-batch: 0F, 1F down, 2B, 1B up (no W, no last-stage F, no first-stage B)
    assert len(msgs) == 4 * 4
    assert [op for op, _, _ in msgs] == [op for op in seq if (op.kind, op.stage) in (
        ("F", 0), ("F", 1), ("B", 2), ("B", 1))]
    for op, src, dst in msgs:
        to = op.stage + 1 if op.kind == "F" else op.stage - 1
        assert (src, dst) == (rank_of(s, op.stage, op.microbatch),
                              rank_of(s, to, op.microbatch))
    assert {dst for op, _, dst in msgs if op == Op("F", 0, 1)} == {2}  # replica 1 of stage 1


def test_weight_versions_of_each_policy() -> None:
    n = 16
    stash = _sched("pipedream")
    plan = version_plan(stash, replay_sequence(stash, n))
    assert plan.held == tuple(P - k for k in range(P)) == stash.weight_versions  # p - k
    assert plan.forward == plan.backward  # a backward reads the version its forward read
    for k in range(P):  # in steady state forward j reads the weights after j - (p - k) + 1
        assert all(plan.forward[k][j] == j - (P - k) + 1 for j in range(P, n))
    assert plan.updates == (n,) * P
    two = _sched("pipedream-2bw")
    plan = version_plan(two, replay_sequence(two, n))
    assert two.update_every == P and plan.updates == (n // P,) * P
    # two versions where micro-batches of two update groups are in flight; the last stage has
    # one in flight, so it never reads an older one (the model counts 2 there)
    assert plan.held == (2, 2, 2, 1) and max(plan.held) <= max(two.weight_versions)
    assert plan.forward == plan.backward
    mare = _sched("pipemare")
    plan = version_plan(mare, replay_sequence(mare, n))
    assert plan.held == (1,) * P == mare.weight_versions
    for k in range(P):  # the backward's weights are staleness = p - k - 1 updates newer
        assert all(plan.backward[k][j] - plan.forward[k][j] == mare.staleness[k] == P - k - 1
                   for j in range(P, n))


def test_replicated_stages_by_hand() -> None:
    """Stage 1 on 2 replicas (PipeDream's round-robin): ranks 0 | 1, 2 | 3, micro-batch j of
    stage 1 on rank 1 + j mod 2; the replicas update together once per round of two
    micro-batches (their gradients all-reduced), where the round's last backward stands."""
    from pipeopt.executor.periodic import rank_of

    prob = uniform_problem(3, 4, f=1.0, b=2.0, w=0.5)
    s = async_pattern(prob, "pipedream", (1.0,) * 3, replicas=(1, 2, 1))
    assert [rank_of(s, 1, j) for j in range(4)] == [1, 2, 1, 2]
    orders = replay_orders(s, 8)
    assert len(orders) == 4
    assert {op.microbatch for op in orders[2]} == {1, 3, 5, 7}
    plan = version_plan(s, replay_sequence(s, 8))
    assert plan.updates == (8, 4, 8)  # stage 1: one update per round of 2
    # stage 1's forward j reads the weights after the rounds whose last W came before it
    w_pos = {op: i for i, op in enumerate(replay_sequence(s, 8))}
    for j in range(8):
        done = sum(1 for u in range(4) if w_pos[Op("W", 1, 2 * u + 1)] < w_pos[Op("F", 1, j)])
        assert plan.forward[1][j] == done
    assert plan.held[1] <= s.weight_versions[1] + 1


def test_2bw_with_replicated_stages_by_hand() -> None:
    """2BW with stage 1 on 2 replicas: 1F1B-async holds 4, 2, 1 micro-batches in flight per
    replica, so ``update_every`` = 4 micro-batches per replica, and stage 1 updates once per
    group of 2 x 4 = 8 (each replica sums its 4, then one all-reduce), stages 0 and 2 once
    per 4. Over 12 micro-batches: stage 1's second group (8..11 of 8..15) is cut short and
    dropped, so updates (3, 1, 3); every replica holds at most 2 versions (2BW's double
    buffer) and a forward reads weights at most 1 update older than the group its gradient
    joins (staleness 1)."""
    from pipeopt.executor.periodic import update_group

    prob = uniform_problem(3, 4, f=1.0, b=2.0, w=0.5)
    two = async_pattern(prob, "pipedream-2bw", (1.0,) * 3, replicas=(1, 2, 1))
    assert two.update_every == 4 and two.replica_in_flight == (4, 2, 1)
    assert [update_group(two, k) for k in range(3)] == [4, 8, 4]
    plan = version_plan(two, replay_sequence(two, 12))
    assert plan.updates == (3, 1, 3)
    assert plan.held == (2, 2, 1)
    for k in range(3):
        group = update_group(two, k)
        assert all(j // group - plan.forward[k][j] <= two.staleness[k] for j in range(12))
    assert plan.forward[1] == (0,) * 10 + (1, 1)  # 10 and 11 start after group 0's update
    assert len(replay_orders(two, 12)) == 4


@pytest.mark.torch
def test_reference_tells_versions_apart() -> None:
    """The check can fail: the same micro-batches on the newest weights (no staleness) give
    gradients far beyond the tolerance from those of PipeDream's stashed versions."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import RunConfig
    from pipeopt.executor.periodic import VersionPlan, reference_async

    s = _sched("pipedream")
    cfg = RunConfig(model="mlp", model_options=(("width", 8),), steps=2, lr=0.5)
    plan = version_plan(s, replay_sequence(s, 8))
    fresh = VersionPlan(tuple(tuple(range(8)) for _ in range(P)),
                        tuple(tuple(range(8)) for _ in range(P)), plan.updates, (1,) * P)
    a, b = reference_async(s, cfg, plan), reference_async(s, cfg, fresh)
    assert a["losses"][0] == b["losses"][0]  # before any update both read version 0
    assert a["losses"][1] != b["losses"][1]  # the last stage updated once since
    diff = max(float(np.abs(a["grads"][7][0][name] - b["grads"][7][0][name]).max())
               for name in a["grads"][7][0])
    assert diff > 1e-3  # 100x the check's atol (1e-5)


@pytest.mark.torch
def test_replay_matches_the_reference_per_microbatch() -> None:
    """PipeDream, 2BW and PipeMare on 4 gloo ranks, 8 micro-batches each (2 x 4), and
    PipeDream, PipeMare and 2BW with a stage on 2 replicas: every micro-batch's weight gradient,
    every loss and the final weights (of every replica) equal the one-process reference's
    within rtol = atol = 1e-5 (fp32; in practice bit-equal but for the all-reduce's order),
    and every forward and backward used the planned version."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import RunConfig
    from pipeopt.executor.periodic import run_async

    cfg = RunConfig(model="mlp", model_options=(("width", 16),), steps=2, lr=0.1, check=True)
    jobs = [(_sched(m), cfg) for m in ("pipedream", "pipedream-2bw", "pipemare")]
    # 3 stages, the middle one on 2 replicas (4 ranks too): all-reduced rounds
    rep = uniform_problem(3, 4, f=1.0, b=2.0, w=0.5)
    jobs += [(async_pattern(rep, m, (1.0,) * 3, replicas=(1, 2, 1)), cfg)
             for m in ("pipedream", "pipemare")]
    # 2BW with the replicas: groups of 2 x 4 micro-batches on stage 1, the second of the
    # three iterations' 12 cut short (dropped by the run and the reference alike)
    three = replace(cfg, steps=3)
    jobs.append((async_pattern(rep, "pipedream-2bw", (1.0,) * 3, replicas=(1, 2, 1)), three))
    results = run_async(jobs)
    for (s, _), r in zip(jobs, results, strict=True):
        assert r.versions_match, s.method
        assert tuple(r.held) == r.plan.held, s.method
        assert r.grads_match and r.max_abs_grad_diff is not None, s.method
        assert r.max_abs_grad_diff <= 1e-5, s.method
        n = 12 if s.policy == "2bw" and max(s.replicas) > 1 else 8
        assert len(r.losses) == n and r.losses == pytest.approx(r.reference_losses, rel=1e-5)
    assert results[0].held == [4, 3, 2, 1] and results[2].held == [1, 1, 1, 1]
    assert results[3].plan.updates == (8, 4, 8)
    assert results[5].plan.updates == (3, 1, 3) and results[5].held == [2, 2, 1]


@pytest.mark.torch
def test_example_solves_plots_and_runs_in_the_executor_check(tmp_path, capsys) -> None:
    """examples/async.yaml end to end: solve, plot, and run --check (the mlp, one iteration
    of its 16 micro-batches on 4 ranks)."""
    pytest.importorskip("torch")
    out = tmp_path / "async.json"
    assert main(["solve", str(ROOT / "examples" / "async.yaml"), "-o", str(out)]) == 0
    assert main(["plot", str(out), "-o", str(tmp_path / "async.png")]) == 0
    assert (tmp_path / "async.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["run", str(out), "--check", "--json", "--steps", "1", "--model", "mlp"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["grads_match"] is True and doc["versions_match"] is True
    assert doc["ranks"] == 4 and doc["microbatches"] == 16
    assert doc["weight_versions_held"] == [5, 4, 2, 1]  # the solved schedule's in-flight counts


@pytest.mark.parametrize(("flags", "phrase"), [
    (["--data-parallel", "2"], "--data-parallel: replicate stages in the schedule"),
    (["--backend", "nccl"], "--backend nccl: the async replay runs on gloo"),
    (["--batch-size", "6"], "--batch-size: must be a positive multiple of the schedule's 4"),
    (["--model-arg", "width"], "--model-arg: expected KEY=VALUE"),
])
def test_run_refuses_what_the_replay_does_not_take(tmp_path, capsys, flags, phrase) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_sched("pipedream").to_dict()))
    assert main(["run", str(path), *flags]) == 2
    assert phrase in capsys.readouterr().err


@pytest.mark.torch
def test_cli_exit_status_on_mismatch_and_failure(tmp_path, capsys, monkeypatch) -> None:
    """Exit 1 when a gradient differs or a version was not the planned one, and when a rank
    fails (its message on standard error); 0 when all match. No ranks start: the run is
    replaced by canned results."""
    pytest.importorskip("torch")
    import pipeopt.executor.periodic as ep

    s = _sched("pipedream")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(s.to_dict()))
    plan = version_plan(s, replay_sequence(s, 4))

    def canned(grads_ok: bool, versions_ok: bool):
        def fake(jobs):
            return [ep.AsyncRunResult(s.method, s.policy, P, 4, [1.0] * 4, 0.1, 1.0, plan,
                                      list(plan.held), versions_ok, max_abs_grad_diff=0.5,
                                      grads_match=grads_ok, worst_param="0.final.0.weight")]
        return fake

    for grads_ok, versions_ok, rc in ((True, True, 0), (False, True, 1), (True, False, 1)):
        monkeypatch.setattr(ep, "run_async", canned(grads_ok, versions_ok))
        assert main(["run", str(path), "--check", "--steps", "1"]) == rc
        out = capsys.readouterr().out
        assert ("MISMATCH" in out) == (not grads_ok)
        assert ("every forward and backward on its planned version: NO" in out) == (
            not versions_ok)

    def fails(jobs):
        raise ExecutorError("rank 2 failed: boom")

    monkeypatch.setattr(ep, "run_async", fails)
    assert main(["run", str(path), "--steps", "1"]) == 1
    assert "pipeopt: run failed: rank 2 failed: boom" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["pipedream", "periodic", "periodic-2bw", "pipemare",
                                    "periodic-pipemare"])
def test_replay_plan_agrees_with_the_model_on_the_example(method: str) -> None:
    """On examples/async.yaml (unbalanced stages, a slow link): the versions the replay holds
    are the model's ``weight_versions`` (2BW: at most 2), and the staleness it realises, the
    most updates between a micro-batch's forward weights and its own update (stash) or its
    backward weights (PipeMare), is the model's ``staleness``."""
    from pipeopt.config import load_config

    cfg = load_config(str(ROOT / "examples" / "async.yaml"))
    s = solve_async(cfg.problem, method, cfg.extra("weight_bytes"), time_limit=5)
    n = 64
    plan = version_plan(s, replay_sequence(s, n))
    if s.policy == "2bw":
        assert all(h <= v for h, v in zip(plan.held, s.weight_versions, strict=True))
        assert all(h == 2 for h, f in zip(plan.held, s.replica_in_flight, strict=True) if f > 1)
        return
    assert plan.held == s.weight_versions
    for k in range(cfg.problem.stages):
        if s.policy == "stash":
            got = max(j - plan.forward[k][j] for j in range(n))
        else:
            got = max(b - f for b, f in zip(plan.backward[k], plan.forward[k], strict=True))
        assert got == s.staleness[k], (method, k)


def _threads_after_async_jobs(rank: int, world: int, device: object, schedule: object,
                              cfg: object, jobs: int, status: object = None) -> list[int]:
    """The rank's OS threads after each of ``jobs`` async replays of ``schedule``."""
    import os

    from pipeopt.executor.periodic import _run_rank

    out = []
    for _ in range(jobs):
        _run_rank(rank, world, device, schedule, cfg, status)
        out.append(len(os.listdir("/proc/self/task")))
    return out


@pytest.mark.torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_async_jobs_in_one_process_free_their_groups() -> None:
    """A replicated stage's all-reduce group is made per job; each job destroys its own, so
    jobs after the first leave a rank's thread count where it was (a live gloo group keeps
    threads: the same leak as the synchronous executor's, tests/test_executor.py)."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import RunConfig
    from pipeopt.executor.procs import spawn

    sched = async_pattern(uniform_problem(3, 4, f=1.0, b=2.0, w=0.5), "pipedream", (1.0,) * 3,
                          replicas=(1, 2, 1))
    cfg = RunConfig(model="mlp", model_options=(("width", 8),), steps=1)
    for counts in spawn(_threads_after_async_jobs, 4, (sched, cfg, 3), timeout=120,
                        backend="gloo"):
        assert counts[1:] == [counts[0]] * 2, counts
