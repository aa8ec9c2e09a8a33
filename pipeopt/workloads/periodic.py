"""Steady-state (periodic) pipelines: one pattern of a chain's tasks that repeats forever.

Asynchronous pipelines (PipeDream, PipeDream-2BW, PipeMare) never flush: every stage runs the
forward, backward (and weight-gradient) task of a new micro-batch once per *period* ``T``
(seconds per micro-batch). A :class:`PeriodicSchedule` is that pattern as plain data: per
task ``(kind, stage)`` its start ``start`` for micro-batch 0 (seconds; micro-batch ``j``'s copy
starts ``j * T`` later), and per message that occupies a link its send time. The offset of a
task in the period is ``start mod T`` and its iteration shift ``floor(start / T)``: how many
micro-batches entered the pipeline between micro-batch 0's entry and this task.

Weights: each stage updates its weights after every micro-batch's last backward task (or,
with PipeDream-2BW, once every ``update_every`` micro-batches). How many copies of a stage's
weights must be held, and how stale the weights behind a gradient are, follow from the pattern
and the policy (:data:`POLICIES`):

* ``stash`` (PipeDream, Narayanan et al., SOSP'19, section 3.3): every micro-batch in flight
  keeps the version its forward used, so its backward uses the same one: versions = micro-batches
  in flight on the stage; a gradient is applied ``in_flight - 1`` updates after its weights;
* ``2bw`` (PipeDream-2BW, Narayanan et al., ICML'21, section 3.1): updates once every
  ``update_every >= in flight`` micro-batches, so two versions suffice (double buffering); a
  gradient is applied one update after its weights (staleness 1);
* ``pipemare`` (Yang et al., MLSys'21): no stash, one version; the forward's weights are
  ``in_flight - 1`` updates older than the backward's (the delay grows toward the first stage).

Replicated stages (PipeDream's data-parallel stages, section 3.1 of the SOSP'19 paper):
``replicas[k]`` devices run stage k round-robin, micro-batch j on replica ``j mod replicas[k]``,
so each replica runs one copy of the stage's tasks every ``replicas[k]`` periods; the unrolled
graph has one device per replica (with its stage's device memory and links). The replicas'
gradient synchronisation (``sync_s``: one all-reduce per round of ``replicas[k]``
micro-batches) is a load on their own network that bounds the period
(:func:`replica_sync_bound`); it is not placed as tasks in the unrolled graph. Per-stage
figures below are per replica.

Memory of a device in steady state (bytes): its static memory (which holds one version of its
weights) + ``(versions - 1) * weight_bytes[k]`` per stage + the peak of the activations of the
micro-batches in flight (:meth:`PeriodicSchedule.peak_memory`).

:func:`unroll` turns a pattern into a finite :class:`GraphSchedule` of the chain's task graph,
which the core validator judges (:mod:`pipeopt.schedules.periodic` does so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, NamedTuple

from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule, MessageTime
from pipeopt.problem import Op, Problem
from pipeopt.workloads import training

Policy = Literal["stash", "2bw", "pipemare"]
#: Weight-version policies, see the module docstring.
POLICIES: tuple[str, ...] = ("stash", "2bw", "pipemare")
#: Relative tolerance on times (s) when counting copies of a repeating interval: floating
#: point sums of durations must not turn an exact fit into one more micro-batch in flight.
_REL_TOL = 1e-9
#: Bits of the unrolled horizon that :func:`unroll` keeps (its time grid is 2**-40 of it, far
#: below the validator's relative tolerance of 1e-9, about 2**-30).
_GRID_BITS = 40


class PeriodicError(ValueError):
    """A periodic schedule that cannot exist; the message names the field and the reason."""


class PatternTask(NamedTuple):
    """Task ``kind`` of ``stage`` in the pattern: micro-batch 0's copy starts at ``start`` (s)."""

    kind: str
    stage: int
    start: float


class PatternMessage(NamedTuple):
    """The message ``kind`` (``F``: activation, ``B``: gradient) from ``src_stage`` to
    ``dst_stage``: micro-batch 0's copy is sent at ``start`` (s)."""

    kind: str
    src_stage: int
    dst_stage: int
    start: float


def pattern_edges(problem: Problem) -> list[tuple[Op, Op]]:
    """The chain's dependencies of one micro-batch, as (producer, consumer) op pairs."""
    out = []
    for kind in problem.kinds:
        for k in range(problem.stages):
            dst = Op(kind, k, 0)
            out.extend((src, dst) for src in problem.inputs(dst))
    return out


