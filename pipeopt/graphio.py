"""Schedule JSON v2 (``pipeopt.schedule/v2``): a :class:`~pipeopt.core.schedule.GraphSchedule`
with the :class:`~pipeopt.core.graph.TaskGraph` it schedules, written and read with every check.

The document is columnar, like the graph: each per-task, per-edge, per-link or per-device value
is one JSON list indexed by id (a 200,000-task schedule is a few lists of 200,000 numbers, not
200,000 objects). docs/schedule_format.md describes every field. Chain schedules
(:class:`~pipeopt.schedule.Schedule`) keep the v1 document of :mod:`pipeopt.io`;
:func:`dump_any` and :func:`load_any` pick the format by the schedule's type or the file's
``format`` field. Times in seconds, memory and message sizes in bytes. Communication tasks
(device -1, issue 13) are written with two optional sections: ``graph.networks`` (the named
resources after the links) and ``graph.holds`` (a (task, resource) pair per resource held).

Reading checks, in order, each failure a :class:`~pipeopt.simulate.ScheduleError` naming the
field path and the reason: the format, the shape and type of every field (sizes capped before
anything is built, numbers finite, indexes in range), the graph's own rules
(:class:`~pipeopt.core.graph.TaskGraph` validation: links, cycles, what a communication task
may hold), the schedule's rules (:func:`pipeopt.core.validate.check`: every edge, device,
link, network resource and memory limit), then the
recorded metrics, bound, gap and status against the times.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pipeopt.core.graph import GraphError, TaskGraph
from pipeopt.core.schedule import GraphSchedule, MessageTime
from pipeopt.core.validate import check
from pipeopt.errors import MAX_DEVICES, MAX_OPS
from pipeopt.io import (
    _FORMAT_V2,
    OPTIMAL_GAP_TOLERANCE,
    TooLarge,
    _get,
    _is_number,
    _shown,
    document_method,
    dump_schedule,
    format_json,
    known_fields,
    read_schedule_doc,
    refuse_violations,
    schedule_from_dict,
    solver_status,
    solver_wall_time,
    write_atomic,
)
from pipeopt.problem import Problem
from pipeopt.schedule import FORMAT as FORMAT_V1
from pipeopt.schedule import Message, Schedule, SolverInfo, TimedOp
from pipeopt.simulate import ScheduleError
from pipeopt.workloads import training
from pipeopt.workloads.inference import serving_metrics

#: The serving figures a schedule of an inference plan (issue 15) records in ``metrics``
#: (tokens/s, s): derived from the plan in ``graph.meta.plan`` and the times, and checked so
#: on reading.
SERVING_METRICS = ("throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_s")

#: The ``format`` of a task-graph schedule document.
FORMAT_V2 = _FORMAT_V2
#: Most tasks a v2 file may hold: the op cap of chain schedules (:data:`pipeopt.errors.MAX_OPS`).
MAX_TASKS = MAX_OPS
#: Most edges a v2 file may hold: four inputs per task on average (a chain task has at most
#: two: its stage's previous op and the neighbouring stage's message).
MAX_EDGES = 4 * MAX_TASKS
#: Most named network resources (``graph.networks``): as many as there may be links.
MAX_NETWORKS = MAX_DEVICES * (MAX_DEVICES - 1)
#: Most (task, resource) pairs in ``graph.holds``: as many as edges (a collective over a ring
#: of d devices holds d links, once per stage and iteration).
MAX_HOLDS = MAX_EDGES
#: Relative tolerance of the recorded metrics against those of the times (as v1's).
_METRIC_TOL = 1e-6

_TOP_KEYS = ("format", "method", "metrics", "solver", "graph", "timeline")
_METRIC_KEYS = ("makespan", "objective", "peak_memory", *SERVING_METRICS)
_SOLVER_KEYS = ("status", "lower_bound", "gap", "wall_time")
_GRAPH_KEYS = ("devices", "links", "networks", "tasks", "holds", "edges", "meta")
#: Columns of the optional network sections (issue 13): the named resources after the links,
#: and one (task, resource) pair per resource a communication task holds, in the task's order.
_NETWORK_KEYS = ("name",)
_HOLDS_KEYS = ("task", "resource")
#: Columns of each graph section: JSON shape, required, TaskGraph field.
_COLUMNS: dict[str, tuple[tuple[str, str, bool, str], ...]] = {
    "devices": (("memory_limit", "limit", True, "memory_limit"),
                ("static_memory", "number", False, "static_memory")),
    "links": (("src", "int", True, "link_src"), ("dst", "int", True, "link_dst"),
              ("latency", "number", True, "latency"), ("bandwidth", "rate", True, "bandwidth")),
    "tasks": (("device", "int", True, "device"), ("duration", "number", True, "duration"),
              ("label", "str", False, "label"), ("mem_start", "number", False, "mem_start"),
              ("mem_end", "number", False, "mem_end"), ("tail", "number", False, "tail")),
    "edges": (("src", "int", True, "src"), ("dst", "int", True, "dst"),
              ("bytes", "number", False, "bytes")),
}
_TIMELINE_KEYS = ("start", "end", "messages")
_MESSAGE_KEYS = ("edge", "start", "end", "arrival")
#: Deepest nesting of lists / objects in a ``graph.meta`` value: meta holds facts a builder
#: records (names, a column per task), a level or two; the cap keeps reading and writing a
#: hostile file within Python's recursion limit.
MAX_META_DEPTH = 32
#: ``graph.meta`` entries with a meaning for pipeopt: a name per task (colours in plots and
#: traces) and a resource kind per device (e.g. ``gpu``, ``network``), for later workloads.
META_COLUMNS = {"task_group": "tasks", "device_kind": "devices"}


# ----- writing -------------------------------------------------------------------------------
def _num(x: float | None) -> float | str | None:
    """JSON has no infinity: written as the string "inf" (as in v1)."""
    if x is not None and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` as JSON data (tuples as lists, mappings as objects), nested at most
    :data:`MAX_META_DEPTH` levels; anything else raises :class:`ValueError` naming ``where``."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return _num(value) if not math.isnan(value) else _unwritable(value, where)
    if depth >= MAX_META_DEPTH and isinstance(value, list | tuple | Mapping):
        raise ValueError(f"{where}: nested deeper than {MAX_META_DEPTH} levels")
    if isinstance(value, list | tuple):
        return [_plain(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    return _unwritable(value, where)


def _unwritable(value: Any, where: str) -> Any:
    raise ValueError(f"{where}: {type(value).__name__} {_shown(value)} cannot be written as JSON")


def graph_schedule_to_dict(schedule: GraphSchedule) -> dict[str, Any]:
    """The v2 document of ``schedule`` (metrics computed from its times); ``graph.networks``
    and ``graph.holds`` only when the graph has them (communication tasks, issue 13)."""
    s, g = schedule, schedule.graph
    msgs = sorted(s.messages, key=lambda mm: (mm.start, mm.edge))
    serving = serving_metrics(s)
    figures = {} if serving is None else {k: _num(serving.as_dict()[k]) for k in SERVING_METRICS}
    doc = {
        "format": FORMAT_V2,
        "method": s.method,
        "metrics": {"makespan": s.makespan, "objective": s.objective,
                    "peak_memory": list(s.peak_memory), **figures},
        "solver": {"status": s.status, "lower_bound": s.lower_bound, "gap": s.gap,
                   "wall_time": s.wall_time},
        "graph": {
            "devices": {"memory_limit": list(g.memory_limit),
                        "static_memory": list(g.static_memory)},
            "links": {"src": list(g.link_src), "dst": list(g.link_dst),
                      "latency": list(g.latency), "bandwidth": [_num(b) for b in g.bandwidth]},
            "tasks": {"label": list(g.label), "device": list(g.device),
                      "duration": list(g.duration), "mem_start": list(g.mem_start),
                      "mem_end": list(g.mem_end), "tail": list(g.tail)},
            "edges": {"src": list(g.src), "dst": list(g.dst), "bytes": list(g.bytes)},
            "meta": _plain(dict(g.meta), "graph.meta"),
        },
        "timeline": {
            "start": list(s.start), "end": list(s.end),
            "messages": {"edge": [mm.edge for mm in msgs], "start": [mm.start for mm in msgs],
                         "end": [mm.end for mm in msgs],
                         "arrival": [mm.arrival for mm in msgs]},
        },
    }
    graph: dict[str, Any] = doc["graph"]  # type: ignore[assignment]
    if g.networks or g.holds:  # sections in the order of _GRAPH_KEYS
        graph = {k: graph[k] for k in ("devices", "links")}
        if g.networks:
            graph["networks"] = {"name": list(g.networks)}
        graph["tasks"] = doc["graph"]["tasks"]  # type: ignore[index]
        if g.holds:
            pairs = [(i, r) for i in g.comm_tasks for r in g.holds[i]]
            graph["holds"] = {"task": [i for i, _ in pairs], "resource": [r for _, r in pairs]}
        graph.update({k: doc["graph"][k] for k in ("edges", "meta")})  # type: ignore[index]
        doc["graph"] = graph
    return doc


def graph_schedule_json(schedule: GraphSchedule) -> str:
    """The v2 text: top-level fields, sections and columns one per line, each column compact."""
    return format_json(graph_schedule_to_dict(schedule), open_levels=3)


def dump_graph_schedule(schedule: GraphSchedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as v2 JSON to ``path`` atomically."""
    write_atomic(path, graph_schedule_json(schedule))


