"""Time limits at the documented sizes: wall time of `pipeopt solve` against its time limit.

Run: python benchmarks/limits.py [--quick] [--limits 10,30] [--method auto]

Solves p = 1024, m = 300 (921,600 ops) and p = 64, m = 4096 (786,432 ops) with 10 s and 30 s
limits (``--quick``: p = 1024, m = 300 at 10 s only), each in a fresh process as a user runs it
(`pipeopt solve config.yaml -o out.json --time-limit L -v`), and prints the wall time, its
ratio to the limit, whether it is within the aim of 1.1 x limit + 5 s, and where the time went
(from the `-v` log: loading, search with validation, writing), and the CPU time the process
used (user + system: on a machine shared with other jobs the wall time also counts their use
of the cores, the CPU time does not). Instances: every stage 10 / 12
/ 8 ms (F / B / W), 1 ms between neighbouring devices, each device's memory limited to 1F1B's
peak (p micro-batches' activations). Wall times depend on the machine's other load: the load
average is printed first.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((1024, 300), (64, 4096))


def config_text(p: int, m: int, method: str) -> str:
    """The explicit-form config of one benchmark instance."""
    lat = ", ".join(["0.001"] * (p - 1))
    return (f"pipeline: {{devices: {p}, microbatches: {m}}}\n"
            "stages: {forward: 0.010, backward_input: 0.012, backward_weight: 0.008, "
            "activation_memory: 1.0}\n"
            f"links: {{latency: [{lat}]}}\n"
            f"memory: {{limit: {p}.0}}\n"
            f"solver: {{method: {method}}}\n")


def _seconds(pattern: str, log: str) -> float | None:
    found = re.search(pattern, log)
    return float(found.group(1)) if found else None


def run(p: int, m: int, limit: float, method: str, folder: Path) -> dict[str, object]:
    """One `pipeopt solve` in a fresh process: wall time and the phases of its -v log."""
    cfg, out = folder / f"p{p}m{m}.yaml", folder / "out.json"
    cfg.write_text(config_text(p, m, method), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeopt", "solve", str(cfg), "-o", str(out),
                           "--time-limit", f"{limit:g}", "-q", "-v", "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"p={p} m={m}: pipeopt solve failed: {proc.stderr.strip()[-500:]}")
    log = proc.stderr
    chosen = re.search(r'"method": "([^"]+)"', proc.stdout)
    return {
        "wall": wall,
        "cpu": cpu,
        "load": _seconds(r"solve: loaded in ([0-9.]+) s", log),
        "given": _seconds(r"([0-9.]+) s of the [0-9.e+]+ s time limit left", log),
        "search": _seconds(r"solve: search and validation took ([0-9.]+) s", log),
        "write": _seconds(r"solve: schedule written in ([0-9.]+) s", log),
        "in_all": _seconds(r"solve: ([0-9.]+) s in all", log),
        "method": chosen.group(1) if chosen else "?",
        "greedy_gave_up": "ended before its first schedule" in log,
        "unvalidated": "validation skipped" in log,
        "slowdown": _seconds(r"wall / CPU ([0-9.]+)", log),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p=1024, m=300 at 10 s only")
    ap.add_argument("--limits", default="10,30", help="time limits in seconds (default 10,30)")
    ap.add_argument("--method", default="auto", help="solver.method (default auto)")
    args = ap.parse_args()
    limits = [10.0] if args.quick else [float(x) for x in args.limits.split(",")]
    sizes = SIZES[:1] if args.quick else SIZES
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; method "
          f"{args.method}")
    head = (f"{'instance':14s} {'ops':>9s} {'limit':>6s} {'wall':>7s} {'wall/limit':>10s} "
            f"{'aim':>5s} {'cpu':>6s} {'cpu/limit':>9s}  {'load':>5s} {'search':>7s} "
            f"{'(given)':>7s} {'write':>6s} {'other':>6s} {'slow':>5s}  chosen")
    print(head)
    print("-" * len(head))
    over: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for p, m in sizes:
            for limit in limits:
                r = run(p, m, limit, args.method, Path(tmp))
                aim = 1.1 * limit + 5
                wall = float(r["wall"])  # type: ignore[arg-type]
                ok = wall <= aim

                def f(key: str, r: dict[str, object] = r) -> str:
                    val = r[key]
                    return "?" if val is None else f"{val:.1f}"

                note = " (greedy gave up at the limit)" if r["greedy_gave_up"] else ""
                note += " (validation skipped)" if r["unvalidated"] else ""
                cpu = float(r["cpu"])  # type: ignore[arg-type]
                in_all = r["in_all"]
                other = "?" if in_all is None else f"{wall - float(in_all):.1f}"  # type: ignore[arg-type]
                print(f"{f'p={p} m={m}':14s} {3 * p * m:9,d} {limit:5.0f}s {wall:6.1f}s "
                      f"{wall / limit:10.2f} {'ok' if ok else 'OVER':>5s} {cpu:5.1f}s "
                      f"{cpu / limit:9.2f}  {f('load'):>5s} {f('search'):>7s} {f('given'):>7s} "
                      f"{f('write'):>6s} {other:>6s} {f('slowdown'):>5s}  "
                      f"{r['method']}{note}", flush=True)
                if not ok:
                    over.append(f"p={p} m={m} at {limit:g} s")
    print("\nsearch = the method and the validation of its schedule; (given) = the seconds the "
          "time limit left them after loading and with writing kept aside; other = starting "
          "Python and importing pipeopt before the clock starts, and exiting; cpu = user + system "
          "time of the whole process (what the run itself used, whatever the other jobs on "
          "the machine take); slow = the wall / CPU time of loading, by which the run scales "
          "its estimates of the phases that cannot stop midway (validation, writing).")
    if over:
        print("Over the aim: " + "; ".join(over) + ". The phases that cannot stop midway ran "
              "past their share: loading, the first hand-made schedule (auto's fallback) with "
              "its memory check, and the summary and writing of a schedule of this size each "
              "take seconds that no time limit shortens (validation is skipped, with a note, "
              "when it would overrun by more than a tenth of the limit). Compare cpu with "
              "wall: on a shared machine most of the difference is other jobs' use of the "
              "cores.")


if __name__ == "__main__":
    main()
