"""Data parallelism across two datacenters: the search against hand-made schedules whose
collectives run as early as allowed (Megatron-style), with and without the one-step delayed
reduction and per-layer buckets, and against the lower bound, in one run.

Run: python benchmarks/collectives.py [--quick] [--time-limit 20] [--workers 2]
     [--iterations 3]

Instances: a p = 4 stage pipeline, m = 8 micro-batches, T_F = T_B = T_W = 0.1 s per stage
(activation 1 per stage), replicated twice, ZeRO-1 as CrossPipe models it
(:mod:`pipeopt.workloads.dataparallel`): per stage a parameter all-gather (bf16 parameters,
half the fp32 gradient bytes) before its first forward and a gradient reduce-scatter after its
last weight gradient. Either both replicas in one datacenter (100 GB/s, 5 us between replicas)
or one per datacenter over a shared 10 Gbit/s WAN (1.25e9 B/s, 30 ms), every stage's
collectives taking turns on it; gradients per stage from 0.25 GB to 4 GB (a WAN reduce-scatter
of 0.13-1.6 s against 2.4 s of compute per stage and iteration).

``--iterations`` K consecutive iterations are one graph; every figure is seconds per iteration,
makespan / K (fill and drain paid once). Per instance:

* ``sync``: the best of 1F1B (fused backward) and ZB-H1 with Megatron-style collectives (as
  early as allowed, the next iteration waits for each stage's reduction): the baseline;
* ``delay``: the same hand-made schedules with the one-step delayed reduction (the next
  iteration's forwards need not wait for the reduction; the update applies one step late);
* ``no-fl``: delayed, the same schedules run over iterations x m micro-batches with no flush
  between iterations (``NAME:pipelined``: possible only with the delay);
* ``+bkt``: delayed (with a flush), and each stage's reduce-scatter in 4 buckets (its last W
  cut in 4, each bucket starts after its quarter; every bucket pays the 30 ms latency);
* ``search``: core CP-SAT on the delayed graph (without buckets: they never won in the
  runs of benchmarks/README.md), started from the shorter of the delay and no-fl ZB-H1
  schedules (on the same graph; 1F1B runs its own, fused graph), given the largest hand-made
  peak memory as the limit, so the search may not buy time with memory;
* ``bound``: the larger of the analytic bound and CP-SAT's over that graph, / K; and
  ``per``: the busiest resource's load per iteration, a bound on the period of any periodic
  schedule.

Ratios: sync / search (the aim, >= 1.2x geometric mean over the WAN cases, issue 13), delay /
search (what the search adds to the best hand-made schedule with the delay), search / bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeopt.core.bounds import lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.core.validate import validate
from pipeopt.problem import Problem, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.workloads import dataparallel as dpw

#: A 10 Gbit/s WAN (1.25e9 B/s) with 30 ms one way: the order of a cross-region link.
WAN_BANDWIDTH, WAN_LATENCY = 1.25e9, 0.03
#: Replicas in one datacenter: 100 GB/s, 5 us (an InfiniBand-class fabric, order of magnitude).
DC_BANDWIDTH, DC_LATENCY = 1e11, 5e-6
#: Buckets per stage in the ``+bkt`` rows (equal bytes, equal shares of the last W).
BUCKETS = 4


def _hand_made(prob: Problem, dp: dpw.DataParallel, name: str) -> GraphSchedule:
    """A hand-made schedule on ``prob`` with its collectives as early as allowed; ``NAME:
    pipelined``: the iterations as one run of iterations x m micro-batches (no flush)."""
    g = dpw.build(prob, dp)
    family, _, how = name.partition(":")
    if how:
        long = prob.replace(microbatches=prob.microbatches * dp.iterations)
        orders = dpw.task_orders(prob, dp, GENERATORS[family](long), pipelined=True)
    else:
        orders = dpw.task_orders(prob, dp, GENERATORS[family](prob))
    return validate(simulate(g, orders, name))


def _best_hand(split: Problem, dp: dpw.DataParallel, pipelined: bool = False
               ) -> tuple[GraphSchedule, GraphSchedule]:
    """(the better of 1F1B and ZB-H1 by makespan, ZB-H1: the one on the split graph); with
    ``pipelined``, their no-flush variants."""
    how = ":pipelined" if pipelined else ""
    one = _hand_made(split.replace(split_backward=False), dp, "1f1b" + how)
    zb = _hand_made(split, dp, "zb-h1" + how)
    return min((one, zb), key=lambda s: s.makespan), zb


def bucketed(dp: dpw.DataParallel, n: int) -> dpw.DataParallel:
    """``dp`` with every stage's reduction in ``n`` equal buckets."""
    return dataclasses.replace(dp, bucket_bytes=tuple((g / n,) * n for g in dp.grad_bytes),
                               bucket_share=tuple((1.0 / n,) * n for _ in dp.grad_bytes))


