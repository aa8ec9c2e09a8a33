"""Export a schedule as torch.distributed.pipelining's compute-only CSV.

One row per rank, one cell per compute action in the rank's order: ``<stage><kind><mb>`` with
kind ``F`` (forward), ``I`` (input gradient: our B of a split backward), ``W`` (weight gradient)
or ``B`` (full backward: our fused B). ``_PipelineScheduleRuntime._load_csv(path,
format="compute_only")`` reads it and adds the communication itself. Every cell is checked
before writing, because PyTorch's parser silently accepts a malformed cell by its prefix.
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


def torch_actions(schedule: Schedule) -> list[list[str]]:
    """Per rank, the compute actions of ``schedule`` as PyTorch action strings, in order."""
    split = schedule.problem.split_backward
    kind_map = {"F": "F", "B": "I" if split else "B", "W": "W"}
    return [[f"{op.stage}{kind_map[op.kind]}{op.microbatch}" for op in order]
            for order in schedule.device_orders()]


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
        from torch.distributed.pipelining.schedules import _Action
    except ImportError:  # export works without torch
        return
    for r, row in enumerate(rows):
        for cell in row:
            if str(_Action.from_str(cell)) != cell:
                raise ScheduleError(f"export: rank {r}: torch reads {cell!r} as "
                                    f"{_Action.from_str(cell)!s}")


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


def run_torch_rank(rank: int, world: int, device: object, problem: object, cfg: object,
                   source: str, status: object = None) -> dict[str, object]:
    """Train with PyTorch's own pipelining runtime as ``rank`` (process group joined): the
    schedule is a compute-only CSV path, or ``class:NAME`` for a built-in single-stage schedule
    class such as ``class:Schedule1F1B``. Returns per-step losses and times (seconds) and the
    last step's gradients, like :func:`pipeopt.executor.launch.run_rank`."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as tsched

    from pipeopt.executor.check import batch_for, stage_grads
    from pipeopt.executor.models import build_model, split_stages

    prob = problem
    spec = build_model(cfg.model, prob, seed=cfg.seed,  # type: ignore[attr-defined]
                       **dict(cfg.model_options))  # type: ignore[attr-defined]
    stages = split_stages(spec, prob)  # type: ignore[arg-type]
    m, bs = prob.microbatches, cfg.batch(prob.microbatches)  # type: ignore[attr-defined]
    xs, _ = batch_for(spec, bs, cfg.seed, 0, m)  # type: ignore[attr-defined]
    examples = [xs[0]]
    with torch.no_grad():
        for mod in stages:
            examples.append(mod(examples[-1]))
    mine = sorted(prob.device_stages[rank])  # type: ignore[attr-defined]
    pstages = []
    for k in mine:
        inp = examples[k] if k == 0 else examples[k].clone().requires_grad_(True)
        pstages.append(PipelineStage(stages[k].to(device), k, prob.stages, device,
                                     input_args=(inp,),
                                     output_args=(examples[k + 1].clone().requires_grad_(True),)))
    if source.startswith("class:"):
        cls = getattr(tsched, source.split(":", 1)[1])
        target = pstages[0] if issubclass(cls, tsched.PipelineScheduleSingle) else pstages
        sched = cls(target, m, loss_fn=spec.loss_fn, scale_grads=True)
    else:
        sched = tsched._PipelineScheduleRuntime(pstages, m, loss_fn=spec.loss_fn,
                                                scale_grads=True)
        sched._load_csv(source, format="compute_only")
    params = [p for k in mine for p in stages[k].parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr)  # type: ignore[attr-defined]
    losses, times, grads = [], [], None
    last = prob.stages - 1
    for step in range(cfg.steps):  # type: ignore[attr-defined]
        x_mb, y_mb = batch_for(spec, bs, cfg.seed, step, m)  # type: ignore[attr-defined]
        x, y = torch.cat(x_mb).to(device), torch.cat(y_mb).to(device)
        opt.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        dist.barrier()
        t0 = time.perf_counter()
        args = (x,) if 0 in mine else ()
        if last in mine:
            sched.step(*args, target=y, losses=mb_losses)
        else:
            sched.step(*args)
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(sum(float(v.detach()) for v in mb_losses) / m if mb_losses else 0.0)
        if step == cfg.steps - 1:  # type: ignore[attr-defined]
            grads = stage_grads({k: stages[k] for k in mine})
    return {"losses": losses, "step_times": times, "grads": grads}


def run_torch_jobs(rank: int, world: int, device: object,
                   jobs: list[tuple[object, object, str]], status: object = None
                   ) -> list[dict[str, object]]:
    """:func:`run_torch_rank` for several (problem, config, source) jobs in one process group."""
    return [run_torch_rank(rank, world, device, prob, cfg, src) for prob, cfg, src in jobs]
