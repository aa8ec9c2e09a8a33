"""Where the kernel puts two gloo ranks, unbound and bound to cores (issue 17).

The MLP of ``executor.py --ranking`` (8 layers of width 512, 4 micro-batches of 8 samples)
runs 1F1B on 2 spawned ranks, ``--rounds`` rounds of ``--steps`` steps (the first of each not
counted), alternately with the ranks left to the kernel (``spawn(..., pin=False)``, what every
run did before 2026-12-05) and bound to a core each (``pin_to_cores``, the default on gloo).
While they run, this process reads every millisecond the CPU each rank's main thread last ran
on and its state (``/proc/PID/stat``); it prints per run the share of the samples with both
ranks runnable in which they were on the same CPU, the median step (the slower rank's, ms)
and the trimmed-mean op times. The sampling thread costs this process a little CPU. A bound
rank is bound by the launcher right after its start, before it loads anything.

    python benchmarks/rank_placement.py [--pairs 3] [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time

from executor import RANK_MODELS, load_note, project_profile

from pipeopt.costs.profiler import _step_rank, step_trace_costs, trimmed_mean
from pipeopt.executor.procs import RunConfig, spawn
from pipeopt.solvers import solve

MICROBATCHES = 4
BATCH = 32


def _sample(stop: threading.Event, out: list[tuple[tuple[str, int], ...]]) -> None:
    """Every millisecond until ``stop``: (state, last CPU) of each spawned rank, by rank."""
    while not stop.is_set():
        row = []
        for proc in sorted(mp.active_children(), key=lambda c: c.name):
            if not proc.name.startswith("pipeopt-rank"):
                continue
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            row.append((fields[0], int(fields[36])))  # state, processor (proc(5))
        if len(row) == 2:
            out.append(tuple(row))
        time.sleep(0.001)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="unbound / bound runs, alternated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    _, options = RANK_MODELS["mlp"]
    with tempfile.TemporaryDirectory() as tmp:
        prob, _ = project_profile(2, MICROBATCHES, BATCH, tmp, "mlp", options, None,
                                  keep_steps=True)
    sched = solve(prob, "1f1b")
    cfg = RunConfig(model="mlp", model_options=options, steps=args.steps, batch_size=BATCH)
    print(f"mlp {dict(options)}, 1F1B, {MICROBATCHES} micro-batches, 2 gloo ranks, "
          f"{args.rounds} rounds x {args.steps} steps; {load_note(2)}")
    for _ in range(args.pairs):
        for pin in (False, True):
            samples: list[tuple[tuple[str, int], ...]] = []
            stop = threading.Event()
            sampler = threading.Thread(target=_sample, args=(stop, samples), daemon=True)
            sampler.start()
            try:
                reports = spawn(_step_rank, 2, ([(sched, cfg)], args.rounds, 4, 0),
                                timeout=600, backend="gloo", pin=pin)
            finally:
                stop.set()
                sampler.join()
            both = [row for row in samples if row[0][0] == "R" and row[1][0] == "R"]
            same = sum(row[0][1] == row[1][1] for row in both) / max(1, len(both))
            got = step_trace_costs(sched, [r["runs"][0] for r in reports])
            ops = ", ".join(f"{k} {trimmed_mean(v) * 1e3:.2f}"
                            for k, v in sorted(got["ops"].items()))
            print(f"  {'bound  ' if pin else 'unbound'}: both runnable in {len(both)} of "
                  f"{len(samples)} samples, on the same CPU in {same:.0%} of those; step "
                  f"{statistics.median(got['steps']) * 1e3:.1f} ms; ops (ms) {ops}; "
                  f"{load_note()}")


if __name__ == "__main__":
    main()
