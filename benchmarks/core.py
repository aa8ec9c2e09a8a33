"""The core task graph against the chain code: build time and simulator speed.

Run: python benchmarks/core.py [--devices 64] [--microbatches 1024] [--repeat 3]

For 1F1B (fused backward) and ZB-H1 (split backward) orders at p=64, m=1024 with 50 ms latency
links, prints the time to build the graph (``workloads.training.build``), the chain API's
``pipeopt.simulate.simulate`` (since step 4 of docs/architecture.md a thin call into the core:
build, the core simulator, a chain Schedule) and the core simulator alone on an already built
graph (without order checks, and with them), and the ratio chain API / core alone measured in
the same run (what building the graph and speaking in ops cost on top of the core's timing).
The last line does the same for ZB-H1 on links that serialize messages (event-driven path).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from pipeopt.core.simulate import simulate as core_simulate
from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import simulate
from pipeopt.workloads import training


def _best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    p, m, r = args.devices, args.microbatches, args.repeat
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, latency=0.05)
    lat, bw = chain_links(p, [0.05] * (p - 1), [1e9] * (p - 1))
    cont = prob.replace(latency=lat, bandwidth=bw, message_size=(1e8,) * (p - 1))
    cases = [("1f1b", prob.replace(split_backward=False), r),
             ("zb-h1", prob, r), ("zb-h1 serialized", cont, 1)]
    for name, pr, rep in cases:
        orders = GENERATORS[name.split()[0]](pr)
        build = _best_of(lambda pr=pr: training.build(pr), rep)
        graph = training.build(pr)
        tasks = training.task_orders(pr, orders)
        chain = _best_of(lambda pr=pr, orders=orders: simulate(pr, orders, check=False), rep)
        core = _best_of(lambda g=graph, t=tasks: core_simulate(g, t, check=False), rep)
        checked = _best_of(lambda g=graph, t=tasks: core_simulate(g, t), rep)
        print(f"{name:17s} {pr.num_ops} tasks: build {build:.3f} s | chain API {chain:.3f} s | "
              f"core {core:.3f} s (with order checks {checked:.3f} s) | "
              f"chain API / core {chain / core:.2f}")


if __name__ == "__main__":
    main()
