"""The chain simulator on the core task graph: where the time of one ``simulate`` call goes.

Run: python benchmarks/core.py [--devices 64] [--microbatches 1024] [--repeat 3] [--cpu]

For 1F1B (fused backward) and ZB-H1 (split backward) orders at p=64, m=1024 with 50 ms latency
links, prints, each the best of ``--repeat`` runs alternated in one process (so every row sees
the same machine): ``simulate`` per call on a problem object never simulated before (an equal
copy each time: the call builds the task graph and the problem's cached tables), with its order
checks (one problem object each time: from the second call on, its graph is the one
``training.graph_of`` kept), and with the graph built once outside the timed call
(``graph=training.chain_graph(problem)``, what a caller that times several orders of one
problem hands it); then the parts of a call: the graph's build (``workloads.training.build``),
the orders as task ids (``training.task_orders``), the core's timing
(``core.simulate.time_orders``), and the rest (the chain ``Schedule`` made from the times:
since 2026-12-04 its ops as columns, ``schedule.TimedOps``, and freeing the previous result).
The last line times ZB-H1 on links that serialize messages (the core's event path).

``simulate`` had a pass of its own for latency-only links until 2026-12-04; the speed of the
core route against it is measured by ``benchmarks/simulate.py --base DIR`` with DIR a checkout
from before (both in one run), and by this script's version of that date on that checkout.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from pipeopt.core.simulate import time_orders
from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import simulate
from pipeopt.workloads import training


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu", action="store_true",
                    help="time with this process's CPU clock (time.process_time), not the wall "
                         "clock")
    args = ap.parse_args()
    for name in ("devices", "microbatches", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    p, m, r = args.devices, args.microbatches, args.repeat
    clock = time.process_time if args.cpu else time.perf_counter
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8, latency=0.05)
    lat, bw = chain_links(p, [0.05] * (p - 1), [1e9] * (p - 1))
    cont = prob.replace(latency=lat, bandwidth=bw, message_size=(1e8,) * (p - 1))
    gc.disable()  # as simulate runs (pipeopt._gc): the collector's passes are not the code's
    try:
        for name, pr in (("1f1b", prob.replace(split_backward=False)), ("zb-h1", prob)):
            orders = GENERATORS[name](pr)
            built = training.chain_graph(pr)
            tasks = training.task_orders(pr, orders)
            fresh = [pr.replace() for _ in range(r)]  # equal copies, none simulated before
            sides: dict[str, Callable[[], object]] = {
                "call": lambda f=fresh, o=orders: simulate(f.pop(), o, check=False),
                "checked": lambda pr=pr, o=orders: simulate(pr, o),
                "given": lambda pr=pr, o=orders, g=built: simulate(pr, o, check=False, graph=g),
                "build": lambda pr=pr: training.build(pr),
                "ids": lambda pr=pr, o=orders: training.task_orders(pr, o),
                "timing": lambda g=built.graph, t=tasks: time_orders(g, t, check=False),
            }
            best = dict.fromkeys(sides, float("inf"))
            for _ in range(r):
                for key, fn in sides.items():
                    t0 = clock()
                    fn()
                    best[key] = min(best[key], clock() - t0)
            rest = best["given"] - best["ids"] - best["timing"]
            print(f"{name:6s} {pr.num_ops} ops: simulate {best['call']:.3f} s per call, "
                  f"{best['checked']:.3f} s with order checks, {best['given']:.3f} s with the "
                  f"graph built once ({best['given'] / best['call']:.2f} of a call) | parts: "
                  f"build {best['build']:.3f} s, task ids {best['ids']:.3f} s, core timing "
                  f"{best['timing']:.3f} s, Schedule {rest:.3f} s")
            del fresh
        orders = GENERATORS["zb-h1"](cont)
        t0 = clock()
        simulate(cont, orders, check=False)
        print(f"zb-h1 serialized {cont.num_ops} ops: simulate {clock() - t0:.3f} s (one run)")
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
