"""V-Min and V-Half: V-shape schedules built from a repeating block (Qi, Wan, Amar, Lin,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024, sections 3-4).

The paper's framework: a schedule is one *building block* (where each device runs the ops of
one micro-batch) repeated every period; the block's *lifespan* on a device (from its first F
to the last op that frees that micro-batch's memory) over the period is the number of
micro-batches the device holds at once, so the block alone sets the peak activation memory.

Construction used here, in unit slots (every chunk op takes one slot, as at equal times):

* device r holds stage r (chunk 0, down the V) and stage 2p-1-r (chunk 1, back up); a device
  runs six ops per micro-batch (F, B, W of each chunk), so the block repeats every 6 slots;
* the block is the tightest V: every op starts one slot after its input, except that chunk 0's
  forward and chunk 1's input-gradient pass advance ``step`` slots per device (1: V-Min,
  2: V-Half), and two gaps are added, at the V's bottom before the first backward and at its
  tip between the two backwards: of the pairs that give the four F/B ops of every device four
  different slots modulo 6, the one with the lowest peak, then the shortest (the two free
  slots take the W ops, each in the first free slot after its B, chunk 1's first);
* the repeated table is *squeezed* (section 4): op by op in slot order, each op of the warm-up
  and cool-down moves to the earliest free slot its inputs allow, a forward only where the
  device's memory (counted in chunk activations, held from F to W) stays within the table's
  peak; the steady state (device 0's first chunk-0 B to its last chunk-0 F) is tight already
  and keeps its slots. The cool-down is then squeezed once more with its W ops lifted out,
  each F and B moving only where the W ops, refilled into the gaps afterwards, keep the peak.

The result is a per-device order; the simulator times it with the problem's real costs and
links. At equal times the peak is about p/3 (V-Min) and p/2 (V-Half) micro-batches'
activations, against p for 1F1B; the paper's bubbles are about 2/3 and 1/2 of 1F1B's.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from functools import lru_cache

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import Orders, require

#: Slots per block: a device runs F, B and W of both its chunks for every micro-batch.
PERIOD = 6


def _rows(p: int, step: int, g: int, d: int) -> list[tuple[int, int, int, int]]:
    """The V block with gaps ``g`` (before chunk 1's first B) and ``d`` (between the two B
    at the V's tip): per device, the slots of F chunk 0, F chunk 1, B chunk 1, B chunk 0."""
    f0 = [step * r for r in range(p)]
    f1 = [f0[p - 1] + 1 + (p - 1 - r) for r in range(p)]
    b1 = [f1[0] + 1 + g + step * r for r in range(p)]
    b0 = [b1[p - 1] + 1 + d + (p - 1 - r) for r in range(p)]
    return list(zip(f0, f1, b1, b0, strict=True))


@lru_cache(maxsize=64)
def block_offsets(p: int, step: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per device r, the slots of (F chunk 0, F chunk 1, B chunk 1, B chunk 0) of micro-batch 0.

    Chunk 0's F and chunk 1's B advance ``step`` slots per device, the other two one slot (the
    V-shape block of the paper, section 4.1). Of the gaps ``g`` (before chunk 1's first B, on
    device 0) and ``d`` (between the two B on device p-1) that give every device four distinct
    slots modulo :data:`PERIOD`, the block keeps the pair with the lowest steady-state peak
    (measured on the repeated table, W ops included), then the shortest.
    """
    best: tuple[tuple[int, int], list[tuple[int, int, int, int]]] | None = None
    for g, d in sorted(itertools.product(range(PERIOD), repeat=2), key=sum):
        rows = _rows(p, step, g, d)
        if any(len({x % PERIOD for x in row}) < 4 for row in rows):
            continue
        if best is not None and g + d > best[0][1] + PERIOD // 2:
            break  # longer blocks only add bubble
        _, tables = _repeat(rows, 2 * p + 2)
        key = (max(max(t.live) for t in tables), g + d)
        if best is None or key < best[0]:
            best = (key, rows)
    if best is None:  # pragma: no cover - g = d = 0..5 always has a valid pair
        raise AssertionError(f"no V block for p={p}, step={step}")
    return tuple(best[1])


class _Table:
    """Slot table of one device: which op occupies each slot, and live activations per slot."""

    def __init__(self, horizon: int) -> None:
        self.op: list[Op | None] = [None] * horizon
        self.live = [0] * horizon  # chunk activations held (from F's slot to W's slot)

    def hold(self, a: int, b: int, delta: int) -> None:
        for t in range(a, b):
            self.live[t] += delta


def _repeat(rows: Sequence[tuple[int, int, int, int]], m: int
            ) -> tuple[dict[Op, int], list[_Table]]:
    """The block repeated for ``m`` micro-batches (micro-batch j at the block's slots + 6j),
    each W in the first free slot after its B (oldest B first)."""
    p = len(rows)
    s = 2 * p
    slot: dict[Op, int] = {}
    for r, (f0, f1, b1, b0) in enumerate(rows):
        lo, hi = r, s - 1 - r
        for j in range(m):
            base = PERIOD * j
            slot[Op("F", lo, j)] = f0 + base
            slot[Op("F", hi, j)] = f1 + base
            slot[Op("B", hi, j)] = b1 + base
            slot[Op("B", lo, j)] = b0 + base
    tables = [_Table(max(slot.values()) + 1) for _ in range(p)]
    for op, t in slot.items():
        tables[min(op.stage, s - 1 - op.stage)].op[t] = op
    for tab in tables:
        _fill_w(tab, slot, 0, p)
    for tab in tables:  # live activations: +1 at each F's slot, -1 after its W's slot
        horizon = len(tab.op)
        diff = [0] * (horizon + 1)
        for t, op in enumerate(tab.op):
            if op is not None and op.kind == "F":
                diff[t] += 1
                diff[slot[op._replace(kind="W")] + 1] -= 1
        tab.live = list(itertools.accumulate(diff[:horizon]))
    return slot, tables


def _fill_w(tab: _Table, slot: dict[Op, int], start: int, p: int,
            waiting: Sequence[Op] = ()) -> None:
    """Put the ``waiting`` W ops and the W of every B at or after slot ``start`` in the first
    free slots after their B; chunk 1's W first when both chunks have one waiting."""
    pending: tuple[deque[Op], deque[Op]] = (deque(), deque())
    for w in waiting:
        pending[0 if w.stage >= p else 1].append(w)
    for t in range(start, len(tab.op)):
        op = tab.op[t]
        if op is None:
            queue = next((q for q in pending if q), None)
            if queue is not None:
                w = queue.popleft()
                tab.op[t] = w
                slot[w] = t
        elif op.kind == "B":
            pending[0 if op.stage >= p else 1].append(Op("W", op.stage, op.microbatch))
    for queue in pending:  # the last W, after everything else
        while queue:
            w = queue.popleft()
            slot[w] = len(tab.op)
            tab.op.append(w)


def _v_orders(problem: Problem, method: str, step: int) -> Orders:
    """Orders of the V block with ``step`` (see the module docstring)."""
    require(problem.virtual_stages == 2 and problem.placement == "vshape", method,
            "needs virtual_stages: 2 and placement: vshape")
    require(problem.split_backward, method, "needs split_backward: true (separate B and W ops)")
    slot, tables = _repeat(block_offsets(problem.devices, step), problem.microbatches)
    dev = problem.stage_device
    cap = max(max(tab.live) for tab in tables)
    # The steady state, from device 0's first chunk-0 B to its last chunk-0 F, is already
    # tight and keeps its slots.
    steady = range(slot[Op("B", 0, 0)], slot[Op("F", 0, problem.microbatches - 1)] + 1)
    # Squeeze: in slot order, each op moves to its earliest allowed free slot.
    for op in sorted(slot, key=lambda o: (slot[o], dev[o.stage])):
        tab, t0 = tables[dev[op.stage]], slot[op]
        if t0 in steady:
            continue
        lo_t = max((slot[x] + 1 for x in problem.inputs(op)), default=0)
        if op.microbatch > 0:
            lo_t = max(lo_t, slot[op._replace(microbatch=op.microbatch - 1)] + 1)
        if op.kind == "F":
            t = t0  # a forward moves only while holding one more activation fits the cap
            while t > lo_t and tab.live[t - 1] < cap:
                t -= 1
            lo_t = t
        t = next(x for x in range(lo_t, t0 + 1) if x == t0 or tab.op[x] is None)
        if t == t0:
            continue
        tab.op[t0], tab.op[t] = None, op
        slot[op] = t
        if op.kind == "F":
            tab.hold(t, t0, 1)
        elif op.kind == "W":
            tab.hold(t + 1, t0 + 1, -1)
    tail = _squeeze_tail(problem, slot, tables, steady.stop, cap)
    return [[op for op in tab.op if op is not None] for tab in tail]


def _held_before(tab: _Table, start: int) -> int:
    """Activations the device holds entering slot ``start`` (F so far less W so far)."""
    ops = [op.kind for op in tab.op[:start] if op is not None]
    return ops.count("F") - ops.count("W")


def _tail_peak(tab: _Table, start: int, live: int, waiting: Sequence[Op], p: int) -> int:
    """Most activations the device holds from slot ``start`` on (``live`` entering it), with
    the W ops of its B ops from there (and ``waiting``) each in the first free slot after its
    B (see :func:`_fill_w`)."""
    pending = [sum(1 for w in waiting if w.stage >= p), sum(1 for w in waiting if w.stage < p)]
    peak, freed = live, 0
    last = len(tab.op) - 1  # after the last F or B, W only free memory
    while last >= start and tab.op[last] is None:
        last -= 1
    for t in range(start, last + 1):
        live -= freed  # a W frees its activation after its slot
        freed = 0
        op = tab.op[t]
        if op is None:
            if pending[0] or pending[1]:
                pending[0 if pending[0] else 1] -= 1
                freed = 1
        elif op.kind == "F":
            live += 1
        elif op.kind == "B":
            pending[0 if op.stage >= p else 1] += 1
        peak = max(peak, live)
    return peak


def _squeeze_tail(problem: Problem, slot: dict[Op, int], tables: list[_Table], start: int,
                  cap: int) -> list[_Table]:
    """The cool-down squeezed again with its W ops lifted out (the paper's second squeeze):
    each F and B after slot ``start`` takes the earliest free slot its inputs allow where the
    device, its W ops refilling the gaps afterwards, still holds at most ``cap``
    activations; then the W ops refill the gaps."""
    p, dev = problem.devices, problem.stage_device
    new = [_Table(len(tab.op)) for tab in tables]
    waiting: list[list[Op]] = [[] for _ in range(p)]
    for d, tab in enumerate(tables):
        for t, op in enumerate(tab.op):
            if op is None or op.kind != "W" or t < start:
                new[d].op[t] = op
            elif slot[op._replace(kind="B")] < start:
                waiting[d].append(op)
    held = [_held_before(tab, start) for tab in new]
    for op in sorted((o for o in slot if o.kind != "W" and slot[o] >= start), key=slot.get):
        d, t0 = dev[op.stage], slot[op]
        tab = new[d]
        lo_t = max([start] + [slot[x] + 1 for x in problem.inputs(op)])
        if op.microbatch > 0:
            lo_t = max(lo_t, slot[op._replace(microbatch=op.microbatch - 1)] + 1)
        for t in range(lo_t, t0):
            if tab.op[t] is not None:
                continue
            tab.op[t0], tab.op[t] = None, op
            if _tail_peak(tab, start, held[d], waiting[d], p) <= cap:
                slot[op] = t
                break
            tab.op[t0], tab.op[t] = op, None
    for d, tab in enumerate(new):
        _fill_w(tab, slot, start, p, waiting[d])
    return new


def v_min(problem: Problem) -> Orders:
    """V-Min: the V block with one-slot offsets; about 1/3 of 1F1B's activation memory
    (Qi et al. 2024, section 4.2)."""
    return _v_orders(problem, "v-min", 1)


def v_half(problem: Problem) -> Orders:
    """V-Half: chunk 0's F and chunk 1's B advance two slots per device; about 1/2 of 1F1B's
    activation memory at a bubble about half of 1F1B's (Qi et al. 2024, section 4.2)."""
    return _v_orders(problem, "v-half", 2)