def link_edges(problem: Problem) -> list[tuple[Op, Op]]:
    """The dependencies whose message occupies a link (positive transmission)."""
    return [(a, b) for a, b in pattern_edges(problem)
            if problem.transfer(a.stage, b.stage)[0] > 0]


def check_async_problem(problem: Problem) -> None:
    """Raise :class:`PeriodicError` unless a steady state of ``problem`` can be described
    by one pattern: every micro-batch must cost the same."""
    if not problem.uniform_microbatches:
        raise PeriodicError("pipeline.microbatch_scale: a periodic schedule repeats one "
                            "micro-batch's pattern, so every micro-batch must cost the same")


def check_replicas(problem: Problem, replicas: Sequence[int]) -> tuple[int, ...]:
    """``replicas`` per stage (``()``: one each), checked: integers >= 1, and more than one
    only with one stage per device. Raises :class:`PeriodicError`."""
    if not replicas:
        return (1,) * problem.stages
    reps = tuple(replicas)
    if len(reps) != problem.stages:
        raise PeriodicError(f"replicas: expected {problem.stages} values (one per stage), got "
                            f"{len(reps)}")
    for k, r in enumerate(reps):
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise PeriodicError(f"replicas[{k}]: must be an integer >= 1, got {r!r}")
    if max(reps) > 1 and problem.virtual_stages != 1:
        raise PeriodicError("replicas: replicated stages need one stage per device (pipeline."
                            f"virtual_stages 1, got {problem.virtual_stages})")
    return reps


def period_lower_bound(problem: Problem, replicas: Sequence[int] = (),
                       sync_s: Sequence[float] = ()) -> float:
    """A lower bound on the period of every periodic schedule of ``problem`` (s per
    micro-batch): the largest work per micro-batch of one resource, i.e. of a device (the
    durations of its stages' tasks, over the stage's ``replicas``), of a directed link (the
    transmissions it carries; between replicated stages a link carries one micro-batch of
    every ``lcm(r_a, r_b)``), or of the network among a replicated stage's devices
    (:func:`replica_sync_bound`: ``sync_s[k] / replicas[k]``).

    Proof: a device runs one task at a time and each period adds one copy of each of its
    tasks, so over ``N`` micro-batches it is busy ``N * work`` within ``(N - 1) * T + L`` (``L``
    the span of one micro-batch's pattern); ``T >= work - (L - work) / (N - 1)`` for every
    ``N``, hence ``T >= work``. A replica of a stage with r replicas gets every r-th
    micro-batch: ``N / r`` copies in that time, hence ``T >= work / r``. A link carries one
    message at a time: the same argument, with the pairs of replicas that micro-batch j joins
    (``j mod r_a``, ``j mod r_b``) repeating every ``lcm(r_a, r_b)`` micro-batches."""
    check_async_problem(problem)
    reps = check_replicas(problem, replicas)
    dev = [0.0] * problem.devices
    for k in range(problem.stages):
        for kind in problem.kinds:
            dev[problem.stage_device[k]] += problem.duration(Op(kind, k, 0)) / reps[k]
    link: dict[tuple[int, int], float] = {}
    for a, b in link_edges(problem):
        pair = (problem.stage_device[a.stage], problem.stage_device[b.stage])
        link[pair] = link.get(pair, 0.0) + (problem.transfer(a.stage, b.stage)[0]
                                            / math.lcm(reps[a.stage], reps[b.stage]))
    return max([*dev, *link.values(), replica_sync_bound(problem, reps, sync_s)])


def check_sync(problem: Problem, replicas: Sequence[int], sync_s: Sequence[float]
               ) -> tuple[float, ...]:
    """``sync_s`` per stage (``()``: none), checked: finite numbers >= 0 s, and 0 on a stage
    that runs on one device (it has no replicas to synchronise with). Raises
    :class:`PeriodicError` naming the stage."""
    reps = check_replicas(problem, replicas)
    if not sync_s:
        return (0.0,) * problem.stages
    out = tuple(sync_s)
    if len(out) != problem.stages:
        raise PeriodicError(f"sync_s: expected {problem.stages} values (one per stage), got "
                            f"{len(out)}")
    for k, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, int | float) or not (
                math.isfinite(x) and x >= 0):
            raise PeriodicError(f"sync_s[{k}]: must be a finite number >= 0 s, got {x!r}")
        if x > 0 and reps[k] == 1:
            raise PeriodicError(f"sync_s[{k}]: stage {k} runs on one device, so it has no "
                                f"replicas to synchronise with; got {x} s")
    return tuple(float(x) for x in out)


