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

from pipeopt.problem import Op, Problem, ProblemError, positive_int

__all__ = ["WEIGHT_COLUMNS", "expand_orders", "merge", "piece_layers", "split"]


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


#: The columns of :func:`split`'s ``weights``: what each piece's share is taken of.
WEIGHT_COLUMNS = ("forward", "backward_input", "backward_weight", "activation_memory",
                  "weight_grad_memory", "params")

#: For each column of :data:`WEIGHT_COLUMNS`, the fields of a ``meta['stage_costs']`` row
#: (model configs) that a piece gets that share of (seconds, bytes, parameters).
_ROW_FIELDS = (("forward_s",), ("backward_input_s",), ("backward_weight_s",),
               ("activation_bytes",), ("weight_grad_bytes",), ("params", "static_bytes"))


def split(problem: Problem, k: int,
          weights: Sequence[Sequence[Sequence[float]]] | None = None) -> Problem:
    """``problem`` with every model stage cut into ``k`` sub-blocks (``k = 1``: ``problem``).

    Each piece gets a share of its stage's F, B and W time, activation and weight-gradient
    memory, and gradient reduction: ``1/k`` each, or with ``weights`` (per model stage, per
    piece, one non-negative value per column of :data:`WEIGHT_COLUMNS`, e.g. the sums of the
    piece's layers' costs) each piece's value over the stage's sum (``1/k`` where that sum is
    0); the reduction follows the ``params`` column (each piece's gradients reduced once its
    W ends, as bucketed data parallelism does). The message out of a stage leaves its last
    piece with the stage's ``message_size``; messages between pieces of one stage carry
    nothing (they stay on the device). Micro-batch factors given per stage apply to each of
    its pieces. A layer partition recorded in ``meta['partition']`` (model configs) is cut
    into contiguous layer ranges (:func:`piece_layers`; :class:`ProblemError` naming
    ``sub_blocks`` when a stage has fewer than ``k`` layers), and its per-stage records
    (``meta['stage_costs']``) into one row per piece: its layers, its shares of the stage's
    times, bytes and parameters, the stage's recomputation, and output bytes only on the last
    piece (the others' stay on the device).
    """
    k = positive_int("sub_blocks", k)
    if problem.sub_blocks != 1:
        raise ProblemError(f"sub_blocks: the problem is cut into {problem.sub_blocks} "
                           "sub-blocks already (merge it first)")
    if k == 1:
        return problem
    s = problem.stages
    share = _shares(weights, s, k)  # share[stage][piece][column]
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

    def per(values: Sequence[Any], col: int) -> list[float]:
        return [float(values[st]) * share[st][j][col] for st in range(s) for j in range(k)]

    fb = meta.get("fused_backward")
    if isinstance(fb, list) and len(fb) == s:
        # the fused backward's pieces in the split backward's proportion of B + W
        meta["fused_backward"] = [float(fb[st]) * _fused_share(problem, share, st, j)
                                  for st in range(s) for j in range(k)]
    split_costs = meta.get("split_backward_costs")
    if isinstance(split_costs, dict):
        cols = {"backward_input": 1, "backward_weight": 2}
        meta["split_backward_costs"] = {
            name: (per(vals, cols[name]) if name in cols and isinstance(vals, list)
                   and len(vals) == s else vals)
            for name, vals in split_costs.items()}
    rows = meta.get("stage_costs")
    if isinstance(rows, list) and len(rows) == s and part is not None:
        meta["stage_costs"] = _piece_rows(rows, meta["partition"], meta.get("layer_names"),
                                          share)
    else:
        meta.pop("stage_costs", None)
    msg = []
    for q in range(s * k - 1):
        st, j = divmod(q, k)
        msg.append(problem.message_size[st] if j == k - 1 else 0.0)
    act = per(problem.activation_memory, 3)
    # a piece keeps no more than it allocated (a share of each may differ)
    wgm = [min(w, a) for w, a in zip(per(problem.weight_grad_memory, 4), act, strict=True)]
    return Problem(
        devices=problem.devices, microbatches=problem.microbatches,
        virtual_stages=problem.virtual_stages, placement=problem.placement,
        split_backward=problem.split_backward,
        forward=tuple(per(problem.forward, 0)),
        backward_input=tuple(per(problem.backward_input, 1)),
        backward_weight=tuple(per(problem.backward_weight, 2)),
        activation_memory=tuple(act), weight_grad_memory=tuple(wgm),
        latency=problem.latency, bandwidth=problem.bandwidth, message_size=tuple(msg),
        memory_limit=problem.memory_limit, static_memory=problem.static_memory,
        grad_reduce=tuple(per(problem.grad_reduce, 5)), **_split_scales(problem, k),
        sub_blocks=k, meta=tuple(meta.items()))


