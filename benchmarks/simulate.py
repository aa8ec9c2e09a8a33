"""Simulator throughput: ops timed per second on large instances.

Run: python benchmarks/simulate.py [--devices 64] [--microbatches 1024] [--repeat 3]

Prints ops/s for 1F1B and ZB-H1 orders (fast path: latency-only links) and for the event-driven
path (links that serialize messages), and, as the baseline measured in the same run, the cost of
merely walking the same ops once in Python (a loop that reads each op's duration). Each "ratio to
baseline" is the simulator's ops/s divided by the bare loop's ops/s, so it says how close the
simulator is to a bare loop on this machine (the issue's target is 1e6 ops/s absolute).
"""

from __future__ import annotations

import argparse
import time

from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import simulate


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    p, m = args.devices, args.microbatches
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, latency=0.05)
    print(f"p={p} m={m}: {prob.num_ops} ops (split backward)")

    def bare_loop() -> None:
        dur = prob.duration
        total = 0.0
        for op in prob.ops():
            total += dur(op)

    base = _best_of(bare_loop, args.repeat)
    print(f"{'baseline: one Python pass over the ops':44s} {prob.num_ops / base:12,.0f} ops/s")
    for name in ("1f1b", "zb-h1"):
        pr = prob.replace(split_backward=False) if name == "1f1b" else prob
        orders = GENERATORS[name](pr)
        t = _best_of(lambda pr=pr, orders=orders: simulate(pr, orders, check=False),
                     args.repeat)
        tc = _best_of(lambda pr=pr, orders=orders: simulate(pr, orders), args.repeat)
        print(f"{'simulate ' + name + ' (fast path)':44s} {pr.num_ops / t:12,.0f} ops/s  "
              f"ratio to baseline {(pr.num_ops / t) / (prob.num_ops / base):.2f}  "
              f"(with order checks {pr.num_ops / tc:,.0f} ops/s)")
    lat, bw = chain_links(p, [0.05] * (p - 1), [1e9] * (p - 1))
    cont = prob.replace(latency=lat, bandwidth=bw, message_size=(1e8,) * (p - 1))
    orders = GENERATORS["zb-h1"](cont)
    t = _best_of(lambda: simulate(cont, orders, check=False), 1)
    print(f"{'simulate zb-h1 (serialized links, events)':44s} {cont.num_ops / t:12,.0f} ops/s  "
          f"ratio to baseline {(cont.num_ops / t) / (prob.num_ops / base):.2f}")


if __name__ == "__main__":
    main()
