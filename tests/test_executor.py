"""The torch executor: message plans (pure), model splits, and replays on gloo that must match
the one-process gradients. Spawned runs are batched: one set of processes runs many schedules."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pipeopt.executor import _torch  # noqa: E402
from pipeopt.executor.check import compare_grads  # noqa: E402
from pipeopt.executor.export import schedule_rows, to_torch_csv  # noqa: E402
from pipeopt.executor.launch import RunConfig, run_pipelines  # noqa: E402
from pipeopt.executor.models import ModelError, build_model, split_stages  # noqa: E402
from pipeopt.executor.procs import ExecutorError, Fault  # noqa: E402
from pipeopt.problem import Op, Problem, uniform_problem  # noqa: E402
from pipeopt.schedule import Schedule  # noqa: E402
from pipeopt.schedules import GENERATORS  # noqa: E402
from pipeopt.simulate import simulate  # noqa: E402
from pipeopt.solvers import solve  # noqa: E402

SHAPES = {  # method -> problem keywords
    "1f1b": {}, "gpipe": {}, "zb-h1": {}, "zb-h2": {},
    "interleaved-1f1b": {"virtual_stages": 2},
    "looped-bfs": {"virtual_stages": 2},
    "zb-v": {"virtual_stages": 2, "placement": "vshape"},
}


def _orders_schedule(method: str, p: int, m: int, split: bool, **kw: object) -> Schedule:
    """A classic order generator on a problem with the given backward split (1F1B and
    interleaved 1F1B then run B and W back to back)."""
    prob = uniform_problem(p, m, split_backward=split, **kw)  # type: ignore[arg-type]
    label = f"{method}/{'split' if split else 'fused'}"
    return simulate(prob, GENERATORS[method](prob), method=label)


def _search_schedule(p: int, m: int, split: bool = True) -> Schedule:
    """A CP-SAT schedule (one worker, fixed seed) with the given backward split."""
    prob = uniform_problem(p, m, f=1.0, b=1.0, w=0.5, split_backward=split)
    sched = solve(prob, "cpsat", time_limit=5, workers=1, seed=0)
    assert sched.method == "cpsat" and sched.problem.split_backward == split
    return sched


# ----- pure: the runtime's actions -------------------------------------------------------------
def _random_orders(prob: Problem, rnd: random.Random) -> list[list[Op]]:
    """Device orders that follow one random topological order of the ops (always valid)."""
    s = prob.stages
    deps: dict[Op, list[Op]] = {}
    for op in prob.ops():
        d = []
        if op.kind == "F" and op.stage > 0:
            d.append(Op("F", op.stage - 1, op.microbatch))
        if op.kind == "B":
            d.append(Op("F", op.stage, op.microbatch))
            if op.stage + 1 < s:
                d.append(Op("B", op.stage + 1, op.microbatch))
        if op.kind == "W":
            d.append(Op("B", op.stage, op.microbatch))
        deps[op] = d
    placed: set[Op] = set()
    orders: list[list[Op]] = [[] for _ in range(prob.devices)]
    while len(placed) < len(deps):
        ready = sorted(op for op in deps if op not in placed
                       and all(x in placed for x in deps[op]))
        op = rnd.choice(ready)
        placed.add(op)
        orders[prob.stage_device[op.stage]].append(op)
    return orders


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 4), v=st.integers(1, 2),
       vshape=st.booleans(), split=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_lowers_any_valid_schedule(p: int, m: int, v: int, vshape: bool,
                                         split: bool, seed: int) -> None:
    """Every valid schedule becomes actions that PyTorch validates and lowers (its send /
    receive insertion fails on a schedule that would deadlock), and PyTorch's parser reads the
    exported CSV back to the same actions; the last stage's forwards run
    in micro-batch order after relabelling, as the runtime's loss bookkeeping needs."""
    prob = uniform_problem(p, m, virtual_stages=v, split_backward=split,
                           placement="vshape" if vshape and v == 2 else "loop")
    sched = simulate(prob, _random_orders(prob, random.Random(seed)))
    rows, order = schedule_rows(sched)
    assert sorted(order) == list(range(m))
    last = [j for row in rows for k, kind, j in row if kind == "F" and k == prob.stages - 1]
    assert last == list(range(m))
    actions = _torch.rows_to_actions(rows)
    cells = [line.split(",") for line in to_torch_csv(sched).splitlines()]  # PyTorch reads
    assert [[_torch.parse_action(c) for c in row] for row in cells] == list(actions.values())
    lowered = _torch.lower(actions, prob.stages, m)
    sends = sum(str(a).count("SEND") for acts in lowered.values() for a in acts)
    remote = sum(prob.stage_device[k] != prob.stage_device[k + 1] for k in range(prob.stages - 1))
    assert sends == 2 * m * remote  # an activation and a gradient per remote boundary