def run_case(p: int, m: int, grad_bytes: float, wan: bool, time_limit: float, workers: int,
             iterations: int) -> dict[str, float]:
    """Every method on one instance (see the module docstring); seconds per iteration."""
    sync = dpw.DataParallel(
        replicas=2, grad_bytes=(grad_bytes,) * p, param_bytes=(grad_bytes / 2,) * p,
        latency=DC_LATENCY, bandwidth=DC_BANDWIDTH, datacenter=(0, 1) if wan else (0, 0),
        wan_latency=WAN_LATENCY, wan_bandwidth=WAN_BANDWIDTH, iterations=iterations)
    delay = dataclasses.replace(sync, delayed=True)
    bkt = bucketed(delay, BUCKETS)
    split = uniform_problem(p, m, 0.1, 0.1, 0.1)
    hands = {name: _best_hand(split, dp, name == "nf") for name, dp in
             (("sync", sync), ("delay", delay), ("nf", delay), ("bkt", bkt))}
    limit = max(max(s.peak_memory) for pair in hands.values() for s in pair)
    limited = split.replace(memory_limit=(limit,) * p)
    t0 = time.perf_counter()
    g = dpw.build(limited, delay)
    hint = min((hands[x][1] for x in ("delay", "nf")), key=lambda s: s.makespan)
    hint = dataclasses.replace(hint, graph=g) if max(hint.peak_memory) <= limit else None
    search = validate(solve_cpsat(g, time_limit=time_limit, workers=workers, initial=hint))
    k = iterations
    return {**{x: hands[x][0].makespan / k for x in hands}, "search": search.makespan / k,
            "hint": (hint.makespan if hint else math.inf) / k,
            "bound": max(lower_bound(g), search.lower_bound or 0.0) / k,
            "per": dpw.periodic_bound(g), "reduce_s": sync.collective_times()[1][0],
            "wall": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two WAN cases, 10 s each")
    ap.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per case")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT threads")
    ap.add_argument("--iterations", type=int, default=3, help="iterations in one graph")
    args = ap.parse_args()
    p, m, k = 4, 8, args.iterations
    sizes = [1e9, 4e9] if args.quick else [2.5e8, 1e9, 2e9, 4e9]
    cases = [(b, True) for b in sizes] + ([] if args.quick else [(1e9, False), (4e9, False)])
    limit = 10.0 if args.quick else args.time_limit
    print(f"p = {p}, m = {m}, 2 replicas, T_F = T_B = T_W = 0.1 s, {k} iterations per graph; "
          f"CP-SAT {limit:g} s, {args.workers} workers; seconds per iteration")
    print(f"{'where':>5} {'grad GB':>7} {'RS s':>6} {'sync':>7} {'delay':>7} {'no-fl':>7} "
          f"{'+bkt':>7} "
          f"{'search':>7} {'bound':>7} {'per':>7} {'sync/search':>11} {'delay/search':>12} "
          f"{'search/bound':>12}")
    ratios = []
    for nbytes, wan in cases:
        r = run_case(p, m, nbytes, wan, limit, args.workers, k)
        ratio = r["sync"] / r["search"]
        if wan:
            ratios.append(ratio)
        mark = "*" if r["search"] < r["hint"] - 1e-9 else " "
        print(f"{'WAN' if wan else 'DC':>5} {nbytes / 1e9:7.2f} {r['reduce_s']:6.3f} "
              f"{r['sync']:7.3f} {r['delay']:7.3f} {r['nf']:7.3f} {r['bkt']:7.3f} "
              f"{r['search']:6.3f}{mark} "
              f"{r['bound']:7.3f} {r['per']:7.3f} {ratio:10.2f}x "
              f"{min(r['delay'], r['nf'], r['bkt']) / r['search']:11.2f}x "
              f"{r['search'] / r['bound']:11.3f}x")
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"WAN cases: sync hand-made / search, geometric mean {mean:.2f}x (aim >= 1.2x: "
          f"{'PASS' if mean >= 1.2 else 'FAIL'}); search marked *: CP-SAT improved on its start; "
          "delay/search uses the best hand-made row with the delay (delay, no-fl, +bkt)")


if __name__ == "__main__":
    main()