def as_chain_schedule(problem: Problem, schedule: GraphSchedule) -> Schedule:
    """The chain :class:`~pipeopt.schedule.Schedule` of a schedule of
    ``workloads.training.build(problem)``'s graph (task ``i`` is op ``training.task_op(problem,
    i)``; each timed message becomes the message of its source op), with the same times,
    method, status, bound and wall time. Raises :class:`ValueError` when ``schedule`` is over
    another graph."""
    graph = training.build(problem)
    if schedule.graph != graph:
        raise ValueError("schedule: its graph is not workloads.training.build(problem)'s; only "
                         "a schedule of that graph is a chain schedule of this problem")
    dev = graph.device
    op = [training.task_op(problem, i) for i in range(graph.num_tasks)]
    ops = tuple(TimedOp(d, o.stage, o.microbatch, o.kind, a, b)
                for d, o, a, b in zip(dev, op, schedule.start, schedule.end, strict=True))
    msgs = []
    for mm in schedule.messages:
        a, b = graph.src[mm.edge], graph.dst[mm.edge]
        msgs.append(Message(dev[a], dev[b], op[a].stage, op[b].stage, op[a].microbatch,
                            op[a].kind, mm.start, mm.end, mm.arrival))
    return Schedule(problem=problem, method=schedule.method, ops=ops, messages=tuple(msgs),
                    solver=SolverInfo(status=schedule.status, lower_bound=schedule.lower_bound,
                                      wall_time=schedule.wall_time))


