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