def replica_sync_bound(problem: Problem, replicas: Sequence[int] = (),
                       sync_s: Sequence[float] = ()) -> float:
    """The period's bound from the replicas' gradient synchronisation (s per micro-batch):
    ``max_k sync_s[k] / replicas[k]`` (0 without replicated stages).

    ``sync_s[k]`` is one all-reduce of stage k's weight gradients among its ``r`` replicas
    (PipeDream, SOSP'19, section 3.1: replicas of a stage synchronise as data parallelism
    does), once per round of ``r`` micro-batches (one per replica), on the replicas' own
    network, which carries one all-reduce at a time. Proof: over ``N`` micro-batches there are
    ``floor(N / r)`` rounds, ``floor(N / r) * sync_s`` of that network's time within ``(N - 1)
    T + L`` (``L`` the span of one micro-batch); as N grows, ``T >= sync_s / r``. The
    all-reduce overlaps computation (the planner's ``max(compute, sync) / r`` assumes the
    same) and is not placed as tasks in the unrolled graph."""
    reps = check_replicas(problem, replicas)
    sync = check_sync(problem, reps, sync_s)
    return max((x / r for x, r in zip(sync, reps, strict=True)), default=0.0)


def max_in_flight(problem: Problem, weight_bytes: Sequence[float], policy: str
                  ) -> tuple[int | None, ...]:
    """Per stage (one stage per device), the most micro-batches that may be in flight on one
    device of it within the device's memory limit (None: no limit), each holding the stage's
    activation memory ``a`` from its forward's start: ``S + n a + (v(n) - 1) w <= limit``, with
    ``S`` the static memory, ``w`` the weight bytes and ``v(n)`` the versions (``stash``: n;
    ``2bw``: 2; ``pipemare``: 1). Below 1 when even one micro-batch does not fit."""
    out: list[int | None] = []
    for k in range(problem.stages):
        d = problem.stage_device[k]
        lim = problem.memory_limit[d]
        a, w = problem.activation_memory[k], float(weight_bytes[k]) if weight_bytes else 0.0
        if lim is None or problem.virtual_stages != 1:
            out.append(None)
            continue
        room = lim * (1 + _REL_TOL) - problem.static_memory[d]
        if policy == "stash":
            room, a = room + w, a + w
        elif policy == "2bw":
            room -= w
        if a <= 0:
            out.append(None if room >= 0 else 0)
        else:
            out.append(max(0, math.floor(room / a)))
    return tuple(out)


def round_trip(problem: Problem, stage: int) -> float:
    """The least seconds from a micro-batch's forward start on ``stage`` to its backward (B)
    end there: the forwards from ``stage`` on, the backwards back to it, and every message's
    transmission and latency between them (each on an idle link)."""
    s = problem.stages
    t = sum(problem.duration(Op("F", i, 0)) for i in range(stage, s))
    t += sum(problem.duration(Op("B", i, 0)) for i in range(stage, s))
    t += sum(problem.delay(i, i + 1) + problem.delay(i + 1, i) for i in range(stage, s - 1))
    return t


def memory_period_bound(problem: Problem, weight_bytes: Sequence[float], policy: str,
                        replicas: Sequence[int] = ()) -> float:
    """A lower bound on the period (s) from memory (Little's law), for one stage per device.

    Proof: each micro-batch stays at least ``R = round_trip(k)`` seconds between its forward's
    start and its backward's end on stage k, holding the stage's activations (and, with
    ``stash``, its own weight version) all that time; at most ``n = max_in_flight[k]`` may do
    so at once. Over ``N`` micro-batches, the ``N R`` seconds of holding fit within
    ``(N - 1) T + L`` seconds with at most ``n`` at a time: ``N R <= n ((N - 1) T + L)`` for
    every N, so ``T >= R / n``; with r replicas, ``r n`` at once, so ``T >= R / (r n)``.
    0 without limits; inf when one micro-batch does not fit."""
    reps = check_replicas(problem, replicas)
    best = 0.0
    for k, n in enumerate(max_in_flight(problem, weight_bytes, policy)):
        if n is None:
            continue
        if n < 1:
            return math.inf
        best = max(best, round_trip(problem, k) / (n * reps[k]))
    return best


