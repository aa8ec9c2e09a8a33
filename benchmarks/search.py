"""Search quality at scale (issue 12): greedy, cpsat and auto against the lower bound, before
(a base checkout, run in a subprocess) and after (this checkout), measured in one run.

Run: python benchmarks/search.py [--time-limit 30] [--workers 2] [--large | --small]
                                 [--relax-limit 60] [--relax-window K] [--bounds-only]
                                 [--base /tmp/base-lns] [--json out.json]
     python benchmarks/search.py --families [--quick] [--latency-only] [--time-limit 60]
                                 [--workers 2]
     python benchmarks/search.py --done-when [--workers 2]
     python benchmarks/search.py --analogues [--time-limit 20] [--cpsat-limit 240] [--workers 2]

Instances (T_F = 1 s, T_B = 1.2 s, T_W = 0.8 s per device and micro-batch, activation memory 1
per micro-batch and device, half of it held from B until W; memory limit = 1F1B's peak, p
activations, on every device):

* ``xdc p=8 m=16``, ``xdc p=16 m=64`` (and ``xdc p=32 m=128`` with ``--large``): a chain of two
  datacenters, latency 8 x T_F on the link between devices p/2-1 and p/2, none elsewhere;
* ``vshape p=8 m=16``: two chunks per device in the V placement, no link delay;
* with ``--small`` instead: ``xdc p=4 m=12`` and ``xdc p=8 m=24``, where memory paces stage 0
  and CP-SAT proves the optimum (how tight the analytic bound is), and ``xdc p=4 m=16 lat1.7``
  (latency 1.7 x T_F): memory paces stage 0 just above its device work, as at p = 16, m = 64.

For each method it prints the objective (iteration time, seconds), its ratio to the best lower
bound known in this run (the analytic bound or a search's proven bound, before or after), the
solve time, and with ``--base`` the same for the base checkout and the after / before ratio of
the objectives (< 1: the change made it faster). Per instance it prints each checkout's
analytic bound (``bound`` after, ``bound0`` before: a stronger bound raises it) and its
wall time (``bound_s``), and the relaxation bound of ``pipeopt.solvers.relaxation`` (CP-SAT on
one stage's device with the waits the later stages force; ``--relax-limit`` seconds, 0 to skip;
whether CP-SAT proved the relaxation's optimum; ``--relax-window K``: the model over the last K
micro-batches only, with their F starts from the analytic memory recursion, which CP-SAT
proves above the analytic bound at p = 16, m = 64). ``--bounds-only``: the bounds, no
search.

``--families`` instead checks the issue's done-when bullets against the published schedule of
each family (no base checkout): the V-shape (two chunks per device) at the peak memory of ZB-V
(1F1B's), V-Half and V-Min; ZB-1p / ZB-2p at their own peak memory with the Zero Bubble paper's
profiled 1.5B costs (T_F, T_B, T_W, T_comm = 18.522, 18.086, 9.337, 0.601 ms; Qi et al., ICLR
2024), compared on the largest device span as that paper does; cross-datacenter chains (one
chunk against ``crosspipe``, two chunks in a V against ``crosspipe-v``) with latency 2 or 8 x
T_F or transmission 2 x T_F on the middle link at 1F1B's memory. p = 8 and 16 (``--quick``:
p = 8 only), m = 4p. Per instance: the published schedule, ``greedy`` and ``auto`` (time limit),
``auto`` / published (< 1: faster), greedy / auto, the best proven lower bound (analytic, or
proven by the greedy or ``auto``, whose bound includes its relaxation bound where it ran) and
published and auto over it; then PASS / MISS per bullet: auto never slower than the published
schedule, the geomean of published / auto >= 1.05 where links have latency (raw, with beside it
the most any schedule can reach: the geomean of published / proven bound, since no schedule is
faster than a proven bound; then judged
against what is possible: an instance with published / bound < 1.05 is capped, no schedule is
5 % faster there, and the aim is auto at the bound, as ``benchmarks/schedules.py`` does for
its 1.25 x; the geomean over the uncapped ones is printed beside), greedy within 5 % of auto,
greedy at p = 64, m = 1024 (xdc) in < 1 s (the median of three calls, the load average
beside it), and ``auto`` proving the optimum of ``xdc p=8 m=16`` in <= 5 s. A published
schedule that does not apply to an instance (e.g. every variant of ``crosspipe-v`` deadlocking
under its memory) skips its row. ``--latency-only``: only the instances whose links have
latency (the ZB and cross-datacenter families).

``--done-when`` runs ``auto`` alone on the issue's cross-datacenter rows at their own time
limits, ``xdc p=16 m=64`` (60 s, target: within 3 % of the proven lower bound) and ``xdc p=32
m=128`` (120 s, within 5 %), and prints PASS / MISS per row.

``--analogues`` asks who owes the gap on the V rows with latency (``crosspipe-v`` lat2 / lat8,
where the published schedule is far from the bound): small analogues built the same way
(``xdc_link``, two chunks in a V, the same latency in T_F units, 1F1B's memory) at p = 4 with
m = 8 and 16, where CP-SAT, given ``--cpsat-limit`` seconds after ``auto``, proves the optimum
or comes close. Per instance: the analytic bound, the best proven
bound (CP-SAT's), the best schedule known (``auto``'s or CP-SAT's), the published schedule and
``auto`` (``--time-limit``); ``auto`` / best > 1 is what the search leaves in that time, best /
proven bound > 1 what the bound (or the search, until CP-SAT proves the optimum) leaves.
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
from pipeopt.schedules import NotApplicable  # noqa: E402
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


#: The Zero Bubble paper's profiled costs of its 1.5B model, (T_F, T_B, T_W, T_comm) in ms (Qi et
#: al., ICLR 2024, experiments; also tests/test_published_schedules.py).
PROFILED_1_5B = (18.522, 18.086, 9.337, 0.601)
#: The issue's done-when targets: geomean speedup over the published schedule where links have
#: latency, and the greedy's largest excess over the search.
GEOMEAN_TARGET = 1.05
GREEDY_SLACK = 0.05


def zb_chain(p: int, m: int) -> Problem:
    """One stage per device at the Zero Bubble paper's profiled costs (ms), T_comm as latency."""
    f, b, w, c = PROFILED_1_5B
    lat, bw = chain_links(p, [c] * (p - 1), [math.inf] * (p - 1))
    return uniform_problem(p, m, f, b, w, weight_grad=0.5).replace(latency=lat, bandwidth=bw)


