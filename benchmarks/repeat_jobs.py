"""Identical jobs in one round: how far apart two runs of the same orders measure (issue 17).

Runs the ``--ranking`` MLP of ``benchmarks/executor.py`` (8 layers, its width) on 2 gloo ranks
in rounds of jobs named by ``--order``: ``A4`` / ``B4`` / ``A8`` / ``B8`` are the orders of the
profile's own 1F1B / ZB-H1 runs (:func:`pipeopt.costs.profiler.step_schedules`) at 4 / 8
micro-batches, ``H8`` ZB-H2 and ``G8`` greedy under a one-micro-batch memory limit, both at 8
(``--order "A4 B4 A8 B8 A4 B4 A8 H8 B8 G8"`` is ``--ranking``'s round). Prints, per position,
the median step (max over ranks, the first step of each job not counted), each round's
median and their spread (range / 2 over the median, as ``--ranking``); for every name run more
than once a round, the later run against the first as ``--ranking`` compares a case with the
profile's run of the same orders (pooled median over the median of round medians); the
correlation of the first and second halves of a job against that of a job's second half and
the next job's first (does the speed belong to the job or to the moment?); and per rank the
threads before and after, GC milliseconds and involuntary context switches per job.

    python benchmarks/repeat_jobs.py [--order "A4 B4 A8 B8 A4 B4 A8 B8"] [--rounds 6]
        [--steps 12] [--width 512]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from executor import _limited, load_note, project_profile

from pipeopt.costs.profiler import step_schedules
from pipeopt.executor.launch import RunConfig, run_rank
from pipeopt.executor.procs import spawn
from pipeopt.solvers import solve

NAMES = ("A4", "B4", "A8", "B8", "H8", "G8")


def _rank(rank: int, world: int, device: Any, jobs: list[tuple[Any, RunConfig]], rounds: int,
          status: Any = None) -> list[dict[str, Any]]:
    """Every job ``rounds + 1`` times in order (the first round not counted by the caller);
    per job: step times (seconds), GC seconds, involuntary context switches, threads after."""
    passes: list[float] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            passes.append(time.perf_counter() - began.pop())

    gc.callbacks.append(on_gc)
    out = []
    for _ in range(rounds + 1):
        for sched, cfg in jobs:
            n0, ru0 = len(passes), resource.getrusage(resource.RUSAGE_SELF)
            res = run_rank(rank, world, device, sched, cfg, "gloo", status=status)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            out.append({"steps": res["step_times"], "gc_s": sum(passes[n0:]),
                        "nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
                        "threads": len(os.listdir("/proc/self/task"))
                        if os.path.isdir("/proc/self/task") else -1})
    gc.callbacks.remove(on_gc)
    return out


def _schedules(width: int, batch: int) -> dict[str, Any]:
    opts = (("layers", 8), ("width", width))
    out: dict[str, Any] = {}
    for m in (4, 8):
        with tempfile.TemporaryDirectory() as tmp:
            split, _ = project_profile(2, m, batch, tmp, "mlp", opts, None, keep_steps=True)
            doc = json.loads(Path(f"{tmp}/profile.json").read_text())
        _, _, (one_f, zb) = step_schedules(doc, 2, m)
        out[f"A{m}"], out[f"B{m}"] = one_f, zb
        if m == 8:
            out["H8"] = solve(split, "zb-h2")
            out["G8"] = solve(_limited(split, 1.0), "greedy")
    return out


def _corr(pairs: list[tuple[float, float]]) -> float:
    a, b = zip(*pairs, strict=True)
    return statistics.correlation(a, b) if len(pairs) > 2 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", default="A4 B4 A8 B8 A4 B4 A8 B8",
                    help=f"the jobs of a round, names of {', '.join(NAMES)}")
    ap.add_argument("--rounds", type=int, default=6, help="counted rounds (one more first)")
    ap.add_argument("--steps", type=int, default=12, help="steps per job, the first not counted")
    ap.add_argument("--width", type=int, default=512, help="the MLP's width")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    names = args.order.split()
    bad = [n for n in names if n not in NAMES]
    if bad or not names:
        raise SystemExit(f"--order: names must be among {', '.join(NAMES)}, got {args.order!r}")
    if args.rounds < 2 or args.steps < 4 or args.width < 1:
        raise SystemExit("--rounds must be >= 2, --steps >= 4 and --width >= 1")
    scheds = _schedules(args.width, args.batch)
    cfg = RunConfig(model="mlp", model_options=(("layers", 8), ("width", args.width)),
                    steps=args.steps, batch_size=args.batch)
    before = load_note(2)
    t0 = time.perf_counter()
    per_rank = spawn(_rank, 2, ([(scheds[n], cfg) for n in names], args.rounds), timeout=3600,
                     backend="gloo")
    wall = time.perf_counter() - t0
    n = len(names)

    def steps(rnd: int, pos: int) -> list[float]:  # rnd 1.. counted
        a, b = (per_rank[r][rnd * n + pos]["steps"] for r in (0, 1))
        return [max(x, y) for x, y in zip(a, b, strict=True)][1:]

    rounds = range(1, args.rounds + 1)
    print(f"mlp width {args.width}, 2 gloo ranks, {args.rounds} rounds (+1 not counted) of "
          f"{n} jobs x {args.steps} steps, {wall:.0f} s\n  before: {before}\n  after:  "
          f"{load_note()}")
    print("  pos name  median ms  round medians, ms  spread  GC ms/job  invol. switches/job "
          "(rank 0, 1)")
    for pos, name in enumerate(names):
        med = [statistics.median(steps(r, pos)) for r in rounds]
        pooled = statistics.median(t for r in rounds for t in steps(r, pos))
        spread = (max(med) - min(med)) / 2 / statistics.median(med)
        gcs = [statistics.mean(per_rank[k][r * n + pos]["gc_s"] for r in rounds) * 1e3
               for k in (0, 1)]
        sw = [statistics.median(per_rank[k][r * n + pos]["nivcsw"] for r in rounds)
              for k in (0, 1)]
        print(f"  {pos:3} {name:4} {pooled * 1e3:9.2f}  "
              + " ".join(f"{x * 1e3:5.1f}" for x in med)
              + f"  {spread:6.1%}  {gcs[0]:.2f}, {gcs[1]:.2f}  {sw[0]:.0f}, {sw[1]:.0f}")
    print("  the same orders later in the round against their first run (pooled median over "
          "the median of round medians, as --ranking compares them):")
    for name in dict.fromkeys(names):
        pos = [i for i, x in enumerate(names) if x == name]
        first = statistics.median(statistics.median(steps(r, pos[0])) for r in rounds)
        for q in pos[1:]:
            later = statistics.median(t for r in rounds for t in steps(r, q))
            ratios = [statistics.median(steps(r, q)) / statistics.median(steps(r, pos[0]))
                      for r in rounds]
            print(f"    {name} at {q} / at {pos[0]}: {later / first - 1:+.1%} (per round "
                  f"{min(ratios):.2f}-{max(ratios):.2f})")
    within, across = [], []
    half = (args.steps - 1) // 2
    ref = {name: statistics.median(t for r in rounds for pos in range(n) if names[pos] == name
                                   for t in steps(r, pos)) for name in names}
    flat = [(names[pos], steps(r, pos)) for r in rounds for pos in range(n)]
    for i, (name, s) in enumerate(flat):
        within.append((statistics.median(s[:half]) / ref[name],
                       statistics.median(s[-half:]) / ref[name]))
        if i + 1 < len(flat) and flat[i + 1][0] == name:  # the same orders next
            across.append((statistics.median(s[-half:]) / ref[name],
                           statistics.median(flat[i + 1][1][:half]) / ref[name]))
    print(f"  halves of a job correlate {_corr(within):+.2f} ({len(within)} jobs)"
          + (f"; a job's second half and the next job's first (same orders) "
             f"{_corr(across):+.2f} ({len(across)} pairs)" if across else ""))
    print("  threads per rank after the first / last job: " + ", ".join(
        f"{per_rank[k][0]['threads']} / {per_rank[k][-1]['threads']}" for k in (0, 1)))


if __name__ == "__main__":
    main()
