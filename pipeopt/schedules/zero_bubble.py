"""The Zero Bubble family (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

ZB-H1 and ZB-H2 keep one stage per device and move the weight-gradient ops W into the bubbles;
ZB-V puts two stages on every device in a V (stages r and 2p-1-r) with the hand-made order the
paper and PyTorch's ScheduleZBVZeroBubble use for equal op times.
"""

from __future__ import annotations

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import Orders, require


def _needs_split(problem: Problem, method: str) -> None:
    require(problem.split_backward, method,
            "needs split_backward: true (separate B and W ops)")


def zb_h1(problem: Problem) -> Orders:
    """ZB-H1: 1F1B's warm-up and memory, with W of micro-batch ``i - r`` after B of ``i``."""
    _needs_split(problem, "zb-h1")
    require(problem.virtual_stages == 1, "zb-h1", "needs virtual_stages: 1")
    p, m = problem.devices, problem.microbatches
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Op("F", r, j) for j in range(warm)]
        w_next = 0
        for i in range(m):
            if warm + i < m:
                order.append(Op("F", r, warm + i))
            order.append(Op("B", r, i))
            if i - r >= 0:  # W lags its B by r micro-batches, filling the cool-down bubbles
                order.append(Op("W", r, i - r))
                w_next = i - r + 1
        order += [Op("W", r, j) for j in range(w_next, m)]
        orders.append(order)
    return orders


def zb_h2(problem: Problem) -> Orders:
    """ZB-H2: ``2(p - r) - 1`` warm-up forwards (twice 1F1B's memory); then per micro-batch
    B, a lagging W, then the next F; the remaining W at the end."""
    _needs_split(problem, "zb-h2")
    require(problem.virtual_stages == 1, "zb-h2", "needs virtual_stages: 1")
    p, m = problem.devices, problem.microbatches
    orders = []
    for r in range(p):
        warm = min(m, 2 * (p - r) - 1)
        order = [Op("F", r, j) for j in range(warm)]
        w_next = 0
        for j in range(m):
            order.append(Op("B", r, j))
            if j - 2 * r >= 0:
                order.append(Op("W", r, j - 2 * r))
                w_next = j - 2 * r + 1
            if warm + j < m:
                order.append(Op("F", r, warm + j))
        order += [Op("W", r, j) for j in range(w_next, m)]
        orders.append(order)
    return orders


def zb_v(problem: Problem) -> Orders:
    """ZB-V: device r holds stage r (going down) and 2p-1-r (coming back up).

    Warm-up: ``2(p - r) - 1`` forwards of the first chunk, then ``r`` pairs of (second-chunk F,
    first-chunk F), then ``p - r`` rounds of second-chunk F, B, W. Steady state: first-chunk F,
    B, W, then second-chunk F, B, W, until every forward is done. Cool-down: ``r`` pairs of B
    (first chunk, then second), then ``p - r`` rounds of first-chunk B and W; the remaining W
    last (second chunk first).
    """
    _needs_split(problem, "zb-v")
    p, m = problem.devices, problem.microbatches
    require(problem.virtual_stages == 2 and problem.placement == "vshape", "zb-v",
            "needs virtual_stages: 2 and placement: vshape")
    require(m >= 2 * p, "zb-v", f"needs microbatches >= 2 * devices ({2 * p}), got {m}")
    s = 2 * p
    orders = []
    for r in range(p):
        lo, hi = r, s - 1 - r  # the device's stage in the first and in the second chunk
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        order: list[Op] = []

        def add(kind: str, chunk: int, counter: str | None = None, *, order: list[Op] = order,
                lo: int = lo, hi: int = hi, cnt: dict[str, int] = cnt) -> None:
            key = counter or f"{kind.lower() if kind == 'F' else 'b'}{chunk}"
            order.append(Op(kind, lo if chunk == 0 else hi, cnt[key]))
            if counter is None:
                cnt[key] += 1

        for _ in range(2 * (p - r) - 1):
            add("F", 0)
        for _ in range(r):
            add("F", 1)
            add("F", 0)
        for _ in range(p - r):
            add("F", 1)
            add("B", 1, "b1")
            add("W", 1, "b1")
            cnt["b1"] += 1
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < m:
            if cnt["f0"] < m:
                add("F", 0)
            add("B", 0, "b0")
            add("W", 0, "b0")
            cnt["b0"] += 1
            add("F", 1)
            add("B", 1, "b1")
            add("W", 1, "b1")
            cnt["b1"] += 1
        w0, w1 = cnt["b0"], cnt["b1"]
        for _ in range(r):
            add("B", 0)
            add("B", 1)
        for _ in range(p - r):
            add("B", 0)
            order.append(Op("W", lo, w0))
            w0 += 1
        order += [Op("W", hi, j) for j in range(w1, cnt["b1"])]
        order += [Op("W", lo, j) for j in range(w0, cnt["b0"])]
        orders.append(order)
    return orders
