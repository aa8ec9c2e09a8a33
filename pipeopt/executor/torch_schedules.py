"""Moved to :mod:`pipeopt.schedules.pytorch` (PyTorch's schedules are read as data, not run);
the names stay importable from here."""

from __future__ import annotations

from pipeopt.schedules.pytorch import (
    TORCH_SCHEDULES,
    TorchSchedule,
    solve_torch,
    to_orders,
    torch_actions,
    torch_names,
)

__all__ = ["TORCH_SCHEDULES", "TorchSchedule", "solve_torch", "to_orders", "torch_actions",
           "torch_names"]