def dump_any(schedule: Schedule | GraphSchedule, path: str | os.PathLike[str], *,
             problem: Problem | None = None) -> None:
    """Write a chain schedule as v1 (unchanged) and a graph schedule as v2, atomically; a
    graph schedule of ``workloads.training.build(problem)`` as v1 when ``problem`` is given
    (:func:`as_chain_schedule`)."""
    if isinstance(schedule, GraphSchedule) and problem is not None:
        schedule = as_chain_schedule(problem, schedule)
    if isinstance(schedule, GraphSchedule):
        dump_graph_schedule(schedule, path)
    else:
        dump_schedule(schedule, path)


# ----- reading -------------------------------------------------------------------------------
def _object(doc: Mapping[str, Any], key: str, where: str, *, required: bool = True
            ) -> dict[str, Any]:
    if key not in doc and not required:
        return {}
    return _get(doc, key, dict, where)  # type: ignore[arg-type]


def _bad_element(where: str, i: int, x: Any, shape: str) -> ScheduleError:
    what = {"int": "an integer", "str": "a string", "number": "a finite number",
            "rate": 'a number > 0 or "inf"', "limit": "a number >= 0 or null"}[shape]
    if isinstance(x, TooLarge):
        return ScheduleError(f"{where}[{i}]: expected {what}, got {x}")
    return ScheduleError(f"{where}[{i}]: expected {what}, got {_shown(x)}")


def _ok(x: Any, shape: str) -> bool:
    if shape == "int":
        return type(x) is int
    if shape == "str":
        return type(x) is str
    if shape == "number":
        return (type(x) is float or type(x) is int) and math.isfinite(x)
    if shape == "rate":
        return x == "inf" or ((type(x) is float or type(x) is int) and x > 0)
    return x is None or ((type(x) is float or type(x) is int) and math.isfinite(x))  # limit