def test_vshape_tip_is_local() -> None:
    sched = _orders_schedule("zb-v", 2, 4, True, virtual_stages=2, placement="vshape")
    rows, _ = schedule_rows(sched)
    lowered = _torch.lower(_torch.rows_to_actions(rows), 4, 4)
    # stages 1 and 2 share rank 1: neither the activation nor the gradient crosses a link
    comms = [str(a) for acts in lowered.values() for a in acts if "SEND" in str(a)
             or "RECV" in str(a)]
    assert not any(c.startswith(("1SEND_F", "2RECV_F", "2SEND_B", "1RECV_B")) for c in comms)
    assert "0SEND_F0" in comms and "2SEND_F0" in comms and "3SEND_B0" in comms


def test_private_torch_api_needs_the_pinned_version() -> None:
    from pipeopt.executor._torch import SUPPORTED, TorchVersionError, _check_version

    _check_version(SUPPORTED + ".0")
    with pytest.raises(TorchVersionError, match=r"checked on torch 2\.13\.x; this is torch 2\.12"):
        _check_version("2.12.1")


# ----- pure: models ------------------------------------------------------------------------------
def test_split_even_and_by_partition() -> None:
    prob = uniform_problem(2, 2)
    spec = build_model("mlp", prob.replace(virtual_stages=1), seed=0, layers=5)
    assert [len(s) for s in split_stages(spec, prob)] == [2, 3]
    part = prob.replace(meta=(("partition", [[0, 1], [1, 5]]),))
    assert [len(s) for s in split_stages(spec, part)] == [1, 4]
    with pytest.raises(ModelError, match="partition"):
        split_stages(spec, prob.replace(meta=(("partition", [[0, 2], [3, 5]]),)))
    with pytest.raises(ModelError, match="fewer than"):
        split_stages(build_model("mlp", prob, layers=1), prob)
    with pytest.raises(ModelError, match="unknown model"):
        build_model("resnet", prob)


def test_compare_grads_catches_a_difference() -> None:
    import numpy as np

    ref = {0: {"w": np.ones((2, 2), dtype=np.float32)}}
    assert compare_grads({0: {"w": ref[0]["w"] + 1e-7}}, ref).ok
    bad = compare_grads({0: {"w": ref[0]["w"] + np.float32(1e-3)}}, ref)
    assert not bad.ok and bad.worst == "0.w"
    assert bad.max_abs_grad_diff == pytest.approx(1e-3, rel=1e-3)


# ----- spawned runs ------------------------------------------------------------------------------
def _assert_all_match(jobs: list[tuple[Schedule, RunConfig]], results: list) -> None:
    for (sched, cfg), res in zip(jobs, results, strict=True):
        what = f"{sched.method} on {cfg.model}"
        assert res.grads_match, f"{what}: max |grad diff| {res.max_abs_grad_diff}"
        assert res.max_abs_grad_diff < 1e-5, what
        assert res.losses == pytest.approx(res.reference_losses, rel=1e-5), what


@pytest.mark.torch
def test_replay_two_ranks_matches_reference() -> None:
    p, m = 2, 4
    scheds = [
        _orders_schedule("1f1b", p, m, False),
        _orders_schedule("1f1b", p, m, True),
        _orders_schedule("interleaved-1f1b", p, m, False, virtual_stages=2),
        _orders_schedule("zb-h1", p, m, True),
        _orders_schedule("zb-v", p, m, True, virtual_stages=2, placement="vshape"),
    ]
    scheds += [_search_schedule(p, m, split=True), _search_schedule(p, m, split=False)]
    jobs = []
    for i, s in enumerate(scheds):
        for model in ("mlp", "tiny-gpt"):
            steps = 2 if i == 0 else 1  # one two-step job: the optimizer step is checked too
            jobs.append((s, RunConfig(model=model, check=True, steps=steps)))
    # PyTorch's whole-stage split backward instead of pipeopt's per-layer one
    jobs.append((scheds[3], RunConfig(model="tiny-gpt", check=True, per_layer_split=False)))
    results = run_pipelines(jobs)
    _assert_all_match(jobs, results)


@pytest.mark.torch
def test_replay_four_ranks_matches_reference() -> None:
    p, m = 4, 8
    part = (("partition", [[0, 1], [1, 2], [2, 5], [5, 6]]),)  # uneven, from a "profile"
    fused_1f1b = _orders_schedule("1f1b", p, m, False)
    scheds = [
        (fused_1f1b, "tiny-gpt"),
        (Schedule(fused_1f1b.problem.replace(meta=part), "1f1b/partition", fused_1f1b.ops),
         "mlp"),
        (_orders_schedule("interleaved-1f1b", p, m, False, virtual_stages=2), "mlp"),
        (_orders_schedule("interleaved-1f1b", p, m, True, virtual_stages=2), "tiny-gpt"),
        (_orders_schedule("zb-h1", p, m, True), "tiny-gpt"),
        (_orders_schedule("zb-v", p, m, True, virtual_stages=2, placement="vshape"), "mlp"),
        (_orders_schedule("zb-v", p, m, True, virtual_stages=2, placement="vshape"), "tiny-gpt"),
    ]
    scheds += [(_search_schedule(p, m, split), model)
               for split in (True, False) for model in ("mlp", "tiny-gpt")]
    jobs = [(s, RunConfig(model=model, check=True)) for s, model in scheds]
    _assert_all_match(jobs, run_pipelines(jobs))


