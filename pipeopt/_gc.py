"""Pausing Python's cyclic garbage collector around allocation-heavy, cycle-free work."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic collector, then restore the caller's setting (also on errors).

    Timing, validating and the greedy build one tuple per op and no reference cycles; at 10^5
    ops the collector's repeated passes over those young tuples took about 40 % of a
    simulation (``benchmarks/simulate.py``). Reference counting frees everything as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