def _column(doc: Mapping[str, Any], key: str, where: str, shape: str, n: int | None,
            cap: int) -> list[Any]:
    """The list ``doc[key]``: at most ``cap`` elements (``n`` exactly when given), each of
    ``shape``; raises naming the first element that is not."""
    col = _get(doc, key, list, where)
    if n is not None and len(col) != n:
        raise ScheduleError(f"{where}{key}: expected {n} values, got {len(col)}")
    if len(col) > cap:
        raise ScheduleError(f"{where}{key}: at most {cap:,} values, got {len(col):,}")
    if not all(_ok(x, shape) for x in col):
        i = next(i for i, x in enumerate(col) if not _ok(x, shape))
        raise _bad_element(f"{where}{key}", i, col[i], shape)
    if shape == "rate":
        return [math.inf if x == "inf" else x for x in col]
    return col


def _freeze(value: Any, where: str, depth: int = 0) -> Any:
    """JSON data made immutable: lists as tuples, objects as read-only mappings; nested at
    most :data:`MAX_META_DEPTH` levels."""
    if depth > MAX_META_DEPTH and isinstance(value, list | dict):
        raise ScheduleError(f"{where}: nested deeper than {MAX_META_DEPTH} levels")
    if isinstance(value, list):
        return tuple(_freeze(x, where, depth + 1) for x in value)
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v, where, depth + 1) for k, v in value.items()})
    return value


def _graph(doc: dict[str, Any]) -> TaskGraph:
    known_fields(doc, _GRAPH_KEYS, "graph.")
    caps = {"devices": MAX_DEVICES, "links": MAX_DEVICES * (MAX_DEVICES - 1),
            "tasks": MAX_TASKS, "edges": MAX_EDGES}
    fields: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for section, columns in _COLUMNS.items():
        where = f"graph.{section}."
        # A graph without links or edges may leave those sections out.
        sec = _object(doc, section, "graph.", required=section in ("devices", "tasks"))
        if not sec and section in ("links", "edges"):
            continue
        known_fields(sec, [c[0] for c in columns], where)
        n: int | None = None
        for key, shape, required, name in columns:
            if key not in sec and not required:
                continue
            col = _column(sec, key, where, shape, n, caps[section])
            n = len(col)
            fields[name] = tuple(col)
        sizes[section] = n or 0
    fields.update(_network(doc, sizes, len(fields.get("link_src", ()))))
    meta = _object(doc, "meta", "graph.", required=False)
    for key, section in META_COLUMNS.items():
        if key in meta:
            _column(meta, key, "graph.meta.", "str", sizes[section], caps[section])
    try:
        return TaskGraph(**fields, meta=tuple((k, _freeze(v, f"graph.meta.{k}"))
                                              for k, v in meta.items()))
    except GraphError as exc:
        raise ScheduleError(f"graph.{_holds_path(str(exc))}") from None


def _network(doc: dict[str, Any], sizes: dict[str, int], links: int) -> dict[str, Any]:
    """``networks`` and ``holds`` of the optional sections ``graph.networks`` (names) and
    ``graph.holds`` (task, resource pairs, each id in range), as :class:`TaskGraph` takes
    them: a tuple of resource ids per task (empty for tasks on a device)."""
    out: dict[str, Any] = {}
    sec = _object(doc, "networks", "graph.", required=False)
    if "networks" in doc:
        known_fields(sec, _NETWORK_KEYS, "graph.networks.")
        out["networks"] = tuple(_column(sec, "name", "graph.networks.", "str", None,
                                        MAX_NETWORKS))
    if "holds" not in doc:
        return out
    sec = _object(doc, "holds", "graph.")
    where = "graph.holds."
    known_fields(sec, _HOLDS_KEYS, where)
    task = _column(sec, "task", where, "int", None, MAX_HOLDS)
    res = _column(sec, "resource", where, "int", len(task), MAX_HOLDS)
    n, nr = sizes["tasks"], links + len(out.get("networks", ()))
    for key, col, hi in (("task", task, n), ("resource", res, nr)):
        if col and not 0 <= min(col) <= max(col) < hi:
            i = next(i for i, x in enumerate(col) if not 0 <= x < hi)
            what = "tasks" if key == "task" else "links, then the networks"
            none = "no tasks" if key == "task" else "no links and no networks"
            rule = f"must be in 0..{hi - 1} (the {what})" if hi else f"the graph has {none}"
            raise ScheduleError(f"{where}{key}[{i}]: {rule}, got {col[i]}")
    holds: list[list[int]] = [[] for _ in range(n)]
    for i, r in zip(task, res, strict=True):
        holds[i].append(r)
    out["holds"] = tuple(map(tuple, holds))
    return out


