"""The core: a problem as a graph of tasks on devices and network resources, and the methods
over it (a communication task, e.g. a collective, holds links and named networks).

:mod:`pipeopt.core.graph` holds :class:`~pipeopt.core.graph.TaskGraph`, which knows no
workload (F/B/W, stages and micro-batches exist only in builders such as
:mod:`pipeopt.workloads.training` and in labels). Over it: :mod:`~pipeopt.core.simulate`
(device orders -> times), :mod:`~pipeopt.core.validate` (the independent judge),
:mod:`~pipeopt.core.bounds`, :mod:`~pipeopt.core.greedy` and :mod:`~pipeopt.core.cpsat`.
Nothing is imported here, so ``import pipeopt.core.graph`` stays cheap.
"""
