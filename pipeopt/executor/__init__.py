"""Run schedules on torch.distributed, export them to PyTorch, import PyTorch's schedules.

Needs the ``torch`` extra. Entry points: :func:`pipeopt.executor.launch.run_pipeline` (replay a
schedule on spawned ranks or under torchrun), :func:`pipeopt.executor.export.export_torch`
(PyTorch's compute-only CSV) and :func:`pipeopt.schedules.pytorch.solve_torch` (the
``torch:NAME`` methods, read as data). Submodules import torch, so import them directly.
"""