def _holds_path(message: str) -> str:
    """TaskGraph names a task's resources ``tasks.holds[i]``; the file holds them as pairs in
    ``graph.holds``: ``message`` worded with the file's field, naming the task."""
    message = re.sub(r"needs tasks\.holds\[(\d+)\]: the network resources it holds",
                     r"needs graph.holds pairs (task \1, resource): the resources it holds",
                     message)
    m = re.match(r"tasks\.holds\[(\d+)\]: ", message)
    if m is None:
        return message
    return f"holds (task {m.group(1)}): {message[m.end():]}"


def _timeline(doc: dict[str, Any], graph: TaskGraph) -> tuple[tuple[float, ...],
                                                              tuple[float, ...],
                                                              tuple[MessageTime, ...]]:
    known_fields(doc, _TIMELINE_KEYS, "timeline.")
    n = graph.num_tasks
    start = tuple(map(float, _column(doc, "start", "timeline.", "number", n, MAX_TASKS)))
    end = tuple(map(float, _column(doc, "end", "timeline.", "number", n, MAX_TASKS)))
    raw = _object(doc, "messages", "timeline.", required=False)
    if not raw:
        return start, end, ()
    where = "timeline.messages."
    known_fields(raw, _MESSAGE_KEYS, where)
    edges = _column(raw, "edge", where, "int", None, graph.num_edges)
    if edges and not 0 <= min(edges) <= max(edges) < graph.num_edges:
        i = next(i for i, e in enumerate(edges) if not 0 <= e < graph.num_edges)
        raise ScheduleError(f"{where}edge[{i}]: must be in 0..{graph.num_edges - 1}, got "
                            f"{edges[i]}")
    times = [_column(raw, key, where, "number", len(edges), graph.num_edges)
             for key in ("start", "end", "arrival")]
    msgs = tuple(MessageTime(e, float(a), float(b), float(c))
                 for e, a, b, c in zip(edges, *times, strict=True))
    return start, end, msgs


def _solver(doc: dict[str, Any]) -> tuple[str, float | None, float]:
    """(status, lower bound s or None, wall time s) of the ``solver`` object."""
    known_fields(doc, _SOLVER_KEYS, "solver.")
    status = solver_status(doc, ("lower_bound", "gap"))
    lb = doc.get("lower_bound")
    return status, None if lb is None else float(lb), solver_wall_time(doc)


def graph_schedule_from_dict(doc: Any, *, check_semantics: bool = True) -> GraphSchedule:
    """Parse and check a v2 document (see the module docstring for the order of the checks).
    Raises :class:`~pipeopt.simulate.ScheduleError` naming the first problem found."""
    method = document_method(doc, FORMAT_V2, _TOP_KEYS)
    status, lb, wall = _solver(_object(doc, "solver", "", required=False))
    graph = _graph(_get(doc, "graph", dict))
    start, end, msgs = _timeline(_get(doc, "timeline", dict), graph)
    sched = GraphSchedule(graph, start, end, msgs, method=method,
                          status=status,  # type: ignore[arg-type]  # checked in _solver
                          lower_bound=lb, wall_time=wall)
    try:
        serving = serving_metrics(sched)  # a malformed plan record is refused here
    except ValueError as exc:
        raise ScheduleError(f"graph.meta.{exc}") from None
    if check_semantics:
        refuse_violations(check(sched))
        _check_recorded(doc, sched)
        _check_serving(doc, serving)
    return sched


