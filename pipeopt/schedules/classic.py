"""GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Megatron) and looped BFS as order generators.

Each function returns, per device, the order of its ops; the simulator times them. ``r`` is the
device (pipeline rank). Rules follow the papers (GPipe, Huang et al. 2019; PipeDream-Flush,
Narayanan et al. 2021; Megatron-LM interleaving, Narayanan et al. SC'21).
"""

from __future__ import annotations

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import Orders, backward, require


def _single_chunk(problem: Problem, method: str) -> None:
    require(problem.virtual_stages == 1, method,
            f"needs one stage per device (virtual_stages: 1), got {problem.virtual_stages}")


def gpipe(problem: Problem) -> Orders:
    """All forwards, then all backwards (in micro-batch order)."""
    _single_chunk(problem, "gpipe")
    m = problem.microbatches
    orders = []
    for r in range(problem.devices):
        order = [Op("F", r, j) for j in range(m)]
        for j in range(m):
            order += backward(problem, r, j)
        orders.append(order)
    return orders


def one_f_one_b(problem: Problem) -> Orders:
    """1F1B: ``p - r - 1`` warm-up forwards, then alternate one forward and one backward."""
    _single_chunk(problem, "1f1b")
    p, m = problem.devices, problem.microbatches
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Op("F", r, j) for j in range(warm)]
        for i in range(m - warm):
            order.append(Op("F", r, warm + i))
            order += backward(problem, r, i)
        for i in range(m - warm, m):
            order += backward(problem, r, i)
        orders.append(order)
    return orders


def _chunk_table(p: int, v: int, m: int, group: int, reverse: bool) -> list[tuple[int, int]]:
    """Megatron's (chunk, micro-batch) sequence: micro-batches in groups of ``group``, every
    chunk of a group before the next group; backward visits the chunks in reverse."""
    table = []
    for g0 in range(0, m, group):
        mbs = range(g0, min(g0 + group, m))
        for c in range(v):
            cc = v - 1 - c if reverse else c
            table += [(cc, j) for j in mbs]
    return table


def interleaved_1f1b(problem: Problem, group: int | None = None) -> Orders:
    """Interleaved 1F1B: device r holds chunks c (stage c*p + r); warm-up
    ``2(p - r - 1) + (v - 1) * group`` forwards, then one forward / one backward."""
    p, v, m = problem.devices, problem.virtual_stages, problem.microbatches
    require(problem.placement == "loop", "interleaved-1f1b", "needs placement: loop")
    require(v >= 2, "interleaved-1f1b", "needs virtual_stages >= 2 (use 1f1b for one chunk)")
    n = group or p
    require(m % n == 0, "interleaved-1f1b",
            f"needs microbatches divisible by {n} (the micro-batch group), got {m}")
    fwd = _chunk_table(p, v, m, n, reverse=False)
    bwd = _chunk_table(p, v, m, n, reverse=True)
    total = v * m
    orders = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * n, total)
        order = [Op("F", c * p + r, j) for c, j in fwd[:warm]]
        for i in range(total - warm):
            c, j = fwd[warm + i]
            order.append(Op("F", c * p + r, j))
            c, j = bwd[i]
            order += backward(problem, c * p + r, j)
        for c, j in bwd[total - warm:]:
            order += backward(problem, c * p + r, j)
        orders.append(order)
    return orders


def looped_bfs(problem: Problem) -> Orders:
    """Looped BFS: every micro-batch through a chunk before the next chunk; backwards in
    reverse chunk order (breadth-first pipeline parallelism, Lamy-Poirier 2023)."""
    p, v, m = problem.devices, problem.virtual_stages, problem.microbatches
    require(problem.placement == "loop", "looped-bfs", "needs placement: loop")
    orders = []
    for r in range(p):
        order = [Op("F", c * p + r, j) for c in range(v) for j in range(m)]
        for c in reversed(range(v)):
            for j in range(m):
                order += backward(problem, c * p + r, j)
        orders.append(order)
    return orders