#: The decoder recipe: bf16 autocast, AdamW, clipping to a global norm, two steps (the second
#: step's gradients follow an AdamW update and a clipped step on both sides). Parameters and
#: gradients stay fp32 under autocast and both sides run the same bf16 ops per micro-batch, so
#: the default tolerance holds: |a - b| <= 1e-5 + 1e-5 |b|.
DECODER = RunConfig(model="decoder_model:decoder", check=True, steps=2, optimizer="adamw",
                    clip_grad_norm=0.5, autocast="bf16", lr=1e-3)


@pytest.mark.torch
def test_decoder_two_ranks_matches_reference() -> None:
    """A Hugging Face-style decoder (tuples between stages) under 1F1B, ZB-H1, ZB-V, the
    greedy solver's and CP-SAT's schedules on 2 gloo ranks equals one-process training; also
    with every layer an activation checkpoint (1F1B by the flag, ZB-H1 as its problem says)."""
    p, m = 2, 4
    greedy = solve(uniform_problem(p, m, f=1.0, b=1.0, w=0.5), "greedy")
    scheds = [_orders_schedule("1f1b", p, m, False), _orders_schedule("zb-h1", p, m, True),
              _orders_schedule("zb-v", p, m, True, virtual_stages=2, placement="vshape"),
              greedy, _search_schedule(p, m)]
    jobs = [(s, DECODER) for s in scheds]
    jobs.append((scheds[0], dataclasses.replace(DECODER, recompute="full")))
    zb = scheds[1]  # its problem says recompute: full (as the model form records it)
    rows = [{"stage": k, "recompute": "full"} for k in range(zb.problem.stages)]
    zb = Schedule(zb.problem.replace(meta=(("stage_costs", rows),)), zb.method, zb.ops)
    jobs.append((zb, DECODER))
    _assert_all_match(jobs, run_pipelines(jobs))


@pytest.mark.torch
@pytest.mark.slow
def test_decoder_four_ranks_matches_reference() -> None:
    """The same five methods on 4 ranks (ZB-V: 8 stages, so a decoder of 6 blocks, and at
    least 2 x 4 micro-batches)."""
    p, m = 4, 4
    scheds = [_orders_schedule("1f1b", p, m, False), _orders_schedule("zb-h1", p, m, True),
              solve(uniform_problem(p, m, f=1.0, b=1.0, w=0.5), "greedy"),
              _search_schedule(p, m)]
    jobs = [(s, DECODER) for s in scheds]
    jobs.append((_orders_schedule("zb-v", p, 2 * p, True, virtual_stages=2, placement="vshape"),
                 dataclasses.replace(DECODER, model_options=(("layers", 6),))))
    _assert_all_match(jobs, run_pipelines(jobs))


@pytest.mark.torch
@pytest.mark.slow
def test_decoder_two_stages_two_replicas_matches_reference() -> None:
    """2 pipeline stages x 2 data-parallel replicas (4 ranks), each replica on its half of a
    batch twice as large, gradients averaged: equal to one-process training on the whole
    batch."""
    from dataclasses import replace

    cfg = replace(DECODER, data_parallel=2)
    jobs = [(_orders_schedule("1f1b", 2, 4, False), cfg),
            (_orders_schedule("zb-h1", 2, 4, True), cfg)]
    _assert_all_match(jobs, run_pipelines(jobs))


@pytest.mark.torch
def test_failing_rank_ends_the_run_with_its_error() -> None:
    sched = _orders_schedule("1f1b", 2, 2, False)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 failed: RuntimeError: injected fault"):
        run_pipelines([(sched, RunConfig(fault=Fault(rank=1), timeout=60))])
    assert time.monotonic() - t0 < 30