def _shares(weights: Sequence[Sequence[Sequence[float]]] | None, s: int, k: int
            ) -> list[list[tuple[float, ...]]]:
    """Per stage, per piece, the share of each :data:`WEIGHT_COLUMNS` column (checked)."""
    n = len(WEIGHT_COLUMNS)
    even = tuple([1.0 / k] * n)
    if weights is None:
        return [[even] * k for _ in range(s)]
    if len(weights) != s:
        raise ProblemError(f"sub_blocks: weights: expected {s} stages, got {len(weights)}")
    out = []
    for st, pieces in enumerate(weights):
        if len(pieces) != k or any(len(w) != n for w in pieces):
            raise ProblemError(f"sub_blocks: weights[{st}]: expected {k} pieces of {n} values "
                               f"({', '.join(WEIGHT_COLUMNS)})")
        vals = [[float(x) for x in w] for w in pieces]
        if any(not math.isfinite(x) or x < 0 for w in vals for x in w):
            raise ProblemError(f"sub_blocks: weights[{st}]: must be finite and >= 0, got "
                               f"{vals!r:.80}")
        sums = [math.fsum(w[c] for w in vals) for c in range(n)]
        out.append([tuple(w[c] / sums[c] if sums[c] > 0 else 1.0 / k for c in range(n))
                    for w in vals])
    return out


def _fused_share(problem: Problem, share: list[list[tuple[float, ...]]], st: int, j: int
                 ) -> float:
    """Piece j's share of stage st's fused backward: its share of B + W."""
    b, w = problem.backward_input[st], problem.backward_weight[st]
    if b + w <= 0:
        return share[st][j][1]
    return (b * share[st][j][1] + w * share[st][j][2]) / (b + w)


def merge(problem: Problem) -> Problem:
    """The uncut problem of a cut one (``problem`` itself when ``sub_blocks`` is 1): per model
    stage, the sums of its pieces' times, memory and reductions, the message of its last
    piece, the micro-batch factors of its first piece, and the recorded layer partition
    joined back (the per-piece ``stage_costs`` rows are left out). ``merge(split(P, k))``
    equals ``P`` up to float rounding."""
    k = problem.sub_blocks
    if k == 1:
        return problem
    s = problem.stages // k

    def whole(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(math.fsum(values[st * k:(st + 1) * k]) for st in range(s))

    meta = dict(problem.meta)
    meta.pop("stage_costs", None)  # per piece; the uncut problem is for ordering, not reports
    part = meta.get("partition")
    if part is not None:
        ranges = _ranges(part, s * k)
        meta["partition"] = [[ranges[st * k][0], ranges[st * k + k - 1][1]] for st in range(s)]
    fb = meta.get("fused_backward")
    if isinstance(fb, list) and len(fb) == s * k:
        meta["fused_backward"] = list(whole([float(x) for x in fb]))
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


def _piece_rows(rows: list[Any], part: list[list[int]], names: Any,
                share: list[list[tuple[float, ...]]]) -> list[dict[str, Any]]:
    """``meta['stage_costs']`` with each stage's row cut into its pieces' rows (``part``: the
    pieces' layer ranges; ``share``: :func:`_shares`)."""
    k = len(share[0])
    out = []
    for q, (a, b) in enumerate(part):
        st, j = divmod(q, k)
        row = dict(rows[st]) if isinstance(rows[st], dict) else {}
        for col, keys in enumerate(_ROW_FIELDS):
            for key in keys:
                if isinstance(row.get(key), (int, float)):
                    row[key] = float(row[key]) * share[st][j][col]
        row.update(stage=q, model_stage=st, sub_block=j, layers=[a, b])
        if isinstance(names, list) and len(names) >= b:
            row.update(first=names[a], last=names[b - 1])
        if j < k - 1 and "output_bytes" in row:
            row["output_bytes"] = 0.0
        if all(isinstance(row.get(x), (int, float)) for x in (
                "static_bytes", "inflight_microbatches", "activation_bytes",
                "backward_transient_bytes")):
            row["memory_estimate_bytes"] = (row["static_bytes"] + row["inflight_microbatches"]
                                            * row["activation_bytes"]
                                            + row["backward_transient_bytes"])
        out.append(row)
    return out


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
