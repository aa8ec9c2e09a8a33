"""Simulator and greedy throughput: ops timed per second on large instances.

Run: python benchmarks/simulate.py [--devices 64] [--microbatches 1024] [--repeat 3] [--cpu]
                                   [--base DIR [--rounds 2]]

Prints ops/s for 1F1B and ZB-H1 orders (fast path: latency-only links; the same problem object
every call), the same with the
order checks ``simulate`` runs by default, the same with the problem's task graph built once
outside the timed calls (``graph=training.chain_graph(problem)``, what the solvers hand
``simulate`` when they time several orders of one problem; NaN on a checkout without it),
the same on a fresh copy of the problem each call (nothing kept from an earlier call: the
graph is built, the problem's cached tables computed), the event-driven path (links that serialize
messages), and the greedy (``solve(problem, "greedy")``, ops / wall second) on the ``large``
instance of ``benchmarks/schedules.py`` (memory at 1F1B's peak). The baseline, measured in the
same run, is the cost of merely walking the same ops once in Python (a loop that reads each
op's duration): each "ratio to baseline" says how close a row is to a bare loop on this
machine (the issue's target is 1e6 ops/s absolute).

``--base DIR``: the same measurements with another checkout's code (``PYTHONPATH=DIR``, e.g. a
``git worktree`` of the previous commit) and with this one's, each in its own process, the two
alternated for ``--rounds`` rounds (best of each row kept), then the ratio this / base per row
(above 1: this checkout is faster; the bare loop's ratio shows how much the machine drifted).
``--cpu`` times every row with the process's CPU clock instead of the wall clock.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeopt.problem import chain_links, uniform_problem
from pipeopt.schedules import GENERATORS
from pipeopt.simulate import simulate

#: Per-device T_F, T_B, T_W (s): the ratio of benchmarks/schedules.py (T_B + T_W = 2 T_F).
TIMES = (1.0, 1.2, 0.8)
#: Link latency (s) on the fast path, and the serialized case's bandwidth (bytes/s) and message
#: size (bytes): 0.1 s per message, so messages queue on the links.
LATENCY, BANDWIDTH, MESSAGE = 0.05, 1e9, 1e8

ROWS = {
    "baseline": "baseline: one Python pass over the ops",
    "1f1b": "simulate 1f1b (fast path)",
    "1f1b checked": "simulate 1f1b (fast path, order checks)",
    "1f1b given": "simulate 1f1b (fast path, graph built once)",
    "1f1b cold": "simulate 1f1b (fast path, a fresh problem)",
    "zb-h1": "simulate zb-h1 (fast path)",
    "zb-h1 checked": "simulate zb-h1 (fast path, order checks)",
    "zb-h1 given": "simulate zb-h1 (fast path, graph built once)",
    "zb-h1 cold": "simulate zb-h1 (fast path, a fresh problem)",
    "serialized": "simulate zb-h1 (serialized links, events)",
    "greedy": "greedy, memory at 1F1B's peak (ops / s)",
}


def measure(p: int, m: int, repeat: int, clock: Callable[[], float] = time.perf_counter
            ) -> dict[str, float]:
    """ops/s of every row of :data:`ROWS` with the code on ``sys.path``, each the best of
    ``repeat`` runs timed by ``clock`` (seconds)."""
    from pipeopt.solvers import solve

    def _best_of(fn: Callable[[], object], repeat: int) -> float:
        best = float("inf")
        for _ in range(repeat):
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
        return best

    prob = uniform_problem(p, m, *TIMES, latency=LATENCY)
    n = prob.num_ops
    # A checkout from before simulate took a prebuilt graph has no "graph built once" rows.
    given = "graph" in inspect.signature(simulate).parameters
    out: dict[str, float] = {}

    def bare_loop() -> None:
        dur = prob.duration
        total = 0.0
        for op in prob.ops():
            total += dur(op)

    out["baseline"] = n / _best_of(bare_loop, repeat)
    for name in ("1f1b", "zb-h1"):
        pr = prob.replace(split_backward=False) if name == "1f1b" else prob
        orders = GENERATORS[name](pr)
        out[name] = pr.num_ops / _best_of(
            lambda pr=pr, orders=orders: simulate(pr, orders, check=False), repeat)
        out[name + " checked"] = pr.num_ops / _best_of(
            lambda pr=pr, orders=orders: simulate(pr, orders), repeat)
        if given:
            from pipeopt.workloads.training import chain_graph

            graph = chain_graph(pr)
            out[name + " given"] = pr.num_ops / _best_of(
                lambda pr=pr, orders=orders, g=graph: simulate(pr, orders, check=False,
                                                               graph=g), repeat)
        else:
            out[name + " given"] = math.nan
        # Each call on a problem object never simulated before (an equal copy made outside
        # the timed call): nothing the problem or a cache keeps from an earlier call helps.
        copies = [pr.replace() for _ in range(repeat)]
        out[name + " cold"] = pr.num_ops / _best_of(
            lambda orders=orders, copies=copies: simulate(copies.pop(), orders, check=False),
            repeat)
        del copies
    lat, bw = chain_links(p, [LATENCY] * (p - 1), [BANDWIDTH] * (p - 1))
    cont = prob.replace(latency=lat, bandwidth=bw, message_size=(MESSAGE,) * (p - 1))
    orders = GENERATORS["zb-h1"](cont)
    out["serialized"] = n / _best_of(lambda: simulate(cont, orders, check=False), 1)
    activation = uniform_problem(p, m, *TIMES, activation=1.0, weight_grad=0.5)
    peak = max(simulate(activation, GENERATORS["1f1b"](activation)).peak_memory)
    tight = activation.replace(memory_limit=(peak,) * p)
    out["greedy"] = n / _best_of(lambda: solve(tight, "greedy"), repeat)
    return out


def _print(results: dict[str, float], p: int, m: int) -> None:
    print(f"p={p} m={m}: {p * m * 3} ops (split backward; 1F1B fused: {p * m * 2})")
    base = results["baseline"]
    for key, label in ROWS.items():
        extra = "" if key == "baseline" else f"  ratio to baseline {results[key] / base:.2f}"
        print(f"{label:46s} {results[key]:12,.0f} ops/s{extra}")


def _side(root: str, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process with ``root``'s package first on the path."""
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--devices",
           str(args.devices), "--microbatches", str(args.microbatches), "--repeat",
           str(args.repeat)] + (["--cpu"] if args.cpu else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"benchmarks/simulate.py: the run with PYTHONPATH={root} failed:\n"
                 f"{done.stderr.strip()}")
    return json.loads(done.stdout.splitlines()[-1])