@pytest.mark.torch
def test_silent_rank_is_reported_within_the_op_timeout() -> None:
    """Rank 0 stops answering; within the per-op timeout (not the run's) the run ends with
    rank 1 named, the op it waited at and whose output it waited for."""
    sched = _orders_schedule("1f1b", 2, 2, False)
    cfg = RunConfig(fault=Fault(rank=0, mode="hang"), timeout=120, op_timeout=4)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError) as err:
        run_pipelines([(sched, cfg)])
    assert time.monotonic() - t0 < 40  # spawning 2 ranks on a busy 2-core machine: ~5-15 s
    msg = str(err.value)
    assert "rank 1: step 0: 1F0 waits for the output of 0F0 from rank 0" in msg, msg
    assert "rank 0: step 0: stopped answering (injected fault)" in msg, msg  # the silent one
    assert "timed out after" not in msg  # not the whole-run timeout


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_launcher_ends_every_rank(tmp_path) -> None:
    """A launcher killed with SIGKILL (no clean-up code runs) takes its ranks with it within
    5 s: the parent-death signal."""
    import os
    import signal
    import subprocess

    script = tmp_path / "launcher.py"
    script.write_text(  # imports under __main__: a rank re-imports this module at start
        "if __name__ == '__main__':\n"
        "    from pipeopt.executor.launch import RunConfig, run_pipelines\n"
        "    from pipeopt.executor.procs import Fault\n"
        "    from pipeopt.problem import uniform_problem\n"
        "    from pipeopt.schedules import GENERATORS\n"
        "    from pipeopt.simulate import simulate\n"
        "    prob = uniform_problem(2, 2, split_backward=False)\n"
        "    s = simulate(prob, GENERATORS['1f1b'](prob))\n"
        "    run_pipelines([(s, RunConfig(fault=Fault(0, 'hang'), timeout=300,\n"
        "                                 op_timeout=300))])\n")
    launcher = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ))
    children: list[int] = []

    def ranks() -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == launcher.pid and b"spawn_main" in cmd:
                out.append(int(pid))
        return out

    try:
        deadline = time.monotonic() + 60
        while len(ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        children = ranks()
        assert len(children) == 2, "the ranks did not start"
        time.sleep(0.5)  # the signal is armed first thing, before torch is imported
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        alive = children
        while alive and time.monotonic() - t0 < 5:
            time.sleep(0.1)
            alive = [pid for pid in children if _alive(pid)]
        assert not alive, f"ranks {alive} outlived their launcher by 5 s"
    finally:
        launcher.kill()
        for pid in children + ranks():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.torch
def test_cli_run_check_json(tmp_path, capsys) -> None:
    from pipeopt.cli import main
    from pipeopt.io import dump_schedule

    path = tmp_path / "s.json"
    dump_schedule(_orders_schedule("zb-h1", 2, 2, True), path)
    rc = main(["run", str(path), "--model", "tiny-gpt", "--check", "--json", "--steps", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["grads_match"] is True and out["ranks"] == 2
    assert out["max_abs_grad_diff"] < 1e-5 and out["predicted_step_time"] > 0
    assert out["step_time"] > 0 and len(out["losses"]) == 2


@pytest.mark.torch
def test_closed_loop_profile_solve_run(tmp_path, capsys) -> None:
    """``pipeopt profile`` on the tiny GPT -> ``pipeopt solve`` on its profile (CP-SAT, with the
    partition the profile's costs choose) -> ``pipeopt run --check``, all through the CLI."""
    from pipeopt.cli import main
    from pipeopt.io import load_schedule

    prof, cfg, out = tmp_path / "profile.json", tmp_path / "cfg.yaml", tmp_path / "s.json"
    assert main(["profile", "--model", "tiny-gpt", "--layers", "4", "--batch-size", "4",
                 "--device", "cpu", "--warmup", "1", "--repeats", "3", "-o", str(prof)]) == 0
    cfg.write_text("pipeline: {devices: 2, microbatches: 4}\n"
                   "model: {profile: profile.json}\n"  # relative to the config file
                   "solver: {method: cpsat, time_limit: 5, workers: 1, seed: 0}\n")
    assert main(["solve", str(cfg), "-o", str(out), "--quiet"]) == 0
    sched = load_schedule(out)
    part = dict(sched.problem.meta)["partition"]
    assert sched.method == "cpsat" and part[0][0] == 0 and part[-1][1] == 6  # emb, 4 blocks, head
    capsys.readouterr()
    rc = main(["run", str(out), "--model", "tiny-gpt", "--check", "--json", "--steps", "2"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["grads_match"] is True and res["ranks"] == 2
    assert res["max_abs_grad_diff"] < 1e-5 and len(res["losses"]) == 2
    assert res["loss"] == pytest.approx(res["reference_losses"][-1], rel=1e-5)
    assert res["step_time"] > 0
    # the profile is in seconds, so the prediction is a step time in seconds too
    # ... with the optimizer step the profile timed per layer after each stage's last W
    assert res["predicted_step_time"] == pytest.approx(sched.iteration_time)
    assert sched.iteration_time > sched.makespan
    assert 0 < res["predicted_step_time"] < 10
    # ... -> run --costs-out -> solve again on what the run measured
    measured = tmp_path / "measured.json"
    assert main(["run", str(out), "--model", "tiny-gpt", "--steps", "2", "--json",
                 "--costs-out", str(measured)]) == 0
    costs = json.loads(capsys.readouterr().out)["op_costs"]
    assert sorted(costs) == sorted(f"{k}{kind}" for k in range(2) for kind in "FBW")
    got = load_schedule(measured)
    meta = dict(got.problem.meta)
    assert meta["partition"] == part and meta["measured_costs"]["from_run_of"] == "cpsat"
    assert got.problem.forward == pytest.approx((costs["0F"], costs["1F"]))
    assert got.problem.backward_weight == pytest.approx((costs["0W"], costs["1W"]))
    assert got.problem.backward_input[0] < 0.1 * got.problem.backward_weight[0]  # token ids
    assert got.device_orders() == sched.device_orders()  # the same orders, re-timed
    tail = got.problem.grad_reduce  # the run's step beyond its ops, after every stage
    assert tail[0] == tail[1] >= 0 and dict(got.problem.meta)["overheads"]["step_s"] == list(tail)
    again = tmp_path / "again.json"
    assert main(["solve", str(measured), "--method", "greedy", "-o", str(again), "--quiet"]) == 0
    assert load_schedule(again).problem == got.problem


def test_cli_exit_status_on_mismatch_and_failure(tmp_path, monkeypatch, capsys) -> None:
    """No processes: the run itself is replaced, only the CLI's verdicts are checked."""
    from pipeopt.cli import main
    from pipeopt.executor import launch
    from pipeopt.io import dump_schedule

    path = tmp_path / "s.json"
    dump_schedule(_orders_schedule("1f1b", 2, 2, False), path)
    bad = launch.RunResult("1f1b", 2, [1.0], [0.1], 6.0, [1.0], 0.2, 0.5, False, "0.w",
                           op_costs={("F", 1): 0.002, ("B", 1): 0.004})
    monkeypatch.setattr(launch, "run_pipeline", lambda s, c: bad)
    assert main(["run", str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out
    assert "op times      stage 1: F 2 ms, B 4 ms measured (problem: 1000 ms, 2000 ms)" in out
    for line in out.splitlines():  # every printed time carries its unit
        if line.startswith(("step time", "predicted", "reference")):
            assert line.split()[2] == "s" or line.split()[3] == "s", line

    def fail(s: Schedule, c: RunConfig) -> None:
        raise ExecutorError("rank 1 failed: RuntimeError: boom")

    monkeypatch.setattr(launch, "run_pipeline", fail)
    assert main(["run", str(path)]) == 1
    assert "run failed: rank 1 failed" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["run", str(path), "--model", "nope"]) == 2  # caught before any process starts
    assert "unknown model 'nope'" in capsys.readouterr().err


class _Pair(torch.nn.Module):
    """Hands a tuple on: no cut point of a split stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _Prod(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y


def view_model() -> object:
    """Three stage modules; the first hands on a view (a Linear on a 3-d input), the middle
    one has layers with a tuple between two of them."""
    from pipeopt.executor.models import ModelSpec

    layers = [torch.nn.Linear(4, 4),
              torch.nn.Sequential(torch.nn.Linear(4, 4), _Pair(), _Prod(), torch.nn.Linear(4, 4)),
              torch.nn.Linear(4, 1)]

    def make_batch(bs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(bs, 3, 4, generator=g), torch.randn(bs, 3, 1, generator=g)

    return ModelSpec("view", layers, make_batch, torch.nn.functional.mse_loss,
                     stage_modules=True)


@pytest.mark.parametrize("split", [True, False])
def test_stage_whose_output_is_a_view(split: bool, monkeypatch) -> None:
    """A non-last stage may hand on a view; PyTorch's split backward detaches the stage output
    in place, which it refuses for a view. One rank with three loop stages (local hand-offs),
    in this process (a one-rank gloo group): gradients equal the one-process reference."""
    import sys

    import torch.distributed as dist

    from pipeopt.executor.launch import _assemble, run_rank

    assert torch.nn.Linear(4, 4)(torch.zeros(2, 3, 4))._base is not None  # the case under test
    monkeypatch.setitem(sys.modules, "_view_model_mod", sys.modules[__name__])
    prob = uniform_problem(1, 2, virtual_stages=3, split_backward=split)
    order = [Op(kind, k, j) for j in range(2) for kind, k in
             (("F", 0), ("F", 1), ("F", 2), ("B", 2), ("W", 2), ("B", 1), ("W", 1), ("B", 0),
              ("W", 0)) if split or kind != "W"]
    sched = simulate(prob, [order])
    cfg = RunConfig(model="_view_model_mod:view_model", check=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        report = run_rank(0, 1, torch.device("cpu"), sched, cfg)
    finally:
        dist.destroy_process_group()
    res = _assemble(sched, cfg, [report])
    assert res.grads_match and res.max_abs_grad_diff < 1e-5, res.worst_param


def test_steady_cpu_allocator_on_glibc() -> None:
    import platform

    from pipeopt._malloc import steady_cpu_allocator

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert steady_cpu_allocator() is True
    assert steady_cpu_allocator() is True  # idempotent


def test_measured_problem_keeps_the_fused_split_share() -> None:
    from pipeopt.executor.launch import RunResult, measured_problem, measured_schedule
    from pipeopt.schedules import fused_variant

    sched = _orders_schedule("1f1b", 2, 2, False)  # fused from the start: B = input + weight
    prob = sched.problem.replace(backward_input=(2.0, 2.0), backward_weight=(1.0, 1.0))
    sched = simulate(prob, sched.device_orders(), method="1f1b")
    res = RunResult("1f1b", 2, [1.0], [0.5], sched.makespan,
                    op_costs={("F", 0): 0.1, ("F", 1): 0.2, ("B", 0): 0.3, ("B", 1): 0.6})
    got = measured_problem(sched, res)
    assert got.split_backward and got.forward == pytest.approx((0.1, 0.2))
    assert got.backward_input == (2.0, 2.0) and got.backward_weight == (1.0, 1.0)
    assert dict(got.meta)["measured_costs"]["from_run_of"] == "1f1b"
    assert dict(got.meta)["fused_backward"] == pytest.approx([0.3, 0.6])  # recorded apart
    fused = fused_variant(got)
    assert fused.backward_input == pytest.approx((0.2, 0.4))  # 2 : 1 as before
    assert fused.backward_weight == pytest.approx((0.1, 0.2))
    assert measured_schedule(sched, res).problem.durations["B"] == pytest.approx((0.3, 0.6))
    split = _orders_schedule("zb-h1", 2, 2, True)
    split = Schedule(split.problem.replace(meta=(("fused_backward", [0.5, 0.5]),)),
                     "zb-h1", split.ops)
    res = RunResult("zb-h1", 2, [1.0], [0.5], split.makespan,
                    op_costs={("B", 0): 0.7, ("W", 0): 0.4})
    got = measured_problem(split, res)
    assert got.backward_input[0] == 0.7 and got.backward_weight[0] == 0.4
    assert dict(got.meta)["fused_backward"] == [0.5, 0.5]  # a split run keeps the fused one


def test_fused_run_costs_out_keeps_the_split_costs(tmp_path) -> None:
    """A 1F1B run of a split problem (profiled: B 0.5, W 0.25, fused 0.6 s per stage) measures
    F 0.1 s and a fused backward of 0.3 s. The file ``--costs-out`` writes re-times 1F1B on
    them, and the problem solved from it prices 1F1B at the measured fused backward and ZB-H1
    at the split it had, by hand (p = 2, m = 2, no latency):
    1F1B  (m + p - 1)(F + B_fused) = 3 x 0.4 = 1.2 s;
    ZB-H1 stage 1 runs F B on micro-batch 0 after stage 0's F (0.1 + 0.1 + 0.5), then stage 0
          runs B W B W back to back (stage 1's second B ends at 1.3 < 1.45): 0.7 + 2 x 0.75
          = 2.2 s."""
    from pipeopt.config import config_from_schedule
    from pipeopt.executor.launch import RunResult, measured_schedule
    from pipeopt.io import dump_schedule
    from pipeopt.schedules import SPLIT_COSTS
    from pipeopt.solvers import run_classic

    prob = uniform_problem(2, 2, f=0.2, b=0.5, w=0.25).replace(
        meta=(("fused_backward", [0.6, 0.6]),))
    sched = run_classic(prob, "1f1b")
    assert not sched.problem.split_backward
    assert sched.makespan == pytest.approx(3 * (0.2 + 0.6))  # priced at the profiled fused
    assert dict(sched.problem.meta)[SPLIT_COSTS] == {"backward_input": [0.5, 0.5],
                                                     "backward_weight": [0.25, 0.25]}
    res = RunResult("1f1b", 2, [1.0], [0.5], sched.makespan,
                    op_costs={("F", 0): 0.1, ("F", 1): 0.1, ("B", 0): 0.3, ("B", 1): 0.3})
    out = tmp_path / "measured.json"
    dump_schedule(measured_schedule(sched, res), out)
    problem = config_from_schedule(out).problem
    assert problem.split_backward  # the split problem is back, on the measured costs
    assert problem.forward == (0.1, 0.1)
    assert problem.backward_input == (0.5, 0.5) and problem.backward_weight == (0.25, 0.25)
    assert dict(problem.meta)["fused_backward"] == [0.3, 0.3]
    assert run_classic(problem, "1f1b").makespan == pytest.approx(1.2)
    zb = run_classic(problem, "zb-h1")
    assert zb.problem.split_backward and zb.makespan == pytest.approx(2.2)


def test_recompute_follows_the_problem() -> None:
    """Activation checkpointing where the model form says ``recompute: full`` (each stage's mode
    in ``stage_costs``), none for ``selective`` (with a note); ``--recompute`` overrides it on
    every stage, saying where it contradicts the problem."""
    from pipeopt.config import parse_config
    from pipeopt.executor.launch import _build
    from pipeopt.executor.models import recompute_modes, recompute_plan

    doc = {"pipeline": {"devices": 2, "microbatches": 2, "split_backward": False},
           "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 128,
                     "recompute": "full"},
           "cluster": {"gpu": "A100-80GB", "gpus_per_node": 2}}
    prob = parse_config(doc).problem
    assert recompute_modes(prob) == ("full", "full")
    assert recompute_plan(prob) == ((True, True), [])
    meta = dict(prob.meta)
    rows = [dict(r) for r in meta["stage_costs"]]
    rows[0]["recompute"] = "none"
    rows[1]["recompute"] = "selective"
    mixed = prob.replace(meta=tuple({**meta, "stage_costs": rows}.items()))
    assert recompute_modes(mixed) == ("none", "selective")
    checkpointed, notes = recompute_plan(mixed)
    assert checkpointed == (False, False) and "stage(s) 1: selective" in notes[0]
    checkpointed, notes = recompute_plan(mixed, "full")
    assert checkpointed == (True, True)
    assert notes == ["--recompute full: overrides the problem's recompute (stage 0: none, "
                     "stage 1: selective); its op times assume the problem's, so the measured "
                     "ones will differ"]
    assert recompute_plan(prob, "full") == ((True, True), [])  # agrees: nothing to say
    assert recompute_plan(uniform_problem(2, 2)) == ((False, False), [])  # no model form
    rows[1]["recompute"] = "some"
    bad = prob.replace(meta=tuple({**meta, "stage_costs": rows}.items()))
    with pytest.raises(ModelError, match=r"^problem\.meta\.stage_costs\[1\]\.recompute: must "
                       r"be one of none, selective, full, got 'some'"):
        recompute_modes(bad)
    sched = simulate(mixed, GENERATORS["1f1b"](mixed), method="1f1b")
    rows[1]["recompute"] = "full"
    sched = Schedule(mixed.replace(meta=tuple({**meta, "stage_costs": rows}.items())), "1f1b",
                     sched.ops)
    _, _, mods, _ = _build(sched, RunConfig(model="tiny-gpt"))
    assert [m.recompute for m in mods] == [False, True]
    _, _, mods, _ = _build(sched, RunConfig(model="tiny-gpt", recompute="none"))
    assert [m.recompute for m in mods] == [False, False]


def test_run_config_refuses_an_unknown_recipe() -> None:
    with pytest.raises(ValueError, match=r"optimizer 'adam' / autocast None: expected sgd or "
                       r"adamw / bf16, fp16 or None"):
        RunConfig(optimizer="adam")
    with pytest.raises(ValueError, match=r"autocast 'fp8'"):
        RunConfig(autocast="fp8")


def test_split_stage_cuts_only_between_single_tensors() -> None:
    """A multi-layer stage with split backward is cut after every layer that hands on one
    differentiable tensor; a layer handing on a tuple joins the next layer's segment. B then W
    give the gradients of one whole backward."""
    from pipeopt.costs.profiler import executor_split

    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 4), _Pair(), _Prod(), torch.nn.Linear(4, 4))
    f, b, w = executor_split(mod, torch.device("cpu"))
    x, g = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4)
    saved = f(x)
    assert [len(seg.params) for seg in saved["segs"]] == [2, 4, 2]
    b(saved, g)
    w(saved)
    got = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    l0, pair, prod, l3 = mod
    l3(prod(*pair(l0(x.detach().requires_grad_(True))))).backward(g)
    for a, p in zip(got, mod.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_costs_out_records_the_step_tail() -> None:
    """``--costs-out`` (issue 17 item 4): what a step measured beyond its ops (optimizer step,
    barrier, the runtime between ops) becomes every stage's step tail, so a schedule re-timed
    or re-planned on the file predicts the measured step; a data-parallel reduction in
    ``grad_reduce`` stays, the profile's step tail is replaced. By hand: ZB-H1, p = m = 2,
    every op 0.1 s as measured: makespan 0.7 s (stage 0: F F, a wait for stage 1's first B,
    then B W B W; both stages' last W end at 0.7), steps 1.0 and 1.2 s (the first not
    counted), so the tail is 1.1 - 0.7 = 0.4 s."""
    from pipeopt.executor.launch import RunResult, measured_problem, measured_schedule
    from pipeopt.solvers import run_classic

    prob = uniform_problem(2, 2, f=0.1, b=0.1, w=0.1)
    sched = run_classic(prob, "zb-h1")
    assert sched.makespan == pytest.approx(0.7)
    ops = {(k, s): 0.1 for k in "FBW" for s in range(2)}
    res = RunResult("zb-h1", 2, [1.0] * 3, [5.0, 1.0, 1.2], sched.makespan, op_costs=ops)
    got = measured_problem(sched, res)
    assert got.grad_reduce == pytest.approx((0.4, 0.4))
    assert dict(got.meta)["overheads"]["step_s"] == pytest.approx([0.4, 0.4])
    assert measured_schedule(sched, res).iteration_time == pytest.approx(1.1)
    assert run_classic(got, "1f1b").iteration_time > run_classic(got, "1f1b").makespan
    # a reduction of 0.05 s plus a profiled tail of 0.02 s: the reduction stays
    meta = (("overheads", {"action_s": 0.0, "message_s": 0.0, "step_s": [0.02, 0.02]}),)
    prob2 = prob.replace(grad_reduce=(0.07, 0.07), meta=meta)
    sched2 = run_classic(prob2, "zb-h1")
    got2 = measured_problem(sched2, res)
    base = simulate(prob.replace(grad_reduce=(0.05, 0.05)), sched2.device_orders())
    tail = 1.1 - base.iteration_time
    assert got2.grad_reduce == pytest.approx((0.05 + tail, 0.05 + tail))
    # no step time recorded (a run summarised without them): the problem's own tail stays
    res0 = RunResult("zb-h1", 2, [1.0], [0.0], sched.makespan, op_costs=ops)
    assert measured_problem(sched2, res0).grad_reduce == pytest.approx((0.07, 0.07))


@pytest.mark.torch
def test_every_step_trace_follows_the_rank_order() -> None:
    """``run_rank``'s ``step_traces`` (issue 17: where a step's time goes): one trace per step,
    the rank's ops in its device order, each ending after it starts and within the step."""
    from pipeopt.executor.launch import run_rank
    from pipeopt.executor.procs import spawn

    sched = solve(uniform_problem(2, 2), "zb-h1")
    cfg = RunConfig(model="mlp", model_options=(("layers", 2), ("width", 4)), steps=2,
                    batch_size=2)
    reports = spawn(run_rank, 2, (sched, cfg), timeout=120, backend="gloo")
    for rank, rep in enumerate(reports):
        assert len(rep["step_traces"]) == 2
        for trace, step_s in zip(rep["step_traces"], rep["step_times"], strict=True):
            assert [name for name, _, _ in trace] == [
                str(op) for op in sched.device_orders()[rank]]
            ends = [b for _, _, b in trace]
            assert all(0.0 <= a <= b for _, a, b in trace)
            assert ends == sorted(ends) and ends[-1] <= step_s


def _threads_after_jobs(rank: int, world: int, device: object, sched: Schedule,
                        cfg: RunConfig, jobs: int, status: object = None) -> list[int]:
    """The rank's OS threads after each of ``jobs`` runs of ``sched`` in one process."""
    import os

    from pipeopt.executor.launch import run_rank

    out = []
    for _ in range(jobs):
        run_rank(rank, world, device, sched, cfg)
        out.append(len(os.listdir("/proc/self/task")))
    return out


@pytest.mark.torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_jobs_in_one_process_free_their_groups() -> None:
    """Each job builds its own process groups; a job that left them alive added 3 gloo threads
    per rank (issue 17: 175 threads per rank after 56 jobs). After the first job, further jobs
    in the same ranks leave the thread count where it was."""
    from pipeopt.executor.procs import spawn

    sched = solve(uniform_problem(2, 2), "1f1b")
    cfg = RunConfig(model="mlp", model_options=(("layers", 2), ("width", 4)), steps=1,
                    batch_size=2)
    for counts in spawn(_threads_after_jobs, 2, (sched, cfg, 4), timeout=120, backend="gloo"):
        assert counts[1:] == [counts[0]] * 3, counts


def _affinity(rank: int, world: int, device: object, status: object = None) -> list[int]:
    """A spawned rank's CPUs (for the pinning test)."""
    import os

    return sorted(os.sched_getaffinity(0))


def test_pin_to_cores_gives_each_rank_its_own_cores(monkeypatch) -> None:
    """Rank r of a run gets the r-th run of ``threads`` CPUs of those allowed; a run whose
    ranks' threads do not fit is left to the kernel (the affinity is not touched)."""
    import os

    from pipeopt.executor import procs

    set_to: list[list[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 6, 9}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: set_to.append(list(cpus)),
                        raising=False)
    assert procs.pin_to_cores(1, 2, 2) == [6, 9] and set_to == [[6, 9]]
    assert procs.pin_to_cores(0, 4, 1) == [3]
    assert procs.pin_to_cores(0, 3, 2) is None and procs.pin_to_cores(4, 5, 1) is None
    assert set_to == [[6, 9], [3]]


def test_pin_to_cores_refused_leaves_the_rank_unbound(monkeypatch, capsys) -> None:
    """Where the system refuses the binding (a sandbox's seccomp: EPERM), the rank runs
    unbound with a one-line note, not a traceback out of ``spawn``."""
    import os

    from pipeopt.executor import procs

    def refuse(pid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", refuse, raising=False)
    assert procs.pin_to_cores(1, 2, 1) is None
    assert "rank 1 not bound to CPUs [1]" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity")
                    or len(__import__("os").sched_getaffinity(0)) < 2,
                    reason="needs sched_getaffinity and 2 CPUs")
def test_spawned_gloo_ranks_run_on_cores_of_their_own() -> None:
    """Two gloo ranks of one thread each are bound to two different CPUs (unbound, the
    kernel ran both on one core in 55-91 % of the samples where both were runnable, an MLP's
    1F1B on 2 vCPUs, 2026-12-05); ``pin=False`` leaves them every CPU."""
    import os

    from pipeopt.executor.procs import spawn

    allowed = sorted(os.sched_getaffinity(0))
    assert spawn(_affinity, 2, timeout=120, backend="gloo", threads=1) == [
        [allowed[0]], [allowed[1]]]
    assert spawn(_affinity, 2, timeout=120, backend="gloo", threads=1, pin=False) == [
        allowed, allowed]
