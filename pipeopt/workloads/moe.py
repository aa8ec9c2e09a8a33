"""A pipeline of MoE stages as a task graph: each MoE block's dispatch and combine all-to-all are
communication tasks, so a device may compute another micro-batch while one's all-to-all is in
flight (DeepSeek-V3's DualPipe overlap, here found by the search instead of hand-written).

Per stage s (device s) and micro-batch j, with the stage's MoE blocks l = 0..L-1 (times in
seconds; ``a2a s`` is the stage's expert-parallel network resource, one per device):

* forward: ``A`` (attention + router, and the dense work before the block) -> dispatch ``D``
  (on ``a2a s``) -> routed experts ``E`` -> combine ``C`` (on ``a2a s``) -> the next block's
  ``A``; shared experts ``S`` (when given) run from ``A`` beside the dispatch and join at the
  next block; after the last block ``O`` (the combine's weighted sum, dense work after the
  blocks, the LM head on the last stage) sends the activation to stage s + 1;
* backward (input gradients, mirrored): ``O`` -> per block from the last: combine-gradient
  all-to-all ``dC`` -> experts ``E`` -> dispatch-gradient all-to-all ``dD`` -> ``A`` (with the
  shared experts' ``S`` beside them); the block-0 ``A`` sends the gradient to stage s - 1;
* ``W``: the stage's weight gradients, one device task after its backward (with
  ``split_backward=False`` each backward task does its own weight gradient and there is no W).

Memory (bytes): each forward task allocates its activations when it starts; each backward task
frees its own part less what its weight gradient still needs when it ends, ``W`` frees the rest.
The all-to-all tasks change no memory (the core's rule for communication tasks).

A dispatch and a combine of the same stage take turns on ``a2a s`` whatever their micro-batch
(the rank's NIC carries one all-to-all at a time, at full bandwidth: the same total time as
sharing it). The other ranks of the EP group are taken to be data-parallel replicas of this
pipeline running the same schedule, so one pipeline stands for the group (DualPipe's setting:
DeepSeek-V3 report, section 3.2.2). Pipeline messages use the stage links, not ``a2a s``.

:func:`task_orders` expands a chain schedule's op orders (:mod:`pipeopt.schedules`) into device
orders in which each op's tasks run back to back: the device waits for its own all-to-all (the
hand-made schedule without overlap). :func:`windowed` adds edges that let a device run ahead at
most into the next op of such an order, the input of a list schedule by op position that
overlaps an op's all-to-all with the next op's compute (the same hand-made order with overlap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeopt.core.graph import TaskGraph
from pipeopt.problem import Op, Problem, uniform_problem


class Work(NamedTuple):
    """One piece of compute for one micro-batch (s, bytes): ``forward``, ``backward_input``,
    ``backward_weight`` seconds, ``activation_bytes`` kept from the forward to the backward,
    ``weight_grad_bytes`` (<= activation) of them kept after the backward until W."""

    forward: float
    backward_input: float = 0.0
    backward_weight: float = 0.0
    activation_bytes: float = 0.0
    weight_grad_bytes: float = 0.0


class MoEBlock(NamedTuple):
    """One MoE block of a stage: ``attention`` (and router) work, routed ``experts`` work,
    ``shared`` experts (None: none), and the ``dispatch`` / ``combine`` all-to-all seconds
    (each also the seconds of its gradient all-to-all in the backward)."""

    attention: Work
    experts: Work
    dispatch: float
    combine: float
    shared: Work | None = None


@dataclass(frozen=True)
class MoEPipeline:
    """An MoE pipeline: ``stages[s]`` is stage s's MoE blocks, ``post[s]`` its work after
    them (default none); one device per stage; ``microbatches``; ``message_bytes`` between
    stages over links of ``latency`` (s) and ``bandwidth`` (bytes/s); ``memory_limit[s]``
    (bytes, None = unlimited) and ``static_memory[s]`` (bytes) per device."""

    stages: tuple[tuple[MoEBlock, ...], ...]
    microbatches: int
    post: tuple[Work, ...] = ()
    split_backward: bool = True
    message_bytes: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    memory_limit: tuple[float | None, ...] = ()
    static_memory: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        p = len(self.stages)
        if p < 1:
            raise ValueError("stages: need at least one stage")
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"microbatches: must be an integer >= 1, got {m!r}")
        set_ = object.__setattr__
        set_(self, "stages", tuple(tuple(MoEBlock(*b) for b in st) for st in self.stages))
        set_(self, "post", tuple(Work(*w) for w in self.post) or (Work(0.0),) * p)
        if len(self.post) != p:
            raise ValueError(f"post: expected {p} values (one per stage), got {len(self.post)}")
        for s, blocks in enumerate(self.stages):
            for b, blk in enumerate(blocks):
                where = f"stages[{s}][{b}]"
                for name in ("dispatch", "combine"):
                    _seconds(f"{where}.{name}", getattr(blk, name))
                for name in ("attention", "experts", "shared"):
                    w = getattr(blk, name)
                    if w is not None:
                        _check_work(f"{where}.{name}", w)
            _check_work(f"post[{s}]", self.post[s])
        _seconds("latency", self.latency)
        if not (self.message_bytes >= 0 and math.isfinite(self.message_bytes)):
            raise ValueError(f"message_bytes: must be a finite number >= 0, got "
                             f"{self.message_bytes!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth: must be > 0 bytes/s, got {self.bandwidth!r}")
        lim = tuple(self.memory_limit) or (None,) * p
        static = tuple(self.static_memory) or (0.0,) * p
        if len(lim) != p or len(static) != p:
            raise ValueError(f"memory_limit / static_memory: expected {p} values (one per "
                             f"stage), got {len(lim)} / {len(static)}")
        set_(self, "memory_limit", lim)
        set_(self, "static_memory", static)

    @property
    def devices(self) -> int:
        """Number of devices (= stages)."""
        return len(self.stages)

    def problem(self) -> Problem:
        """A chain problem of the same shape (stages, micro-batches, split or fused backward;
        unit op times: only its op orders are used), for the hand-made generators of
        :mod:`pipeopt.schedules`; :func:`task_orders` maps their orders to this graph's tasks.
        """
        p, m = self.devices, self.microbatches
        return uniform_problem(p, m, 1.0, 1.0, 1.0 if self.split_backward else 0.0,
                               split_backward=self.split_backward)


def _seconds(name: str, x: float) -> None:
    if not (isinstance(x, (int, float)) and 0 <= x < math.inf):
        raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {x!r}")


def _check_work(name: str, w: Work) -> None:
    for k in ("forward", "backward_input", "backward_weight"):
        _seconds(f"{name}.{k}", getattr(w, k))
    for k in ("activation_bytes", "weight_grad_bytes"):
        x = getattr(w, k)
        if not (isinstance(x, (int, float)) and 0 <= x < math.inf):
            raise ValueError(f"{name}.{k}: must be a finite number of bytes >= 0, got {x!r}")
    if w.weight_grad_bytes > w.activation_bytes:
        raise ValueError(f"{name}.weight_grad_bytes: must be <= activation_bytes "
                         f"({w.activation_bytes:g}), got {w.weight_grad_bytes:g}")


class _Graph:
    """Columns of the graph being built, and the task id of every (name, stage, mb, block)."""

    def __init__(self) -> None:
        self.device: list[int] = []
        self.duration: list[float] = []
        self.mem_start: list[float] = []
        self.mem_end: list[float] = []
        self.label: list[str] = []
        self.group: list[str] = []
        self.holds: list[tuple[int, ...]] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.bytes: list[float] = []
        self.index: dict[tuple[str, int, int, int], int] = {}

    def task(self, key: tuple[str, int, int, int], device: int, seconds: float, group: str, *,
             alloc: float = 0.0, free: float = 0.0, holds: tuple[int, ...] = ()) -> int:
        name, s, j, b = key
        kind = name[0]
        part = name[1:]
        self.index[key] = len(self.device)
        self.device.append(device)
        self.duration.append(seconds)
        self.mem_start.append(alloc)
        self.mem_end.append(-free)
        self.label.append(f"{s}{kind}{j}.{part}" + (str(b) if b >= 0 else ""))
        self.group.append(group)
        self.holds.append(holds)
        return len(self.device) - 1

    def edge(self, a: int, b: int, nbytes: float = 0.0) -> None:
        self.src.append(a)
        self.dst.append(b)
        self.bytes.append(nbytes)


def _weight(w: Work | None, split: bool) -> tuple[float, float]:
    """(backward seconds, bytes freed at its end) of one piece: the input gradient, plus the
    weight gradient when the backward is fused."""
    if w is None:
        return 0.0, 0.0
    if split:
        return w.backward_input, w.activation_bytes - w.weight_grad_bytes
    return w.backward_input + w.backward_weight, w.activation_bytes


def _assemble(pipe: MoEPipeline) -> _Graph:
    """The columns of :func:`build`'s graph and its task index."""
    p, m, split = pipe.devices, pipe.microbatches, pipe.split_backward
    g = _Graph()
    nl = 2 * (p - 1)  # the links between adjacent stages, both ways (build() lists them)
    a2a = [(nl + s,) for s in range(p)]  # the EP network resource of each stage
    for s, blocks in enumerate(pipe.stages):
        post = pipe.post[s]
        for j in range(m):
            prev: list[int] = []  # tasks the next forward piece waits for
            for b, blk in enumerate(blocks):
                att, exp, sh = blk.attention, blk.experts, blk.shared
                a = g.task(("Fattn", s, j, b), s, att.forward, "attention F",
                           alloc=att.activation_bytes)
                for x in prev:
                    g.edge(x, a)
                d = g.task(("Fdispatch", s, j, b), -1, blk.dispatch, "all-to-all",
                           holds=a2a[s])
                g.edge(a, d)
                e = g.task(("Fexperts", s, j, b), s, exp.forward, "experts F",
                           alloc=exp.activation_bytes)
                g.edge(d, e)
                c = g.task(("Fcombine", s, j, b), -1, blk.combine, "all-to-all",
                           holds=a2a[s])
                g.edge(e, c)
                prev = [c]
                if sh is not None:
                    x = g.task(("Fshared", s, j, b), s, sh.forward, "shared F",
                               alloc=sh.activation_bytes)
                    g.edge(a, x)
                    prev.append(x)
            o = g.task(("Fout", s, j, -1), s, post.forward, "out F",
                       alloc=post.activation_bytes)
            for x in prev:
                g.edge(x, o)
            ob, ofree = _weight(post, split)
            g.task(("Bout", s, j, -1), s, ob, "out B", free=ofree)
            if s == p - 1:
                g.edge(o, g.index[("Bout", s, j, -1)])
            prev = [g.index[("Bout", s, j, -1)]]
            for b in range(len(blocks) - 1, -1, -1):
                blk = blocks[b]
                dc = g.task(("Bcombine", s, j, b), -1, blk.combine, "all-to-all",
                            holds=a2a[s])
                for x in prev:
                    g.edge(x, dc)
                eb, efree = _weight(blk.experts, split)
                e = g.task(("Bexperts", s, j, b), s, eb, "experts B", free=efree)
                g.edge(dc, e)
                dd = g.task(("Bdispatch", s, j, b), -1, blk.dispatch, "all-to-all",
                            holds=a2a[s])
                g.edge(e, dd)
                ab, afree = _weight(blk.attention, split)
                a = g.task(("Battn", s, j, b), s, ab, "attention B", free=afree)
                g.edge(dd, a)
                if blk.shared is not None:
                    sb, sfree = _weight(blk.shared, split)
                    x = g.task(("Bshared", s, j, b), s, sb, "shared B", free=sfree)
                    for y in prev:
                        g.edge(y, x)
                    g.edge(x, a)
                prev = [a]
            if split:
                pieces = [post] + [w for blk in blocks
                                   for w in (blk.attention, blk.experts, blk.shared) if w]
                w = g.task(("Wall", s, j, -1), s, sum(x.backward_weight for x in pieces),
                           "W", free=sum(x.weight_grad_bytes for x in pieces))
                g.edge(prev[0], w)
    for s in range(1, p):  # pipeline messages: F forward, B backward, per micro-batch
        for j in range(m):
            g.edge(g.index[("Fout", s - 1, j, -1)], _first_f(g, pipe, s, j), pipe.message_bytes)
            g.edge(_last_b(g, pipe, s, j), g.index[("Bout", s - 1, j, -1)], pipe.message_bytes)
    return g


