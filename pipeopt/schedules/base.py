"""What every order generator shares: its signature and the "does not apply" error."""

from __future__ import annotations

from collections.abc import Callable

from pipeopt.problem import Op, Problem

Orders = list[list[Op]]
Generator = Callable[[Problem], Orders]


class NotApplicable(ValueError):
    """A schedule family that cannot express this problem (the message says why)."""


def backward(problem: Problem, stage: int, mb: int) -> list[Op]:
    """The full backward of one micro-batch on one stage: B then W (or the fused B)."""
    if problem.split_backward:
        return [Op("B", stage, mb), Op("W", stage, mb)]
    return [Op("B", stage, mb)]


def require(cond: bool, method: str, reason: str) -> None:
    """Raise :class:`NotApplicable` for ``method`` unless ``cond`` holds."""
    if not cond:
        raise NotApplicable(f"{method}: {reason}")


#: ``Problem.meta`` key where :func:`fused_variant` keeps the split backward's own B and W
#: (seconds per stage) when it prices the fused backward apart from them, so that
#: :func:`split_variant` can give the split problem back.
SPLIT_COSTS = "split_backward_costs"


def fused_variant(problem: Problem) -> Problem:
    """``problem`` with its backward fused: one B per stage and micro-batch. A fused backward
    is priced at ``meta.fused_backward`` (seconds per stage: measured by a profile or a run)
    when the problem has it, B and W keeping their proportion, and the split's own B and W go
    to ``meta.split_backward_costs`` (see :func:`split_variant`); else at B + W of the split,
    B and W unchanged."""
    if not problem.split_backward:
        return problem
    meta = dict(problem.meta)
    fused = meta.get("fused_backward")
    if fused is None or len(fused) != problem.stages:
        return problem.replace(split_backward=False)
    b, w = list(problem.backward_input), list(problem.backward_weight)
    meta[SPLIT_COSTS] = {"backward_input": b, "backward_weight": w}
    fb, fw = list(b), list(w)
    for k, t in enumerate(fused):
        total = b[k] + w[k]
        share = b[k] / total if total > 0 else 1.0
        fb[k], fw[k] = float(t) * share, float(t) * (1 - share)
    return problem.replace(split_backward=False, backward_input=tuple(fb),
                           backward_weight=tuple(fw), meta=tuple(meta.items()))


def split_variant(problem: Problem) -> Problem:
    """The split problem that :func:`fused_variant` made ``problem`` from when it priced the
    fused backward apart: B and W from ``meta.split_backward_costs``, the fused times
    ``problem`` priced in ``meta.fused_backward``. ``problem`` itself when it is split or
    carries no such record (fused from the start, or at B + W of its split)."""
    meta = dict(problem.meta)
    split = meta.pop(SPLIT_COSTS, None)
    if problem.split_backward or not isinstance(split, dict):
        return problem
    b, w = split.get("backward_input"), split.get("backward_weight")
    if not (isinstance(b, list) and isinstance(w, list)
            and len(b) == len(w) == problem.stages):
        return problem
    meta["fused_backward"] = list(problem.durations["B"])
    return problem.replace(split_backward=True, backward_input=tuple(b),
                           backward_weight=tuple(w), meta=tuple(meta.items()))
