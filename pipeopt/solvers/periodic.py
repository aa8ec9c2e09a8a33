"""The periodic search: the shortest period of a 1F1B-async-like cyclic order within memory.

The search space is the in-flight count ``n_k`` of every stage in the cyclic order of
:mod:`pipeopt.schedules.periodic` (device k repeats ``F(j + n_k - 1), B(j), W(j)``). For given
counts the least period and the earliest pattern are exact (cycle-ratio iteration); the counts
trade memory for period:

* more micro-batches in flight on stage k hide the round trip of the stages after it (a cycle
  of height ``n_k`` through the whole chain: ``T >= round trip / n_k``, Little's law);
* a gap ``n_{k-1} - n_k`` between neighbours hides their shared round trip (a cycle of height
  ``n_{k-1} - n_k + 1``); a stage with more in flight than the one before it deadlocks;
* memory caps each count (:func:`~pipeopt.workloads.periodic.max_in_flight`).

Method: counts ``min(cap_k, c + g (s - 1 - k))`` (made non-increasing in k) for gaps g = 1..3
and base c = 1, 2, ... (1F1B-async is c = g = 1), then steps of +-1 on one stage or on every
stage up to one while the period drops or, at the same period, the memory does (fewer in
flight: less staleness too), until no step helps or the time limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from pipeopt.problem import Problem
from pipeopt.schedules.base import NotApplicable
from pipeopt.schedules.periodic import Deadlock, cyclic_schedule, one_stage_per_device
from pipeopt.workloads.periodic import (
    POLICIES,
    PeriodicSchedule,
    check_replicas,
    max_in_flight,
    memory_period_bound,
    period_lower_bound,
    round_trip,
)

#: Gaps between neighbouring stages' in-flight counts tried first: 1 is 1F1B-async's; 2 and 3
#: hide round trips of up to two and three periods between neighbours (a slow link's latency).
_GAPS = (1, 2, 3)
#: A period within this relative distance of the lower bound is taken as the bound (s / s).
_AT_BOUND = 1e-9


def _key(s: PeriodicSchedule) -> tuple[float, float]:
    """Shorter period first, then less memory in all (bytes)."""
    return (s.period, math.fsum(s.peak_memory))


def solve_periodic(problem: Problem, weight_bytes: Sequence[float] = (), policy: str = "stash",
                   *, time_limit: float = 10.0, replicas: Sequence[int] = (),
                   sync_s: Sequence[float] = ()) -> PeriodicSchedule:
    """The shortest-period pattern found within every device's memory (module docstring),
    with ``lower_bound`` = max(resource bound, memory bound); ``replicas[k]`` devices run
    stage k round-robin, ``sync_s[k]`` seconds of their all-reduce per round (a resource
    load, :func:`~pipeopt.workloads.periodic.replica_sync_bound`). ``time_limit`` in seconds.
    Raises :class:`NotApplicable` when even one micro-batch in flight does not fit."""
    one_stage_per_device(problem)
    reps = check_replicas(problem, replicas)
    if policy not in POLICIES:
        raise NotApplicable(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not (isinstance(time_limit, int | float) and time_limit > 0):
        raise NotApplicable(f"time_limit: must be > 0 s, got {time_limit!r}")
    deadline = time.monotonic() + time_limit
    s = problem.stages
    wb = tuple(weight_bytes) or (0.0,) * s
    caps = max_in_flight(problem, wb, policy)
    for k, c in enumerate(caps):
        if c is not None and c < 1:
            d = problem.stage_device[k]
            need = (problem.static_memory[d] + problem.activation_memory[k]
                    + (wb[k] if policy == "2bw" else 0.0))
            raise NotApplicable(f"memory.limit[{d}]: one micro-batch in flight on stage {k} "
                                f"needs {need:g} bytes ({policy} weights), over the limit "
                                f"{problem.memory_limit[d]:g}")
    resource = period_lower_bound(problem, reps, sync_s)
    bound = max(resource, memory_period_bound(problem, wb, policy, reps))
    # Enough in flight (in all, over a stage's replicas) to hide the longest round trip
    # behind the resource bound.
    most = max(1, math.ceil(max(round_trip(problem, k) for k in range(s)) / resource) + 1)
    limit = [most + s if c is None else min(c, most + s) for c in caps]  # per replica

    def run(counts: Sequence[int]) -> PeriodicSchedule | None:
        try:
            return cyclic_schedule(problem, counts, policy=policy, weight_bytes=wb,
                                   method="periodic", replicas=reps, sync_s=sync_s)
        except Deadlock:
            return None

    seen: dict[tuple[int, ...], PeriodicSchedule | None] = {}

    def evaluate(counts: Sequence[int]) -> PeriodicSchedule | None:
        key = tuple(counts)
        if key not in seen:
            seen[key] = run(key)
        return seen[key]

    # One in flight everywhere first: it never deadlocks (every cycle through a device's
    # F -> B arc returns through that device's W -> F arc of height r_k >= 1).
    best = evaluate([1] * s)
    if best is None:  # pragma: no cover - see above
        raise NotApplicable("in_flight: no cyclic order found")
    for g in _GAPS:
        for c in range(1, most + 1):
            if best.period <= bound * (1 + _AT_BOUND) or time.monotonic() > deadline:
                break
            total = _monotone([c + g * (s - 1 - k) for k in range(s)])
            counts = _after_caps([min(limit[k], max(1, math.ceil(n / reps[k]))) for k, n in
                                  enumerate(total)], reps)
            cand = evaluate(counts)
            if cand is not None and _key(cand) < _key(best):
                best = cand
    improved = True
    # Also once at the bound: fewer in flight at the same period is less memory and staleness.
    while improved and time.monotonic() < deadline:
        improved = False
        counts = list(best.replica_in_flight)
        # One stage +-1, or every stage up to k +-1 (which widens or narrows only the gap
        # between k and k + 1, the move a slow link between them needs).
        for k in range(s):
            for step, first in ((1, k), (-1, k), (1, 0), (-1, 0)):
                trial = [c + step if first <= i <= k else c for i, c in enumerate(counts)]
                if not all(1 <= c <= m for c, m in zip(trial, limit, strict=True)):
                    continue  # a deadlocking trial is refused by evaluate
                cand = evaluate(trial)
                if cand is not None and _key(cand) < _key(best):
                    best, improved = cand, True
    return best.replace(lower_bound=bound, method="periodic")


def _after_caps(counts: list[int], reps: Sequence[int]) -> list[int]:
    """The per-replica counts lowered where a memory cap upstream would make a later stage
    hold more than it can feed: ``r_k (n_k - 1) <= r_{k-1} n_{k-1} - 1``, the height of the
    cycle through neighbours k - 1 and k staying positive (for one replica: non-increasing)."""
    out = list(counts)
    for k in range(1, len(out)):
        out[k] = max(1, min(out[k], (reps[k - 1] * out[k - 1] - 1) // reps[k] + 1))
    return out


def _monotone(counts: list[int]) -> list[int]:
    """The counts made non-increasing along the chain (no stage with more in flight than the
    one before it, which would deadlock), lowering the later ones."""
    out = list(counts)
    for k in range(1, len(out)):
        out[k] = min(out[k], out[k - 1])
    return out
