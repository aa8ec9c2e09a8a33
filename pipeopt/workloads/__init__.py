"""Workload builders: each turns one kind of problem into a :class:`~pipeopt.core.graph.TaskGraph`.

:mod:`pipeopt.workloads.training` builds today's synchronous pipeline (a chain of F/B/W stages);
:mod:`pipeopt.workloads.dataparallel` replicates it and adds each stage's data-parallel
collectives as communication tasks on the replicas' links; :mod:`pipeopt.workloads.moe` builds
a pipeline of MoE blocks whose dispatch and combine all-to-all are communication tasks.
"""
