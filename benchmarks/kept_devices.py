"""The kept-devices bound (issue 12 item 5): devices kept exactly, the rest as least delays
(``pipeopt.solvers.kept_devices``), against the analytic bound, on the instances where the bound
owes the gap.

Run: python benchmarks/kept_devices.py [--time-limit 60] [--workers 2] [--windows all,16]
                                  [--large] [--families] [--only NAME] [--devices 0,13,14,15]

Instances (``benchmarks/search.py``'s builders): the V rows with latency (``crosspipe-v``:
two chunks in a V, latency 2 or 8 x T_F or transmission 2 x T_F on the middle link, 1F1B's
memory) at p = 4 (m = 8, 16; the ``--analogues``, where CP-SAT's proven optima are known) and
p = 8, m = 32 (``--families --quick``' rows); the cross-datacenter chains xdc p = 16, m = 64 and
p = 32, m = 128 (``--done-when``'s rows); with ``--large`` the p = 16, m = 64 V rows; with
``--families`` the V-shape family at its published schedules' own peak memory (ZB-V, V-Half,
V-Min, p = 8, m = 32). Per instance and window (``all``: every micro-batch; K: the last K, F
starts from the analytic recursion): the analytic makespan bound and its time, the device kept
(``kept_device``: the one whose memory bound is the largest), the kept-devices bound, whether
CP-SAT settled the model, its questions and wall time. ``--only``: the instances whose name
starts with NAME; ``--devices``: keep these devices instead of ``kept_device``'s one (e.g. xdc
p = 16, m = 64 with devices 0, 13, 14 and 15, the last 40 micro-batches: 255.2 s). Bounds
only, no search: compare them with the schedules in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("PIPEOPT_BENCH_ROOT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search import families, xdc, xdc_link  # noqa: E402

from pipeopt.bounds import makespan_lower_bound  # noqa: E402
from pipeopt.problem import Problem  # noqa: E402
from pipeopt.solvers import solve  # noqa: E402
from pipeopt.solvers.kept_devices import kept_device, kept_devices_bound  # noqa: E402


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def instances(large: bool, with_families: bool) -> list[tuple[str, Problem]]:
    """(name, problem) per instance of the module docstring."""
    out = [(f"crosspipe-v p=4 m={m} lat{lat:g}", xdc_link(4, m, 2, lat, 0.0))
           for m in (8, 16) for lat in (2.0, 8.0)]
    out += [("crosspipe-v p=8 m=32 lat2", xdc_link(8, 32, 2, 2.0, 0.0)),
            ("crosspipe-v p=8 m=32 lat8", xdc_link(8, 32, 2, 8.0, 0.0)),
            ("crosspipe-v p=8 m=32 bw2", xdc_link(8, 32, 2, 0.0, 2.0))]
    if large:
        out += [("crosspipe-v p=16 m=64 lat2", xdc_link(16, 64, 2, 2.0, 0.0)),
                ("crosspipe-v p=16 m=64 lat8", xdc_link(16, 64, 2, 8.0, 0.0))]
    out += [("xdc p=16 m=64", xdc(16, 64)), ("xdc p=32 m=128", xdc(32, 128))]
    if with_families:
        for family, name, prob, pub, _ in families(quick=True):
            if family == "vshape":  # at the published schedule's own peak, as search.py
                peak = max(solve(prob, pub).peak_memory)
                out.append((name, prob.replace(memory_limit=(peak,) * prob.devices)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--windows", default="all,16",
                    help="comma-separated: 'all' or a number of last micro-batches")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--families", action="store_true")
    ap.add_argument("--only", default="", help="instances whose name starts with this")
    ap.add_argument("--devices", default="",
                    help="comma-separated devices to keep (default: kept_device's one)")
    args = ap.parse_args()
    windows = [None if w == "all" else int(w) for w in args.windows.split(",")]
    print(f"time limit {args.time_limit:g} s per model, {args.workers} workers; load {_load()}")
    print(f"{'instance':<28} {'analytic':>9} {'ms':>6} {'device':>10} {'window':>6} "
          f"{'kept':>8} {'settled':>7} {'questions':>9} {'wall s':>7} {'load':>5}")
    for name, prob in instances(args.large, args.families):
        if not name.startswith(args.only):
            continue
        t = time.perf_counter()
        analytic = makespan_lower_bound(prob)
        ms = (time.perf_counter() - t) * 1000
        devices = (tuple(int(d) for d in args.devices.split(",")) if args.devices
                   else (kept_device(prob),))
        device = ",".join(map(str, devices))
        for window in windows:
            if window is not None and window >= prob.microbatches:
                continue
            try:
                got = kept_devices_bound(prob, devices, time_limit=args.time_limit,
                                         workers=args.workers, window=window)
            except ValueError as exc:  # e.g. --devices beyond this instance's
                print(f"{name:<28} skipped: {exc}", flush=True)
                break
            if got is None:
                print(f"{name:<28} {analytic:>9.5g} {ms:>6.1f} {device:>10} "
                      f"{window or 'all':>6} {'-':>8}  (not applicable)", flush=True)
                continue
            print(f"{name:<28} {analytic:>9.5g} {ms:>6.1f} {device:>10} {window or 'all':>6} "
                  f"{got.value:>8.5g} {'yes' if got.optimal else 'no':>7} "
                  f"{got.questions:>9} {got.wall_s:>7.1f} {_load():>5}", flush=True)


if __name__ == "__main__":
    main()
