"""The one home of the private ``torch.distributed.pipelining`` names pipeopt uses.

They have changed between releases, so they are imported here only, after a version check:
on a torch other than :data:`SUPPORTED` importing this module raises :class:`TorchVersionError`
with what to install. Everything else in pipeopt reaches them through this module. The one
other tie to PyTorch's internals is :class:`pipeopt.executor.runtime.TimedStage`, a
``PipelineStage`` that overrides its ``*_one_chunk`` methods and ``backward_maybe_with_nosync``
(whose ``bwd_kwargs`` keys it reads); it is checked against the same version.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

#: The torch release whose private pipelining runtime the executor was checked against.
SUPPORTED = "2.13"


class TorchVersionError(ImportError):
    """The installed torch is not the one whose private pipelining API pipeopt uses."""


def _check_version(version: str) -> None:
    if not (version == SUPPORTED or version.startswith(SUPPORTED + ".")):
        raise TorchVersionError(
            f"pipeopt's executor uses private torch.distributed.pipelining APIs checked on torch "
            f"{SUPPORTED}.x; this is torch {version}: pip install 'pipeopt[torch]' "
            f"(torch=={SUPPORTED}.*)")


_check_version(torch.__version__.split("+")[0])

# ruff: noqa: E402  (the imports below must follow the version check)
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineScheduleRuntime,
    _validate_schedule,
)

__all__ = ["SUPPORTED", "TorchVersionError", "action", "get_schedule_ops", "group_options",
           "load_actions", "lower", "parse_action", "rows_to_actions", "runtime",
           "stage_backward_input", "stage_backward_weight"]

#: pipeopt op kind -> torch computation type (B is our split input gradient when split).
_KIND = {"F": _ComputationType.FORWARD, "I": _ComputationType.BACKWARD_INPUT,
         "W": _ComputationType.BACKWARD_WEIGHT, "B": _ComputationType.FULL_BACKWARD}


def action(stage: int, kind: str, microbatch: int) -> Any:
    """The runtime's action for ``kind`` in F, I (input gradient), W, B (full backward)."""
    return _Action(stage, _KIND[kind], microbatch)


def parse_action(cell: str) -> Any:
    """torch's own reading of one action string (``_Action.from_str``)."""
    return _Action.from_str(cell)


def rows_to_actions(rows: Sequence[Iterable[tuple[int, str, int]]]) -> dict[int, list[Any]]:
    """Per-rank ``(stage, kind, microbatch)`` rows as the runtime's compute-only actions."""
    return {r: [action(k, kind, j) for k, kind, j in row] for r, row in enumerate(rows)}


def runtime(stages: list[Any], microbatches: int, loss_fn: Any,
            actions: dict[int, list[Any]]) -> Any:
    """PyTorch's ``_PipelineScheduleRuntime`` over this rank's ``stages`` with the
    compute-only ``actions`` of every rank loaded (it lowers them itself); gradients scaled by
    the number of micro-batches, as for a mean loss."""
    rt = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    load_actions(rt, actions)
    return rt


def lower(actions: dict[int, list[Any]], stages: int, microbatches: int
          ) -> dict[int, list[Any]]:
    """torch's lowering of a compute-only schedule: validation (stage -> rank map) and its
    send / receive insertion, without a process group. Raises torch's error on a bad one."""
    stage_rank = _validate_schedule(actions, len(actions), stages, microbatches)
    return _add_send_recv({r: list(a) for r, a in actions.items()},
                          stage_to_rank=lambda s: stage_rank[s], num_stages=stages)


def load_actions(rt: Any, actions: dict[int, list[Any]]) -> None:
    """Replace the compute-only ``actions`` of a :func:`runtime` (lowered again by it)."""
    rt._prepare_schedule_with_comms(actions)


def group_options(backend: str, timeout_s: float) -> Any:
    """Process-group options of ``backend`` (gloo, nccl) whose operations time out after
    ``timeout_s`` seconds, for ``init_device_mesh``'s ``backend_override`` (the timeout is the
    options' private ``_timeout``, which DeviceMesh reads)."""
    import datetime

    import torch.distributed as dist

    opts = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
            else dist.ProcessGroupGloo._Options())
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return opts
