"""Wall time against this process's CPU time: how much a loaded machine slows a run down.

A time limit is in wall seconds, but the cost of a phase that cannot stop midway (validating or
writing a million-op schedule) is known in CPU seconds per op. On a machine shared with other
jobs the process gets only part of a core, so each such estimate is multiplied by the slowdown
measured on this run's own work so far (:meth:`Stopwatch.slowdown`), and a time limit then
holds as far as the process controls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: CPU seconds below which a slowdown is not measured (1.0 is returned): a few milliseconds of
#: work say nothing about the machine's load (the clocks tick in about 1 ms on Linux).
MIN_CPU_SAMPLE_S = 0.05
#: The largest slowdown assumed, so that one stall (a swapped-out page, a stopped process)
#: does not make every later phase give up: a 2-core machine under a load average of 16
#: gives each job about 1/8 of a core.
MAX_SLOWDOWN = 8.0


@dataclass(frozen=True)
class Stopwatch:
    """Wall (``time.perf_counter``) and CPU (``time.process_time``) readings at a start."""

    wall: float
    cpu: float

    @classmethod
    def start(cls) -> Stopwatch:
        """A stopwatch started now."""
        return cls(time.perf_counter(), time.process_time())

    def elapsed(self) -> float:
        """Wall seconds since the start."""
        return time.perf_counter() - self.wall

    def slowdown(self, *, calibrate: bool = False) -> float:
        """Wall seconds per CPU second of this process since the start, between 1 and
        :data:`MAX_SLOWDOWN` (1 when threads used more CPU than wall time). When too little
        CPU time was used to tell: 1, or with ``calibrate`` the same ratio over a busy loop of
        :data:`MIN_CPU_SAMPLE_S` of CPU run now (what a phase about to start would get)."""
        cpu = time.process_time() - self.cpu
        if cpu >= MIN_CPU_SAMPLE_S:
            return min(MAX_SLOWDOWN, max(1.0, self.elapsed() / cpu))
        if not calibrate:
            return 1.0
        probe = Stopwatch.start()
        while time.process_time() - probe.cpu < MIN_CPU_SAMPLE_S:
            pass
        return probe.slowdown()
