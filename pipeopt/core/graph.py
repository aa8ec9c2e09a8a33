"""TaskGraph: a problem as tasks on devices, edges between them, links that carry messages.

The instance is columnar: every per-task value is a tuple indexed by task id, every per-edge
value a tuple indexed by edge id, and so on for devices and links. Columns are cheap to build
and to read in tight loops (a p = 64, m = 1024 pipeline is ~200k tasks). The graph knows no
workload; builders (:mod:`pipeopt.workloads`) or :class:`GraphBuilder` make one.

Rules every method over a graph follows (times in seconds, memory in bytes):

* a device runs one task at a time; task ``i`` runs ``duration[i]`` on ``device[i]``;
* edge ``e`` means ``dst[e]`` starts after ``src[e]`` ends; across devices its message of
  ``bytes[e]`` occupies the directed link ``(device[src], device[dst])`` for
  ``bytes / bandwidth`` (one message at a time per direction) and arrives ``latency`` after;
  on the same device there is no delay;
* memory of device ``d`` starts at ``static_memory[d]``; each task adds ``mem_start[i]`` when it
  starts and ``mem_end[i]`` when it ends (either sign); at equal times decreases apply before
  increases; the level never exceeds ``memory_limit[d]`` (None = unlimited);
* the objective is ``max(end[i] + tail[i])`` over tasks (the makespan when every tail is 0);
* a *communication task* (``device[i] == -1``, e.g. a collective) runs on no device: it holds
  the network resources ``holds[i]`` for its whole duration (ids ``0..num_links-1`` are the
  directed links, then one per name in ``networks``: a NIC, a WAN link...); a resource carries
  one thing at a time, a communication task or a message (a message holds its own link);
  edges to or from a communication task carry no bytes and have no delay; it changes no memory.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

#: Waves of at least this many tasks are ordered by numpy at once (narrower: one by one).
_WIDE_WAVE = 64


class GraphError(ValueError):
    """A graph that cannot exist; the message names the field, the index and the reason."""


def _ints(name: str, values: Iterable[int], n: int | None, hi: int) -> tuple[int, ...]:
    try:
        vals = tuple(map(operator.index, values))
    except TypeError:
        vals = tuple(values)
        bad = next(i for i, x in enumerate(vals) if not isinstance(x, int))
        raise GraphError(f"{name}[{bad}]: must be an integer, got {vals[bad]!r}") from None
    if n is not None and len(vals) != n:
        raise GraphError(f"{name}: expected {n} values, got {len(vals)}")
    if vals and (min(vals) < 0 or max(vals) >= hi):
        bad = next(i for i, x in enumerate(vals) if not 0 <= x < hi)
        raise GraphError(f"{name}[{bad}]: must be in 0..{hi - 1}, got {vals[bad]}")
    return vals


def _floats(name: str, values: Iterable[float], n: int, *, signed: bool = False,
            allow_inf: bool = False, positive: bool = False,
            default: float | None = None) -> tuple[float, ...]:
    try:
        vals = tuple(map(float, values))
    except (TypeError, ValueError):
        vals = tuple(values)
        bad = next(i for i, x in enumerate(vals) if not _is_number(x))
        raise GraphError(f"{name}[{bad}]: must be a number, got {vals[bad]!r}") from None
    if not vals and default is not None:
        return (default,) * n
    if len(vals) != n:
        raise GraphError(f"{name}: expected {n} values, got {len(vals)}")
    if not all(map(math.isfinite, vals)):
        bad = next((i for i, x in enumerate(vals)
                    if not (math.isfinite(x) or (allow_inf and x == math.inf))), None)
        if bad is not None:
            raise GraphError(f"{name}[{bad}]: must be a finite number, got {vals[bad]}")
    if vals and not signed and (min(vals) < 0 or (positive and min(vals) == 0)):
        rel = "> 0" if positive else ">= 0"
        bad = next(i for i, x in enumerate(vals) if x < 0 or (positive and x == 0))
        raise GraphError(f"{name}[{bad}]: must be {rel}, got {vals[bad]:g}")
    return vals


def _is_minus_one(x: object) -> bool:
    """True for the integer -1 (a communication task's device), False for anything else."""
    try:
        return operator.index(x) == -1  # type: ignore[arg-type]
    except TypeError:
        return False


def _is_number(x: object) -> bool:
    try:
        float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def _csr(keys: Sequence[int], others: Sequence[int], n: int
         ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(offsets, items, ends): the ids of ``keys`` grouped by key value, each group in id order,
    and ``others`` of those ids in the same order (the task at an edge's other end)."""
    import numpy as np  # here: importing the graph module stays cheap

    a = np.asarray(keys, dtype=np.int64)
    items = np.argsort(a, kind="stable")  # stable: id order within a group
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(a, minlength=n), out=offsets[1:])
    ends = np.asarray(others, dtype=np.int64)[items]
    return tuple(offsets.tolist()), tuple(items.tolist()), tuple(ends.tolist())


#: Columns :meth:`TaskGraph.trusted` may leave out (empty: no network beyond the links).
_OPTIONAL = frozenset({"meta", "networks", "holds"})

#: Derived columns a builder may hand :meth:`TaskGraph.trusted` instead of having them computed.
_GIVEN_DERIVED = frozenset({"edge_link", "edge_latency", "serialized", "in_degree",
                            "out_steps"})


@dataclass(frozen=True, kw_only=True)
class TaskGraph:
    """A frozen, validated task graph (see the module docstring for the rules).

    Devices: ``memory_limit[d]`` (bytes, None = unlimited), ``static_memory[d]`` (bytes).
    Links (directed): ``link_src[l]``, ``link_dst[l]`` (devices), ``latency[l]`` (s),
    ``bandwidth[l]`` (bytes/s, may be inf). Tasks: ``device[i]``, ``duration[i]`` (s),
    ``mem_start[i]`` / ``mem_end[i]`` (bytes, either sign; default 0), ``label[i]`` (default
    ``t<i>``), ``tail[i]`` (s, default 0). Edges: ``src[e]``, ``dst[e]`` (task ids),
    ``bytes[e]`` (default 0). Every cross-device edge needs a link in its direction.
    Network: ``networks`` names resources beyond the links (a NIC, a WAN link); ``holds[i]``
    (default none) the network resource ids (links first, then networks) that communication
    task ``i`` (``device[i] == -1``) holds while it runs.
    """

    memory_limit: tuple[float | None, ...]
    static_memory: tuple[float, ...] = ()
    link_src: tuple[int, ...] = ()
    link_dst: tuple[int, ...] = ()
    latency: tuple[float, ...] = ()
    bandwidth: tuple[float, ...] = ()
    device: tuple[int, ...] = ()
    duration: tuple[float, ...] = ()
    mem_start: tuple[float, ...] = ()
    mem_end: tuple[float, ...] = ()
    label: Sequence[str] = ()
    tail: tuple[float, ...] = ()
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    bytes: tuple[float, ...] = ()
    networks: tuple[str, ...] = ()
    holds: tuple[tuple[int, ...], ...] = ()
    meta: tuple[tuple[str, object], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        lim: list[float | None] = []
        for d, x in enumerate(self.memory_limit):
            if x is None or (_is_number(x) and float(x) == math.inf):
                lim.append(None)
                continue
            if not _is_number(x) or not math.isfinite(float(x)) or float(x) < 0:
                raise GraphError(f"devices.memory_limit[{d}]: must be >= 0 or None, got {x!r}")
            lim.append(float(x))
        set_(self, "memory_limit", tuple(lim))
        p = len(lim)
        if p < 1:
            raise GraphError("devices: a graph needs at least one device")
        set_(self, "static_memory", _floats("devices.static_memory", self.static_memory, p,
                                            default=0.0))
        nl = len(self.link_src)
        set_(self, "link_src", _ints("links.src", self.link_src, None, p))
        set_(self, "link_dst", _ints("links.dst", self.link_dst, nl, p))
        set_(self, "latency", _floats("links.latency", self.latency, nl))
        set_(self, "bandwidth", _floats("links.bandwidth", self.bandwidth, nl, allow_inf=True,
                                        positive=True))
        seen: dict[tuple[int, int], int] = {}
        for k, ab in enumerate(zip(self.link_src, self.link_dst, strict=True)):
            if ab[0] == ab[1]:
                raise GraphError(f"links[{k}]: a link joins two devices, got {ab[0]}->{ab[1]}")
            if ab in seen:
                raise GraphError(f"links[{k}]: {ab[0]}->{ab[1]} is already links[{seen[ab]}]")
            seen[ab] = k
        dev = tuple(self.device)
        comm = {q for q, x in enumerate(dev) if _is_minus_one(x)} if -1 in dev else set()
        if comm:  # communication tasks: -1, checked apart from the device ids
            dev = _ints("tasks.device", (0 if q in comm else x for q, x in enumerate(dev)),
                        None, p)
            dev = tuple(-1 if q in comm else x for q, x in enumerate(dev))
        set_(self, "device", dev if comm else _ints("tasks.device", dev, None, p))
        n = len(self.device)
        set_(self, "duration", _floats("tasks.duration", self.duration, n))
        set_(self, "mem_start", _floats("tasks.mem_start", self.mem_start, n, signed=True,
                                        default=0.0))
        set_(self, "mem_end", _floats("tasks.mem_end", self.mem_end, n, signed=True,
                                      default=0.0))
        set_(self, "tail", _floats("tasks.tail", self.tail, n, default=0.0))
        self._check_network(n)
        labels = tuple(self.label) if self.label else tuple(f"t{i}" for i in range(n))
        if len(labels) != n:
            raise GraphError(f"tasks.label: expected {n} values, got {len(labels)}")
        if not set(map(type, labels)) <= {str}:
            bad = next(i for i, x in enumerate(labels) if not isinstance(x, str))
            raise GraphError(f"tasks.label[{bad}]: must be a string, got {labels[bad]!r}")
        set_(self, "label", labels)
        ne = len(self.src)
        set_(self, "src", _ints("edges.src", self.src, None, n))
        set_(self, "dst", _ints("edges.dst", self.dst, ne, n))
        set_(self, "bytes", _floats("edges.bytes", self.bytes, ne, default=0.0))
        if not isinstance(self.meta, tuple):
            set_(self, "meta", tuple(dict(self.meta).items()))
        _ = self.edge_link  # every cross-device edge has a link
        if self.comm_tasks:
            self._check_comm_edges()
        _ = self.topological_order  # refuses a cycle

    def _check_network(self, n: int) -> None:
        """Network names, ``holds`` and the communication tasks' rules (no device, no memory).
        """
        set_ = object.__setattr__
        names = tuple(self.networks)
        if not set(map(type, names)) <= {str}:
            bad = next(k for k, x in enumerate(names) if not isinstance(x, str))
            raise GraphError(f"networks[{bad}]: must be a string, got {names[bad]!r}")
        set_(self, "networks", names)
        nr = len(self.link_src) + len(names)
        if not self.holds:
            if -1 in self.device:
                i = self.device.index(-1)
                raise GraphError(f"tasks.device[{i}]: -1 (a communication task) needs "
                                 f"tasks.holds[{i}]: the network resources it holds")
            set_(self, "holds", ())
            return
        holds = tuple(self.holds)
        if len(holds) != n:
            raise GraphError(f"tasks.holds: expected {n} values, got {len(holds)}")
        out = []
        for i, h in enumerate(holds):
            try:
                ids = _ints(f"tasks.holds[{i}]", h, None, nr)
            except TypeError:
                raise GraphError(f"tasks.holds[{i}]: must be a list of resource ids, "
                                 f"got {h!r}") from None
            if len(set(ids)) != len(ids):
                raise GraphError(f"tasks.holds[{i}]: a resource is listed twice: {ids}")
            if bool(ids) != (self.device[i] == -1):
                raise GraphError(
                    f"tasks.holds[{i}]: a task holds network resources exactly when it is a "
                    f"communication task (device -1); device {self.device[i]}, holds {ids}")
            if ids and (self.mem_start[i] or self.mem_end[i]):
                raise GraphError(f"tasks.mem_start[{i}]: a communication task changes no "
                                 f"memory, got {self.mem_start[i]:g} / {self.mem_end[i]:g}")
            out.append(ids)
        set_(self, "holds", tuple(out))

    def _check_comm_edges(self) -> None:
        dev = self.device
        for e, (a, b) in enumerate(zip(self.src, self.dst, strict=True)):
            if (dev[a] == -1 or dev[b] == -1) and self.bytes[e]:
                raise GraphError(f"edges[{e}]: {self.label[a]} -> {self.label[b]}: an edge of a "
                                 f"communication task carries no bytes, got {self.bytes[e]:g}")

    @classmethod
    def trusted(cls, *, given: Mapping[str, object] | None = None,
                **columns: Any) -> TaskGraph:
        """A graph from columns a builder guarantees (:mod:`pipeopt.workloads`), unchecked.

        Every field but ``meta`` must be given exactly as validation would store it: tuples of
        the right lengths and types (``label`` may be any sequence of strings), ids in range,
        no cycle, a link for every cross-device edge. Nothing is checked or converted, and
        derived columns are computed when first read (the topological order only by a method
        that needs it), except those in ``given`` (``edge_link``, ``edge_latency``,
        ``serialized``, ``in_degree``, ``out_steps``), which a builder that knows its graph's
        structure makes whole, by blocks of alike tasks. Each builder's tests compare its graph
        with the validated constructor's. Use :class:`TaskGraph` itself for anything built from
        user input.
        """
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in columns and n not in _OPTIONAL]
        unknown = set(columns).difference(names) | set(given or {}).difference(_GIVEN_DERIVED)
        if missing or unknown:
            raise TypeError(f"TaskGraph.trusted: missing {missing}, unknown {sorted(unknown)}")
        graph = object.__new__(cls)
        for name in names:
            object.__setattr__(graph, name, columns.get(name, ()))
        graph.__dict__.update(given or {})  # what the cached properties would compute
        return graph

    # ----- sizes -----------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        """Number of devices."""
        return len(self.memory_limit)

    @property
    def num_tasks(self) -> int:
        """Number of tasks."""
        return len(self.device)

    @property
    def num_edges(self) -> int:
        """Number of edges."""
        return len(self.src)

    @property
    def num_links(self) -> int:
        """Number of directed links."""
        return len(self.link_src)

    @property
    def num_resources(self) -> int:
        """Number of network resources: the directed links, then the named ``networks``."""
        return len(self.link_src) + len(self.networks)

    def resource_name(self, r: int) -> str:
        """``link a->b`` or the network's name, for messages."""
        if r < self.num_links:
            return f"link {self.link_src[r]}->{self.link_dst[r]}"
        return self.networks[r - self.num_links]

    @cached_property
    def comm_tasks(self) -> tuple[int, ...]:
        """Ids of the communication tasks (on no device), in id order."""
        if not self.holds:
            return ()
        return tuple(i for i, h in enumerate(self.holds) if h)

    # ----- derived columns (cached) ----------------------------------------------------------
    @cached_property
    def link_index(self) -> dict[tuple[int, int], int]:
        """Link id of every directed device pair that has one."""
        return {ab: k for k, ab in enumerate(zip(self.link_src, self.link_dst, strict=True))}

    @cached_property
    def edge_link(self) -> tuple[int, ...]:
        """Per edge, the link its message crosses (-1 when both tasks share a device)."""
        dev = self.device
        index: dict[tuple[int, int], int] = {(d, d): -1 for d in range(self.devices)}
        index.update(self.link_index)
        if self.comm_tasks:  # an edge of a communication task crosses no link
            index.update({(a, -1): -1 for a in range(-1, self.devices)})
            index.update({(-1, b): -1 for b in range(self.devices)})
        out = tuple(map(index.get, zip(map(dev.__getitem__, self.src),
                                       map(dev.__getitem__, self.dst), strict=True)))
        if None in out:
            e = out.index(None)
            a, b = self.src[e], self.dst[e]
            raise GraphError(
                f"edges[{e}]: {self.label[a]} (device {dev[a]}) -> {self.label[b]} (device "
                f"{dev[b]}) crosses devices without a link {dev[a]}->{dev[b]}")
        return out  # type: ignore[return-value]

    @cached_property
    def edge_transmission(self) -> tuple[float, ...]:
        """Per edge, seconds its message occupies the link (``bytes / bandwidth``; 0 on the
        same device, for an empty message or an infinite bandwidth)."""
        bw = self.bandwidth
        return tuple(0.0 if k < 0 or b == 0 or math.isinf(bw[k]) else b / bw[k]
                     for k, b in zip(self.edge_link, self.bytes, strict=True))

    @cached_property
    def edge_latency(self) -> tuple[float, ...]:
        """Per edge, seconds from the end of its transmission to its arrival (0 on a device)."""
        lat = (*self.latency, 0.0)  # link -1 (same device) reads the appended 0
        return tuple(map(lat.__getitem__, self.edge_link))

    @cached_property
    def edge_delay(self) -> tuple[float, ...]:
        """Per edge, seconds from the producer's end to the arrival on an idle link."""
        return tuple(t + lat for t, lat in zip(self.edge_transmission, self.edge_latency,
                                               strict=True))

    @cached_property
    def serialized(self) -> bool:
        """True when some message occupies its link for a positive time or some communication
        task holds network resources (resources contend)."""
        return bool(self.comm_tasks) or any(t > 0 for t in self.edge_transmission)

    @cached_property
    def _pred_csr(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return _csr(self.dst, self.src, self.num_tasks)

    @cached_property
    def _succ_csr(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return _csr(self.src, self.dst, self.num_tasks)

    @cached_property
    def in_degree(self) -> tuple[int, ...]:
        """Per task, its number of incoming edges."""
        import numpy as np

        dst = np.asarray(self.dst, dtype=np.int64)
        return tuple(np.bincount(dst, minlength=self.num_tasks).tolist())

    @cached_property
    def out_steps(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Per task ``i``, its outgoing edges as ``(destination - i, latency)`` pairs in edge id
        order: the fast simulator's successors and delays in one small tuple per task (alike
        tasks may share one tuple object, as a builder makes it once per block)."""
        off, tasks = self.succ_offsets, self.succ_tasks
        edges, lat = self.succ_edges, self.edge_latency
        return tuple(tuple((tasks[q] - i, lat[edges[q]]) for q in range(off[i], off[i + 1]))
                     for i in range(self.num_tasks))

    @property
    def pred_offsets(self) -> tuple[int, ...]:
        """CSR offsets: task i's incoming edges are ``pred_edges[pred_offsets[i]:...[i+1]]``."""
        return self._pred_csr[0]

    @property
    def pred_edges(self) -> tuple[int, ...]:
        """Incoming edge ids grouped by destination task, each group in edge id order."""
        return self._pred_csr[1]

    @property
    def pred_tasks(self) -> tuple[int, ...]:
        """Per slot of :attr:`pred_edges`, the edge's source task."""
        return self._pred_csr[2]

    @property
    def succ_offsets(self) -> tuple[int, ...]:
        """CSR offsets: task i's outgoing edges are ``succ_edges[succ_offsets[i]:...[i+1]]``."""
        return self._succ_csr[0]

    @property
    def succ_edges(self) -> tuple[int, ...]:
        """Outgoing edge ids grouped by source task, each group in edge id order."""
        return self._succ_csr[1]

    @property
    def succ_tasks(self) -> tuple[int, ...]:
        """Per slot of :attr:`succ_edges`, the edge's destination task."""
        return self._succ_csr[2]

    def preds(self, task: int) -> tuple[int, ...]:
        """Incoming edge ids of ``task``."""
        off = self.pred_offsets
        return self.pred_edges[off[task]:off[task + 1]]

    def succs(self, task: int) -> tuple[int, ...]:
        """Outgoing edge ids of ``task``."""
        off = self.succ_offsets
        return self.succ_edges[off[task]:off[task + 1]]

    @cached_property
    def device_tasks(self) -> tuple[tuple[int, ...], ...]:
        """Task ids of each device, in id order."""
        out: list[list[int]] = [[] for _ in range(self.devices + 1)]  # [-1]: communication
        for i, d in enumerate(self.device):
            out[d].append(i)
        return tuple(map(tuple, out[:-1]))

    @cached_property
    def topological_order(self) -> tuple[int, ...]:
        """Task ids, every edge's source before its destination: Kahn's algorithm, by waves
        (all tasks whose inputs are all ordered) while waves are wide, which numpy does at once,
        then task by task. Raises :class:`GraphError` naming a cycle."""
        import numpy as np

        n = self.num_tasks
        off_np = np.asarray(self.succ_offsets, dtype=np.int64)
        nxt_np = np.asarray(self.dst, dtype=np.int64)[np.asarray(self.succ_edges,
                                                                 dtype=np.int64)]
        indeg_np = np.bincount(np.asarray(self.dst, dtype=np.int64), minlength=n)
        frontier = np.flatnonzero(indeg_np == 0)
        parts = []
        while frontier.size >= _WIDE_WAVE:
            parts.append(frontier)
            first, count = off_np[frontier], off_np[frontier + 1] - off_np[frontier]
            total = int(count.sum())
            # The CSR slots of every frontier task, side by side.
            slots = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(total)
            targets, hits = np.unique(nxt_np[slots], return_counts=True)
            indeg_np[targets] -= hits
            frontier = targets[indeg_np[targets] == 0]
        order: list[int] = np.concatenate(parts).tolist() if parts else []
        indeg = indeg_np.tolist()
        off = self.succ_offsets
        nxt = nxt_np.tolist()
        queue = frontier.tolist()
        push = queue.append
        for i in queue:  # the list grows while it is walked
            for b in nxt[off[i]:off[i + 1]]:
                c = indeg[b] - 1
                indeg[b] = c
                if not c:
                    push(b)
        order += queue
        if len(order) < n:
            raise GraphError(f"edges: the graph has a cycle: {self._cycle(indeg)}")
        return tuple(order)

    def _cycle(self, indeg: list[int]) -> str:
        """A cycle among the tasks Kahn's algorithm could not order (indeg > 0), as labels."""
        poff, pe, src = self.pred_offsets, self.pred_edges, self.src
        i = next(t for t, c in enumerate(indeg) if c)
        seen: dict[int, int] = {}
        path: list[int] = []
        while i not in seen:
            seen[i] = len(path)
            path.append(i)
            # A task left over has a predecessor that is left over too.
            i = next(src[pe[q]] for q in range(poff[i], poff[i + 1]) if indeg[src[pe[q]]])
        loop = path[seen[i]:][::-1]  # walked backwards along edges
        return " -> ".join(self.label[t] for t in [*loop, loop[0]])

    def replace(self, **changes: object) -> TaskGraph:
        """A copy with some columns changed (validated again)."""
        from dataclasses import replace

        return replace(self, **changes)  # type: ignore[arg-type]

    def with_durations(self, duration: Sequence[float],
                       edge_latency: Sequence[float] | None = None) -> TaskGraph:
        """A copy whose tasks last ``duration`` (seconds, one finite value >= 0 per task) and,
        when given, whose edges arrive ``edge_latency`` after their transmission (seconds,
        one finite value >= 0 per edge, in place of their links' latency; 0 on an edge within
        a device, as there), the rest of the graph unchanged; both checked. Of the derived
        columns, those already computed among ``edge_link``, ``serialized``, ``in_degree``
        (and ``edge_latency``, ``out_steps`` when the latencies stay) are shared; the others
        are computed again when read. For a caller that times the same orders under many
        draws of the durations and delays (:mod:`pipeopt.costs.variation`)."""
        dur = _floats("tasks.duration", duration, self.num_tasks)
        columns = {f.name: getattr(self, f.name) for f in fields(self)}
        columns["duration"] = dur
        given = {k: self.__dict__[k] for k in _GIVEN_DERIVED if k in self.__dict__}
        if edge_latency is not None:
            lat = _floats("edges.latency", edge_latency, self.num_edges)
            inside = next((e for e, (k, x) in enumerate(zip(self.edge_link, lat, strict=True))
                           if k < 0 and x != 0.0), None)
            if inside is not None:
                raise GraphError(f"edges.latency[{inside}]: {lat[inside]!r} on an edge within "
                                 "a device (no link); must be 0")
            given["edge_latency"] = lat
            given.pop("out_steps", None)  # made again from the new latencies
        return TaskGraph.trusted(given=given, **columns)


class GraphBuilder:
    """Build a small :class:`TaskGraph` by hand, one device, link, task or edge at a time.

    Each call returns the new item's id; :meth:`edge` accepts task ids or labels::

        g = GraphBuilder()
        gpu = g.device(memory_limit=8e9)
        cpu = g.device()
        g.link(gpu, cpu, latency=1e-5, bandwidth=1e10, both_ways=True)
        a = g.task("load", cpu, 0.2, mem_start=1e9, mem_end=-1e9)
        g.task("train", gpu, 1.0, tail=0.1)
        g.edge(a, "train", bytes=4e8)
        graph = g.build()
    """

    def __init__(self) -> None:
        self._dev: list[tuple[float | None, float]] = []
        self._links: list[tuple[int, int, float, float]] = []
        self._tasks: list[tuple[int, float, float, float, str, float]] = []
        self._by_label: dict[str, int] = {}
        self._edges: list[tuple[int, int, float]] = []
        self._networks: list[str] = []
        self._holds: dict[int, tuple[int, ...]] = {}

    def network(self, name: str) -> int:
        """Add a network resource beyond the links (a NIC, a WAN link); returns its resource
        id, which counts after every link (so add the links first)."""
        self._networks.append(name)
        return -len(self._networks)  # resolved to num_links + k at build time

    def comm(self, label: str, holds: Iterable[int], duration: float, *,
             tail: float = 0.0) -> int:
        """Add a communication task (on no device) holding ``holds`` (link ids from
        :meth:`link`, network ids from :meth:`network`) for ``duration`` seconds."""
        i = self.task(label, -1, duration, tail=tail)
        self._holds[i] = tuple(holds)
        return i

    def device(self, memory_limit: float | None = None, static_memory: float = 0.0) -> int:
        """Add a device (bytes; ``memory_limit`` None = unlimited); returns its id."""
        self._dev.append((memory_limit, static_memory))
        return len(self._dev) - 1

    def link(self, src: int, dst: int, latency: float = 0.0, bandwidth: float = math.inf,
             *, both_ways: bool = False) -> int:
        """Add the directed link ``src -> dst`` (s, bytes/s), and ``dst -> src`` with the same
        values when ``both_ways``; returns the (first) link id."""
        self._links.append((src, dst, latency, bandwidth))
        if both_ways:
            self._links.append((dst, src, latency, bandwidth))
            return len(self._links) - 2
        return len(self._links) - 1

    def task(self, label: str, device: int, duration: float, *, mem_start: float = 0.0,
             mem_end: float = 0.0, tail: float = 0.0) -> int:
        """Add a task (s, bytes) with a unique ``label``; returns its id."""
        if label in self._by_label:
            raise GraphError(f"tasks.label[{len(self._tasks)}]: {label!r} is already task "
                             f"{self._by_label[label]}")
        self._by_label[label] = len(self._tasks)
        self._tasks.append((device, duration, mem_start, mem_end, label, tail))
        return len(self._tasks) - 1

    def edge(self, src: int | str, dst: int | str, bytes: float = 0.0) -> int:
        """Add the edge ``src -> dst`` (task ids or labels) carrying ``bytes``; returns its id."""
        self._edges.append((self._id(src), self._id(dst), bytes))
        return len(self._edges) - 1

    def _id(self, task: int | str) -> int:
        if isinstance(task, str):
            if task not in self._by_label:
                raise GraphError(f"edges[{len(self._edges)}]: no task labelled {task!r}")
            return self._by_label[task]
        return task

    def build(self) -> TaskGraph:
        """The validated graph (raises :class:`GraphError`)."""
        lim, static = zip(*self._dev, strict=True) if self._dev else ((), ())
        ls, ld, lat, bw = zip(*self._links, strict=True) if self._links else ((),) * 4
        dev, dur, ms, me, lab, tail = zip(*self._tasks, strict=True) if self._tasks else ((),) * 6
        es, ed, eb = zip(*self._edges, strict=True) if self._edges else ((),) * 3
        nl = len(self._links)
        holds: tuple[tuple[int, ...], ...] = ()
        if self._holds:  # network ids (-1, -2, ...) count after the links
            holds = tuple(tuple(r if r >= 0 else nl - r - 1 for r in self._holds.get(i, ()))
                          for i in range(len(self._tasks)))
        return TaskGraph(memory_limit=lim, static_memory=static, link_src=ls, link_dst=ld,
                         latency=lat, bandwidth=bw, device=dev, duration=dur, mem_start=ms,
                         mem_end=me, label=lab, tail=tail, src=es, dst=ed, bytes=eb,
                         networks=tuple(self._networks), holds=holds)
