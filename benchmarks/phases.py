"""CPU seconds of each phase of `pipeopt solve` that cannot stop midway, at p = 1024, m = 300.

Run: python benchmarks/phases.py [--base DIR]

Times, in a fresh process each, on the CPU clock (``time.process_time``, so the other jobs on
a shared machine count less than in wall time): the imports, reading the config, building the
config and its ``Problem`` (the 1024 x 1024 latency / bandwidth matrices), zb-h1's orders,
their simulation (order checks included), the peak memory, the summary, the JSON header, the
op records, their layout and the file write. ``--base DIR``: the same in a checkout of another
revision (e.g. ``git worktree add --detach /tmp/base main``), run first, and the ratio
this / base per phase. The instance is benchmarks/limits.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
t = time.process_time
out = {}
c = t()
def mark(name):
    global c
    now = t(); out[name] = now - c; c = now
from pipeopt.workload_config import chain_config, read_workload
from pipeopt.schedules.zero_bubble import zb_h1
from pipeopt.simulate import simulate
from pipeopt.schedule import schedule_header
import pipeopt.io as io
mark("imports")
work = read_workload(sys.argv[1]); mark("read config")
cfg = chain_config(work, method="auto", time_limit=10, seed=0, objective=None)
mark("config + Problem")
orders = zb_h1(cfg.problem); mark("zb-h1 orders")
s = simulate(cfg.problem, orders, method="zb-h1"); mark("simulate")
s.peak_memory; mark("peak memory")
s.summary(); mark("summary")
h = schedule_header(s); mark("JSON header")
r = io._record_lines(s); mark("op records")
txt = io.format_json({**h, **r}); mark("layout")
io.write_atomic(sys.argv[2], txt); mark("write file")
print(json.dumps(out))
"""


def phases(checkout: Path, cfg: Path, out: Path) -> dict[str, float]:
    """CPU seconds per phase in a fresh process over ``checkout``'s pipeopt."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(cfg), str(out)], env=env,
                          capture_output=True, text=True, check=True, cwd=checkout)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="another checkout, measured first")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from limits import config_text

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; p=1024 m=300; "
          "CPU seconds")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "p1024.yaml"
        cfg.write_text(config_text(1024, 300, "auto"), encoding="utf-8")
        base = phases(args.base, cfg, Path(tmp) / "base.json") if args.base else None
        this = phases(ROOT, cfg, Path(tmp) / "this.json")
    print(f"{'phase':18s} {'base':>6s} {'this':>6s} {'this/base':>9s}")
    for name, sec in [*this.items(), ("total", sum(this.values()))]:
        b = (sum(base.values()) if name == "total" else base[name]) if base else None
        ratio = f"{sec / b:9.2f}" if b else f"{'-':>9s}"
        print(f"{name:18s} {'-' if b is None else f'{b:6.2f}':>6s} {sec:6.2f} {ratio}")


if __name__ == "__main__":
    main()