def _compare(args: argparse.Namespace) -> None:
    base_dir = Path(args.base).resolve()
    if not (base_dir / "pipeopt" / "__init__.py").is_file():
        sys.exit(f"--base: {args.base} holds no pipeopt package (expected a checkout's root)")
    here = str(Path(__file__).resolve().parents[1])
    best: dict[str, dict[str, float]] = {"base": {}, "this": {}}
    for _ in range(args.rounds):
        for side, root in (("base", str(base_dir)), ("this", here)):
            for key, val in _side(root, args).items():
                best[side][key] = max(val, best[side].get(key, 0.0))
    print(f"p={args.devices} m={args.microbatches}, best of {args.rounds} alternated rounds x "
          f"{args.repeat} repeats, {'CPU' if args.cpu else 'wall'} clock; base = {base_dir}")
    print(f"{'row':46s} {'base ops/s':>12s} {'this ops/s':>12s}  this/base")
    for key, label in ROWS.items():
        b, t = best["base"][key], best["this"][key]
        print(f"{label:46s} {b:12,.0f} {t:12,.0f}  {t / b if b else math.nan:9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", metavar="DIR", help="another checkout to measure back to back")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds with --base")
    ap.add_argument("--cpu", action="store_true",
                    help="time with this process's CPU clock (time.process_time), not the wall "
                         "clock: on a shared machine it leaves out the time other jobs hold the "
                         "cores")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one side's run
    args = ap.parse_args()
    for name in ("devices", "microbatches", "repeat", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.base:
        _compare(args)
        return
    clock = time.process_time if args.cpu else time.perf_counter
    results = measure(args.devices, args.microbatches, args.repeat, clock)
    if args.json:
        print(json.dumps(results))
    else:
        _print(results, args.devices, args.microbatches)


if __name__ == "__main__":
    main()