def build(pipe: MoEPipeline) -> TaskGraph:
    """The task graph of ``pipe`` (see the module docstring). Labels: ``{stage}{F|B|W}{mb}.
    {part}{block}`` (``2F5.dispatch0``); ``meta["task_group"]`` colours plots by part."""
    g = _assemble(pipe)
    p = pipe.devices
    links = [(s, s + 1) for s in range(p - 1)] + [(s + 1, s) for s in range(p - 1)]
    nl = len(links)
    return TaskGraph(
        memory_limit=pipe.memory_limit, static_memory=pipe.static_memory,
        link_src=tuple(a for a, _ in links), link_dst=tuple(b for _, b in links),
        latency=(pipe.latency,) * nl, bandwidth=(pipe.bandwidth,) * nl,
        device=tuple(g.device), duration=tuple(g.duration), mem_start=tuple(g.mem_start),
        mem_end=tuple(g.mem_end), label=tuple(g.label), src=tuple(g.src), dst=tuple(g.dst),
        bytes=tuple(g.bytes), networks=tuple(f"a2a {s}" for s in range(p)),
        holds=tuple(g.holds),
        meta=(("workload", "moe"), ("task_group", tuple(g.group))))


def _last_b(g: _Graph, pipe: MoEPipeline, s: int, j: int) -> int:
    """The task of stage s's backward of micro-batch j that sends the gradient on."""
    return g.index[("Battn", s, j, 0)] if pipe.stages[s] else g.index[("Bout", s, j, -1)]


