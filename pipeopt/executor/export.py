"""Export a schedule as torch.distributed.pipelining's compute-only CSV.

One row per rank, one cell per compute action in the rank's order: ``<stage><kind><mb>`` with
kind ``F`` (forward), ``I`` (input gradient: our B of a split backward), ``W`` (weight gradient)
or ``B`` (full backward: our fused B). ``_PipelineScheduleRuntime._load_csv(path,
format="compute_only")`` reads it and adds the communication itself; ``pipeopt run`` hands
the same actions to that runtime in memory. Every cell is checked before writing, because
PyTorch's parser silently accepts a malformed cell by its prefix.
"""

from __future__ import annotations

import csv
import io
import os
import re

from pipeopt.io import write_atomic
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError, check

_CELL = re.compile(r"(\d+)(F|I|W|B)(\d+)")


def schedule_rows(schedule: Schedule) -> tuple[list[list[tuple[int, str, int]]], list[int]]:
    """Per rank, ``(stage, kind, microbatch)`` in torch's vocabulary (our split B is ``I``,
    a fused B is ``B``), and the micro-batch relabelling ``order``: the runtime pairs the
    last stage's losses with its forwards in the order they run, so micro-batch ``i`` of the
    rows is the schedule's micro-batch ``order[i]`` (the identity for in-order schedules)."""
    prob = schedule.problem
    orders = schedule.device_orders()
    last = prob.stages - 1
    order = [op.microbatch for d in orders for op in d if op.kind == "F" and op.stage == last]
    label = {j: i for i, j in enumerate(order)}
    b = "I" if prob.split_backward else "B"
    rows = [[(op.stage, b if op.kind == "B" else op.kind, label[op.microbatch]) for op in d]
            for d in orders]
    return rows, order


def torch_actions(schedule: Schedule) -> list[list[str]]:
    """Per rank, the compute actions of ``schedule`` as PyTorch action strings, in order
    (micro-batches relabelled as :func:`schedule_rows` says)."""
    return [[f"{k}{kind}{j}" for k, kind, j in row] for row in schedule_rows(schedule)[0]]


def check_actions(rows: list[list[str]], schedule: Schedule) -> None:
    """Each cell must parse exactly (no prefix match) back to an op of ``schedule`` on the
    right rank, and every op must appear once. Raises :class:`ScheduleError`."""
    prob = schedule.problem
    back = {"F": "F", "I": "B", "W": "W", "B": "B"}
    seen = set()
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            m = _CELL.fullmatch(cell)
            if m is None:
                raise ScheduleError(f"export: rank {r} action {c}: malformed cell {cell!r}")
            k, kind, j = int(m[1]), m[2], int(m[3])
            if (kind == "I" and not prob.split_backward) or (kind == "B" and prob.split_backward):
                raise ScheduleError(f"export: rank {r} action {c}: {cell} does not match "
                                    f"split_backward={prob.split_backward}")
            if not 0 <= k < prob.stages or prob.stage_device[k] != r:
                raise ScheduleError(f"export: rank {r} action {c}: stage {k} is not on rank {r}")
            key = (back[kind], k, j)
            if key in seen:
                raise ScheduleError(f"export: rank {r} action {c}: {cell} appears twice")
            seen.add(key)
    if len(seen) != prob.num_ops:
        raise ScheduleError(f"export: {prob.num_ops - len(seen)} ops missing")
    _check_with_torch(rows)


def _check_with_torch(rows: list[list[str]]) -> None:
    """When torch is installed, its own parser must print every cell back unchanged."""
    try:
        from pipeopt.executor._torch import parse_action
    except ImportError:  # export works without torch (or with another torch)
        return
    for r, row in enumerate(rows):
        for cell in row:
            if str(parse_action(cell)) != cell:
                raise ScheduleError(f"export: rank {r}: torch reads {cell!r} as "
                                    f"{parse_action(cell)!s}")


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV text of a valid ``schedule``."""
    violations = check(schedule)
    if violations:
        raise ScheduleError(f"export: invalid schedule: {violations[0]}", violations)
    rows = torch_actions(schedule)
    check_actions(rows, schedule)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


def export_torch(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as PyTorch's compute-only CSV to ``path`` (atomically)."""
    write_atomic(path, to_torch_csv(schedule))
