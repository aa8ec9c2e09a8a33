"""CrossPipe's greedy against ``auto`` on cross-datacenter instances (issue 12, item 1), before
(a base checkout, run in a subprocess at the same time) and after (this checkout).

Run: python benchmarks/crosspipe.py [--time-limit 10] [--workers 1] [--base /tmp/base-xpipe]
                                    [--time-tolerance 0] [--quick] [--json out.json]
                                    [--sub-blocks 1,2,4]

64 instances (``--quick``: the 16 with p = 8 and one memory): p = 4 and 8 devices, m = 2p
micro-batches, T_F = 1 s, T_B = 1.2 s, T_W = 0.8 s per device and micro-batch (split evenly over
a device's chunks), activation memory 1 per micro-batch and device, half of it held from B until
W; two datacenters joined by the link between devices p/2 - 1 and p/2, which alone has a delay:
latency 0, 0.5, 1 or 2 x T_F, or a transmission time (message bytes / bandwidth) of 0.5, 1 or
2 x T_F, or latency 1 x T_F plus transmission 1 x T_F; memory limit 1x or 2x 1F1B's peak (p
activations); one stage per device (CrossPipe's "UD" layout, its greedy: ``crosspipe``) or two
chunks in a V (its "wave" layout, ``crosspipe-v``).

For each instance it prints the iteration time (seconds) of CrossPipe's greedy for that layout
(pipeopt's re-derivation, :mod:`pipeopt.schedules.crosspipe`), of ``auto`` in the base checkout
(which does not know the greedy) and in this one, and the ratios auto / greedy (< 1: auto is
faster); then per layout the wins, ties and losses of auto against the greedy and the worst and
geometric-mean ratios.

With ``--sub-blocks 1,2,4`` it instead runs ``auto`` on each instance cut into each number of
sub-blocks (:func:`pipeopt.subblocks.split`: every op in k pieces of its stage's layers, other
work allowed between them; issue 12 item 3) in this checkout, and prints the iteration times,
each k's ratio to k = 1 (< 1: cutting helps) and per layout the wins and the geometric mean.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from pipeopt.solvers import solve  # noqa: E402

TIMES = (1.0, 1.2, 0.8)  # T_F, T_B, T_W per device and micro-batch (seconds)
#: (name, latency, transmission) on the datacenter boundary, in units of T_F.
DELAYS = (("none", 0.0, 0.0), ("lat0.5", 0.5, 0.0), ("lat1", 1.0, 0.0), ("lat2", 2.0, 0.0),
          ("bw0.5", 0.0, 0.5), ("bw1", 0.0, 1.0), ("bw2", 0.0, 2.0), ("lat1+bw1", 1.0, 1.0))
#: Relative difference under which two iteration times count as a tie (float round-off).
TIE = 1e-6


def cross_dc(p: int, chunks: int, latency_x: float, transmission_x: float,
             memory_x: float) -> Problem:
    """Two datacenters of p/2 devices; the boundary link's latency and transmission time are
    multiples of T_F; memory ``memory_x`` times 1F1B's peak (p activations)."""
    lat = [0.0] * (p - 1)
    bw = [math.inf] * (p - 1)
    lat[p // 2 - 1] = latency_x * TIMES[0]
    if transmission_x > 0:
        bw[p // 2 - 1] = 1.0 / (transmission_x * TIMES[0])  # messages of 1 byte
    links, bws = chain_links(p, lat, bw)
    placement = "vshape" if chunks == 2 else "loop"
    prob = uniform_problem(p, 2 * p, *TIMES, weight_grad=0.5, virtual_stages=chunks,
                           placement=placement, memory_limit=memory_x * p)
    return prob.replace(latency=links, bandwidth=bws,
                        message_size=(1.0,) * (prob.stages - 1))


def instances(quick: bool) -> dict[str, Problem]:
    out = {}
    for chunks in (1, 2):
        for p in ((8,) if quick else (4, 8)):
            for mem in ((1.0,) if quick else (1.0, 2.0)):
                for name, lat, tx in DELAYS:
                    key = f"v={chunks} p={p} mem={mem:g}x {name}"
                    out[key] = cross_dc(p, chunks, lat, tx, mem)
    return out


def run_auto(probs: dict[str, Problem], time_limit: float, workers: int,
             tolerance: float) -> dict[str, Any]:
    """auto's iteration time and wall time per instance."""
    out = {}
    for key, prob in probs.items():
        t0 = time.perf_counter()
        sched = solve(prob, "auto", time_limit=time_limit, workers=workers,
                      time_tolerance=tolerance)
        out[key] = {"time": sched.iteration_time, "wall_s": time.perf_counter() - t0,
                    "method": sched.method}
    return out


def run_greedy(probs: dict[str, Problem]) -> dict[str, Any]:
    """CrossPipe's greedy for the instance's layout: iteration time and wall time."""
    if importlib.util.find_spec("pipeopt.schedules.crosspipe") is None:
        raise SystemExit("this checkout has no pipeopt.schedules.crosspipe")
    out = {}
    for key, prob in probs.items():
        name = "crosspipe-v" if prob.virtual_stages == 2 else "crosspipe"
        t0 = time.perf_counter()
        sched = solve(prob, name)
        out[key] = {"time": sched.iteration_time, "wall_s": time.perf_counter() - t0}
    return out


def run_sub_blocks(probs: dict[str, Problem], ks: list[int], time_limit: float,
                   workers: int, tolerance: float) -> None:
    """auto on every instance cut into each of ``ks`` sub-blocks: iteration times, ratios to
    the first k, and per layout the wins and geometric means."""
    from pipeopt.subblocks import split

    times: dict[str, dict[int, float]] = {}
    print(f"auto {time_limit:g} s, {workers} worker(s), time_tolerance {tolerance:g}; "
          f"iteration time (s) per number of sub-blocks k, and its ratio to k = {ks[0]}")
    print(f"{'instance':28} " + " ".join(f"{f'k={k}':>8} {'s':>5}" for k in ks) + "  "
          + " ".join(f"{f'{k}/{ks[0]}':>7}" for k in ks[1:]))
    for key, prob in probs.items():
        row, cells = {}, []
        for k in ks:
            t0 = time.perf_counter()
            sched = solve(split(prob, k), "auto", time_limit=time_limit, workers=workers,
                          time_tolerance=tolerance)
            row[k] = sched.iteration_time
            cells.append(f"{row[k]:8.3f} {time.perf_counter() - t0:5.1f}")
        times[key] = row
        print(f"{key:28} " + " ".join(cells) + "  "
              + " ".join(f"{row[k] / row[ks[0]]:7.4f}" for k in ks[1:]), flush=True)
    for chunks, layout in ((1, "one chunk"), (2, "V")):
        keys = [key for key in probs if key.startswith(f"v={chunks} ")]
        for k in ks[1:]:
            ratios = [times[key][k] / times[key][ks[0]] for key in keys]
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            print(f"{layout}, k={k} / k={ks[0]}: faster on {sum(r < 1 - TIE for r in ratios)}, "
                  f"tied on {sum(abs(r - 1) <= TIE for r in ratios)}, slower on "
                  f"{sum(r > 1 + TIE for r in ratios)} of {len(ratios)}; best "
                  f"{min(ratios):.4f}, worst {max(ratios):.4f}, geomean {geo:.4f}")


def summary(rows: list[tuple[str, float, float]]) -> str:
    """Wins / ties / losses of auto against the greedy, worst and geomean ratio."""
    ratios = [a / g for _, g, a in rows]
    wins = sum(r < 1 - TIE for r in ratios)
    ties = sum(abs(r - 1) <= TIE for r in ratios)
    worst = max(ratios)
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return (f"auto faster on {wins}, tied on {ties}, slower on {len(ratios) - wins - ties} of "
            f"{len(ratios)}; worst auto / greedy {worst:.4f}, geomean {geo:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--time-tolerance", type=float, default=0.0,
                    help="auto's solver.time_tolerance (default 0: the fastest, whatever "
                         "its memory; auto's own default 0.01 trades up to 1%% for memory)")
    ap.add_argument("--base", type=Path, help="a base checkout: auto before the change")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sub-blocks", help="e.g. 1,2,4: auto on each instance cut into each "
                    "number of sub-blocks (this checkout only)")
    ap.add_argument("--auto-only", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    probs = instances(args.quick)
    if args.sub_blocks:
        ks = [int(x) for x in args.sub_blocks.split(",")]
        run_sub_blocks(probs, ks, args.time_limit, args.workers, args.time_tolerance)
        return
    if args.auto_only:
        json.dump(run_auto(probs, args.time_limit, args.workers, args.time_tolerance),
                  sys.stdout)
        return
    child = None
    if args.base is not None:  # the base checkout's auto, at the same time in a subprocess
        cmd = [sys.executable, str(Path(__file__).resolve()), "--auto-only",
               "--time-limit", str(args.time_limit), "--workers", str(args.workers),
               "--time-tolerance", str(args.time_tolerance)]
        if args.quick:
            cmd.append("--quick")
        env = {**os.environ, "PIPEOPT_BENCH_ROOT": str(args.base.resolve()),
               "PYTHONPATH": str(args.base.resolve())}
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    greedy = run_greedy(probs)
    after = run_auto(probs, args.time_limit, args.workers, args.time_tolerance)
    before: dict[str, Any] = {}
    if child is not None:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"the base run failed (exit {child.returncode})")
        before = json.loads(out)
    print(f"auto {args.time_limit:g} s, {args.workers} worker(s), time_tolerance "
          f"{args.time_tolerance:g}; iteration time (s) and auto / greedy")
    head = f"{'instance':28} {'greedy':>8} {'g s':>5}"
    if before:
        head += f" {'before':>8} {'b/g':>7}"
    head += f" {'after':>8} {'a/g':>7}  after's method"
    print(head)
    for key in probs:
        g = greedy[key]["time"]
        line = f"{key:28} {g:8.3f} {greedy[key]['wall_s']:5.2f}"
        if before:
            line += f" {before[key]['time']:8.3f} {before[key]['time'] / g:7.4f}"
        line += f" {after[key]['time']:8.3f} {after[key]['time'] / g:7.4f}  {after[key]['method']}"
        print(line)
    for chunks, layout in ((1, "one chunk (crosspipe)"), (2, "V (crosspipe-v)")):
        keys = [k for k in probs if k.startswith(f"v={chunks} ")]
        for label, res in (("before", before), ("after", after)):
            if res:
                rows = [(k, greedy[k]["time"], res[k]["time"]) for k in keys]
                print(f"{layout}, {label}: {summary(rows)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"greedy": greedy, "before": before, "after": after},
                                        indent=1))


if __name__ == "__main__":
    main()