def _first_f(g: _Graph, pipe: MoEPipeline, s: int, j: int) -> int:
    """The task of stage s's forward of micro-batch j that receives the activation."""
    return g.index[("Fattn", s, j, 0)] if pipe.stages[s] else g.index[("Fout", s, j, -1)]


def _op_tasks(pipe: MoEPipeline, index: dict[tuple[str, int, int, int], int], op: Op
              ) -> list[int]:
    """The device tasks of chain op ``op`` in the order they run back to back: a forward's
    blocks in order (attention, shared experts beside the dispatch, experts), then ``O``; a
    backward's ``O`` then its blocks from the last (shared, experts, attention); ``W``."""
    s, j = op.stage, op.microbatch
    blocks = range(len(pipe.stages[s]))
    shared = [blk.shared is not None for blk in pipe.stages[s]]
    if op.kind == "F":
        out = []
        for b in blocks:
            out += [index[("Fattn", s, j, b)]] + (
                [index[("Fshared", s, j, b)]] if shared[b] else []) + [
                index[("Fexperts", s, j, b)]]
        return [*out, index[("Fout", s, j, -1)]]
    if op.kind == "B":
        out = [index[("Bout", s, j, -1)]]
        for b in reversed(blocks):
            out += ([index[("Bshared", s, j, b)]] if shared[b] else []) + [
                index[("Bexperts", s, j, b)], index[("Battn", s, j, b)]]
        return out
    if op.kind == "W" and pipe.split_backward:
        return [index[("Wall", s, j, -1)]]
    raise ValueError(f"orders: op {op} is not an op of this pipeline (kinds "
                     f"{'F, B, W' if pipe.split_backward else 'F, B'})")


