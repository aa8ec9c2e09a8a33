"""Search quality at scale (issue 12): greedy, cpsat and auto against the lower bound, before
(a base checkout, run in a subprocess) and after (this checkout), measured in one run.

Run: python benchmarks/search.py [--time-limit 30] [--workers 2] [--large | --small]
                                 [--base /tmp/base-lns] [--json out.json]

Instances (T_F = 1 s, T_B = 1.2 s, T_W = 0.8 s per device and micro-batch, activation memory 1
per micro-batch and device, half of it held from B until W; memory limit = 1F1B's peak, p
activations, on every device):

* ``xdc p=8 m=16``, ``xdc p=16 m=64`` (and ``xdc p=32 m=128`` with ``--large``): a chain of two
  datacenters, latency 8 x T_F on the link between devices p/2-1 and p/2, none elsewhere;
* ``vshape p=8 m=16``: two chunks per device in the V placement, no link delay;
* with ``--small`` instead: ``xdc p=4 m=12`` and ``xdc p=8 m=24``, where memory paces stage 0
  and CP-SAT proves the optimum (how tight the analytic bound is).

For each method it prints the objective (iteration time, seconds), its ratio to the best lower
bound known in this run (the analytic bound or a search's proven bound, before or after), the
solve time, and with ``--base`` the same for the base checkout and the after / before ratio of
the objectives (< 1: the change made it faster). Per instance it prints each checkout's
analytic bound (``bound`` after, ``bound0`` before: a stronger bound raises it) and its
wall time (``bound_s``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("PIPEOPT_BENCH_ROOT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(ROOT))

from pipeopt.problem import Problem, chain_links, uniform_problem  # noqa: E402
from pipeopt.solvers import lower_bound, solve  # noqa: E402

TIMES = (1.0, 1.2, 0.8)  # T_F, T_B, T_W per device and micro-batch (seconds)
METHODS = ("greedy", "cpsat", "auto")


def xdc(p: int, m: int, latency_x: float = 8.0) -> Problem:
    """Two datacenters: latency ``latency_x`` x T_F on the middle link; 1F1B's memory."""
    lat = [0.0] * (p - 1)
    lat[p // 2 - 1] = latency_x * TIMES[0]
    links, bw = chain_links(p, lat, [math.inf] * (p - 1))
    prob = uniform_problem(p, m, *TIMES, weight_grad=0.5, memory_limit=float(p))
    return prob.replace(latency=links, bandwidth=bw)


def vshape(p: int, m: int) -> Problem:
    """Two chunks per device in the V placement at 1F1B's memory (p activations)."""
    return uniform_problem(p, m, *TIMES, weight_grad=0.5, virtual_stages=2,
                           placement="vshape", memory_limit=float(p))


def instances(large: bool, small: bool = False) -> dict[str, Problem]:
    if small:  # memory paces these, and CP-SAT proves their optimum: how tight the bound is
        return {"xdc p=4 m=12": xdc(4, 12), "xdc p=8 m=24": xdc(8, 24)}
    out = {"xdc p=8 m=16": xdc(8, 16), "xdc p=16 m=64": xdc(16, 64),
           "vshape p=8 m=16": vshape(8, 16)}
    if large:
        out["xdc p=32 m=128"] = xdc(32, 128)
    return out


def measure(large: bool, time_limit: float, workers: int, small: bool = False
            ) -> dict[str, Any]:
    """Per instance: the analytic bound and, per method, objective, proven bound, seconds."""
    res: dict[str, Any] = {}
    for name, prob in instances(large, small).items():
        t = time.perf_counter()
        row: dict[str, Any] = {"ops": prob.num_ops, "bound": lower_bound(prob, "makespan"),
                               "bound_s": time.perf_counter() - t}
        for method in METHODS:
            t = time.perf_counter()
            s = solve(prob, method, time_limit=time_limit, workers=workers)
            row[method] = {"value": s.iteration_time, "wall_s": time.perf_counter() - t,
                           "bound": s.solver.lower_bound, "status": s.solver.status}
            print(f"  [{ROOT.name}] {name}: {method} {s.iteration_time:.6g} s in "
                  f"{row[method]['wall_s']:.1f} s", file=sys.stderr, flush=True)
        res[name] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--large", action="store_true", help="add p=32, m=128")
    ap.add_argument("--small", action="store_true",
                    help="instead: xdc p=4 m=12 and p=8 m=24, where CP-SAT proves the optimum")
    ap.add_argument("--base", type=Path, help="a base checkout to measure first")
    ap.add_argument("--json", type=Path, help="write the figures here (a new file)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # JSON to stdout
    args = ap.parse_args()
    if args.json is not None and args.json.exists():
        sys.exit(f"--json: {args.json} exists; not overwriting it")
    base: dict[str, Any] | None = None
    if args.base is not None:
        if not (args.base / "pipeopt").is_dir():
            sys.exit(f"--base: {args.base} is not a pipeopt checkout (no pipeopt/ in it)")
        cmd = [sys.executable, __file__, "--time-limit", str(args.time_limit), "--workers",
               str(args.workers), "--child"] + (["--large"] if args.large else []) + (
                   ["--small"] if args.small else [])
        env = {**os.environ, "PIPEOPT_BENCH_ROOT": str(args.base.resolve()),
               "PYTHONPATH": str(args.base.resolve())}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        sys.stderr.write(out.stderr)
        base = json.loads(out.stdout)
    after = measure(args.large, args.time_limit, args.workers, args.small)
    if args.child:
        sys.stdout.write(json.dumps(after))
        return
    if args.json is not None:
        args.json.write_text(json.dumps({"after": after, "before": base}))
    print(f"time limit {args.time_limit:g} s, {args.workers} workers; ratio = iteration time / "
          "best lower bound of the run")
    head = f"{'instance':<18} {'ops':>5} {'bound':>7} {'method':<7} {'after':>8} {'ratio':>6} " \
           f"{'time':>6}"
    if base is not None:
        head += f" {'before':>8} {'ratio':>6} {'time':>6} {'after/before':>12}"
    print(head)
    for name, row in after.items():
        extra = f" bound0 {base[name]['bound']:.5g}" if base is not None else ""
        print(f"{name:<18} analytic bound {row['bound']:.5g} ({row['bound_s']:.3f} s){extra}")
        runs = [row] + ([base[name]] if base is not None else [])
        bound = max([r["bound"] for r in runs]
                    + [r[m]["bound"] for r in runs for m in METHODS
                       if r[m]["bound"] is not None and r[m]["status"] in ("optimal",
                                                                          "feasible")])
        for m in METHODS:
            a = row[m]
            line = (f"{name:<18} {row['ops']:>5} {bound:>7.5g} {m:<7} {a['value']:>8.5g} "
                    f"{a['value'] / bound:>6.3f} {a['wall_s']:>5.1f}s")
            if base is not None:
                b = base[name][m]
                line += (f" {b['value']:>8.5g} {b['value'] / bound:>6.3f} {b['wall_s']:>5.1f}s "
                         f"{a['value'] / b['value']:>12.4f}")
            print(line)


if __name__ == "__main__":
    main()