def _check_serving(doc: dict[str, Any], serving: Any) -> None:
    """The serving figures in ``metrics`` must be those of the recorded plan and the times;
    a graph that records no plan has none."""
    metrics = _object(doc, "metrics", "", required=False)
    for key in SERVING_METRICS:
        if key not in metrics:
            continue
        if serving is None:
            raise ScheduleError(f"metrics.{key}: only a schedule of an inference plan (with "
                                f"graph.meta.plan) has serving figures")
        actual = serving.as_dict()[key]
        val = metrics[key]
        same = (val == "inf" and math.isinf(actual)) or _close(val, actual)
        if not same:
            raise ScheduleError(f"metrics.{key}: the file says {_shown(val)}, its plan and "
                                f"times give {actual:g}")


def _close(a: Any, b: float) -> bool:
    return _is_number(a) and math.isfinite(a) and abs(a - b) <= _METRIC_TOL * max(1.0, abs(b))


def _check_recorded(doc: dict[str, Any], sched: GraphSchedule) -> None:
    """The metrics, bound, gap and status written in the file must be those of its times."""
    metrics = _object(doc, "metrics", "", required=False)
    known_fields(metrics, _METRIC_KEYS, "metrics.")
    for key in ("makespan", "objective"):
        if key in metrics and not _close(metrics[key], getattr(sched, key)):
            raise ScheduleError(f"metrics.{key}: the file says {_shown(metrics[key])}, its "
                                f"times give {getattr(sched, key):g}")
    if "peak_memory" in metrics:
        val, actual = metrics["peak_memory"], sched.peak_memory
        if (not isinstance(val, list) or len(val) != len(actual)
                or not all(_close(a, b) for a, b in zip(val, actual, strict=True))):
            raise ScheduleError(f"metrics.peak_memory: the file says {val!r:.80}, its times "
                                f"give {list(actual)!r:.80}")
    lb, value = sched.lower_bound, sched.objective
    if lb is not None and lb > value + _METRIC_TOL * max(1.0, value):
        raise ScheduleError(f"solver.lower_bound: {lb:g} is above the schedule's own objective "
                            f"{value:g}: not a lower bound")
    solver = _object(doc, "solver", "", required=False)
    if "gap" in solver:
        gap, actual = solver["gap"], sched.gap
        if actual is None and gap is not None:
            raise ScheduleError(f"solver.gap: the file says {_shown(gap)}, but without a lower "
                                "bound there is no gap (null)")
        if actual is not None and (gap is None or abs(gap - actual) > _METRIC_TOL):
            raise ScheduleError(f"solver.gap: the file says {_shown(gap)}, its lower bound and "
                                f"times give {actual:g}")
    if sched.status == "optimal" and sched.gap is not None and sched.gap > OPTIMAL_GAP_TOLERANCE:
        raise ScheduleError(f"solver.status: optimal, but the objective {value:g} is "
                            f"{sched.gap:.2%} above the lower bound {lb:g}; a proven optimum "
                            "has gap 0 (use feasible or heuristic)")


def schedule_from_any_dict(doc: Any, *, check_semantics: bool = True
                           ) -> Schedule | GraphSchedule:
    """A v1 document as a chain :class:`~pipeopt.schedule.Schedule`, a v2 document as a
    :class:`~pipeopt.core.schedule.GraphSchedule`, each with every check of its reader."""
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt == FORMAT_V2:
        return graph_schedule_from_dict(doc, check_semantics=check_semantics)
    if fmt != FORMAT_V1 and isinstance(doc, dict):
        raise ScheduleError(f"format: expected {FORMAT_V1!r} or {FORMAT_V2!r}, got "
                            f"{_shown(fmt)}")
    return schedule_from_dict(doc, check_semantics=check_semantics)


def load_graph_schedule(path: str | os.PathLike[str], *, check_semantics: bool = True
                        ) -> GraphSchedule:
    """Read a v2 schedule file (``-``: standard input) with every check."""
    return graph_schedule_from_dict(read_schedule_doc(path), check_semantics=check_semantics)


def load_any(path: str | os.PathLike[str], *, check_semantics: bool = True
             ) -> Schedule | GraphSchedule:
    """Read a schedule file of either format (``-``: standard input): see
    :func:`schedule_from_any_dict`."""
    return schedule_from_any_dict(read_schedule_doc(path), check_semantics=check_semantics)