def task_orders(pipe: MoEPipeline, orders: Sequence[Sequence[Op]]) -> list[list[int]]:
    """A chain schedule's per-device op orders (of :meth:`MoEPipeline.problem`) as device
    orders of :func:`build`'s graph, each op's tasks back to back: a device waits for its own
    all-to-all (no overlap); the all-to-all tasks run as early as allowed."""
    index = _assemble(pipe).index
    return [[t for op in order for t in _op_tasks(pipe, index, op)] for order in orders]


def windowed(graph: TaskGraph, pipe: MoEPipeline, orders: Sequence[Sequence[Op]],
             window: int = 2) -> tuple[TaskGraph, list[float]]:
    """``graph`` with edges that keep each device within ``window`` consecutive ops of its op
    order (op k + window starts after ops 0..k ended), and a priority per task
    (earlier ops first) for :func:`pipeopt.core.greedy.list_schedule`: the hand-made order
    with an op's all-to-all overlapped by the next ops' compute. Every schedule of the
    returned graph is one of ``graph`` (only edges are added, on one device, without delay).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: must be an integer >= 1, got {window!r}")
    index = _assemble(pipe).index
    src, dst = list(graph.src), list(graph.dst)
    prio = [0.0] * graph.num_tasks
    for order in orders:
        tasks = [_op_tasks(pipe, index, op) for op in order]
        for k, ts in enumerate(tasks):
            for t in ts:
                prio[t] = float(len(tasks) - k)
            # op k + window waits for ops k - window + 1 .. k: with every earlier op's own
            # such edges, for all ops up to k (at most ``window`` ops open at once)
            if k + window < len(tasks):
                for q in range(max(0, k - window + 1), k + 1):
                    src.append(tasks[q][-1])
                    dst.append(tasks[k + window][0])
    extra = len(src) - graph.num_edges
    return graph.replace(src=tuple(src), dst=tuple(dst),
                         bytes=(*graph.bytes, *(0.0,) * extra)), prio


def op_priority(graph: TaskGraph, pipe: MoEPipeline) -> list[float]:
    """A list-scheduling priority per task: the longest path ahead of the first task of its
    op (:func:`pipeopt.core.bounds.tail_paths`), shared by all the op's tasks, so a device
    finishes an op's experts before it opens later micro-batches (per-task longest paths
    prefer every micro-batch's attention first, which stalls the pipeline's fill). Ties go to
    the lower task id: the earlier micro-batch."""
    from pipeopt.core.bounds import tail_paths

    q = tail_paths(graph)
    index = _assemble(pipe).index
    prio = list(q)  # the all-to-all tasks keep their own (they are never chosen)
    kinds = ("F", "B", "W") if pipe.split_backward else ("F", "B")
    for s in range(pipe.devices):
        for j in range(pipe.microbatches):
            for kind in kinds:
                tasks = _op_tasks(pipe, index, Op(kind, s, j))
                for t in tasks:
                    prio[t] = q[tasks[0]]
    return prio


def stage_activation(pipe: MoEPipeline, s: int) -> float:
    """Bytes one micro-batch's forward allocates on stage s: the most it holds there (every
    backward task that frees memory runs after the stage's whole forward)."""
    pieces = [w for blk in pipe.stages[s] for w in (blk.attention, blk.experts, blk.shared) if w]
    return sum(w.activation_bytes for w in pieces) + pipe.post[s].activation_bytes


