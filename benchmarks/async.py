"""Asynchronous pipelines: the periodic search against 1F1B-async, the lower bound and the best
synchronous schedule, in one run.

Run: python benchmarks/async.py [--quick] [--time-limit 10]

Instances: p = 4, 8, 12, 16 stages (one per device) of unbalanced cost (seeded: F uniform in
0.7-1.3 s, B = 1.2 F, W = 0.8 F), links of 10 ms latency and 1 s of transmission per message,
except one slow link in the middle (2 s latency, 2 s of transmission each way, a cross-node
hop); activations 1 per micro-batch and stage, weight copies 0.5, static memory 2. Two memory
limits: ``roomy`` (room for 3p micro-batches in flight with their stashes) and ``tight``
(1F1B-async's own need on device 0, ``2 + p + 0.5 (p - 1)``).

Per instance it prints, in seconds per micro-batch: PipeDream's 1F1B-async (and whether it
fits), the search (``periodic``, weight stashing), the lower bound (max of the resource bound
and the memory bound of Little's law) and the ratios 1F1B-async / search and search / bound;
then the best synchronous schedule within the same limits (hand-made schedules and ``greedy``
on m = 4p micro-batches: its iteration time / m) and the throughput gain sync / search; then
the cyclic CP-SAT model's period (weight stashing, free order per device, the same time limit)
and its time, the search's period with 2BW and PipeMare weights (fewer versions, so more
micro-batches fit in flight) and the gain of the best of them all (``gain*``). The
aim of issue 14: the search at the bound whenever memory allows (PASS / FAIL on the roomy
instances).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeopt.problem import Problem, chain_links
from pipeopt.schedules import GENERATORS
from pipeopt.schedules.periodic import async_pattern, check_periodic
from pipeopt.solvers import compare
from pipeopt.solvers.periodic import solve_periodic
from pipeopt.solvers.periodic_cpsat import solve_periodic_cpsat

ACT, WEIGHT, STATIC = 1.0, 0.5, 2.0  # memory units per micro-batch / per weight copy / static
BANDWIDTH = 1e9  # bytes/s on every link but the slow one
MESSAGE = 1e9  # bytes per activation or gradient: 1 s on a normal link
SLOW_LATENCY_S, SLOW_BANDWIDTH = 2.0, 5e8  # the slow link: 2 s latency, 2 s transmission


def instance(p: int, limit: str, seed: int = 0) -> Problem:
    """The unbalanced chain of p stages with a slow middle link (module docstring)."""
    rng = random.Random(seed * 1000 + p)
    f = [rng.uniform(0.7, 1.3) for _ in range(p)]
    lat = [0.01] * (p - 1)
    bw = [BANDWIDTH] * (p - 1)
    lat[p // 2 - 1], bw[p // 2 - 1] = SLOW_LATENCY_S, SLOW_BANDWIDTH
    lt, bwm = chain_links(p, lat, bw)
    mem = (STATIC + 3 * p * (ACT + WEIGHT) if limit == "roomy"
           else STATIC + p * ACT + (p - 1) * WEIGHT)
    return Problem(devices=p, microbatches=4 * p, forward=tuple(f),
                   backward_input=tuple(1.2 * x for x in f),
                   backward_weight=tuple(0.8 * x for x in f),
                   activation_memory=(ACT,) * p, weight_grad_memory=(ACT / 2,) * p,
                   latency=lt, bandwidth=bwm, message_size=(MESSAGE,) * (p - 1),
                   memory_limit=(mem,) * p, static_memory=(STATIC,) * p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="p = 4 and 8 only")
    ap.add_argument("--time-limit", type=float, default=10.0,
                    help="seconds per search (periodic, periodic-cpsat, greedy)")
    args = ap.parse_args()
    sizes = (4, 8) if args.quick else (4, 8, 12, 16)
    head = (f"{'p':>3} {'memory':>6} {'1f1b-async':>11} {'fits':>4} {'search':>8} {'bound':>8} "
            f"{'async/srch':>10} {'srch/bnd':>8} {'best sync':>9} {'sync method':>14} "
            f"{'gain':>6} {'search s':>8} {'cpsat':>7} {'cpsat s':>7} {'2bw':>7} {'pipemare':>8} "
            f"{'gain*':>6}")
    print(head)
    print("-" * len(head))
    aims: list[bool] = []
    gains: list[float] = []
    gains_any: list[float] = []
    speedups: list[float] = []
    for p in sizes:
        for limit in ("roomy", "tight"):
            prob = instance(p, limit)
            wb = (WEIGHT,) * p
            base = async_pattern(prob, "pipedream", wb)
            t0 = time.perf_counter()
            found = solve_periodic(prob, wb, "stash", time_limit=args.time_limit)
            took = time.perf_counter() - t0
            others = [solve_periodic(prob, wb, policy, time_limit=args.time_limit)
                      for policy in ("2bw", "pipemare")]
            t0 = time.perf_counter()
            cp = solve_periodic_cpsat(prob, wb, "stash", time_limit=args.time_limit)
            took_cp = time.perf_counter() - t0
            assert all(check_periodic(s) == [] for s in [*others, cp])
            assert check_periodic(found) == [], check_periodic(found)[:1]
            bound = found.lower_bound or 0.0
            rows = compare(prob, [*GENERATORS, "greedy"], time_limit=args.time_limit)
            fitting = [r for r in rows if r.schedule is not None and r.fits]
            best = min(fitting, key=lambda r: r.schedule.iteration_time, default=None)
            sync = math.inf if best is None else best.schedule.iteration_time / prob.microbatches
            gain = sync / found.period
            at_bound = found.period <= bound * (1 + 1e-9)
            if limit == "roomy":
                aims.append(at_bound)
            gains.append(gain)
            best_any = min(found.period, cp.period, *(s.period for s in others))
            gains_any.append(sync / best_any)
            if not base.over_memory():
                speedups.append(base.period / found.period)
            print(f"{p:>3} {limit:>6} {base.period:>11.4f} "
                  f"{'yes' if not base.over_memory() else 'no':>4} {found.period:>8.4f} "
                  f"{bound:>8.4f} {base.period / found.period:>10.3f} "
                  f"{found.period / bound:>8.3f} {sync:>9.4f} "
                  f"{best.method if best else '-':>14} {gain:>6.3f} {took:>8.2f} "
                  f"{cp.period:>7.4f} {took_cp:>7.2f} "
                  f"{others[0].period:>7.4f} {others[1].period:>8.4f} {sync / best_any:>6.3f}")
    geo = math.exp(sum(map(math.log, gains)) / len(gains))
    geo_any = math.exp(sum(map(math.log, gains_any)) / len(gains_any))
    print(f"\ngeomean throughput gain over the best synchronous schedule: {geo:.3f}x with "
          f"weight stashing, {geo_any:.3f}x with the best of stash / 2BW / PipeMare")
    if speedups:
        geo_s = math.exp(sum(map(math.log, speedups)) / len(speedups))
        print(f"geomean period of 1F1B-async / search (where 1F1B-async fits): {geo_s:.3f}x")
    ok = all(aims)
    print(f"aim: the search at the bound whenever memory allows (roomy): "
          f"{sum(aims)}/{len(aims)} {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