def xdc_link(p: int, m: int, chunks: int, latency_x: float, transmission_x: float) -> Problem:
    """Two datacenters; the middle link has latency / transmission (x T_F); 1F1B's memory."""
    lat = [0.0] * (p - 1)
    bw = [math.inf] * (p - 1)
    lat[p // 2 - 1] = latency_x * TIMES[0]
    if transmission_x > 0:
        bw[p // 2 - 1] = 1.0 / (transmission_x * TIMES[0])  # messages of 1 byte
    links, bws = chain_links(p, lat, bw)
    prob = uniform_problem(p, m, *TIMES, weight_grad=0.5, virtual_stages=chunks,
                           placement="vshape" if chunks == 2 else "loop", memory_limit=float(p))
    return prob.replace(latency=links, bandwidth=bws, message_size=(1.0,) * (prob.stages - 1))


def families(quick: bool) -> list[tuple[str, str, Problem, str, bool]]:
    """(family, instance, problem, published method, links have latency) per instance; the
    memory limit of the V and ZB families is the published schedule's own peak (set later)."""
    out = []
    for p in ((8,) if quick else (8, 16)):
        m = 4 * p
        for name in ("zb-v", "v-half", "v-min"):
            prob = uniform_problem(p, m, *TIMES, weight_grad=0.5, virtual_stages=2,
                                   placement="vshape")
            out.append(("vshape", f"{name} p={p} m={m}", prob, name, False))
        for name in ("zb-1p", "zb-2p"):
            out.append(("zb", f"{name} p={p} m={m}", zb_chain(p, m), name, True))
        for chunks, method in ((1, "crosspipe"), (2, "crosspipe-v")):
            for tag, lat, tx in (("lat2", 2.0, 0.0), ("lat8", 8.0, 0.0), ("bw2", 0.0, 2.0)):
                out.append(("xdc", f"{method} p={p} m={m} {tag}",
                            xdc_link(p, m, chunks, lat, tx), method, True))
    return out


#: Calls of the greedy at p = 64, m = 1024 whose median wall time is judged: one call on a
#: shared machine is as much the other jobs' figure as the code's.
BIG_REPEATS = 3


def _load() -> str:
    """The 1-minute load average, or '?' where the OS does not tell."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "?"


def _geomean(xs: list[float]) -> float:
    return math.exp(math.fsum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def proven_bound(prob: Problem, objective: str, scheds: tuple[Any, ...]) -> float:
    """The best proven lower bound on ``objective`` (seconds): the analytic one and what the
    searches proved (auto's includes its relaxation and kept-devices bounds where they ran).
    A solver's ``lower_bound`` is proven whatever its status, which only says how the schedule
    was found: auto keeps its chosen candidate's, ``heuristic`` when the greedy's schedule won,
    and its bound is still the best it proved."""
    got = [s.solver.lower_bound for s in scheds if s.solver.lower_bound is not None
           and s.solver.objective == objective]
    return max([lower_bound(prob, objective), *got])


def capped_line(rows: list[tuple[Any, ...]]) -> tuple[bool, str]:
    """The geomean bullet judged against what is possible: (met, one line) for rows (family,
    latency, published, greedy, auto, bound). An instance whose published / proven lower
    bound is below the target is capped (no schedule at all is 5 % faster): there the aim
    is auto at the bound, as ``benchmarks/schedules.py`` does for its 1.25 x. Met when every
    instance is at >= the target or capped and at its bound; the geomean over the uncapped
    instances and the raw one are printed beside."""
    if not rows:
        return True, "no instance where links have latency"
    raw = _geomean([r[2] / r[4] for r in rows])
    capped = [r for r in rows if r[2] / r[5] < GEOMEAN_TARGET]
    free = [r for r in rows if r[2] / r[5] >= GEOMEAN_TARGET]
    ok = sum(r[2] / r[4] >= GEOMEAN_TARGET for r in free)
    at_bound = sum(r[4] <= r[5] * (1 + 1e-6) for r in capped)
    line = (f"published / auto >= {GEOMEAN_TARGET} where links have latency on {ok}/"
            f"{len(free)} uncapped instances (their geomean "
            f"{_geomean([r[2] / r[4] for r in free]):.4f}; raw geomean over all {len(rows)}: "
            f"{raw:.4f})")
    if capped:
        room = [r[2] / r[5] for r in capped]
        gap = [r[4] / r[5] for r in capped]
        line += (f"; {len(capped)} capped (published / proven lower bound {min(room):.4f}-"
                 f"{max(room):.4f}: no schedule is {GEOMEAN_TARGET - 1:.0%} faster), auto at the "
                 f"bound on {at_bound}/{len(capped)}, auto / bound {min(gap):.4f}-"
                 f"{max(gap):.4f}")
    return ok == len(free) and at_bound == len(capped), line


def check_families(quick: bool, time_limit: float, workers: int,
                   latency_only: bool = False) -> None:
    """Print each family instance and the done-when bullets (see the module docstring)."""
    print(f"time limit {time_limit:g} s, {workers} workers; value = iteration time (span for "
          "zb); a/pub = auto / published, g/a = greedy / auto")
    print(f"{'instance':<28} {'published':>10} {'greedy':>10} {'auto':>10} {'a/pub':>7} "
          f"{'g/a':>7} {'greedy s':>8} {'auto s':>7} {'bound':>9} {'pub/bd':>7} "
          f"{'a/bd':>7}  auto's method")
    rows = []
    for family, name, prob, pub, latency in families(quick):
        if latency_only and not latency:
            continue
        objective = "span" if family == "zb" else "makespan"
        value = (lambda s: s.max_span) if objective == "span" else (
            lambda s: s.iteration_time)
        try:
            ref = solve(prob, pub)
        except NotApplicable as exc:  # e.g. every crosspipe-v variant deadlocks
            print(f"{name:<28} {'-':>10}  skipped: {exc}", flush=True)
            continue
        if family != "xdc":  # the published schedule's own memory is the limit
            prob = prob.replace(memory_limit=(max(ref.peak_memory),) * prob.devices)
            ref = solve(prob, pub)
        t = time.perf_counter()
        g = solve(prob, "greedy", time_limit=time_limit, workers=workers, objective=objective)
        g_s = time.perf_counter() - t
        t = time.perf_counter()
        a = solve(prob, "auto", time_limit=time_limit, workers=workers, objective=objective,
                  time_tolerance=0.0)
        a_s = time.perf_counter() - t
        r = (value(ref), value(g), value(a))
        bound = proven_bound(prob, objective, (g, a))
        rows.append((family, latency, *r, bound))
        print(f"{name:<28} {r[0]:>10.5g} {r[1]:>10.5g} {r[2]:>10.5g} {r[2] / r[0]:>7.4f} "
              f"{r[1] / r[2]:>7.4f} {g_s:>7.1f}s {a_s:>6.1f}s {bound:>9.5g} "
              f"{r[0] / bound:>7.4f} {r[2] / bound:>7.4f}  {a.method}", flush=True)
    slower = [r for r in rows if r[4] > r[2] * (1 + 1e-9)]
    speed = [r[2] / r[4] for r in rows if r[1]]
    worst_g = max(r[3] / r[4] for r in rows)
    big = []  # (wall s, CPU s) of each call, on a fresh problem (its cached columns unbuilt)
    for _ in range(BIG_REPEATS):
        prob = xdc(64, 1024)
        t, cpu = time.perf_counter(), time.process_time()
        solve(prob, "greedy", time_limit=time_limit, workers=workers)
        big.append((time.perf_counter() - t, time.process_time() - cpu))
    big_s, big_cpu = sorted(big)[len(big) // 2]  # the median call by wall time
    t = time.perf_counter()
    small = solve(xdc(8, 16), "auto", time_limit=time_limit, workers=workers)
    small_s = time.perf_counter() - t

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    print(f"{verdict(not slower)} auto no slower than the published schedule: slower on "
          f"{len(slower)} of {len(rows)}")
    ceiling = _geomean([r[2] / r[5] for r in rows if r[1]])
    out_of_reach = ": the target is out of reach here" if ceiling < GEOMEAN_TARGET else ""
    print(f"{verdict(_geomean(speed) >= GEOMEAN_TARGET)} geomean published / auto where links "
          f"have latency: {_geomean(speed):.4f} over {len(speed)} (target {GEOMEAN_TARGET}; no "
          f"schedule can give more than published / proven lower bound, geomean "
          f"{ceiling:.4f}{out_of_reach})")
    ok, line = capped_line([r for r in rows if r[1]])
    print(f"{verdict(ok)} {line}")
    print(f"{verdict(worst_g <= 1 + GREEDY_SLACK)} greedy within {GREEDY_SLACK:.0%} of auto: "
          f"worst greedy / auto {worst_g:.4f}")
    print(f"{verdict(big_s < 1.0)} greedy at p=64 m=1024 (xdc): {big_s:.2f} s wall, "
          f"{big_cpu:.2f} s CPU, the median of {len(big)} calls (wall "
          f"{', '.join(f'{w:.2f}' for w, _ in big)} s; load {_load()}; target < 1 s; the call "
          "includes the validator)")
    print(f"{verdict(small.solver.status == 'optimal' and small_s <= 5.0)} auto on xdc p=8 "
          f"m=16: {small.solver.status} in {small_s:.1f} s (target optimal in <= 5 s)")


#: The issue's cross-datacenter done-when rows: (p, m, auto's time limit in seconds, largest
#: gap to the proven lower bound).
DONE_WHEN_XDC = ((16, 64, 60.0, 0.03), (32, 128, 120.0, 0.05))


def check_done_when(workers: int) -> None:
    """``auto`` on the issue's two cross-datacenter rows at their own time limits: its
    iteration time, the best proven lower bound (the analytic one or auto's), the gap and
    PASS / MISS against the row's target."""
    print(f"{workers} workers; gap = auto / proven lower bound - 1")
    print(f"{'instance':<16} {'limit':>6} {'auto':>8} {'bound':>8} {'gap':>7} {'target':>7} "
          f"{'wall s':>7}  auto's method")
    verdicts = []
    for p, m, limit, target in DONE_WHEN_XDC:
        prob = xdc(p, m)
        t = time.perf_counter()
        a = solve(prob, "auto", time_limit=limit, workers=workers)
        wall = time.perf_counter() - t
        bound = max(lower_bound(prob, "makespan"), a.solver.lower_bound or 0.0)
        gap = a.iteration_time / bound - 1
        name = f"xdc p={p} m={m}"
        verdicts.append((gap <= target, name, limit, gap, target))
        print(f"{name:<16} {limit:>5g}s {a.iteration_time:>8.5g} {bound:>8.5g} {gap:>7.2%} "
              f"{target:>7.0%} {wall:>6.1f}s  {a.method}", flush=True)
    for ok, name, limit, gap, target in verdicts:
        print(f"{'PASS' if ok else 'MISS'} {name} within {target:.0%} of the proven lower bound "
              f"in {limit:g} s: {gap:.2%}")


#: Small analogues of the V rows with latency: (p, m, latency x T_F on the middle link).
ANALOGUES = ((4, 8, 2.0), (4, 8, 8.0), (4, 16, 2.0), (4, 16, 8.0))


def check_analogues(time_limit: float, cpsat_limit: float, workers: int) -> None:
    """The V-with-latency analogues (see the module docstring): bound, CP-SAT's proven bound,
    best known, published and auto, and the ratios that say whether the search or the bound
    leaves the gap."""
    print(f"auto {time_limit:g} s, then CP-SAT {cpsat_limit:g} s; "
          f"{workers} workers; load {_load()}; values: iteration time (s)")
    print(f"{'instance':<26} {'bound':>7} {'proven':>7} {'best':>7} {'status':>8} "
          f"{'published':>9} {'auto':>7} {'auto/best':>9} {'best/prv':>8} {'pub/best':>8}")
    for p, m, lat in ANALOGUES:
        prob = xdc_link(p, m, 2, lat, 0.0)
        name = f"crosspipe-v p={p} m={m} lat{lat:g}"
        bound = lower_bound(prob, "makespan")
        try:
            pub = solve(prob, "crosspipe-v").iteration_time
        except NotApplicable:
            pub = math.nan
        a = solve(prob, "auto", time_limit=time_limit, workers=workers, time_tolerance=0.0)
        # From CP-SAT's own warm start (the best hand-made or greedy schedule), not auto's:
        # started from auto's 72.7 s, p = 4, m = 8, lat8 was not proven in 240 s (load 11);
        # from its own start it proved 72.5 s optimal in 13 s.
        c = solve(prob, "cpsat", time_limit=cpsat_limit, workers=workers)
        best = min(a.iteration_time, c.iteration_time)
        proven = max([bound] + [s.solver.lower_bound for s in (a, c)
                                if s.solver.lower_bound is not None])
        status = "optimal" if proven >= best * (1 - 1e-9) else "open"
        print(f"{name:<26} {bound:>7.4g} {proven:>7.4g} {best:>7.4g} {status:>8} {pub:>9.4g} "
              f"{a.iteration_time:>7.4g} {a.iteration_time / best:>9.4f} "
              f"{best / proven:>8.4f} {pub / best:>8.4f}", flush=True)


def instances(large: bool, small: bool = False) -> dict[str, Problem]:
    if small:  # memory paces these, and CP-SAT proves their optimum: how tight the bound is
        # The third is p = 16, m = 64's regime in small: stage 0's least hold with its W,
        # 4 F + 4 B + 2 x 1.7 s = 9.6 + 3.4 = 13 s, over its 4 activations is 3.25 s per
        # micro-batch against 3 s of device work (p = 16: 52 s / 16), four rounds of them.
        return {"xdc p=4 m=12": xdc(4, 12), "xdc p=8 m=24": xdc(8, 24),
                "xdc p=4 m=16 lat1.7": xdc(4, 16, 1.7)}
    out = {"xdc p=8 m=16": xdc(8, 16), "xdc p=16 m=64": xdc(16, 64),
           "vshape p=8 m=16": vshape(8, 16)}
    if large:
        out["xdc p=32 m=128"] = xdc(32, 128)
    return out


def relaxed(prob: Problem, time_limit: float, workers: int, window: int = 0
            ) -> dict[str, Any] | None:
    """The relaxation bound (``pipeopt.solvers.relaxation``; None in a checkout without it, or
    without windows when ``window`` > 0, or where it does not apply): value, whether CP-SAT
    proved the relaxation's optimum, seconds. ``window`` > 0: only the last ``window``
    micro-batches (at most m) in the model."""
    try:
        from pipeopt.solvers.relaxation import relaxation_bound
    except ImportError:
        return None
    extra = {"window": min(window, prob.microbatches)} if window > 0 else {}
    try:
        got = relaxation_bound(prob, time_limit=time_limit, workers=workers, **extra)
    except TypeError:  # a checkout from before windows
        return None
    if got is None:
        return None
    return {"value": got.value, "optimal": got.optimal, "wall_s": got.wall_s}


def measure(large: bool, time_limit: float, workers: int, small: bool = False,
            relax_limit: float = 60.0, methods: tuple[str, ...] = METHODS,
            relax_window: int = 0) -> dict[str, Any]:
    """Per instance: the analytic bound, the relaxation bound and, per method, objective,
    proven bound, seconds."""
    res: dict[str, Any] = {}
    for name, prob in instances(large, small).items():
        t = time.perf_counter()
        row: dict[str, Any] = {"ops": prob.num_ops, "bound": lower_bound(prob, "makespan"),
                               "bound_s": time.perf_counter() - t}
        row["relax"] = (relaxed(prob, relax_limit, workers, relax_window) if relax_limit > 0
                        else None)
        for method in methods:
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
    ap.add_argument("--families", action="store_true",
                    help="instead: the done-when checks against each family's published "
                         "schedule")
    ap.add_argument("--quick", action="store_true", help="with --families: p = 8 only")
    ap.add_argument("--latency-only", action="store_true",
                    help="with --families: only the instances whose links have latency")
    ap.add_argument("--done-when", action="store_true",
                    help="instead: auto on xdc p=16 m=64 (60 s) and p=32 m=128 (120 s) "
                         "against the issue's 3 %% / 5 %% gaps")
    ap.add_argument("--analogues", action="store_true",
                    help="instead: small analogues of the V rows with latency, auto against "
                         "CP-SAT's optimum and the bound")
    ap.add_argument("--cpsat-limit", type=float, default=240.0,
                    help="with --analogues: CP-SAT's seconds per instance after auto")
    ap.add_argument("--relax-limit", type=float, default=60.0,
                    help="seconds for the relaxation bound per instance (0: skip it)")
    ap.add_argument("--relax-window", type=int, default=0,
                    help="the relaxation over the last K micro-batches only (0: all; "
                         "the base checkout always runs the full model)")
    ap.add_argument("--bounds-only", action="store_true",
                    help="only the analytic and relaxation bounds, no search")
    ap.add_argument("--base", type=Path, help="a base checkout to measure first")
    ap.add_argument("--json", type=Path, help="write the figures here (a new file)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # JSON to stdout
    args = ap.parse_args()
    if args.families:
        check_families(args.quick, args.time_limit, args.workers, args.latency_only)
        return
    if args.done_when:
        check_done_when(args.workers)
        return
    if args.analogues:
        check_analogues(args.time_limit, args.cpsat_limit, args.workers)
        return
    if args.json is not None and args.json.exists():
        sys.exit(f"--json: {args.json} exists; not overwriting it")
    base: dict[str, Any] | None = None
    if args.base is not None:
        if not (args.base / "pipeopt").is_dir():
            sys.exit(f"--base: {args.base} is not a pipeopt checkout (no pipeopt/ in it)")
        cmd = [sys.executable, __file__, "--time-limit", str(args.time_limit), "--workers",
               str(args.workers), "--relax-limit", str(args.relax_limit), "--child"] + (
                   ["--large"] if args.large else []) + (["--small"] if args.small else []) + (
                   ["--bounds-only"] if args.bounds_only else [])
        env = {**os.environ, "PIPEOPT_BENCH_ROOT": str(args.base.resolve()),
               "PYTHONPATH": str(args.base.resolve())}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        sys.stderr.write(out.stderr)
        base = json.loads(out.stdout)
    methods = () if args.bounds_only else METHODS
    if args.relax_window < 0:
        sys.exit(f"--relax-window: must be >= 0, got {args.relax_window}")
    after = measure(args.large, args.time_limit, args.workers, args.small, args.relax_limit,
                    methods, args.relax_window)
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
        rel = row.get("relax")
        if rel is not None:
            extra += (f"; relaxation {rel['value']:.5g} ("
                      f"{'its optimum' if rel['optimal'] else 'not proven further'}, "
                      f"{rel['wall_s']:.1f} s)")
        print(f"{name:<18} analytic bound {row['bound']:.5g} ({row['bound_s']:.3f} s){extra}")
        runs = [row] + ([base[name]] if base is not None else [])
        bound = max([r["bound"] for r in runs]
                    + [r["relax"]["value"] for r in runs if r.get("relax") is not None]
                    + [r[m]["bound"] for r in runs for m in methods
                       if r[m]["bound"] is not None and r[m]["status"] in ("optimal",
                                                                          "feasible")])
        for m in methods:
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