def inflight_limits(pipe: MoEPipeline) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose whole activations fit beside its static memory:
    ``(limit - static) // stage_activation`` (all of them without a limit), at least 1."""
    out = []
    for s in range(pipe.devices):
        lim, act = pipe.memory_limit[s], stage_activation(pipe, s)
        k = pipe.microbatches if lim is None or act <= 0 else int(
            (lim - pipe.static_memory[s]) // act)
        out.append(max(1, min(pipe.microbatches, k)))
    return tuple(out)


def admitted(graph: TaskGraph, pipe: MoEPipeline, limits: Sequence[int] | None = None
             ) -> TaskGraph:
    """``graph`` with admission edges: on stage s, micro-batch j + K_s's first forward task
    starts after micro-batch j's last task there (``W``, or the last backward task when the
    backward is fused), K_s = ``limits[s]`` (default :func:`inflight_limits`).

    At most K_s micro-batches are then open on stage s at once (two open ones j < j' with
    j' = j mod K_s would need j' - K_s, ..., j closed first), so with the default limits every
    schedule of the returned graph fits the memory limits (when one micro-batch fits at all):
    a list scheduler never opens more micro-batches than fit and stalls with half-allocated
    forwards (without them the core greedy opened ten attention tasks on stage 0 of
    benchmarks/moe.py at m 16 within the hand-made schedules' memory, then waited for their
    memory: 0.85 s against 0.71 s). Every schedule of the returned graph is one of ``graph``
    (edges on one device, no delay)."""
    ks = tuple(limits) if limits is not None else inflight_limits(pipe)
    if len(ks) != pipe.devices or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"limits: expected {pipe.devices} integers >= 1 (one per stage), "
                         f"got {list(ks)!r}")
    g = _assemble(pipe)
    src, dst = list(graph.src), list(graph.dst)
    for s, k in enumerate(ks):
        for j in range(pipe.microbatches - k):
            last = g.index[("Wall", s, j, -1)] if pipe.split_backward else _last_b(g, pipe, s, j)
            src.append(last)
            dst.append(_first_f(g, pipe, s, j + k))
    extra = len(src) - graph.num_edges
    return graph.replace(src=tuple(src), dst=tuple(dst),
                         bytes=(*graph.bytes, *(0.0,) * extra))


def age_priority(graph: TaskGraph, pipe: MoEPipeline) -> list[float]:
    """A list-scheduling priority per task: backward tasks first (they close a micro-batch's
    round trip and free memory), then forward, then ``W`` (it fills gaps); within a kind the
    older (lower) micro-batch first. The all-to-all tasks get 0 (they are never chosen)."""
    m = pipe.microbatches
    rank = {"B": 2, "F": 1, "W": 0}
    prio = [0.0] * graph.num_tasks
    for (name, _s, j, _b), t in _assemble(pipe).index.items():
        if graph.device[t] >= 0:
            prio[t] = float(rank[name[0]] * (m + 1) - j)
    return prio

