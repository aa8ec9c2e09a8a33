"""Data-parallel collectives issued in a schedule's order (issue 13, item 5).

A schedule of :func:`pipeopt.workloads.dataparallel.build`'s graph (schedule JSON v2,
``graph.meta.workload: dataparallel``) holds R replicas of a pipeline for K iterations and,
per stage and iteration, its gradient reduction (all-reduce ``AR``, or ZeRO-1's
reduce-scatter ``RS`` and parameter all-gather ``AG``) as tasks with times.
:func:`graph_run` reads it as what the executor replays (pure, no torch): per replica and
iteration the pipeline's compute order, and per rank the position of each collective among
its compute ops (by start time). :class:`Reducer` is one rank's side of them on its stage's
data-parallel process group: each collective is launched asynchronously at that position (so it
overlaps the compute that follows, as in the schedule) and waited only where its result is
needed. Training step ``s`` replays iteration ``s``.

Semantics (D = 1, or 2 with ``delayed_reduction``, the graph's edges):

* the gradients of a stage are copied to a bucket buffer when its last backward ends
  (PyTorch's ``REDUCE_GRAD`` point, after the 1/m scaling): a second buffer, so that the next
  iteration's backward may run while they are reduced;
* all-reduce: iteration u's averaged gradients (sum / R) are applied by the optimizer before
  iteration u + D starts: with D = 2 the one-step-delayed update of Pipe-SGD (Li et al.,
  NeurIPS 2018), ``w[t+1] = w[t] - lr * g(w[t-1])`` for SGD;
* reduce-scatter (ZeRO-1): each replica holds shard r of every bucket's flattened parameters
  and its optimizer state; ``AG`` of iteration v first waits for ``RS`` of v - D and steps its
  shard, then gathers the shards, which are copied into the parameters before iteration v
  starts. Elementwise optimizers (SGD, AdamW) give the same weights as the all-reduce;
* after the last step every reduction still pending is waited and applied (and, with ZeRO-1,
  the shards gathered once more): the run ends with every gradient applied.

The replay needs one stage per device (what the graph builder allows) and, per device, every
op of iteration j before any op of iteration j + 1 (a pipelined order would need weight
stashing); ``--steps`` at most K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pipeopt.core.schedule import GraphSchedule
from pipeopt.errors import ConfigError
from pipeopt.executor.procs import ExecutorError
from pipeopt.graphio import FORMAT_V2, graph_schedule_from_dict
from pipeopt.io import read_schedule_doc
from pipeopt.problem import Op, Problem, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError, simulate

_COMPUTE = re.compile(r"^(?:i(\d+)\.)?r(\d+)\.(\d+)([FBW])(\d+)(?:/b(\d+))?$")
_COLLECTIVE = re.compile(r"^(?:i(\d+)\.)?(AR|RS|AG) (\d+)(?:\.b(\d+))?$")


@dataclass(frozen=True)
class Collective:
    """One collective task: ``kind`` AR, RS or AG of ``stage`` in ``iteration``, ``bucket``
    (0 for an AG, which gathers every bucket), ``label`` as in the graph."""

    kind: str
    stage: int
    iteration: int
    bucket: int
    label: str


@dataclass(frozen=True)
class GraphRun:
    """A data-parallel graph schedule as the executor replays it.

    ``problem``: one replica's pipeline (stage k on device k; durations from the graph, in
    seconds); ``orders[r][j][d]``: replica r's compute ops on device d in iteration j, by
    start; ``launches[r][d]``: (step, n, collective) in the schedule's order, the collective
    launched before compute op n of step ``step`` (n = the step's op count: after its last op);
    ``buckets[k]``: reduction buckets of stage k; ``delay``: 1, or 2 for the one-step-delayed
    reduction; ``iteration_s``: the schedule's seconds per iteration (makespan / K)."""

    problem: Problem
    replicas: int
    iterations: int
    delay: int
    reduction: str
    buckets: tuple[int, ...]
    orders: tuple[tuple[tuple[tuple[Op, ...], ...], ...], ...]
    launches: tuple[tuple[tuple[tuple[int, int, Collective], ...], ...], ...]
    iteration_s: float
    method: str = "custom"


def workload_of(doc: Any) -> Any:
    """``graph.meta.workload`` of a parsed schedule JSON v2 document (None where it has none)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_V2:
        return None
    graph = doc.get("graph")
    meta = graph.get("meta") if isinstance(graph, dict) else None
    return meta.get("workload") if isinstance(meta, dict) else None


def graph_run(schedule: GraphSchedule) -> GraphRun:
    """What the executor replays of ``schedule`` (see the module docstring); ExecutorError
    naming the task when it cannot be replayed."""
    g = schedule.graph
    meta = dict(g.meta)
    if meta.get("workload") != "dataparallel":
        raise ExecutorError("not a data-parallel schedule (graph.meta.workload is "
                            f"{meta.get('workload')!r})")
    rep, iters = int(meta["replicas"]), int(meta.get("iterations", 1))
    p = g.devices // rep
    ops: dict[tuple[int, int, Op], float] = {}  # (replica, iteration, op) -> first start
    colls: list[tuple[float, Collective]] = []
    buckets: dict[int, int] = {}
    dur: dict[Op, float] = {}  # replica 0, iteration 0: seconds of each (unsplit) op
    for t, label in enumerate(g.label):
        c = _COMPUTE.match(label)
        if c:
            j, r, k, kind, mb = (int(c[1] or 0), int(c[2]), int(c[3]), c[4], int(c[5]))
            if g.device[t] != r * p + k:
                raise ExecutorError(f"task {label}: stage {k} of replica {r} runs on device "
                                    f"{g.device[t]}, not {r * p + k}: the replay needs one "
                                    "stage per device")
            key = (r, j, Op(kind, k, mb))
            ops[key] = min(ops.get(key, schedule.start[t]), schedule.start[t])
            if r == j == 0 and c[6] is None:
                dur[key[2]] = g.duration[t]
            continue
        c = _COLLECTIVE.match(label)
        if not c:
            raise ExecutorError(f"task {label}: neither a compute op nor a collective of the "
                                "data-parallel graph")
        k, b = int(c[3]), int(c[4] or 0)
        colls.append((schedule.start[t], Collective(c[2], k, int(c[1] or 0), b, label)))
        if c[2] != "AG":
            buckets[k] = max(buckets.get(k, 0), b + 1)
    m = 1 + max(op.microbatch for _, _, op in ops)
    split = any(op.kind == "W" for _, _, op in ops)
    base = uniform_problem(p, m, split_backward=split)
    prob = base.replace(
        forward=tuple(dur.get(Op("F", k, 0), 0.0) for k in range(p)),
        backward_input=tuple(dur.get(Op("B", k, 0), 0.0) for k in range(p)),
        backward_weight=tuple(dur.get(Op("W", k, 0), 0.0) for k in range(p)))
    orders = tuple(tuple(tuple(tuple(sorted(
        (op for (r_, j_, op) in ops if r_ == r and j_ == j and op.stage == d),
        key=lambda op, r=r, j=j: ops[(r, j, op)])) for d in range(p)) for j in range(iters))
        for r in range(rep))
    launches = tuple(tuple(_positions(ops, colls, r, d, p) for d in range(p))
                     for r in range(rep))
    return GraphRun(prob, rep, iters, 2 if meta.get("delayed_reduction") else 1,
                    "reduce_scatter" if any(c.kind == "RS" for _, c in colls) else "all_reduce",
                    tuple(buckets.get(k, 1) for k in range(p)), orders, launches,
                    schedule.makespan / iters, schedule.method)


def _positions(ops: dict[tuple[int, int, Op], float], colls: list[tuple[float, Collective]],
               replica: int, device: int, p: int) -> tuple[tuple[int, int, Collective], ...]:
    """Rank (replica, device)'s collectives as (step, n, collective) in start order: launched
    before compute op n of that step (a collective that starts with a compute op goes first).
    ExecutorError when the device starts an op of iteration j + 1 before one of j."""
    events = sorted([(s, 1, j, op) for (r, j, op), s in ops.items()
                     if r == replica and op.stage == device]
                    + [(s, 0, c.iteration, c) for s, c in colls if c.stage == device],
                    key=lambda e: (e[0], e[1]))
    out, step, n, seen = [], 0, 0, -1
    for _, is_op, j, item in events:
        if not is_op:
            out.append((step, n, item))
            continue
        if j < seen:
            raise ExecutorError(f"device {replica * p + device} (replica {replica}) runs {item} "
                                f"of iteration {j} after an op of iteration {seen}: "
                                "the replay runs one iteration per training step (a "
                                "pipelined order needs weight stashing)")
        if j > seen:
            step, n, seen = j, 0, j
        n += 1
    return tuple(out)


def plan_schedule(plan: GraphRun, replica: int, iteration: int) -> Schedule:
    """The chain schedule of one replica's iteration of ``plan`` (timed on its problem)."""
    return simulate(plan.problem, [list(o) for o in plan.orders[replica][iteration]],
                    method=plan.method)


def read_v2(path: str) -> Any:
    """The schedule JSON v2 document at ``path`` (parsed, not yet checked), else None:
    standard input, another document, or a file the chain reader will report on."""
    if path == "-":
        return None
    try:
        doc = read_schedule_doc(path)
    except ScheduleError:
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT_V2 else None


def load_graph_run(path: str, doc: Any) -> GraphRun | None:
    """:func:`graph_run` of ``doc`` (:func:`read_v2` of ``path``) when it schedules a
    data-parallel graph (read with every check of :mod:`pipeopt.graphio`), else None;
    ConfigError for an MoE schedule, or when the replay cannot run it (:func:`graph_run`'s
    reason)."""
    kind = workload_of(doc)
    if kind == "moe":
        raise ConfigError(f"{path}: an MoE schedule (graph.meta.workload: moe); pipeopt run "
                          "does not replay MoE blocks and their all-to-all")
    if kind != "dataparallel":
        return None
    try:
        return graph_run(graph_schedule_from_dict(doc))
    except ExecutorError as exc:
        raise ConfigError(f"{path}: {exc}") from None
