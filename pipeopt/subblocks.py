"""Sub-blocks: every model stage cut into k pieces that run in order on its device.

CrossPipe (Chen, Kubicek, Huang, Hoefler, USENIX ATC 2025, arXiv:2507.00217) cuts each op into
sub-blocks so that other work can run between them: a piece of a backward may run between the
pieces of a forward, and a stage's output may leave after its last piece while the next
micro-batch's first piece already runs. Here a piece is a contiguous part of the stage's
layers and a stage of its own (:attr:`pipeopt.problem.Problem.sub_blocks`): piece ``j`` of
model stage ``s`` is global stage ``s * k + j``, on ``s``'s device. The chain's own rules then
give the pieces' order (F(s*k + j) after F(s*k + j - 1); B in reverse, from the last piece to
the first; W(q) after B(q)); messages between pieces of one stage stay on the device (no link,
no delay), the activation leaves after the last F piece and the gradient from the first B
piece. So every method, the simulator, the validator and the bounds work on the cut problem
as they do on any other.

* :func:`split`: an uncut problem -> its cut (times, memory and gradient reductions divided
  evenly over the pieces; a recorded layer partition divided into contiguous layer ranges);
* :func:`merge`: the inverse (the uncut problem), on which hand-made schedules are generated;
* :func:`expand_orders`: a hand-made order of the uncut problem as an order of the cut one
  (each op's pieces back to back), which times exactly as the uncut order does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pipeopt.problem import Op, Problem, ProblemError

__all__ = ["expand_orders", "merge", "piece_layers", "split"]

#: ``Problem.meta`` keys holding one list of per-stage values (seconds) that a cut divides
#: evenly over the pieces and a merge sums back.
_PER_STAGE_META = ("fused_backward",)

#: ``Problem.meta`` keys whose per-stage records describe whole model stages: a cut problem
#: drops them (as :func:`pipeopt.problem.rechunk` does), its pieces have no such figures.
_WHOLE_STAGE_META = ("stage_costs",)


def check_sub_blocks(value: Any, name: str = "sub_blocks") -> int:
    """``value`` as a piece count (an integer >= 1); :class:`ProblemError` naming ``name``
    otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProblemError(f"{name}: must be an integer >= 1, got {value!r}")
    return value


def piece_layers(first: int, last: int, k: int) -> list[tuple[int, int]]:
    """The layer range ``[first, last)`` cut into ``k`` contiguous, non-empty ranges as even as
    can be (the first ones one layer longer when the count does not divide)."""
    n = last - first
    if k > n:
        raise ProblemError(f"sub_blocks: {k} pieces need at least {k} layers, the stage has "
                           f"{n} (layers [{first}, {last}))")
    size, extra = divmod(n, k)
    out, a = [], first
    for j in range(k):
        b = a + size + (1 if j < extra else 0)
        out.append((a, b))
        a = b
    return out


