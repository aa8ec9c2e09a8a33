"""Workload builders: each turns one kind of problem into a :class:`~pipeopt.core.graph.TaskGraph`.

:mod:`pipeopt.workloads.training` builds today's synchronous pipeline (a chain of F/B/W stages).
"""