def _record(kind: Any, value: Any, where: str) -> Any:
    """``value`` as a :class:`PatternTask` / :class:`PatternMessage` (``kind``): its fields
    in order, the start a number; a PeriodicError naming ``where`` otherwise."""
    try:
        *head, start = tuple(value)
        rec = kind(*head, float(start))
    except (TypeError, ValueError):
        raise PeriodicError(f"{where}: expected ({', '.join(kind._fields)}) with a numeric "
                            f"start, got {value!r}") from None
    return rec


def _copies(length: float, period: float) -> int:
    """Most copies of a half-open interval of ``length`` s, repeated every ``period`` s, that
    overlap at one instant: ``ceil(length / period)`` (0 for an empty interval)."""
    if length <= 0:
        return 0
    return max(1, math.ceil(length / period - _REL_TOL))


@dataclass(frozen=True)
class PeriodicSchedule:
    """A steady-state pattern of ``problem``'s chain repeating every ``period`` seconds.

    ``tasks``: one :class:`PatternTask` per (kind, stage), in ``problem.kinds`` then stage
    order; ``messages``: one :class:`PatternMessage` per dependency whose message occupies a
    link (:func:`link_edges`), in that order; ``policy``: weight versions (:data:`POLICIES`);
    ``weight_bytes[k]``: bytes of one copy of stage k's weights (one copy is part of the
    device's static memory); ``update_every``: micro-batches per weight update (1 for
    ``stash`` and ``pipemare``; ``2bw``: default, the most micro-batches in flight on a stage).
    ``lower_bound``: a proven lower bound on the period (s) or None; ``replicas[k]``: devices
    that run stage k round-robin (``()``: one each); ``sync_s[k]``: seconds of one all-reduce
    of stage k's gradients among its replicas, once per round of ``replicas[k]`` micro-batches
    (``()``: none; the period must be at least :func:`replica_sync_bound`).
    """

    problem: Problem
    period: float
    tasks: tuple[PatternTask, ...]
    messages: tuple[PatternMessage, ...] = ()
    policy: str = "stash"
    weight_bytes: tuple[float, ...] = ()
    update_every: int = 0
    method: str = ""
    lower_bound: float | None = None
    replicas: tuple[int, ...] = ()
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    sync_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        p = self.problem
        check_async_problem(p)
        set_ = object.__setattr__
        if not (isinstance(self.period, int | float) and math.isfinite(self.period)
                and self.period > 0):
            raise PeriodicError(f"period: must be a finite number > 0 s, got {self.period!r}")
        set_(self, "period", float(self.period))
        if self.policy not in POLICIES:
            raise PeriodicError(f"policy: must be one of {', '.join(POLICIES)}, got "
                                f"{self.policy!r}")
        want = [(kind, k) for kind in p.kinds for k in range(p.stages)]
        tasks = tuple(_record(PatternTask, t, f"tasks[{i}]")
                      for i, t in enumerate(self.tasks))
        got = [(t.kind, t.stage) for t in tasks]
        if got != want:
            raise PeriodicError(f"tasks: expected one task per (kind, stage) in the order "
                                f"{want[:4]}..., got {got[:4]}...")
        for i, t in enumerate(tasks):
            if not (math.isfinite(t.start) and t.start >= 0):
                raise PeriodicError(f"tasks[{i}] ({t.stage}{t.kind}): start must be a finite "
                                    f"number >= 0 s, got {t.start}")
        set_(self, "tasks", tasks)
        want_m = [(a.kind, a.stage, b.stage) for a, b in link_edges(p)]
        msgs = tuple(_record(PatternMessage, x, f"messages[{i}]")
                     for i, x in enumerate(self.messages))
        if [(x.kind, x.src_stage, x.dst_stage) for x in msgs] != want_m:
            raise PeriodicError(f"messages: expected one per dependency that occupies a link "
                                f"(kind, from, to) = {want_m}, got "
                                f"{[(x.kind, x.src_stage, x.dst_stage) for x in msgs]}")
        for i, x in enumerate(msgs):
            if not math.isfinite(x.start):
                raise PeriodicError(f"messages[{i}]: start must be a finite number, got "
                                    f"{x.start}")
        set_(self, "messages", msgs)
        wb = tuple(float(x) for x in (self.weight_bytes or (0.0,) * p.stages))
        if len(wb) != p.stages:
            raise PeriodicError(f"weight_bytes: expected {p.stages} values (one per stage), "
                                f"got {len(wb)}")
        for k, x in enumerate(wb):
            if not (math.isfinite(x) and x >= 0):
                raise PeriodicError(f"weight_bytes[{k}]: must be a finite number >= 0 bytes, "
                                    f"got {x}")
        set_(self, "weight_bytes", wb)
        set_(self, "replicas", check_replicas(p, self.replicas))
        set_(self, "sync_s", check_sync(p, self.replicas, self.sync_s))
        for k, (x, r) in enumerate(zip(self.sync_s, self.replicas, strict=True)):
            if x / r > self.period * (1 + _REL_TOL):
                raise PeriodicError(f"period: {self.period:g} s is shorter than stage {k}'s "
                                    f"gradient all-reduce among its {r} replicas per "
                                    f"micro-batch (sync_s {x:g} s / {r})")
        every = self.update_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise PeriodicError(f"update_every: must be an integer >= 1, got {every!r}")
        if self.policy == "2bw":
            need = max(self.replica_in_flight)
            if every == 0:
                every = need
            elif every < need:
                raise PeriodicError(f"update_every: 2BW needs >= {need} (the most micro-batches "
                                    f"in flight on a stage) for two weight versions, got {every}")
        elif every not in (0, 1):
            raise PeriodicError(f"update_every: {self.policy} updates after every micro-batch, "
                                f"got {every}")
        set_(self, "update_every", every or 1)
        if not isinstance(self.meta, tuple):
            set_(self, "meta", tuple(dict(self.meta).items()))

    # ----- the pattern -----------------------------------------------------------------------
    def task(self, kind: str, stage: int) -> PatternTask:
        """The pattern task (kind, stage)."""
        return self.tasks[self.problem.kinds.index(kind) * self.problem.stages + stage]

    def duration(self, kind: str, stage: int) -> float:
        """Duration of task (kind, stage) in seconds."""
        return self.problem.duration(Op(kind, stage, 0))

    def offset(self, kind: str, stage: int) -> float:
        """The task's start within the period, ``start mod T`` (s)."""
        return max(0.0, self.task(kind, stage).start - self.shift(kind, stage) * self.period)

    def shift(self, kind: str, stage: int) -> int:
        """The task's iteration shift ``floor(start / T)``: the copy that runs in period ``q``
        belongs to micro-batch ``q - shift``."""
        return math.floor(self.task(kind, stage).start / self.period + _REL_TOL)

    @cached_property
    def span(self) -> float:
        """Seconds from micro-batch 0's first task start to its last task end (its latency)."""
        ends = [t.start + self.duration(t.kind, t.stage) for t in self.tasks]
        return max(ends) - min(t.start for t in self.tasks)

    @property
    def warmup(self) -> float:
        """Seconds from the first task until the pattern runs in full (every task of the period
        busy): the span less one period, and as long again to drain at the end."""
        return max(0.0, self.span - self.period)

    @property
    def throughput(self) -> float:
        """Micro-batches per second in steady state (``1 / period``); times the micro-batch's
        samples for samples per second."""
        return 1.0 / self.period

    # ----- weights -----------------------------------------------------------------------
    def _holds(self, stage: int) -> float:
        """Seconds from the stage's forward start to its last backward task's end (its update
        of that micro-batch)."""
        f = self.task("F", stage)
        last = self.problem.kinds[-1]
        w = self.task(last, stage)
        return w.start + self.duration(last, stage) - f.start

    @cached_property
    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches between their forward's start and their last
        backward task's end at one instant (``ceil(holds / T)``)."""
        return tuple(_copies(self._holds(k), self.period) for k in range(self.problem.stages))

    @cached_property
    def replica_in_flight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches in flight on one of its replicas at one instant
        (``ceil(holds / (replicas * T))``; :attr:`in_flight` without replicas)."""
        return tuple(_copies(self._holds(k), r * self.period)
                     for k, r in enumerate(self.replicas))

    @cached_property
    def weight_versions(self) -> tuple[int, ...]:
        """Per stage, copies of its weights held at once on one device of it (module
        docstring)."""
        if self.policy == "stash":
            return self.replica_in_flight
        n = 2 if self.policy == "2bw" else 1
        return (n,) * self.problem.stages

    @cached_property
    def staleness(self) -> tuple[int, ...]:
        """Per stage, how many weight updates of the stage lie between the weights a
        micro-batch's forward reads and the update its own gradient makes, on its replica
        (``stash``, ``pipemare``: ``replica_in_flight - 1``; ``2bw``: 1, counted in updates of
        ``update_every`` micro-batches; 0 where one micro-batch is in flight, as in a
        synchronous pipeline)."""
        if self.policy == "2bw":
            return tuple(1 if n > 1 else 0 for n in self.replica_in_flight)
        return tuple(n - 1 for n in self.replica_in_flight)

    @cached_property
    def weight_memory(self) -> tuple[float, ...]:
        """Per device (of each replica), bytes of the weight versions beyond the one in its
        static memory."""
        out = [0.0] * self.problem.devices
        for k, (v, b) in enumerate(zip(self.weight_versions, self.weight_bytes, strict=True)):
            out[self.problem.stage_device[k]] += (v - 1) * b
        return tuple(out)

    @cached_property
    def activation_memory(self) -> tuple[float, ...]:
        """Per device (of each replica), the steady-state peak of the activations in flight
        (bytes): the level after every change at an instant (decreases and increases at one
        time count together, as the validator counts them), over one period once the pattern
        runs in full (a replica of r repeats every r periods)."""
        p = self.problem
        rep_of = [1] * p.devices
        for k, r in enumerate(self.replicas):
            rep_of[p.stage_device[k]] = r
        events: list[list[tuple[float, float]]] = [[] for _ in range(p.devices)]
        for t in self.tasks:
            alloc, free = p.memory_delta(Op(t.kind, t.stage, 0))
            d = p.stage_device[t.stage]
            if alloc:
                events[d].append((t.start, alloc))
            if free:
                events[d].append((t.start + self.duration(t.kind, t.stage), -free))
        out = []
        for d, ev in enumerate(events):
            if not ev:
                out.append(0.0)
                continue
            T = rep_of[d] * self.period
            # At time x the copies of an event at e that happened are floor((x - e) / T) + 1
            # (x past every event); the sum of all changes of one micro-batch is 0, so the
            # level depends only on the phase of x. Evaluate at each event's own phase.
            # A whole number of periods past every event: the same phase as each event.
            late = (math.ceil(max(e for e, _ in ev) / T) + 2) * T
            peak = 0.0
            for e0, _ in ev:
                x = e0 + late
                level = sum(delta * (math.floor((x - e) / T + _REL_TOL) + 1) for e, delta in ev)
                peak = max(peak, level)
            out.append(peak)
        return tuple(out)

    @cached_property
    def peak_memory(self) -> tuple[float, ...]:
        """Per device, steady-state peak memory (bytes): static + extra weight versions +
        activations in flight."""
        return tuple(s + w + a for s, w, a in zip(self.problem.static_memory, self.weight_memory,
                                                 self.activation_memory, strict=True))

    def over_memory(self) -> list[int]:
        """Devices whose steady-state peak exceeds their limit."""
        return [d for d, (m, lim) in enumerate(zip(self.peak_memory, self.problem.memory_limit,
                                                   strict=True))
                if lim is not None and m > lim * (1 + _REL_TOL)]

    # ----- output ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the pattern (format ``pipeopt-periodic``, version 1)."""
        p = self.problem
        return {
            "format": "pipeopt-periodic", "version": 1, "method": self.method,
            "period": self.period, "throughput": self.throughput,
            "lower_bound": self.lower_bound, "policy": self.policy,
            "update_every": self.update_every, "span": self.span, "warmup": self.warmup,
            "stages": [{"stage": k, "device": p.stage_device[k],
                        "replicas": self.replicas[k], "in_flight": self.in_flight[k],
                        "replica_in_flight": self.replica_in_flight[k],
                        "weight_versions": self.weight_versions[k],
                        "staleness": self.staleness[k],
                        "weight_bytes": self.weight_bytes[k],
                        "sync_s": self.sync_s[k]} for k in range(p.stages)],
            "peak_memory": list(self.peak_memory),
            "weight_memory": list(self.weight_memory),
            "activation_memory": list(self.activation_memory),
            "tasks": [{"kind": t.kind, "stage": t.stage, "device": p.stage_device[t.stage],
                       "start": t.start, "offset": self.offset(t.kind, t.stage),
                       "shift": self.shift(t.kind, t.stage),
                       "duration": self.duration(t.kind, t.stage)} for t in self.tasks],
            "messages": [x._asdict() for x in self.messages],
            "problem": p.to_dict(),
        }

    def replace(self, **changes: Any) -> PeriodicSchedule:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, doc: Any) -> PeriodicSchedule:
        """The schedule of a :meth:`to_dict` document, every field checked (a
        :class:`PeriodicError` names the key); derived figures are recomputed, not read."""
        from pipeopt.problem import ProblemError

        if not isinstance(doc, dict):
            raise PeriodicError(f"expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != "pipeopt-periodic" or doc.get("version") != 1:
            raise PeriodicError(f"format: expected pipeopt-periodic version 1, got "
                                f"{doc.get('format')!r} version {doc.get('version')!r}")
        try:
            prob = Problem.from_dict(_get(doc, "problem", dict))
        except ProblemError as exc:
            raise PeriodicError(f"problem: {exc}") from None
        stages = _get(doc, "stages", list)
        if len(stages) != prob.stages or not all(isinstance(st, dict) for st in stages):
            raise PeriodicError(f"stages: expected {prob.stages} objects (one per stage)")
        tasks = []
        for i, t in enumerate(_get(doc, "tasks", list)):
            if not isinstance(t, dict):
                raise PeriodicError(f"tasks[{i}]: expected an object")
            tasks.append(PatternTask(_get(t, "kind", str, f"tasks[{i}]."),
                                     _get(t, "stage", int, f"tasks[{i}]."),
                                     float(_get(t, "start", (int, float), f"tasks[{i}]."))))
        msgs = []
        for i, x in enumerate(_get(doc, "messages", list)):
            if not isinstance(x, dict):
                raise PeriodicError(f"messages[{i}]: expected an object")
            w = f"messages[{i}]."
            msgs.append(PatternMessage(_get(x, "kind", str, w), _get(x, "src_stage", int, w),
                                       _get(x, "dst_stage", int, w),
                                       float(_get(x, "start", (int, float), w))))
        return cls(prob, float(_get(doc, "period", (int, float))), tuple(tasks), tuple(msgs),
                   policy=_get(doc, "policy", str),
                   weight_bytes=tuple(float(_get(st, "weight_bytes", (int, float),
                                                 f"stages[{k}].")) for k, st in
                                      enumerate(stages)),
                   update_every=_get(doc, "update_every", int),
                   method=str(doc.get("method", "")),
                   lower_bound=doc.get("lower_bound") if isinstance(
                       doc.get("lower_bound"), int | float) else None,
                   replicas=tuple(int(_get(st, "replicas", int, f"stages[{k}].")) for k, st in
                                  enumerate(stages)),
                   sync_s=tuple(float(_get(st, "sync_s", (int, float), f"stages[{k}]."))
                                if "sync_s" in st else 0.0 for k, st in enumerate(stages)))


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``doc[key]`` of type ``kind`` (a bool is no number), or a PeriodicError naming it."""
    if key not in doc:
        raise PeriodicError(f"{where}{key}: missing")
    val = doc[key]
    if isinstance(val, bool) or not isinstance(val, kind):
        raise PeriodicError(f"{where}{key}: expected {getattr(kind, '__name__', 'a number')}, "
                            f"got {val!r}")
    return val


def unroll_length(schedule: PeriodicSchedule) -> int:
    """Micro-batches :func:`unroll` needs so that one micro-batch meets every other copy it can
    overlap with on both sides, and the steady state is reached: ``2 * ceil(span / T) + 2``."""
    msg_end = max((x.start + schedule.problem.transfer(x.src_stage, x.dst_stage)[0]
                   for x in schedule.messages), default=0.0)
    span = max(schedule.span, msg_end)
    return 2 * math.ceil(span / schedule.period) + 2


def unroll(schedule: PeriodicSchedule, microbatches: int | None = None) -> GraphSchedule:
    """``microbatches`` (default :func:`unroll_length`) copies of the pattern as a schedule of
    the chain's task graph, micro-batch ``j`` shifted by ``j * period``; each device's static
    memory includes its extra weight versions (:attr:`PeriodicSchedule.weight_memory`). With
    replicated stages the graph has one device per replica (:func:`replicated_graph`)."""
    p = schedule.problem
    n = unroll_length(schedule) if microbatches is None else microbatches
    if not isinstance(n, int) or n < 1:
        raise PeriodicError(f"microbatches: must be an integer >= 1, got {n!r}")
    static = tuple(s + w for s, w in zip(p.static_memory, schedule.weight_memory, strict=True))
    prob = p.replace(microbatches=n, static_memory=static, microbatch_scale=(),
                     microbatch_memory_scale=(), microbatch_message_scale=())
    if max(schedule.replicas) == 1:
        graph = training.build(prob)
    else:
        graph = replicated_graph(prob, schedule.replicas)
    T = schedule.period
    # Times on a grid of 2**-40 of the horizon (powers of two: exact in binary), so that events
    # which coincide in the pattern (a task starting as another ends, one period later)
    # coincide when unrolled too, whatever the rounding of ``start + j * T``.
    grid = 2.0 ** (math.frexp(schedule.span + n * T)[1] - _GRID_BITS)

    def snap(x: float) -> float:
        return round(x / grid) * grid

    start = [0.0] * graph.num_tasks
    end = [0.0] * graph.num_tasks
    for t in schedule.tasks:
        base = training.task_id(prob, Op(t.kind, t.stage, 0))
        d = schedule.duration(t.kind, t.stage)
        for j in range(n):
            start[base + j] = snap(t.start + j * T)
            end[base + j] = snap(t.start + d + j * T)
    edge_of = {(a, b): e for e, (a, b) in enumerate(zip(graph.src, graph.dst, strict=True))}
    msgs = []
    for x in schedule.messages:
        dst_kind = "F" if x.kind == "F" else "B"
        tx, lat = p.transfer(x.src_stage, x.dst_stage)
        a0 = training.task_id(prob, Op(x.kind, x.src_stage, 0))
        b0 = training.task_id(prob, Op(dst_kind, x.dst_stage, 0))
        for j in range(n):
            t0 = x.start + j * T
            msgs.append(MessageTime(edge_of[(a0 + j, b0 + j)], snap(t0), snap(t0 + tx),
                                    snap(t0 + tx + lat)))
    msgs.sort(key=lambda mm: mm.edge)
    return GraphSchedule(graph, tuple(start), tuple(end), tuple(msgs), method=schedule.method,
                         status="heuristic")


def replicated_graph(problem: Problem, replicas: Sequence[int]) -> TaskGraph:
    """The chain's task graph (task ids as :func:`pipeopt.workloads.training.build`'s) with
    stage k on ``replicas[k]`` devices, micro-batch j on replica ``j mod replicas[k]``.

    Devices are numbered stage by stage (stage k's replica c is device ``sum(replicas[:k]) +
    c``); each has its stage's device memory limit and static memory; a message between
    replicas of neighbouring stages crosses a directed link with the latency and bandwidth
    between the two stages' devices in ``problem``. One stage per device only."""
    reps = check_replicas(problem, replicas)
    if problem.virtual_stages != 1:
        raise PeriodicError("replicas: replicated stages need one stage per device")
    s, m = problem.stages, problem.microbatches
    first = [sum(reps[:k]) for k in range(s)]
    sd = problem.stage_device
    device: list[int] = []
    duration: list[float] = []
    alloc: list[float] = []
    free: list[float] = []
    label: list[str] = []
    src: list[int] = []
    dst: list[int] = []
    size: list[float] = []
    links: dict[tuple[int, int], tuple[float, float]] = {}

    def dev(k: int, j: int) -> int:
        return first[k] + j % reps[k]

    for kind in problem.kinds:
        for k in range(s):
            for j in range(m):
                op = Op(kind, k, j)
                device.append(dev(k, j))
                duration.append(problem.duration(op))
                a, f = problem.memory_delta(op)
                alloc.append(a)
                free.append(-f)
                label.append(f"{k}{kind}{j}")
    for kind in problem.kinds:
        for k in range(s):
            for x in problem.inputs(Op(kind, k, 0)):
                nbytes = training.message_bytes(problem, x.stage, k)
                for j in range(m):
                    src.append(training.task_id(problem, Op(x.kind, x.stage, j)))
                    dst.append(training.task_id(problem, Op(kind, k, j)))
                    size.append(nbytes)
                    a, b = dev(x.stage, j), dev(k, j)
                    if a != b:
                        links[(a, b)] = (problem.latency[sd[x.stage]][sd[k]],
                                         problem.bandwidth[sd[x.stage]][sd[k]])
    pairs = sorted(links)
    return TaskGraph(
        memory_limit=tuple(problem.memory_limit[sd[k]] for k in range(s) for _ in range(reps[k])),
        static_memory=tuple(problem.static_memory[sd[k]] for k in range(s)
                            for _ in range(reps[k])),
        link_src=tuple(a for a, _ in pairs), link_dst=tuple(b for _, b in pairs),
        latency=tuple(links[ab][0] for ab in pairs),
        bandwidth=tuple(links[ab][1] for ab in pairs),
        device=tuple(device), duration=tuple(duration), mem_start=tuple(alloc),
        mem_end=tuple(free), label=tuple(label), src=tuple(src), dst=tuple(dst),
        bytes=tuple(size), meta=(("workload", "periodic-replicated"),))