def split(problem: Problem, k: int) -> Problem:
    """``problem`` with every model stage cut into ``k`` sub-blocks (``k = 1``: ``problem``).

    Each piece gets ``1/k`` of its stage's F, B and W time, activation and weight-gradient
    memory, and gradient reduction (each piece's gradients reduced once its W ends, as
    bucketed data parallelism does; :func:`pipeopt.problem.rechunk` divides chunks' the same
    way). The message out of a stage leaves its last piece with the stage's ``message_size``;
    messages between pieces of one stage carry nothing (they stay on the device). Micro-batch
    factors given per stage apply to each of its pieces. A layer partition recorded in
    ``meta['partition']`` (model configs) is cut into contiguous layer ranges
    (:func:`piece_layers`; :class:`ProblemError` naming ``sub_blocks`` when a stage has fewer
    than ``k`` layers); per-stage cost records (``meta['stage_costs']``) are dropped.
    """
    k = check_sub_blocks(k)
    if problem.sub_blocks != 1:
        raise ProblemError(f"sub_blocks: the problem is cut into {problem.sub_blocks} "
                           "sub-blocks already (merge it first)")
    if k == 1:
        return problem
    s = problem.stages
    meta = dict(problem.meta)
    part = meta.get("partition")
    if part is not None:
        ranges = _ranges(part, s)
        fewest = min(b - a for a, b in ranges)
        if fewest < k:
            st, (a, b) = next((st, r) for st, r in enumerate(ranges) if r[1] - r[0] == fewest)
            raise ProblemError(f"sub_blocks: {k} pieces need at least {k} layers per stage; "
                               f"stage {st} has {b - a} (layers [{a}, {b})), so at most "
                               f"{fewest} here")
        meta["partition"] = [list(r) for a, b in ranges for r in piece_layers(a, b, k)]
    for key in _PER_STAGE_META:
        vals = meta.get(key)
        if isinstance(vals, list) and len(vals) == s:
            meta[key] = [float(x) / k for x in vals for _ in range(k)]
    split_costs = meta.get("split_backward_costs")
    if isinstance(split_costs, dict):
        meta["split_backward_costs"] = {
            name: ([float(x) / k for x in vals for _ in range(k)]
                   if isinstance(vals, list) and len(vals) == s else vals)
            for name, vals in split_costs.items()}
    for key in _WHOLE_STAGE_META:
        meta.pop(key, None)

    def per(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(x / k for x in values for _ in range(k))

    msg = []
    for q in range(s * k - 1):
        st, j = divmod(q, k)
        msg.append(problem.message_size[st] if j == k - 1 else 0.0)
    return Problem(
        devices=problem.devices, microbatches=problem.microbatches,
        virtual_stages=problem.virtual_stages, placement=problem.placement,
        split_backward=problem.split_backward,
        forward=per(problem.forward), backward_input=per(problem.backward_input),
        backward_weight=per(problem.backward_weight),
        activation_memory=per(problem.activation_memory),
        weight_grad_memory=per(problem.weight_grad_memory),
        latency=problem.latency, bandwidth=problem.bandwidth, message_size=tuple(msg),
        memory_limit=problem.memory_limit, static_memory=problem.static_memory,
        grad_reduce=per(problem.grad_reduce), **_split_scales(problem, k),
        sub_blocks=k, meta=tuple(meta.items()))


def merge(problem: Problem) -> Problem:
    """The uncut problem of a cut one (``problem`` itself when ``sub_blocks`` is 1): per model
    stage, the sums of its pieces' times, memory and reductions, the message of its last
    piece, the micro-batch factors of its first piece, and the recorded layer partition
    joined back. ``merge(split(P, k))`` equals ``P`` up to float rounding (and without the
    per-stage records :func:`split` drops)."""
    k = problem.sub_blocks
    if k == 1:
        return problem
    s = problem.stages // k

    def whole(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(math.fsum(values[st * k:(st + 1) * k]) for st in range(s))

    meta = dict(problem.meta)
    part = meta.get("partition")
    if part is not None:
        ranges = _ranges(part, s * k)
        meta["partition"] = [[ranges[st * k][0], ranges[st * k + k - 1][1]] for st in range(s)]
    for key in _PER_STAGE_META:
        vals = meta.get(key)
        if isinstance(vals, list) and len(vals) == s * k:
            meta[key] = list(whole([float(x) for x in vals]))
    split_costs = meta.get("split_backward_costs")
    if isinstance(split_costs, dict):
        meta["split_backward_costs"] = {
            name: (list(whole([float(x) for x in vals]))
                   if isinstance(vals, list) and len(vals) == s * k else vals)
            for name, vals in split_costs.items()}
    scales: dict[str, Any] = {}
    if not problem.uniform_microbatches:
        scales = {"microbatch_scale": problem.time_table[::k],
                  "microbatch_memory_scale": problem.memory_table[::k],
                  "microbatch_message_scale": problem.message_table[k - 1::k]}
    return Problem(
        devices=problem.devices, microbatches=problem.microbatches,
        virtual_stages=problem.virtual_stages, placement=problem.placement,
        split_backward=problem.split_backward,
        forward=whole(problem.forward), backward_input=whole(problem.backward_input),
        backward_weight=whole(problem.backward_weight),
        activation_memory=whole(problem.activation_memory),
        weight_grad_memory=whole(problem.weight_grad_memory),
        latency=problem.latency, bandwidth=problem.bandwidth,
        message_size=tuple(problem.message_size[k - 1::k]),
        memory_limit=problem.memory_limit, static_memory=problem.static_memory,
        grad_reduce=whole(problem.grad_reduce), **scales, meta=tuple(meta.items()))


def expand_orders(problem: Problem, orders: Sequence[Sequence[Op]]) -> list[list[Op]]:
    """Per-device orders of ``merge(problem)`` (model stages) as orders of the cut
    ``problem``: each op's pieces back to back, F's in layer order, B's and W's in reverse
    (the order autograd runs a stage's layers). Timed by the simulator, the result has the
    uncut order's makespan: a piece starts when the one before it on the device ends, and
    the stage's message leaves when its last piece ends, as the whole op's did."""
    k = problem.sub_blocks
    if k == 1:
        return [list(o) for o in orders]
    up = tuple(range(k))
    down = tuple(reversed(up))
    return [[Op(kind, stage * k + j, mb) for kind, stage, mb in order
             for j in (up if kind == "F" else down)] for order in orders]


def _ranges(part: Any, n: int) -> list[tuple[int, int]]:
    """``meta['partition']`` as ``n`` contiguous ``[first, last)`` layer ranges."""
    if not isinstance(part, (list, tuple)) or len(part) != n:
        raise ProblemError(f"meta.partition: expected {n} layer ranges (one per stage), got "
                           f"{part!r:.60}")
    out = []
    for st, r in enumerate(part):
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] >= r[1] or (out and out[-1][1] != r[0])):
            raise ProblemError(f"meta.partition[{st}]: expected a contiguous [first, last) "
                               f"layer range, got {r!r:.60}")
        out.append((r[0], r[1]))
    return out


def _split_scales(problem: Problem, k: int) -> dict[str, Any]:
    """The micro-batch factors of the cut problem: each stage's rows for each of its pieces;
    a boundary inside a stage (no bytes) takes its stage's memory row, the default."""
    if problem.uniform_microbatches:
        return {}
    s = problem.stages
    mem = tuple(row for row in problem.memory_table for _ in range(k))
    msg = []
    for q in range(s * k - 1):
        st, j = divmod(q, k)
        msg.append(problem.message_table[st] if j == k - 1 else mem[q])
    return {"microbatch_scale": tuple(row for row in problem.time_table for _ in range(k)),
            "microbatch_memory_scale": mem, "microbatch_message_scale": tuple(msg)}
