"""PyTorch's built-in pipeline schedules as pipeopt methods ``torch:NAME``.

They are read as data (per-rank orders), as the other hand-made schedules of this package are
generated, so they live here rather than in :mod:`pipeopt.executor`, which runs schedules;
:mod:`pipeopt.solvers` names them in its method table. torch is imported only when a schedule
is read, through :mod:`pipeopt.executor._torch` (torch's private names behind a version check,
no pipeopt imports).

The per-rank compute actions come from ``torch.distributed.pipelining`` without a process group
(its schedule visualizer instantiates the schedule classes with mock stages). They are mapped to
pipeopt ops and timed by :func:`pipeopt.simulate.simulate` on the same cost model as every other
method:

* ``F`` -> F; ``I`` (input gradient) -> B; ``W`` -> W; ``B`` (full backward) -> the fused B,
  or B then W on a problem with a split backward; ``OVERLAP_F_B`` -> its sub-actions in order;
  communication and ``REDUCE_GRAD`` actions are dropped.
* Schedules that only use full backwards (1F1B, Interleaved1F1B) are timed on the fused variant
  of the problem, as pipeopt's own 1F1B is; the zero-bubble ones need ``split_backward: true``.

Known defect worked around: in torch 2.13, ``Schedule1F1B.pipeline_order`` numbers the last
rank's forwards 1..m instead of 0..m-1 (PyTorch's own validation rejects it). When exactly that
pattern appears, the forwards are renumbered and the fix is recorded in the schedule's solver
details (``torch_fixup``); any other inconsistency raises :class:`NotApplicable`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeopt.bounds import lower_bound
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Schedule, SolverInfo
from pipeopt.schedules.base import NotApplicable, fused_variant
from pipeopt.simulate import ScheduleError, simulate
from pipeopt.subblocks import expand_orders, merge


@dataclass(frozen=True)
class TorchSchedule:
    """A PyTorch schedule class and the problem shape it needs (``chunks`` None = any >= 2)."""

    cls: str
    chunks: int | None
    placement: str
    needs_split: bool
    fused_only: bool


TORCH_SCHEDULES: dict[str, TorchSchedule] = {
    "1F1B": TorchSchedule("Schedule1F1B", 1, "loop", False, True),
    "Interleaved1F1B": TorchSchedule("ScheduleInterleaved1F1B", None, "loop", False, True),
    "InterleavedZeroBubble": TorchSchedule("ScheduleInterleavedZeroBubble", None, "loop",
                                           True, False),
    "ZBVZeroBubble": TorchSchedule("ScheduleZBVZeroBubble", 2, "vshape", True, False),
    "DualPipeV": TorchSchedule("ScheduleDualPipeV", 2, "vshape", True, False),
}


def torch_names() -> list[str]:
    """The ``torch:NAME`` methods."""
    return [f"torch:{n}" for n in TORCH_SCHEDULES]


def _lookup(name: str) -> tuple[str, TorchSchedule]:
    key = name.replace("-", "").replace("_", "").lower().removeprefix("schedule")
    for n, ts in TORCH_SCHEDULES.items():
        if n.lower() == key:
            return n, ts
    raise NotApplicable(f"torch:{name}: unknown PyTorch schedule; choose one of "
                        f"{', '.join(TORCH_SCHEDULES)}")


def _check_shape(problem: Problem, name: str, ts: TorchSchedule) -> None:
    p, v = problem.devices, problem.virtual_stages
    where = f"torch:{name}"
    if ts.chunks == 1 and v != 1:
        raise NotApplicable(f"{where}: needs virtual_stages: 1, got {v}")
    if ts.chunks is None and v < 2:
        raise NotApplicable(f"{where}: needs virtual_stages >= 2, got {v}")
    if ts.chunks is not None and ts.chunks > 1 and v != ts.chunks:
        raise NotApplicable(f"{where}: needs virtual_stages: {ts.chunks}, got {v}")
    if v > 1 and problem.placement != ts.placement:
        raise NotApplicable(f"{where}: needs placement: {ts.placement}, got "
                            f"{problem.placement}")
    if ts.needs_split and not problem.split_backward:
        raise NotApplicable(f"{where}: needs split_backward: true (separate B and W ops)")
    if p < 2 and ts.chunks != 1:
        raise NotApplicable(f"{where}: needs at least 2 devices")


def torch_actions(name: str, devices: int, microbatches: int, chunks: int) -> list[list[Any]]:
    """PyTorch's per-rank compute actions for schedule ``name`` (``torch`` ``_Action`` objects,
    None for idle slots)."""
    from torch.distributed.pipelining import schedules as tsched

    from pipeopt.executor._torch import get_schedule_ops

    _, ts = _lookup(name)
    cls = getattr(tsched, ts.cls)
    return get_schedule_ops(cls, devices, microbatches, chunks)


def _fix_1f1b_last_rank(rows: list[list[tuple[str, int, int]]], m: int) -> str | None:
    """Renumber the last rank's forwards when they are 1..m instead of 0..m-1 (torch 2.13)."""
    last = rows[-1]
    fwd = sorted(j for kind, _, j in last if kind == "F")
    if fwd != list(range(1, m + 1)):
        return None
    rows[-1] = [(kind, k, j - 1 if kind == "F" else j) for kind, k, j in last]
    return "last rank's forwards renumbered from 1..m to 0..m-1 (Schedule1F1B off-by-one)"


