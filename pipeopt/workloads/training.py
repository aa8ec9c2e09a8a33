"""The training chain as a task graph: :func:`build` turns a :class:`Problem` into a TaskGraph.

Task id = op id ``(kind_index * stages + stage) * microbatches + microbatch`` with kinds in
``problem.kinds`` order, the numbering of :attr:`Problem.op_table`, so a chain schedule and a
graph schedule map one to one (:func:`task_id`, :func:`task_orders`). Every value is read
through the problem's own accessors:

* durations from :meth:`Problem.duration`;
* memory from :meth:`Problem.memory_delta`: allocated at the op's start (``mem_start``), freed
  at its end (``mem_end`` = minus the freed bytes);
* edges from :meth:`Problem.inputs`: the inputs of (kind, stage, j) are those of
  (kind, stage, 0) on micro-batch j; edges come in blocks of m, ordered by consumer block, so a
  producer's outgoing edges come in the order the chain simulator hands its outputs on;
* a message between stages on different devices carries ``message_size`` of the boundary over
  the directed link with the problem's latency and bandwidth between the two devices, which
  gives the transmission and latency of :meth:`Problem.transfer`;
* the data-parallel gradient reduction ``grad_reduce[k]`` as the tail of every last-kind op
  (W, or the fused B) of stage k: max over tasks of end + tail is then the iteration time.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import neg

from pipeopt._gc import cyclic_gc_paused
from pipeopt.core.graph import TaskGraph
from pipeopt.problem import Op, Problem


def task_id(problem: Problem, op: Op) -> int:
    """The task id of ``op`` in :func:`build`'s graph."""
    kind = problem.kinds.index(op.kind)
    return (kind * problem.stages + op.stage) * problem.microbatches + op.microbatch


def task_op(problem: Problem, task: int) -> Op:
    """The op of task id ``task`` (the inverse of :func:`task_id`)."""
    km, j = divmod(task, problem.microbatches)
    kind, k = divmod(km, problem.stages)
    return Op(problem.kinds[kind], k, j)


def task_orders(problem: Problem, orders: Sequence[Sequence[Op]]) -> list[list[int]]:
    """Per-device op orders as task-id orders."""
    kinds = {k: i for i, k in enumerate(problem.kinds)}
    s, m = problem.stages, problem.microbatches
    return [[(kinds[o.kind] * s + o.stage) * m + o.microbatch for o in order]
            for order in orders]


def message_bytes(problem: Problem, src_stage: int, dst_stage: int) -> float:
    """Bytes of a unit micro-batch's message from ``src_stage`` to the adjacent ``dst_stage``
    (0 when both are on one device): the boundary's ``message_size``, as
    :meth:`Problem.transfer` sends it; micro-batch j's is this times ``message_scale[j]``."""
    sd = problem.stage_device
    if sd[src_stage] == sd[dst_stage]:
        return 0.0
    return problem.message_size[min(src_stage, dst_stage)]


@cyclic_gc_paused()  # one tuple per task and no reference cycles (pipeopt._gc)
def build(problem: Problem) -> TaskGraph:
    """The task graph of ``problem`` (see the module docstring)."""
    dev, stage, mb, kind = problem.op_table
    ops = list(map(tuple.__new__, repeat(Op), zip(kind, stage, mb, strict=True)))
    duration = tuple(map(problem.duration, ops))
    alloc, free = zip(*map(problem.memory_delta, ops), strict=True)

    kinds = {k: i for i, k in enumerate(problem.kinds)}
    s, m = problem.stages, problem.microbatches
    sd = problem.stage_device
    numbers = list(map(str, range(m)))
    uniform, scale = problem.uniform_microbatches, problem.message_scale
    label: list[str] = []
    tail: list[float] = []
    last = problem.kinds[-1]
    src: list[int] = []
    dst: list[int] = []
    size: list[float] = []
    pairs: set[tuple[int, int]] = set()
    # Ops of one (kind, stage) share their inputs' kinds and stages, each on its own
    # micro-batch: one block of m edges per input (tests check this against every op).
    for kd in problem.kinds:
        for k in range(s):
            base = (kinds[kd] * s + k) * m
            label.extend([f"{k}{kd}" + j for j in numbers])
            tail.extend([problem.grad_reduce[k] if kd == last else 0.0] * m)
            for x in problem.inputs(Op(kd, k, 0)):
                xbase = (kinds[x.kind] * s + x.stage) * m
                src.extend(range(xbase, xbase + m))
                dst.extend(range(base, base + m))
                nbytes = message_bytes(problem, x.stage, k)
                size.extend([nbytes] * m if uniform else [nbytes * c for c in scale])
                if sd[x.stage] != sd[k]:
                    pairs.add((sd[x.stage], sd[k]))
    links = sorted(pairs)
    return TaskGraph(
        memory_limit=problem.memory_limit, static_memory=problem.static_memory,
        link_src=tuple(a for a, _ in links), link_dst=tuple(b for _, b in links),
        latency=tuple(problem.latency[a][b] for a, b in links),
        bandwidth=tuple(problem.bandwidth[a][b] for a, b in links),
        device=dev, duration=duration, mem_start=alloc, mem_end=tuple(map(neg, free)),
        label=tuple(label), tail=tuple(tail), src=tuple(src), dst=tuple(dst), bytes=tuple(size),
        meta=(("workload", "training"),))
