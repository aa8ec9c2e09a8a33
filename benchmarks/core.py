"""The core task graph against the chain code: build time and simulator speed.

Run: python benchmarks/core.py [--devices 64] [--microbatches 1024] [--repeat 3] [--cpu]

For 1F1B (fused backward) and ZB-H1 (split backward) orders at p=64, m=1024 with 50 ms latency
links, prints, each the best of ``--repeat`` runs alternated in one process (so both sides see
the same machine): the time to build the graph (``workloads.training.build``); the chain's own
fast pass (``pipeopt.simulate._simulate_fast``, what ``simulate`` runs on latency-only links);
the core route that would replace it (build the graph, the core simulator, the chain Schedule:
``pipeopt.simulate._time``), both without and with the order checks; the core route with
the graph built once outside the timed call (``training.chain_graph``, what a caller that
times several orders of one problem hands ``simulate``); and the speed ratios core route /
chain pass, per call and with the graph built once (the plan of record, docs/architecture.md
step 4, moves the fast path onto the core once every ratio is >= 0.9). The last line times
ZB-H1 on links that serialize messages, which ``simulate`` already sends through the core
route.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import _check_orders, _simulate_fast, _time
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
            sides: dict[str, Callable[[], object]] = {
                "build": lambda pr=pr: training.build(pr),
                "chain": lambda pr=pr, o=orders: _simulate_fast(pr, o),
                "core": lambda pr=pr, o=orders: _time(pr, o, check=False),
                "core given": lambda pr=pr, o=orders, g=built: _time(pr, o, check=False,
                                                                     graph=g),
                "chain checked": lambda pr=pr, o=orders: (_check_orders(pr, o),
                                                          _simulate_fast(pr, o)),
                "core checked": lambda pr=pr, o=orders: _time(pr, o, check=True),
            }
            best = dict.fromkeys(sides, float("inf"))
            for _ in range(r):
                for key, fn in sides.items():
                    t0 = clock()
                    fn()
                    best[key] = min(best[key], clock() - t0)
            print(f"{name:6s} {pr.num_ops} ops: build {best['build']:.3f} s | chain pass "
                  f"{best['chain']:.3f} s | core route {best['core']:.3f} s | with order checks "
                  f"{best['chain checked']:.3f} / {best['core checked']:.3f} s | speed core/chain "
                  f"{best['chain'] / best['core']:.2f}, checked "
                  f"{best['chain checked'] / best['core checked']:.2f} | graph built once: "
                  f"core route {best['core given']:.3f} s, speed core/chain "
                  f"{best['chain'] / best['core given']:.2f}")
        orders = GENERATORS["zb-h1"](cont)
        t0 = clock()
        _time(cont, orders, check=False)
        print(f"zb-h1 serialized {cont.num_ops} ops: core route {clock() - t0:.3f} s (one run)")
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