def to_orders(problem: Problem, actions: list[list[Any]], name: str
              ) -> tuple[list[list[Op]], str | None]:
    """Map PyTorch actions to per-device pipeopt orders (see the module docstring)."""
    rows: list[list[tuple[str, int, int]]] = []
    for rank, row in enumerate(actions):
        out: list[tuple[str, int, int]] = []
        for a in row:
            if a is None:
                continue
            subs = a.sub_actions if a.sub_actions else (a,)
            for s in subs:
                kind = s.computation_type.value
                if kind not in ("F", "I", "W", "B"):
                    continue  # communication, resharding, gradient reduction
                if s.microbatch_index is None:
                    raise NotApplicable(f"torch:{name}: rank {rank}: action {s} has no "
                                        "micro-batch")
                out.append((kind, s.stage_index, s.microbatch_index))
        rows.append(out)
    fixup = None
    if name == "1F1B":
        fixup = _fix_1f1b_last_rank(rows, problem.microbatches)
    orders: list[list[Op]] = []
    for row in rows:
        order: list[Op] = []
        for kind, k, j in row:
            if kind == "F":
                order.append(Op("F", k, j))
            elif kind == "I":
                order.append(Op("B", k, j))
            elif kind == "W":
                order.append(Op("W", k, j))
            elif problem.split_backward:  # full backward = input then weight gradient
                order += [Op("B", k, j), Op("W", k, j)]
            else:
                order.append(Op("B", k, j))
        orders.append(order)
    return orders, fixup


def solve_torch(problem: Problem, name: str, options: Any = None) -> Schedule:
    """Schedule ``problem`` with PyTorch's schedule ``name`` (e.g. ``1F1B``, ``ZBVZeroBubble``),
    timed by the simulator; raises :class:`NotApplicable` when the problem has the wrong shape
    or PyTorch rejects it. ``options`` is accepted for the common signature and ignored."""
    t0 = time.perf_counter()
    canon, ts = _lookup(name)
    _check_shape(problem, canon, ts)
    prob = fused_variant(problem) if ts.fused_only else problem
    try:
        actions = torch_actions(canon, prob.devices, prob.microbatches, prob.virtual_stages)
    except (ValueError, RuntimeError, AssertionError, ZeroDivisionError) as exc:
        raise NotApplicable(f"torch:{canon}: PyTorch rejects this shape: {exc}") from None
    except ImportError as exc:  # another torch than the pinned one (pipeopt.executor._torch)
        raise NotApplicable(f"torch:{canon}: {exc}") from None
    # Sub-blocks: PyTorch's order of the uncut stages, each op then run piece by piece.
    whole = merge(prob)
    orders, fixup = to_orders(whole, actions, canon)
    for d, order in enumerate(orders):
        for op in order:
            if not 0 <= op.stage < whole.stages or whole.stage_device[op.stage] != d:
                raise NotApplicable(f"torch:{canon}: rank {d} runs stage {op.stage}, which "
                                    f"placement {prob.placement} puts elsewhere")
    orders = expand_orders(prob, orders)
    try:
        sched = simulate(prob, orders, method=f"torch:{canon}")
    except ScheduleError as exc:
        raise NotApplicable(f"torch:{canon}: PyTorch's order is not a valid schedule here: "
                            f"{exc}") from None
    details: tuple[tuple[str, Any], ...] = (("torch_schedule", ts.cls),)
    if fixup:
        details += (("torch_fixup", fixup),)
    info = SolverInfo(status="heuristic", lower_bound=lower_bound(problem),
                      wall_time=time.perf_counter() - t0, details=details)
    return Schedule(prob, sched.method, sched.ops, sched.messages, info)
