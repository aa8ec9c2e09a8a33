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


def fused_variant(problem: Problem) -> Problem:
    """``problem`` with its backward fused: one B per stage and micro-batch. A fused backward
    is priced at ``meta.fused_backward`` (seconds per stage: measured by a profile or a run)
    when the problem has it, else at B + W of the split; B and W keep their proportion."""
    if not problem.split_backward:
        return problem
    fused = dict(problem.meta).get("fused_backward")
    if fused is None or len(fused) != problem.stages:
        return problem.replace(split_backward=False)
    b, w = list(problem.backward_input), list(problem.backward_weight)
    for k, t in enumerate(fused):
        total = b[k] + w[k]
        share = b[k] / total if total > 0 else 1.0
        b[k], w[k] = float(t) * share, float(t) * (1 - share)
    return problem.replace(split_backward=False, backward_input=tuple(b),
                           backward_weight=tuple(w))
