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

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import eq
from typing import overload

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
    """Per-device op orders as task-id orders (:func:`task_id` of every op)."""
    s, m = problem.stages, problem.microbatches
    first = {k: i * s * m for i, k in enumerate(problem.kinds)}  # id of (kind, 0, 0)
    # Unpacking the op beats reading its fields by name (a sixth of the time at p = 64).
    return [[first[kind] + stage * m + j for kind, stage, j in order] for order in orders]


def message_bytes(problem: Problem, src_stage: int, dst_stage: int) -> float:
    """Bytes of a unit micro-batch's message from ``src_stage`` to the adjacent ``dst_stage``
    (0 when both are on one device): the boundary's ``message_size``, as
    :meth:`Problem.transfer` sends it; micro-batch j's is this times its factor in
    :attr:`Problem.message_table`."""
    sd = problem.stage_device
    if sd[src_stage] == sd[dst_stage]:
        return 0.0
    return problem.message_size[min(src_stage, dst_stage)]


@dataclass(frozen=True, eq=False)
class OpLabels(Sequence[str]):
    """The task labels of :func:`build`'s graph, ``str(op)`` of each task's op (``0F3``: stage,
    kind, micro-batch), made when read: most graphs are timed without printing a label."""

    stages: int
    microbatches: int
    kinds: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.kinds) * self.stages * self.microbatches

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(map(self.__getitem__, range(*i.indices(len(self)))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"task {i} out of range 0..{n - 1}")
        km, j = divmod(i % n, self.microbatches)
        kind, k = divmod(km, self.stages)
        return f"{k}{self.kinds[kind]}{j}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(map(eq, self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))


@dataclass(frozen=True, eq=False)
class ChainGraph:
    """A problem with its task graph (``graph`` is ``build(problem)``), made once by
    :func:`chain_graph` and handed to :func:`pipeopt.simulate.simulate` by a caller that times
    several orders of one problem: each call then skips the build (about 0.03 s at p = 64,
    m = 1024). Immutable; the simulator refuses it with any other problem."""

    problem: Problem
    graph: TaskGraph


def chain_graph(problem: Problem) -> ChainGraph:
    """``problem`` with :func:`build`'s graph of it (:func:`graph_of`: built once per problem
    object), for :func:`pipeopt.simulate.simulate`."""
    return ChainGraph(problem, graph_of(problem))


#: How many problems' graphs :func:`graph_of` keeps: the most recently used ones. A graph of
#: p = 64, m = 1024 with split backward holds about 30 MB of columns; each also goes as soon
#: as its problem is freed.
GRAPH_CACHE_SIZE = 4


class _GraphCache:
    """The graphs of the last :data:`GRAPH_CACHE_SIZE` problem objects :func:`graph_of` was
    asked for, keyed by identity (``id``) with a weak reference to each problem: an entry
    leaves when its problem is freed or when newer ones push it out, and never keeps a problem
    alive (a graph holds no reference to its problem). A problem equal to a cached one but not
    the same object gets a graph of its own (hashing or comparing a large problem would cost
    more than a lookup should). Correct because a :class:`Problem` is immutable."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Reentrant: a problem freed inside a locked region runs its callback, which locks.
        self._lock = threading.RLock()
        self._entries: OrderedDict[int, tuple[weakref.ref[Problem], TaskGraph]] = OrderedDict()

    def get(self, problem: Problem) -> TaskGraph | None:
        """The cached graph of this very ``problem`` object, or None."""
        key = id(problem)
        with self._lock:
            hit = self._entries.get(key)
            if hit is None or hit[0]() is not problem:
                return None
            self._entries.move_to_end(key)
            return hit[1]

    def put(self, problem: Problem, graph: TaskGraph) -> None:
        """Keep ``graph`` as ``problem``'s, pushing out the least recently used beyond the
        size."""
        key = id(problem)

        def forget(ref: weakref.ref[Problem], key: int = key) -> None:
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None and hit[0] is ref:
                    del self._entries[key]

        with self._lock:
            self._entries[key] = (weakref.ref(problem, forget), graph)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_CACHE = _GraphCache(GRAPH_CACHE_SIZE)


def graph_of(problem: Problem) -> TaskGraph:
    """:func:`build`'s graph of ``problem``, built once per problem object: the graphs of the
    last :data:`GRAPH_CACHE_SIZE` problems asked for are kept while those problems live (so
    ``simulate`` called again on one problem skips the build, about 0.02 s at p = 64,
    m = 1024)."""
    graph = _CACHE.get(problem)
    if graph is None:
        graph = build(problem)
        _CACHE.put(problem, graph)
    return graph


@cyclic_gc_paused()  # one object per task and no reference cycles (pipeopt._gc)
def build(problem: Problem) -> TaskGraph:
    """The task graph of ``problem`` (see the module docstring).

    Columns are made whole (per (kind, stage) block of m tasks or edges, never one Python call
    per task) and handed to :meth:`TaskGraph.trusted`: by construction they hold every rule the
    validated constructor checks (ids in range, links for every cross-device edge, no cycle:
    edges run F forward, F -> B, B backward, B -> W), which ``tests/test_core_training.py``
    checks against :class:`TaskGraph` itself.
    """
    s, m = problem.stages, problem.microbatches
    kinds = problem.kinds
    kind_index = {k: i for i, k in enumerate(kinds)}
    sd = problem.stage_device
    last = kinds[-1]
    uniform = problem.uniform_microbatches
    tail: list[float] = []
    in_degree: list[int] = []
    alloc: list[float] = []  # uniform micro-batches: memory read once per (kind, stage)
    mem_end: list[float] = []
    # Ops of one (kind, stage) share their inputs' kinds and stages, each on its own
    # micro-batch: one block of m edges per input, blocks in consumer order.
    blocks: list[tuple[int, int, int, int]] = []  # (producer id 0, consumer id 0, stages)
    for kd in kinds:
        for k in range(s):
            base = (kind_index[kd] * s + k) * m
            tail += [problem.grad_reduce[k] if kd == last else 0.0] * m
            inputs = problem.inputs(Op(kd, k, 0))
            in_degree += [len(inputs)] * m
            if uniform:
                a, f = problem.memory_delta(Op(kd, k, 0))
                alloc += [a] * m
                mem_end += [-f] * m
            for x in inputs:
                blocks.append(((kind_index[x.kind] * s + x.stage) * m, base, x.stage, k))
    pairs = sorted({(sd[a], sd[b]) for _, _, a, b in blocks if sd[a] != sd[b]})
    link_id = {ab: i for i, ab in enumerate(pairs)}
    latency = tuple(problem.latency[a][b] for a, b in pairs)
    bandwidth = tuple(problem.bandwidth[a][b] for a, b in pairs)
    table = problem.message_table
    edge_link: list[int] = []
    edge_latency: list[float] = []
    size: list[float] = []
    serialized = False
    outputs: dict[int, list[tuple[int, float]]] = {}  # producer block -> (consumer, latency)
    for x0, c0, a, b in blocks:
        k = link_id.get((sd[a], sd[b]), -1)
        lat = latency[k] if k >= 0 else 0.0
        outputs.setdefault(x0, []).append((c0, lat))
        edge_link += [k] * m
        edge_latency += [lat] * m
        nbytes = message_bytes(problem, a, b)
        sizes = ([nbytes] * m if uniform or not nbytes
                 else [nbytes * c for c in table[min(a, b)]])
        size += sizes
        if k >= 0 and not serialized and not math.isinf(bandwidth[k]):  # TaskGraph's rule
            serialized = any(x / bandwidth[k] > 0 for x in ((nbytes,) if uniform or not nbytes
                                                            else set(sizes)))
    # Producer block x0's tasks all hand on to the same consumer blocks, shifted alike.
    out_steps: list[tuple[tuple[int, float], ...]] = []
    for x0 in range(0, len(tail), m):
        out_steps += [tuple((c0 - x0, lat) for c0, lat in outputs.get(x0, ()))] * m
    # Edge ends as slices of one tuple of task ids: the int objects are made once per task,
    # not once per edge end (about a third of the build's time at p = 64, m = 1024).
    ids = tuple(range(len(tail)))
    src = tuple(chain.from_iterable(ids[x0:x0 + m] for x0, _, _, _ in blocks))
    dst = tuple(chain.from_iterable(ids[c0:c0 + m] for _, c0, _, _ in blocks))
    if not uniform:
        allocs, free = problem.op_memory_deltas()
        negated = {x: -x for x in set(free)}  # a few distinct values: no new float per task
        alloc, mem_end = list(allocs), list(map(negated.__getitem__, free))
    return TaskGraph.trusted(
        memory_limit=problem.memory_limit, static_memory=problem.static_memory,
        link_src=tuple(a for a, _ in pairs), link_dst=tuple(b for _, b in pairs),
        latency=latency, bandwidth=bandwidth,
        device=problem.op_table[0], duration=problem.op_durations(), mem_start=tuple(alloc),
        mem_end=tuple(mem_end), label=OpLabels(s, m, kinds),
        tail=tuple(tail), src=src, dst=dst, bytes=tuple(size),
        meta=(("workload", "training"),),
        given={"edge_link": tuple(edge_link), "edge_latency": tuple(edge_latency),
               "serialized": serialized, "in_degree": tuple(in_degree),
               "out_steps": tuple(out_steps)})

