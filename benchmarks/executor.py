"""Closed loop on CPU: profile a tiny GPT -> solve -> replay with pipeopt's executor.

Two profiles of the same model and partition: the project's (``pipeopt.costs.profiler`` per
layer on one process, then the ``model: {profile: ...}`` config form, which also chooses the
partition: the ``pipeopt profile`` -> ``pipeopt solve`` path), and a rank-timed one (every rank
times its own stage the way the executor runs it, all ranks at once: forward; input gradient
with PyTorch's ``stage_backward_input``; weight gradient with ``stage_backward_weight``; on
stage 0 the input gradient is free and the weight gradient is the whole backward, as in the
executor and in PyTorch's runtime). 1F1B (fused backward), ZB-H1 and CP-SAT are solved on one
of them (``--profiler``, default ``ranks``) and replayed; each measured step time is printed
against the makespan of the same orders on both profiles and on the median op durations seen
in the run itself (this isolates the executor's own overhead from cost-model errors). Then
pipeopt's executor replaying 1F1B against PyTorch's own ``Schedule1F1B`` on the same model,
split and process count, measured in the same run with interleaved rounds, and its ZB-V
against ``ScheduleZBVZeroBubble`` likewise. Aims: prediction within 15%, executor no slower
than 1.05x.

    python benchmarks/executor.py [--ranks 2] [--microbatches 8] [--rounds 5] [--steps 4]
        [--profiler ranks|project] [--no-replan] [--no-vshape]
    python benchmarks/executor.py --ranking   # 6 cases (5 methods) x 3 models: errors, tau-b
        [--rounds 9] [--models tiny-gpt,mlp,mlp-1024] [--timing step|warm] [--no-profile-each-round]
        [--profile-steps N] [--warmup-rounds N] [--sampled [--samples N]] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeopt.costs.profiler import (
    STEP_METHODS,
    executor_split,
    kendall_tau_b,
    ping_pong_s,
    sampled_step_fit,
    step_problem,
    step_profile_from_runs,
    step_schedules,
)
from pipeopt.costs.variation import SAMPLES, OpSpread, sampled_step
from pipeopt.executor.check import batch_for
from pipeopt.executor.launch import (
    RunConfig,
    RunResult,
    _assemble,
    measured_problem,
    op_costs,
    run_rank,
)
from pipeopt.executor.models import build_model, split_stages
from pipeopt.executor.procs import spawn
from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.schedules import fused_variant
from pipeopt.simulate import simulate
from pipeopt.solvers import solve

MODEL = "tiny-gpt"
OPTIONS = (("layers", 6), ("hidden", 128), ("heads", 4), ("vocab", 256), ("seq_len", 64))


def _median_time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _stage_costs(spec: Any, stages: list[Any], k: int, microbatches: int, batch: int,
                 reps: int, sync: Any = None) -> tuple[float, float, float, float]:
    """(F, B, W, fused backward) seconds of stage ``k`` for one micro-batch, timed as the
    executor runs them (B and W through the executor's own code, ``executor_split``; on stage
    0 B is free and W the whole backward). ``sync()`` (a barrier across ranks) separates three
    phases of ``reps`` runs each (forwards, fused backwards, split backwards) so that every rank
    is busy while any rank times: on a machine with as many cores as ranks, a rank timing alone
    would see a free core that it never has in a run."""
    sync = sync or (lambda: None)
    xs, ys = batch_for(spec, batch, 0, 0, microbatches)
    h = xs[0]
    with torch.no_grad():
        for mod in stages[:k]:
            h = mod(h)
    mod = stages[k]
    first, last = k == 0, k == len(stages) - 1
    inp = h if first else h.detach().requires_grad_(True)

    def fwd() -> Any:
        out = mod(inp)
        return spec.loss_fn(out, ys[0]) / microbatches if last else out

    f = _median_time(fwd, reps)
    grad = None if last else torch.ones_like(fwd())

    split_f, split_b, split_w = executor_split(  # the executor's own code
        mod, inp.device, (lambda o: spec.loss_fn(o, ys[0]) / microbatches) if last else None)

    def split_pair() -> tuple[float, float]:
        inp.grad = None  # a fresh input every micro-batch, as in a run
        saved = split_f(inp)
        t0 = time.perf_counter()
        split_b(saved, grad)
        t1 = time.perf_counter()
        split_w(saved)
        return t1 - t0, time.perf_counter() - t1

    def full() -> float:
        out = fwd()
        inp.grad = None
        t0 = time.perf_counter()
        torch.autograd.backward(out, grad)
        return time.perf_counter() - t0

    sync()
    fused = statistics.median(full() for _ in range(reps))
    sync()
    # On stage 0 (token ids: no input gradient) B is free and W is the whole backward.
    pairs = [split_pair() for _ in range(reps)]
    mod.zero_grad(set_to_none=True)
    return (f, 0.0 if first else statistics.median(x for x, _ in pairs),
            statistics.median(y for _, y in pairs), fused)


def _profile_rank(rank: int, world: int, device: Any, microbatches: int, batch: int,
                  reps: int, partition: Any, status: Any = None) -> dict[str, Any]:
    """Each rank times its own stage while the others time theirs (the load of a real run),
    then ranks 0 and 1 time a ping-pong of one activation."""
    import torch.distributed as dist

    skeleton = _skeleton(world, microbatches, partition)
    spec = build_model(MODEL, skeleton, seed=0, **dict(OPTIONS))
    stages = split_stages(spec, skeleton)
    dist.barrier()
    costs = _stage_costs(spec, stages, rank, microbatches, batch, reps, dist.barrier)
    xs, _ = batch_for(spec, batch, 0, 0, microbatches)
    with torch.no_grad():
        act = stages[0](xs[0])
    return {"costs": costs, "latency": ping_pong_s(rank, act, reps * 3)}


def _skeleton(ranks: int, microbatches: int, partition: Any = None) -> Problem:
    meta = (("partition", partition),) if partition else ()
    return Problem(devices=ranks, microbatches=microbatches, forward=(1.0,) * ranks,
                   backward_input=(1.0,) * ranks, backward_weight=(1.0,) * ranks, meta=meta)


def project_profile(ranks: int, microbatches: int, batch: int, workdir: str,
                    model: str = MODEL, options: tuple[tuple[str, Any], ...] = OPTIONS,
                    overheads: dict[str, Any] | None = None, keep_steps: bool = False
                    ) -> tuple[Problem, Problem]:
    """The project's own loop: ``pipeopt.costs.profiler`` times every layer on one micro-batch
    (as ``pipeopt profile`` does: F, and B / W through the executor's split code on each layer
    alone), then the ``model: {profile: ...}`` config form partitions the layers and builds the
    problem (partition recorded in ``problem.meta``); the same form with ``split_backward:
    false`` gives the fused problem (B + W = the stage's summed ``backward_s``). With
    ``overheads`` (what :func:`pipeopt.costs.profiler.measure_overheads` returns, as
    ``pipeopt profile --overheads`` records it) the profile carries the executor's fixed
    costs, which the config form prices in; without, the layers' optimizer steps are left
    out too (unless ``keep_steps``: the document is then re-timed in step, which measures its
    own overheads)."""
    from pipeopt.config import parse_config
    from pipeopt.costs.profiler import profile_model, write_profile

    skeleton = _skeleton(ranks, microbatches)
    spec = build_model(model, skeleton, seed=0, **dict(options))
    xs, _ = batch_for(spec, batch, 0, 0, microbatches)
    doc = profile_model(torch.nn.Sequential(*spec.layers), xs[0], device="cpu", repeats=9,
                        name=model)
    if overheads is not None:
        doc["overheads"] = overheads
    elif not keep_steps:  # no fixed costs at all: nor the layers' optimizer steps
        for rec in doc["layers"]:
            rec.pop("step_s", None)
    path = f"{workdir}/profile.json"
    write_profile(doc, path)
    cfg = parse_config({"pipeline": {"devices": ranks, "microbatches": microbatches},
                        "model": {"profile": path}})
    split = cfg.problem
    counts = [hi - lo for lo, hi in dict(split.meta)["partition"]]
    fused = parse_config({"pipeline": {"devices": ranks, "microbatches": microbatches,
                                       "split_backward": False},
                          "model": {"profile": path}, "training": {"stage_layers": counts}}
                         ).problem  # same partition; B + W = the stages' summed backward_s
    return split, fused


def profile(ranks: int, microbatches: int, batch: int, partition: Any = None, reps: int = 9
            ) -> tuple[Problem, Problem]:
    """Per-stage F / B / W seconds of the benchmark model (one stage per rank), timed on
    ``ranks`` spawned processes at once, and the one-way time of one activation message.
    Returns the split problem and the fused one (whose B is the measured whole backward)."""
    per_rank = spawn(_profile_rank, ranks, (microbatches, batch, reps, partition), timeout=300,
                     backend="gloo")
    f, b, w, full = zip(*(r["costs"] for r in per_rank), strict=True)
    latency = per_rank[0]["latency"] or 0.0
    lat, bw = chain_links(ranks, [latency] * (ranks - 1), [float("inf")] * (ranks - 1))
    split = Problem(devices=ranks, microbatches=microbatches, forward=f, backward_input=b,
                    backward_weight=w, latency=lat, bandwidth=bw,
                    meta=(("source", "benchmarks/executor.py profile"),
                          ("partition", partition)) if partition else ())
    # The fused backward has its own measured time: fused B = backward_input + backward_weight.
    fused = split.replace(split_backward=False, backward_input=tuple(
        max(0.0, x - y) for x, y in zip(full, w, strict=True)))
    return split, fused


def _bench_rank(rank: int, world: int, device: Any, jobs: list[tuple[str, Any, RunConfig]],
                rounds: int, warmup: int = 0, status: Any = None
                ) -> dict[str, list[dict[str, Any]]]:
    """Every job ``warmup + rounds`` times, interleaved, the first ``warmup`` rounds left
    out; ``('ours', schedule, cfg)``, or ``('torch:NAME', schedule, cfg)``: PyTorch's
    schedule class NAME on the schedule's stages."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(warmup + rounds):
        for i, (kind, obj, cfg) in enumerate(jobs):
            if kind.startswith("torch:"):  # PyTorch's own schedule class on the same stages
                cfg = replace(cfg, torch_schedule=kind.removeprefix("torch:"))
            res = run_rank(rank, world, device, obj, cfg, "gloo", status=status)
            if rnd >= warmup:
                out.setdefault(str(i), []).append(res)
    return out


def producer_of(op: Op, stages: int) -> Op | None:
    """The op of a neighbouring stage whose output ``op`` consumes, if any."""
    if op.kind == "F" and op.stage > 0:
        return Op("F", op.stage - 1, op.microbatch)
    if op.kind == "B" and op.stage + 1 < stages:
        return Op("B", op.stage + 1, op.microbatch)
    return None


def _replay(s: Schedule, durs: dict[str, float], latency_s: float) -> float:
    """Makespan of the schedule's device orders when every op takes its measured duration
    ``durs[str(op)]`` (seconds) and each cross-rank message ``latency_s``."""
    prob = s.problem
    orders = [list(o) for o in s.device_orders()]
    end: dict[Op, float] = {}
    free = [0.0] * prob.devices
    pos = [0] * prob.devices
    while any(pos[d] < len(orders[d]) for d in range(prob.devices)):
        for d, order in enumerate(orders):
            while pos[d] < len(order):
                op = order[pos[d]]
                deps = [producer_of(op, prob.stages)]
                deps.append(Op("F", op.stage, op.microbatch) if op.kind == "B" else None)
                deps.append(Op("B", op.stage, op.microbatch) if op.kind == "W" else None)
                if any(x is not None and x not in end for x in deps):
                    break
                ready = free[d]
                for x in deps:
                    if x is not None:
                        far = prob.stage_device[x.stage] != d
                        ready = max(ready, end[x] + (latency_s if far else 0.0))
                end[op] = free[d] = ready + durs[str(op)]
                pos[d] += 1
    return max(end.values())


def error_parts(s: Schedule, runs: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Where the error of ``s``'s predicted step goes (seconds): its device orders replayed
    (:func:`_replay`) on the priced durations, latency and step tail, then with the runs'
    own parts in their place, one at a time (``runs[rank][round]``: ``run_rank``'s reports,
    read by :func:`pipeopt.costs.profiler.step_trace_costs`, trimmed means): ``ops`` every
    op's duration plus the gap before it (the priced op includes ``action_s``), ``messages``
    the delay of a message that held an op up beyond that gap (priced: the link latency),
    ``tail`` the step's end after its last op (priced: the stages' optimizer steps plus
    ``overheads.step_s``, which carries the profile's per-step fit), and ``unexplained``
    the median step left over (what a replay on mean parts misses: waits on ops that vary)."""
    from pipeopt.costs.profiler import step_trace_costs, trimmed_mean

    prob = s.problem
    got = step_trace_costs(s, runs)
    ops = [o for order in s.device_orders() for o in order]
    lat, tail = prob.latency[0][1], max(prob.grad_reduce)
    priced = _replay(s, {str(o): prob.durations[o.kind][o.stage] for o in ops}, lat)
    gap = trimmed_mean(got["gaps"])
    run_ops = {str(o): trimmed_mean(got["ops"][f"{o.kind}{o.stage}"]) + gap for o in ops}
    with_ops = _replay(s, run_ops, lat)
    with_msgs = _replay(s, run_ops, max(0.0, trimmed_mean(got["delays"]) - gap))
    run_tail = trimmed_mean([t for t, _ in got["tails"]])
    return {"ops": with_ops - priced, "messages": with_msgs - with_ops,
            "tail": run_tail - tail, "unexplained": statistics.median(got["steps"])
            - with_msgs - run_tail, "priced_tail": tail, "run_tail": run_tail}


def _show(title: str, prob: Problem, fused: Problem) -> None:
    print(title + ": ms per micro-batch")
    for k in range(prob.stages):
        print(f"  stage {k}: F {prob.forward[k] * 1e3:.2f}  B {prob.backward_input[k] * 1e3:.2f}"
              f"  W {prob.backward_weight[k] * 1e3:.2f}  fused B+W "
              f"{fused.durations['B'][k] * 1e3:.2f}")
    print(f"  link: {prob.latency[0][1] * 1e3:.3f} ms per message (one way)")


def _solve_all(prob: Problem, fused: Problem, time_limit: float) -> list[Schedule]:
    """1F1B (fused backward), ZB-H1 and CP-SAT (split backward) on the given costs."""
    return [solve(fused, "1f1b"), solve(prob, "zb-h1"),
            solve(prob, "cpsat", time_limit=time_limit, workers=1, seed=0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved measured rounds (default 5; with --ranking RANK_ROUNDS)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per round, the first not counted (default 4; --ranking: "
                    "per model, RANK_STEPS)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds")
    ap.add_argument("--profiler", choices=["ranks", "project"], default="ranks",
                    help="costs the schedules are solved on (both are measured and both "
                    "predictions printed): ranks (default): each rank times its stage as the "
                    "executor runs it, all ranks at once; project: pipeopt.costs.profiler, "
                    "per layer, one process")
    ap.add_argument("--ranking", action="store_true",
                    help="instead: every case of RANK_CASES on each model of RANK_MODELS "
                    "(or of --models), "
                    "solved on the project profile (one per micro-batch size), run in "
                    "interleaved rounds; predicted vs measured step time per case, the pairs "
                    "predicted closer than their measured spread and the Kendall tau of the "
                    "two orders")
    ap.add_argument("--models", default=None,
                    help="--ranking: comma-separated names of RANK_MODELS to run (default: all: "
                    + ", ".join(RANK_MODELS) + ")")
    ap.add_argument("--json-out", default=None, metavar="PATH",
                    help="--ranking: also write every case's per-round measured steps and "
                    "predictions (seconds) to PATH as JSON, per model (a new file; an existing "
                    "one is refused), to compare other statistics on the same runs")
    ap.add_argument("--timing", choices=["step", "warm"], default="step",
                    help="--ranking: how the profile times its ops: step (default): in real "
                    "steps of the executor (pipeopt profile's default on the CPU); warm: each "
                    "layer alone in a warm loop, with the fixed costs of a trivial model")
    ap.add_argument("--profile-each-round", action=argparse.BooleanOptionalAction,
                    default=None,
                    help="--ranking (step timing): before every measured round run the "
                    "profile's own schedules again and predict each case also on that "
                    "round's profile (its orders re-priced by the simulator), median over "
                    "rounds; both predictions reported (default: on with --timing step; "
                    "--no-profile-each-round: one profile before the runs, as before "
                    "2026-12-05)")
    ap.add_argument("--sampled", action="store_true",
                    help="--ranking (profile each round): also predict each case per round "
                    "as the median over --samples draws of the simulator's step with every "
                    "op's duration drawn from the spread that round's profile runs measured, "
                    "the per-step cost fitted again against that "
                    "(pipeopt.costs.variation, pipeopt.costs.profiler.sampled_step_fit); "
                    "printed beside the other predictions, which stay the default")
    ap.add_argument("--samples", type=int, default=None,
                    help="--sampled: draws per prediction (default "
                    "pipeopt.costs.variation.SAMPLES)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="--ranking: rounds of every job run first and not counted (in the "
                    "3 fresh spawns traced, the first 2-3 jobs of the tiny GPT ran 1.3-2.4x "
                    "slower than the same jobs later; default 1, as pipeopt profile --timing "
                    "step does)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="--profile-each-round: steps of each of the profile's runs per round "
                    "(default: the rounds' steps)")
    ap.add_argument("--no-overheads", dest="overheads", action="store_false",
                    help="--ranking --timing warm without the executor's fixed costs (per "
                    "action, message, step) in the profile: the predictions as they were "
                    "before they were measured")
    ap.add_argument("--no-vshape", dest="vshape", action="store_false",
                    help="skip pipeopt's ZB-V against PyTorch's ScheduleZBVZeroBubble")
    ap.add_argument("--no-replan", dest="replan", action="store_false",
                    help="skip the last phase: CP-SAT re-planned on the op times the ZB-H1 "
                    "runs measured (pipeopt run --costs-out), run again")
    args = ap.parse_args()
    p, m = args.ranks, args.microbatches
    # Every round's first step is not counted, and the medians need a counted step.
    for name, value, least in (("--ranks", p, 2), ("--microbatches", m, 1),
                               ("--batch", args.batch, 1), ("--rounds", args.rounds, 1),
                               ("--steps", args.steps, 2), ("--samples", args.samples, 1),
                               ("--warmup-rounds", args.warmup_rounds, 0),
                               ("--profile-steps", args.profile_steps, 1)):
        if value is not None and value < least:
            ap.error(f"{name}: must be >= {least}, got {value}")
    ranking_only = [name for name, given in (
        ("--timing", args.timing != "step"), ("--sampled", args.sampled),
        ("--models", args.models is not None), ("--json-out", args.json_out is not None),
        ("--samples", args.samples is not None),
        ("--profile-each-round", args.profile_each_round is not None),
        ("--profile-steps", args.profile_steps is not None),
        ("--warmup-rounds", args.warmup_rounds != 1),
        ("--no-overheads", not args.overheads)) if given]
    if ranking_only and not args.ranking:
        ap.error(f"{', '.join(ranking_only)}: only with --ranking")
    if args.samples is not None and not args.sampled:
        ap.error("--samples: only with --sampled")
    if args.rounds is None:
        args.rounds = RANK_ROUNDS if args.ranking else 5
    if args.json_out is not None and Path(args.json_out).exists():
        ap.error(f"--json-out: {args.json_out} exists; give a new path (nothing is overwritten)")
    if args.json_out is not None and not Path(args.json_out).resolve().parent.is_dir():
        ap.error(f"--json-out: {args.json_out}: its folder does not exist")
    given = args.models
    args.models = [x.strip() for x in (",".join(RANK_MODELS) if given is None
                                       else given).split(",")]
    unknown = [repr(x) if x else "an empty name" for x in args.models if x not in RANK_MODELS]
    if unknown or len(set(args.models)) < len(args.models):
        ap.error(f"--models: {', '.join(unknown) or 'a name repeated'}: give distinct names "
                 f"of {', '.join(RANK_MODELS)}, comma-separated")
    if args.ranking:
        ranking(args)
        return
    args.steps = args.steps or 4

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        prob, fused = project_profile(p, m, args.batch, tmp)
    part = dict(prob.meta).get("partition")
    _show(f"project profile (pipeopt.costs.profiler, per layer, one process; "
          f"{time.perf_counter() - t0:.1f} s), partition {part}", prob, fused)
    # The same partition, timed by every rank on its own stage the way the executor runs it
    # (PyTorch's split backward helpers), all ranks at once.
    t0 = time.perf_counter()
    ex_prob, ex_fused = profile(p, m, args.batch, part)
    _show(f"rank-timed profile (each rank times its stage as the executor runs it; "
          f"{time.perf_counter() - t0:.1f} s)", ex_prob, ex_fused)

    on_ranks = args.profiler == "ranks"
    scheds = _solve_all(*((ex_prob, ex_fused) if on_ranks else (prob, fused)), args.time_limit)
    print(f"schedules solved on the {'rank-timed' if on_ranks else 'project'} profile: "
          + ", ".join(f"{s.method} {s.makespan * 1e3:.1f} ms" for s in scheds))
    cfg = RunConfig(model=MODEL, model_options=OPTIONS, steps=args.steps, batch_size=args.batch)
    jobs: list[tuple[str, Any, RunConfig]] = [("ours", s, cfg) for s in scheds]
    # PyTorch's Schedule1F1B right after ours in every round (fused problem, like our 1F1B),
    # so that both see the same machine load.
    jobs.insert(1, ("torch:Schedule1F1B", scheds[0], cfg))
    job_of = [0, *range(2, len(jobs))]  # job index of each schedule
    t0 = time.perf_counter()
    per_rank = spawn(_bench_rank, p, (jobs, args.rounds), timeout=600, backend="gloo")
    print(f"runs ({time.perf_counter() - t0:.1f} s, {p} gloo ranks, {args.rounds} rounds x "
          f"{args.steps} steps, median of steps after the first of each round)")

    def round_times(job: int, rnd: int) -> list[float]:
        res = _assemble(scheds[0], RunConfig(), [per_rank[r][str(job)][rnd] for r in range(p)])
        return res.step_times[1:]

    def measured(job: int) -> float:
        return statistics.median(t for rnd in range(args.rounds) for t in round_times(job, rnd))

    def replayed(i: int, s: Schedule) -> float:
        """Median over rounds of: the last step's measured time / the makespan of the same
        orders with that step's own op durations (1.0 = no executor overhead at all)."""
        ratios = []
        for rnd in range(args.rounds):
            durs = {op: b - a for r in range(p)
                    for op, a, b in per_rank[r][str(job_of[i])][rnd]["trace"]}
            span = _replay(s, durs, ex_prob.latency[0][1] if p > 1 else 0.0)
            ratios.append(round_times(job_of[i], rnd)[-1] / span)
        return statistics.median(ratios)

    in_run: dict[str, dict[tuple[str, int], float]] = {}

    def calibrated(i: int, s: Schedule) -> float:
        """Makespan of the same orders with each op's median duration measured in the run."""
        durs: dict[tuple[str, int], list[float]] = {}
        for r in range(p):
            for rnd in range(args.rounds):
                for op, a, b in per_rank[r][str(job_of[i])][rnd]["trace"]:
                    stage, kind, _ = re.fullmatch(r"(\d+)([FBW])(\d+)", op).groups()
                    durs.setdefault((kind, int(stage)), []).append(b - a)
        med = {key: statistics.median(v) for key, v in durs.items()}
        in_run[s.method] = med
        n = s.problem.stages
        prob_c = s.problem.replace(
            forward=tuple(med[("F", k)] for k in range(n)),
            backward_input=tuple(med[("B", k)] for k in range(n)),
            backward_weight=tuple(med.get(("W", k), 0.0) for k in range(n)),
            latency=ex_prob.latency, bandwidth=ex_prob.bandwidth)
        return simulate(prob_c, s.device_orders()).makespan

    def on(split: Problem, fused_: Problem, s: Schedule) -> float:
        """Makespan of the schedule's orders re-timed on another profile."""
        return simulate(split if s.problem.split_backward else fused_, s.device_orders()).makespan

    print("step time, ms: measured (median) vs predicted from each cost source (error = "
          "measured / predicted - 1); * = the costs the schedules were solved on")
    star = ("", "*") if on_ranks else ("*", "")
    print(f"{'schedule':<10} {'measured':>9} {'project profile' + star[0]:>18} "
          f"{'rank-timed' + star[1]:>18} {'in-run op times':>18} {'overhead':>9}")
    verdicts = []
    for i, s in enumerate(scheds):
        meas = measured(job_of[i])
        preds = (on(prob, fused, s), on(ex_prob, ex_fused, s), calibrated(i, s))
        cells = [f"{x * 1e3:.1f} ({(meas - x) / x:+.0%})" for x in preds]
        print(f"{s.method:<10} {meas * 1e3:9.1f} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} "
              f"{replayed(i, s) - 1:+9.1%}")
        verdicts.append((s.method, meas / s.makespan - 1))
    print("overhead: a step's measured time against the same orders timed with that step's own "
          "op durations\n(messages, Python, optimizer step, barriers); median over rounds")
    print("in-run op durations (median over the run), ms per micro-batch:")
    for method, med in in_run.items():
        print(f"  {method:<8} " + "  |  ".join(
            f"stage {k}: " + " ".join(f"{kind} {med[(kind, k)] * 1e3:.2f}"
                                      for kind in "FBW" if (kind, k) in med)
            for k in range(p)))
    ours, theirs = measured(0), measured(1)
    per_round = [statistics.median(round_times(0, rnd)) / statistics.median(round_times(1, rnd))
                 for rnd in range(args.rounds)]
    print(f"pipeopt 1F1B {ours * 1e3:.2f} ms vs torch Schedule1F1B {theirs * 1e3:.2f} ms: "
          f"ratio {ours / theirs:.3f}; median of per-round ratios "
          f"{statistics.median(per_round):.3f}"
          f" (rounds: {', '.join(f'{x:.2f}' for x in per_round)}; aim <= 1.05)")
    source = "rank-timed" if on_ranks else "project"
    for method, err in verdicts:
        print(f"{'PASS' if abs(err) <= 0.15 else 'MISS'} {method}: measured vs predicted "
              f"({source} profile) {err:+.1%} (aim within 15%)")
    ratio = statistics.median(per_round)
    print(f"{'PASS' if ratio <= 1.05 else 'MISS'} pipeopt 1F1B / torch Schedule1F1B {ratio:.3f} "
          "(median of per-round ratios; aim <= 1.05)")
    if args.replan:
        _replan(scheds, job_of, per_rank, args, p)
    if args.vshape:
        vshape(args)


#: Models of ``--ranking`` (issue 17: >= 5 methods on >= 2 models), by the name printed:
#: (built-in model, its options). ``mlp-1024`` (added 2026-12-05, after the width-512 MLP's
#: identical runs were seen to differ by up to 14 %): the same MLP at width 1024, whose
#: 0.3-7 ms ops (0.1-1.5 ms at 512) stand well above this VM's scheduling jitter
#: (benchmarks/README.md, "Why the MLP's identical runs differ").
RANK_MODELS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    MODEL: (MODEL, OPTIONS),
    "mlp": ("mlp", (("layers", 8), ("width", 512))),
    "mlp-1024": ("mlp", (("layers", 8), ("width", 1024))),
}
#: Steps per round of ``--ranking`` per model (the first of each round not counted), in the
#: profile's runs and the measured ones alike; fixed before they were measured (2026-12-04,
#: 22:55): about half a second of counted steps per round. The tiny GPT's steps take 150-250
#: ms (3 counted); the MLP's 17-60 ms, so 3 counted steps were 0.05-0.2 s, where one
#: pre-emption of a rank (a few ms) moved a step by 10-50 % and round spreads reached 20-110 %.
#: ``mlp-1024`` (steps 45-120 ms) has the MLP's 12, about a second of counted steps a round.
RANK_STEPS = {MODEL: 4, "mlp": 12, "mlp-1024": 12}
#: Measured rounds of ``--ranking`` by default (``--rounds``); 9 since 2026-12-05 (5 before):
#: in three runs of 9 rounds (07:02-07:17 UTC, load 0.8-2.7) the default prediction's worst
#: error over the first 5 rounds was 3.9-10.5 % on the tiny GPT and 5.7-8.1 % on mlp-1024,
#: over all 9 5.3-6.3 % and 6.8-8.1 % (the median of 9 interleaved rounds moves less with
#: one slow stretch of the machine); a run takes about 5 minutes instead of 3.
RANK_ROUNDS = 9
#: The instances of ``--ranking``, fixed before any was measured (2026-12-04): (method,
#: micro-batches of the same batch, memory limit in micro-batches of activations per device,
#: None = no limit). At 8 micro-batches and no limit, 1F1B, ZB-H1, ZB-H2, greedy and CP-SAT were
#: predicted within 1 % of each other on 2 ranks, so their measured order was noise; these
#: differ in what the cost model must get right: fewer, larger micro-batches (bubble against
#: per-op cost), fused against split backward, and a memory limit that forbids overlap.
RANK_CASES: tuple[tuple[str, int, float | None], ...] = (
    ("1f1b", 4, None),
    ("zb-h1", 4, None),
    ("1f1b", 8, None),
    ("zb-h2", 8, None),
    ("cpsat", 8, None),
    ("greedy", 8, 1.0),
)


def same_runs(cases: list[Schedule]) -> list[list[int]]:
    """``cases`` grouped by what a run of them executes (the same fused or split backward and
    the same op order on every rank; a memory limit changes nothing that runs), each group in
    the order of ``cases``, the groups by their first case. A group is one case of the
    ranking: run once and reported under all its names (two methods that found the same
    schedule are predicted the same step, a tie no measurement can order, and running both
    would only weigh that schedule twice)."""
    groups: dict[tuple[bool, Any], list[int]] = {}
    for i, s in enumerate(cases):
        groups.setdefault((s.problem.split_backward, s.device_orders()), []).append(i)
    return list(groups.values())


def load_note(ranks: int | None = None) -> str:
    """The machine's load average and cores; with ``ranks`` (before a run), a warning when
    that load plus the ranks exceeds the cores: the ranks then share cores with other work,
    and the step times measure the machine, not the schedules."""
    one, five, _ = os.getloadavg()
    cores = os.cpu_count() or 1
    busy = (f"; BUSY: {ranks} ranks on top of this load exceed the cores, so these times do "
            "not rank the schedules") if ranks is not None and one + ranks > cores else ""
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {cores} cores{busy}"


def timed_overheads(ranks: int) -> dict[str, Any]:
    """:func:`pipeopt.costs.profiler.measure_overheads` on ``ranks`` gloo ranks, printed with
    its wall time (seconds), how it was measured and the load average."""
    from pipeopt.costs.profiler import measure_overheads

    t0 = time.perf_counter()
    over = measure_overheads(ranks=ranks)
    print(f"overheads ({time.perf_counter() - t0:.0f} s; {over['how']}): "
          f"{over['action_s'] * 1e3:.3f} ms per action, {over['message_s'] * 1e3:.3f} ms "
          f"per message, {over['step_s'] * 1e3:.3f} ms per step; {load_note()}")
    return over


def _limited(prob: Problem, microbatches: float | None) -> Problem:
    """``prob`` whose devices may hold at most ``microbatches`` micro-batches of their stages'
    activations on top of their static memory (bytes; None: unchanged)."""
    if microbatches is None:
        return prob
    act = [max(prob.activation_memory[k] for k in prob.device_stages[d])
           for d in range(prob.devices)]
    return prob.replace(memory_limit=tuple(s + microbatches * a
                                           for s, a in zip(prob.static_memory, act, strict=True)))


def _case_name(method: str, m: int, limit: float | None) -> str:
    return f"{method} m={m}" + (f" mem={limit:g}" if limit is not None else "")


def priced_on(s: Schedule, prob: Problem, limit: float | None) -> Problem:
    """The problem ``s``'s device orders are priced on in ``prob``'s costs: ``prob`` with the
    case's memory ``limit`` (:func:`_limited`), its fused variant when ``s`` fuses the
    backward."""
    prob = _limited(prob, limit)
    return prob if s.problem.split_backward else fused_variant(prob)


def repriced(s: Schedule, prob: Problem, limit: float | None) -> float:
    """The iteration time (seconds) of ``s``'s device orders re-priced by the simulator on
    ``prob`` (:func:`priced_on`)."""
    return simulate(priced_on(s, prob, limit), s.device_orders()).iteration_time


def _step_timed(doc: dict[str, Any], model: str, options: tuple[tuple[str, Any], ...],
                p: int, m: int, steps: int = 4, name: str | None = None
                ) -> tuple[Problem, Problem, dict[str, float]]:
    """The warm profile ``doc`` re-timed in step (``pipeopt profile --timing step``), as the
    config form's problem on the partition the runs measured, the warm profile (with the
    same overheads) on the same partition: what the warm loop would have predicted for the
    same orders, and the median step (seconds) the profile's own runs measured per method
    (:data:`pipeopt.costs.profiler.STEP_METHODS`); printed as ``name`` (default ``model``)."""
    from pipeopt.costs.profiler import profile_problem, step_profile

    timed = step_profile(doc, model, options, ranks=p, microbatches=m, steps=steps)
    prob = step_problem(timed, m)
    # The warm profile with the same overheads, on the same partition.
    counts = [hi - lo for lo, hi in timed["in_step"]["partition"]]
    other = profile_problem({**doc, "overheads": timed["overheads"]}, p, m, counts)
    st = timed["in_step"]
    print(f"{name or model}, {m} micro-batches: step-timed profile ({st['wall_s']:.0f} s; gap "
          f"{st['gap_ms']:.2f} ms per op, message delay {st['message_delay_ms']:.2f} ms, tail "
          f"{st['tail_ms']:.2f} ms, lead {st['lead_ms']:.2f} ms; a {st['message_bytes']} B "
          f"ping-pong {st['message_ping_pong_ms']:.2f} ms one way); in-step / warm per stage: "
          + "; ".join(
              f"{r['stage']}: F x{r['forward_factor'] or 1:.2f}, fused B x"
              f"{r['backward_factor'] or 1:.2f}" for r in st["stages"])
          + f"; per step {st['step_measured_ms']:.2f} ms measured, {st['step_fit_ms']:.2f} "
          "ms priced; its own runs measured / predicted from the parts / priced: " + ", ".join(
              f"{r['method']} {r['measured_ms']:.1f} / {r['predicted_parts_ms']:.1f} / "
              f"{r['predicted_ms']:.1f} ms" for r in st["replayed"]))
    return prob, other, {r["method"]: r["measured_ms"] / 1e3 for r in st["replayed"]}


def ranking(args: argparse.Namespace) -> None:
    """Per model of :data:`RANK_MODELS` (those ``--models`` names) and micro-batch count of
    :data:`RANK_CASES`: the project profile (``pipeopt profile``; ``--timing step``, the default:
    re-timed in real steps of the executor, :func:`pipeopt.costs.profiler.step_profile`; ``warm``:
    each layer in a warm loop, with the executor's fixed costs measured once on a trivial model
    unless ``--no-overheads``), every case solved on it (the config form; fused methods priced at
    the fused backward), all cases of the model run ``--rounds`` times interleaved; prints each
    case's predicted and measured step time (median of the steps after the first of every round),
    the error, where the error goes (:func:`error_parts`), the pairs whose predicted difference is
    within the measured spread, and the Kendall tau-b between the predicted and the measured order.
    Steps per round: ``--steps`` or :data:`RANK_STEPS` of the model, in the profile's runs too.

    With ``--profile-each-round`` (step timing) every round first runs the profile's own
    schedules again (:func:`pipeopt.costs.profiler.step_schedules`, ``--profile-steps``
    steps), and each case is also predicted per round: its orders (solved once, on the
    first profile) re-priced by the simulator on that round's step-timed profile
    (:func:`pipeopt.costs.profiler.step_profile_from_runs`), the median over rounds
    against the measured median; both predictions are reported. Ends with a summary of
    tau-b and worst error per model and prediction."""
    p = args.ranks
    step = args.timing == "step"
    if args.profile_each_round and not step:
        raise SystemExit("--profile-each-round needs --timing step (the per-round profile is "
                         "timed in the executor's steps)")
    if args.profile_each_round is None:
        args.profile_each_round = step
    if args.sampled and not args.profile_each_round:
        raise SystemExit("--sampled needs the profile of each round (--timing step, without "
                         "--no-profile-each-round): the spread is what that round's profile "
                         "runs measured")
    over = timed_overheads(p) if args.overheads and not step else None
    t_all = time.perf_counter()
    summary: list[tuple[str, str, Verdict, Verdict | None]] = []
    record: dict[str, Any] = {}
    for name in args.models:
        summary += _rank_model(args, name, *RANK_MODELS[name], over, record)
        if args.json_out:  # after every model: a later failure keeps what was measured
            Path(args.json_out).write_text(json.dumps(
                {"argv": sys.argv[1:], "load": load_note(), "models": record}, indent=1))
    print(f"summary ({time.perf_counter() - t_all:.0f} s in all; {load_note()}): Kendall "
          "tau-b (aim >= 0.8) and worst error (aim <= 10 %), over every distinct case and "
          "over those that do not run the orders of the profile's own runs")
    for model, how, every, other in summary:
        rest = (f"; not the profile's own orders ({other.cases} cases): tau-b "
                f"{other.tau:+.2f}, worst {other.worst:.1%}") if other else ""
        print(f"  {model:<9} {how:<26} ({every.cases} cases): tau-b {every.tau:+.2f}, "
              f"worst {every.worst:.1%}{rest}")


@dataclass(frozen=True)
class Verdict:
    """Kendall tau-b of predicted against measured step times, the worst relative error
    (|measured / predicted - 1|) and the number of cases they are over."""

    tau: float
    worst: float
    cases: int


def verdict(predicted: list[float], measured: list[float]) -> Verdict:
    """:class:`Verdict` of predicted against measured step times (seconds); tau-b is NaN
    for fewer than two cases."""
    tau = kendall_tau_b(predicted, measured) if len(predicted) > 1 else float("nan")
    worst = max(abs(b / a - 1) for a, b in zip(predicted, measured, strict=True))
    return Verdict(tau, worst, len(predicted))


def own_orders(cases: list[tuple[str, int, float | None]], scheds: list[Schedule],
               profiled: dict[int, list[Schedule]]) -> list[str | None]:
    """Per case, the method of the profile's own run (``profiled[m]``: the schedules of
    :data:`STEP_METHODS` on the same partition, per micro-batch count) that executes the same
    orders (same fused or split backward, same op order on every rank), else None: such a
    case is priced on a step cost fitted to runs of its own orders, so it is no independent
    prediction."""
    mine: dict[int, dict[tuple[bool, Any], str]] = {}
    for m, sch in profiled.items():
        mine[m] = {(s.problem.split_backward, s.device_orders()): meth
                   for meth, s in zip(STEP_METHODS, sch, strict=True)}
    return [mine.get(c[1], {}).get((s.problem.split_backward, s.device_orders()))
            for c, s in zip(cases, scheds, strict=True)]


def _rank_model(args: argparse.Namespace, name: str, model: str,
                options: tuple[tuple[str, Any], ...], over: dict[str, Any] | None,
                record: dict[str, Any]) -> list[tuple[str, str, Verdict, Verdict | None]]:
    """:func:`ranking` on the built-in ``model`` with ``options``, printed as ``name`` (a key
    of :data:`RANK_MODELS`); returns its summary rows (name, prediction, verdict over every
    case, over the cases that are not the profile's own orders) and puts into
    ``record[name]`` what ``--json-out`` writes: per case its name, the profile's own
    method it repeats (or None), the counted steps of every round, the one-profile
    prediction and the predictions per round (seconds); per micro-batch count the profile's
    own runs' median step per method and round."""
    p = args.ranks
    step = args.timing == "step"
    each = args.profile_each_round
    steps = args.steps or RANK_STEPS[name]
    sizes = sorted({m for _, m, _ in RANK_CASES})
    probs: dict[int, tuple[Problem, Problem]] = {}  # m -> (solved on, the other timing)
    own: dict[int, dict[str, float]] = {}  # m -> method -> the profile's runs' step (s)
    docs: dict[int, dict[str, Any]] = {}  # m -> the warm profile
    t0 = time.perf_counter()
    for m in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            warm, _ = project_profile(p, m, args.batch, tmp, model, options, over,
                                      keep_steps=step)
            docs[m] = json.loads(Path(f"{tmp}/profile.json").read_text())
            if not step:
                probs[m] = (warm, warm)
            else:
                split_p, warm_p, own[m] = _step_timed(docs[m], model, options, p, m, steps,
                                                      name)
                probs[m] = (split_p, warm_p)
        _show(f"{name}, {m} micro-batches: project profile ({args.timing})", probs[m][0],
              fused_variant(probs[m][0]))
        tails = probs[m][0].grad_reduce
        print(f"  step tails (optimizer step + overheads.step_s): "
              f"{', '.join(f'{t * 1e3:.2f}' for t in tails)} ms")
    print(f"  profiles: {time.perf_counter() - t0:.0f} s")
    solved = [solve(_limited(probs[m][0], lim), meth, time_limit=args.time_limit,
                    workers=1, seed=0) for meth, m, lim in RANK_CASES]
    groups = same_runs(solved)
    scheds = [solved[g[0]] for g in groups]
    cases = [RANK_CASES[g[0]] for g in groups]
    names = [" = ".join(_case_name(*RANK_CASES[i]) for i in g) for g in groups]
    for same in (n for n in names if " = " in n):
        print(f"  {same}: the same orders on every rank, run once as one case")
    # The profile's own schedules (order generators: the same orders in every round).
    profiled = {m: step_schedules(docs[m], p, m)[2] for m in sizes} if step else {}
    mine = own_orders(cases, scheds, profiled) if step else [None] * len(scheds)
    jobs: list[tuple[str, Any, RunConfig]] = []
    prof_jobs: dict[int, list[int]] = {}  # m -> job index of each STEP_METHODS run
    prof_steps = args.profile_steps or steps
    if each:  # the profile's own runs first in every round, then the cases
        pcfg = RunConfig(model=model, model_options=options, steps=prof_steps,
                         batch_size=args.batch)
        for m in sizes:
            prof_jobs[m] = list(range(len(jobs), len(jobs) + len(profiled[m])))
            jobs += [("ours", s, pcfg) for s in profiled[m]]
    first = len(jobs)
    jobs += [("ours", s, RunConfig(model=model, model_options=options, steps=steps,
                                   batch_size=args.batch)) for s in scheds]
    before = load_note(p)
    t0 = time.perf_counter()
    per_rank = spawn(_bench_rank, p, (jobs, args.rounds, args.warmup_rounds), timeout=3600,
                     backend="gloo")
    wall = time.perf_counter() - t0

    def reports(i: int) -> list[list[dict[str, Any]]]:  # case i: [rank][round]
        return [per_rank[r][str(first + i)] for r in range(p)]

    # case -> round -> its counted steps (seconds; the first of each round left out)
    counted = [[_assemble(s, RunConfig(), [reports(i)[r][rnd] for r in range(p)]
                          ).step_times[1:] for rnd in range(args.rounds)]
               for i, s in enumerate(scheds)]
    rounds = [[statistics.median(x) for x in c] for c in counted]
    measured = [statistics.median(t for x in c for t in x) for c in counted]
    # The step time a schedule predicts: its makespan plus the stages' step tails.
    once = [s.iteration_time for s in scheds]
    per_round: list[list[float]] = [[] for _ in scheds]  # case -> prediction per round
    sampled_round: list[list[float]] = [[] for _ in scheds]  # the same, sampled (--sampled)
    own_fit: dict[int, dict[str, list[tuple[float, float, float]]]] = {m: {} for m in sizes}
    again_steps: dict[int, dict[str, list[float]]] = {m: {} for m in sizes}
    spreads: dict[int, OpSpread] = {}
    sampled_probs: dict[int, Problem] = {}
    if each:
        for rnd in range(args.rounds):
            probs_r = {}
            for m in sizes:
                runs = [[[per_rank[r][str(j)][rnd]] for j in prof_jobs[m]]
                        for r in range(p)]
                timed = step_profile_from_runs(docs[m], runs, microbatches=m, model=model)
                probs_r[m] = step_problem(timed, m)
                for row in timed["in_step"]["replayed"]:
                    again_steps[m].setdefault(row["method"], []).append(
                        row["measured_ms"] / 1e3)
                if args.sampled:
                    again = sampled_step_fit(timed, samples=args.samples)
                    spreads[m] = OpSpread.from_dict(timed["in_step"]["op_spread"])
                    sampled_probs[m] = step_problem(again, m)
                    for det, smp in zip(timed["in_step"]["replayed"],
                                        again["in_step"]["sampled"]["replayed"],
                                        strict=True):
                        own_fit[m].setdefault(det["method"], []).append(
                            (det["measured_ms"], det["predicted_parts_ms"],
                             smp["predicted_parts_ms"]))
                    own_fit[m].setdefault("fit", []).append(
                        (timed["in_step"]["step_measured_ms"],
                         timed["in_step"]["step_fit_ms"],
                         again["in_step"]["sampled"]["step_fit_ms"]))
            for i, (s, c) in enumerate(zip(scheds, cases, strict=True)):
                per_round[i].append(repriced(s, probs_r[c[1]], c[2]))
                if args.sampled:
                    sampled_round[i].append(sampled_step(
                        priced_on(s, sampled_probs[c[1]], c[2]), s.device_orders(),
                        spreads[c[1]], samples=args.samples or SAMPLES))
    record[name] = {
        "cases": names, "own_method": mine, "counted_steps": steps - 1,
        "steps": counted,
        "one_profile": once, "per_round": per_round if each else None,
        "sampled_round": sampled_round if args.sampled else None,
        "own_runs": {str(m): again_steps[m] for m in sizes} if each else None}
    each_pred = [statistics.median(x) for x in per_round] if each else []
    sampled_pred = [statistics.median(x) for x in sampled_round] if args.sampled else []
    predicted = each_pred or once  # what the pairs and the tau line below judge
    print(f"{name} ({p} gloo ranks, batch {args.batch}, {args.warmup_rounds} round(s) not "
          f"counted, then {args.rounds} rounds x {steps} steps"
          + (f", each round after the profile's own runs ({' and '.join(STEP_METHODS)}, "
             f"{prof_steps} steps each, per micro-batch count)" if each else "")
          + f", {wall:.0f} s)")
    print(f"  before the runs: {before}\n  after the runs:  {load_note()}")
    width = max(20, *(len(n) + 2 for n in names))
    spread = [(max(r) - min(r)) / 2 / statistics.median(r) for r in rounds]
    print(f"  {'case':<{width}} {'measured':>9} {'round spread':>13} {'one profile before':>19}"
          + (f" {'profile each round':>19} {'its spread':>10}" if each else "")
          + (f" {'sampled each round':>19}" if sampled_pred else "")
          + ("  warm profile, same orders" if step else ""))
    for i, s in enumerate(scheds):
        meas = measured[i]
        mark = " *" if mine[i] else ""
        line = (f"  {names[i] + mark:<{width}} {meas * 1e3:7.1f}ms {spread[i]:>12.1%} "
                f"{once[i] * 1e3:8.1f}ms {meas / once[i] - 1:+8.1%}")
        if each:
            pr = per_round[i]
            line += (f" {each_pred[i] * 1e3:8.1f}ms {meas / each_pred[i] - 1:+8.1%} "
                     f"{(max(pr) - min(pr)) / 2 / each_pred[i]:>9.1%}")
        if sampled_pred:
            line += f" {sampled_pred[i] * 1e3:8.1f}ms {meas / sampled_pred[i] - 1:+8.1%}"
        if step:
            s_o = repriced(s, probs[cases[i][1]][1], cases[i][2])
            line += f"  {s_o * 1e3:8.1f} ms ({meas / s_o - 1:+.1%})"
        print(line)
    if any(mine):
        print("  * runs the same orders as the profile's own " + " / ".join(STEP_METHODS)
              + " runs (order generators that ignore costs, same partition): the profile's "
              "step cost is fitted to runs of these orders, so their predictions are not "
              "independent of the measurement")
    # The profile ran 1F1B and ZB-H1 on the same partition: a case with the same orders
    # shows how far the machine moved between the profile and now.
    again = [(names[i], own[c[1]][mine[i]], measured[i]) for i, c in enumerate(cases)
             if mine[i] and step]
    if again:
        print("  the same orders in the profile's runs and in these (the machine's drift "
              "between them, in every error above): one profile before " + ", ".join(
                  f"{name} {then * 1e3:.1f} / {now * 1e3:.1f} ms ({now / then - 1:+.0%})"
                  for name, then, now in again))
        if each:
            print("    each round's profile (median over rounds): " + ", ".join(
                f"{names[i]} {statistics.median(again_steps[c[1]][mine[i]]) * 1e3:.1f} / "
                f"{measured[i] * 1e3:.1f} ms "
                f"({measured[i] / statistics.median(again_steps[c[1]][mine[i]]) - 1:+.0%})"
                for i, c in enumerate(cases) if mine[i]))
    print("  where each error goes (one profile before), ms (the runs' own parts in place of "
          "the priced ones, one at a time; error_parts): ops + gap, messages, step tail "
          "(run / priced), unexplained")
    for i, s in enumerate(scheds):
        e = error_parts(s, reports(i))
        print(f"    {names[i]:<{width}} {e['ops'] * 1e3:+7.1f} {e['messages'] * 1e3:+6.1f} "
              f"{e['tail'] * 1e3:+6.1f} ({e['run_tail'] * 1e3:.1f} / "
              f"{e['priced_tail'] * 1e3:.1f}) {e['unexplained'] * 1e3:+6.1f}")
    how = "profile each round" if each else "one profile before"
    close = [(i, j) for i in range(len(scheds)) for j in range(i + 1, len(scheds))
             if abs(predicted[i] - predicted[j]) / max(predicted[i], predicted[j])
             <= spread[i] + spread[j]]
    if close:
        print(f"  predicted ({how}) closer (difference over the larger) than their two round "
              "spreads added (their order is noise): " + ", ".join(
                  f"{names[i]} / {names[j]} "
                  f"({abs(predicted[i] - predicted[j]) / max(predicted[i], predicted[j]):.1%}"
                  " apart)" for i, j in close))
    sep = [(i, j) for i in range(len(scheds)) for j in range(i + 1, len(scheds))
           if (i, j) not in close]
    agree = sum((predicted[i] < predicted[j]) == (measured[i] < measured[j]) for i, j in sep)
    rows = []
    if args.sampled:
        print("  the profile's own runs, median over rounds, ms: measured, the replay on mean "
              "op times and the sampled one (each with the measured tail; remainder = "
              "measured less it), and the per-step cost: measured tail / fitted on mean "
              "times / fitted on the sampled replay")
        for m in sizes:
            cells = []
            for meth in STEP_METHODS:
                rows_m = own_fit[m][meth]
                meas_ms, det_ms, smp_ms = (statistics.median(r[k] for r in rows_m)
                                           for k in range(3))
                cells.append(f"{meth} {meas_ms:.1f}: mean times {det_ms:.1f} "
                             f"({meas_ms - det_ms:+.1f}), sampled {smp_ms:.1f} "
                             f"({meas_ms - smp_ms:+.1f})")
            tail, fit_d, fit_s = (statistics.median(r[k] for r in own_fit[m]["fit"])
                                  for k in range(3))
            print(f"    m={m}: " + "; ".join(cells) + f"; per step {tail:.2f} / {fit_d:.2f} / "
                  f"{fit_s:.2f}")
    for label, pred in (("one profile before", once), ("profile each round", each_pred),
                        ("sampled each round", sampled_pred)):
        if not pred:
            continue
        every = verdict(pred, measured)
        rest = [i for i in range(len(scheds)) if not mine[i]]
        other = (verdict([pred[i] for i in rest], [measured[i] for i in rest])
                 if step and rest else None)
        pairs = len(scheds) * (len(scheds) - 1) // 2
        ties = sum(math.isclose(pred[i], pred[j], rel_tol=1e-9)  # kendall_tau_b's
                   for i in range(len(scheds)) for j in range(i + 1, len(scheds)))
        best = f"; at most {math.sqrt((pairs - ties) / pairs):+.2f} with them" if ties else ""
        tail = (f"; of the {len(sep)} pairs predicted further apart, {agree} in the measured "
                "order" if pred is predicted else "")
        print(f"  {label}: Kendall tau-b {every.tau:+.2f} over the {pairs} pairs of "
              f"{len(scheds)} distinct cases (aim >= 0.8; tau-b, the statistic for rankings "
              f"with ties; {ties} pair(s) tied in the prediction{best}){tail}; worst error "
              f"{every.worst:.1%} (aim <= 10%)"
              + (f"; over the {other.cases} cases without *: tau-b {other.tau:+.2f}, worst "
                 f"{other.worst:.1%}" if other else ""))
        rows.append((name, label, every, other))
    return rows


def vshape(args: argparse.Namespace) -> None:
    """pipeopt's ZB-V against PyTorch's ``ScheduleZBVZeroBubble`` on the same stages (the
    model split evenly into two stages per rank, placed in a V as both expect), in interleaved
    rounds: the executor's own overhead on a schedule of several stages per rank."""
    p, m = args.ranks, args.microbatches
    zbv = solve(uniform_problem(p, m, virtual_stages=2, placement="vshape"), "zb-v")
    cfg = RunConfig(model=MODEL, model_options=OPTIONS, steps=args.steps, batch_size=args.batch)
    jobs = [("ours", zbv, cfg), ("torch:ScheduleZBVZeroBubble", zbv, cfg)]
    t0 = time.perf_counter()
    runs = spawn(_bench_rank, p, (jobs, args.rounds), timeout=600, backend="gloo")

    def median_step(job: int, rnd: int) -> float:
        res = _assemble(zbv, RunConfig(), [runs[r][str(job)][rnd] for r in range(p)])
        return statistics.median(res.step_times[1:] or res.step_times)

    per_round = [median_step(0, rnd) / median_step(1, rnd) for rnd in range(args.rounds)]
    ratio = statistics.median(per_round)
    print(f"zb-v ({time.perf_counter() - t0:.1f} s, {2 * p} stages on {p} ranks): pipeopt "
          f"/ torch ScheduleZBVZeroBubble per round {', '.join(f'{x:.2f}' for x in per_round)}")
    print(f"{'PASS' if ratio <= 1.05 else 'MISS'} pipeopt ZB-V / torch ScheduleZBVZeroBubble "
          f"{ratio:.3f} (median of per-round ratios; aim <= 1.05)")


def _replan(scheds: list[Schedule], job_of: list[int], per_rank: list[Any],
            args: argparse.Namespace, p: int) -> None:
    """``pipeopt run --costs-out`` -> ``pipeopt solve`` -> ``pipeopt run``: the split
    schedules' runs above measured every op; CP-SAT re-plans on those costs (what
    ``measured_problem`` builds from a run), and the new schedule runs in fresh rounds."""
    zb = next(i for i, s in enumerate(scheds) if s.method == "zb-h1")
    reports = [rnd for r in range(p) for rnd in per_rank[r][str(job_of[zb])]]
    res = RunResult("zb-h1", p, [0.0], [0.0], scheds[zb].makespan,
                    op_costs=op_costs(reports))
    measured = measured_problem(scheds[zb], res)
    again = solve(measured, "cpsat", time_limit=args.time_limit)
    cfg = RunConfig(model=MODEL, model_options=OPTIONS, steps=args.steps, batch_size=args.batch)
    t0 = time.perf_counter()
    runs = spawn(_bench_rank, p, ([("ours", again, cfg)], args.rounds), timeout=600,
                 backend="gloo")
    times = [t for rnd in range(args.rounds) for t in _assemble(
        again, RunConfig(), [runs[r]["0"][rnd] for r in range(p)]).step_times[1:]]
    meas = statistics.median(times)
    err = meas / again.makespan - 1
    print(f"re-planned on the costs measured in the zb-h1 runs ({time.perf_counter() - t0:.1f} "
          f"s): cpsat predicts {again.makespan * 1e3:.1f} ms ({again.solver.status}), "
          f"measured {meas * 1e3:.1f} ms")
    print(f"{'PASS' if abs(err) <= 0.15 else 'MISS'} cpsat re-planned on measured costs: "
          f"measured vs predicted {err:+.1%} (aim within 15%)")


if __name__ == "__main__":
    main()
