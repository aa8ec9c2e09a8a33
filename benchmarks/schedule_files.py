"""Schedule JSON v2 against v1 on the same schedule, and trace thinning: sizes and times.

Run: python benchmarks/schedule_files.py [--devices 64] [--microbatches 1024] [--repeat 2]

Takes ZB-H1 at p=64, m=1024 (196,608 ops) on links that serialize messages (50 ms, 1 GB/s,
100 MB activations), writes it as v1 (the chain document, one object per op and message) and,
as the same times over ``workloads.training.build(problem)``, as v2 (the columnar task-graph
document), and reads each back with every check. Prints bytes and seconds of each and the
ratios v2 / v1 measured in this run. Then the trace of the same schedule: events and bytes in
full and with ``max_events`` at a tenth of them (:func:`pipeopt.trace.thin_trace`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeopt.core.simulate import simulate as core_simulate
from pipeopt.graphio import dump_graph_schedule, load_graph_schedule
from pipeopt.io import dump_schedule, load_schedule
from pipeopt.problem import chain_links, uniform_problem
from pipeopt.solvers import run_classic
from pipeopt.trace import thin_trace, to_trace_events
from pipeopt.workloads import training


def _best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    p, m, r = args.devices, args.microbatches, args.repeat
    lat, bw = chain_links(p, [0.05] * (p - 1), [1e9] * (p - 1))
    prob = uniform_problem(p, m, 1.0, 1.2, 0.8).replace(latency=lat, bandwidth=bw,
                                                        message_size=(1e8,) * (p - 1))
    chain = run_classic(prob, "zb-h1")
    graph = training.build(prob)
    sched = core_simulate(graph, training.task_orders(prob, chain.device_orders()), "zb-h1")
    assert sched.makespan == chain.makespan  # the same schedule in both forms
    with tempfile.TemporaryDirectory() as tmp:
        v1, v2 = Path(tmp) / "v1.json", Path(tmp) / "v2.json"
        w1, _ = _best_of(lambda: dump_schedule(chain, v1), r)
        w2, _ = _best_of(lambda: dump_graph_schedule(sched, v2), r)
        r1, _ = _best_of(lambda: load_schedule(v1), r)
        r2, back = _best_of(lambda: load_graph_schedule(v2), r)
        assert back.end == sched.end
        b1, b2 = v1.stat().st_size, v2.stat().st_size
    print(f"zb-h1 p={p} m={m}: {graph.num_tasks} tasks, {graph.num_edges} edges, "
          f"{len(sched.messages)} messages")
    print(f"v1: {b1 / 1e6:.1f} MB, write {w1:.2f} s, read+check {r1:.2f} s")
    print(f"v2: {b2 / 1e6:.1f} MB, write {w2:.2f} s, read+check {r2:.2f} s")
    print(f"v2/v1: size {b2 / b1:.2f}, write {w2 / w1:.2f}, read+check {r2 / r1:.2f}")
    t_full, doc = _best_of(lambda: to_trace_events(chain), 1)
    full = len(json.dumps(doc, separators=(",", ":")))
    n = len(doc["traceEvents"])
    t_thin, thin = _best_of(lambda: thin_trace(doc, n // 10), 1)
    small = len(json.dumps(thin, separators=(",", ":")))
    print(f"trace: {n} events, {full / 1e6:.0f} MB ({t_full:.1f} s); max_events {n // 10}: "
          f"{len(thin['traceEvents'])} events, {small / 1e6:.0f} MB (+{t_thin:.1f} s), "
          f"merged gap {thin['otherData']['thinned']['merged_gap_us'] / 1e3:.0f} ms; "
          f"size ratio {small / full:.3f}")


if __name__ == "__main__":
    main()
