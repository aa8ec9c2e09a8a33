"""PipeDream's planner: which layers form each stage, on which device type, and how many
devices replicate it.

The dynamic program of PipeDream (Narayanan et al., SOSP'19, section 3.1, "Partitioning
Algorithm"), over a topology of levels (e.g. 4 GPUs per node, then 2 nodes), each with the
bandwidth between its units. For layers ``i..j`` on ``r`` replicated units of level k:

* ``T_k(i..j, r) = max(unit_k(i..j), sync_k(i..j, r)) / r`` seconds per micro-batch: each
  replica runs every r-th micro-batch and then synchronises the stage's weights; the paper
  takes the larger of the two (computation and synchronisation overlap). ``unit_1`` is the
  layers' compute on one device (F + B + W per micro-batch); ``unit_k`` of a higher level is the
  best pipeline of those layers inside one unit of level k - 1 (all its devices).
  ``sync_k = 2 (r - 1) / r * weight_bytes / bandwidth_k`` (ring all-reduce, Patarasuk and Yuan,
  2009; the paper uses its parameter server's cost, the same shape);
* ``A_k(i..j, m)``: the least period of a pipeline of layers ``i..j`` on m units of level k:
  ``min(T_k(i..j, m), min over s, m' of max(A_k(i..s, m - m'), comm_k(s), T_k(s+1..j, m')))``
  with ``comm_k(s) = output_bytes[s] / bandwidth_k``, the activation crossing the cut (and the
  gradient back on the other direction of a full-duplex link; the paper counts ``2 C`` on a
  shared one).

**Heterogeneous devices** (HetPipe, Park et al., USENIX ATC'20, runs pipelines over nodes of
different GPU types): :func:`plan_cluster` takes :class:`DeviceType` s, each with its number of
top-level units (nodes), its own inner levels, its compute ``speed`` relative to the device the
layer profile was measured on (a stage's compute on it is the profile's divided by ``speed``;
or its own ``profile`` of per-layer times, as HetPipe profiles each GPU type)
and its ``memory`` per device. Every stage runs on devices of one type: its replicas share it.
A replicated stage takes micro-batches round-robin, so a mixed group would run at the pace of
its slowest member (the faster ones idle) within the smallest member's memory; HetPipe's
clusters hold one GPU type per node, where a stage's replicas sit. The top level is a DP over
the units left of each type: ``A(0..j, n)`` with ``n[t]`` units of type t, the last part
``s+1..j`` on ``r`` units of one type t (``T_t``, that type's own hierarchy below) and the head
on ``n - r e_t``; with one type this is ``A_top(0..j, m)`` above, term for term. Every device
is used, as in PipeDream's DP, unless ``every_node=False``: then the best over every number of
top-level units of each type (whole nodes left idle, e.g. a type too slow to help).

**Memory.** With a memory limit, a stage on devices of type t is allowed only if one device
holds it in steady state under PipeDream's 1F1B-async: ``n = ceil(devices from the stage on /
replicas)`` micro-batches in flight per replica (PipeDream's NOAM, SOSP'19 section 3.2), each
holding the stage's activations, and ``v(n)`` weight versions (``stash``: n, ``2bw``: 2,
``pipemare``: 1; the rule of :func:`pipeopt.workloads.periodic.max_in_flight`):
``static + v(n) w + n a <= memory``. The devices after a stage are known from the DP's state
(every device is used), so the check is exact within the model; a type without a limit keeps
the state of the unlimited DP.

The answer at the top level is the estimated period (s per micro-batch) and the flattened
stages: a top-level stage on r units whose units each run an inner pipeline gives the inner
stages r times their replicas. :func:`plan_problem` turns a plan into the chain
:class:`~pipeopt.problem.Problem` and ``replicas`` that the asynchronous methods take.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

from pipeopt.costs.collectives import all_reduce_time
from pipeopt.errors import ConfigError
from pipeopt.problem import Problem, chain_links

#: Weight-version policies the memory rule knows (:data:`pipeopt.workloads.periodic.POLICIES`).
MEMORY_POLICIES: tuple[str, ...] = ("stash", "2bw", "pipemare")
#: Relative tolerance on a memory fit (bytes): floating-point sums of layer bytes must not turn
#: an exact fit into a refusal (the periodic model's ``_REL_TOL``).
_REL_TOL = 1e-9


@dataclass(frozen=True)
class Layer:
    """One layer's cost per micro-batch on the profile's device: times (s), its output's bytes
    (the message to the next layer), its weights' bytes (what replicas synchronise) and its
    activation bytes (memory held from forward to backward)."""

    name: str
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    output_bytes: float
    weight_bytes: float
    activation_bytes: float = 0.0

    @property
    def compute_s(self) -> float:
        """F + B + W of one micro-batch (s)."""
        return self.forward_s + self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True)
class Level:
    """``units`` of the level below (devices at the first level) joined by ``bandwidth``
    (bytes/s between two of them)."""

    units: int
    bandwidth: float


@dataclass(frozen=True)
class DeviceType:
    """Devices of one kind in a heterogeneous cluster: ``units`` top-level units (nodes) of
    them, each made of ``levels`` (innermost first; empty: a unit is one device);
    ``speed``: compute speed relative to the layer profile's device (a layer's times are
    divided by it; 2.0 = twice as fast); ``memory``: bytes per device (None: no limit);
    ``profile``: per layer, (forward, backward input, backward weight) seconds measured on
    this type, in place of the profile's times / ``speed`` (then ``speed`` stays 1)."""

    name: str
    units: int
    levels: tuple[Level, ...] = ()
    speed: float = 1.0
    memory: float | None = None
    profile: tuple[tuple[float, float, float], ...] | None = None

    @property
    def unit_devices(self) -> int:
        """Devices in one top-level unit."""
        return math.prod(lv.units for lv in self.levels)

    @property
    def devices(self) -> int:
        """Devices of this type."""
        return self.units * self.unit_devices


@dataclass(frozen=True)
class Stage:
    """Layers ``first..last`` (inclusive) on ``replicas`` devices of type ``device_type`` (an
    index into the plan's ``types``); ``split_level``: the level of its type whose link joins
    this stage to the next (counting its inner levels, then the top one; 0 for the last stage)
    and ``link_bandwidth`` that link's bytes/s (inf for the last stage); ``sync_bandwidth``:
    the slowest link among the replicas (bytes/s: the bandwidth of the highest level at which
    the plan replicates it; inf with one replica)."""

    first: int
    last: int
    replicas: int
    split_level: int = 0
    sync_bandwidth: float = math.inf
    device_type: int = 0
    link_bandwidth: float = math.inf


@dataclass(frozen=True)
class Plan:
    """The planner's answer: ``stages`` in order, its estimated ``period`` (s per
    micro-batch) and the cluster's device ``types`` the stages index."""

    stages: tuple[Stage, ...]
    period: float
    types: tuple[DeviceType, ...] = ()

    @property
    def devices(self) -> int:
        """Devices the plan uses."""
        return sum(s.replicas for s in self.stages)

    def config(self) -> str:
        """PipeDream's notation: replicas per stage joined by dashes (e.g. ``7-1``)."""
        return "-".join(str(s.replicas) for s in self.stages)

    def type_of(self, stage: Stage) -> DeviceType:
        """The device type a stage runs on (a profile device when the plan has no types)."""
        return self.types[stage.device_type] if self.types else DeviceType("device", 1)


def _check_levels(levels: Sequence[Level], where: str) -> None:
    for k, lv in enumerate(levels):
        if not isinstance(lv.units, int) or isinstance(lv.units, bool) or lv.units < 1:
            raise ConfigError(f"{where}[{k}].units: must be an integer >= 1, got {lv.units!r}")
        if not (lv.bandwidth > 0):
            raise ConfigError(f"{where}[{k}].bandwidth: must be > 0 bytes/s, got "
                              f"{lv.bandwidth}")


def _check_layers(layers: Sequence[Layer]) -> None:
    if not layers:
        raise ConfigError("layers: the planner needs at least one layer")
    for i, lay in enumerate(layers):
        for key in ("forward_s", "backward_input_s", "backward_weight_s", "output_bytes",
                    "weight_bytes", "activation_bytes"):
            x = getattr(lay, key)
            if not (math.isfinite(x) and x >= 0):
                raise ConfigError(f"layers[{i}].{key}: must be a finite number >= 0, got {x}")


def _check_types(types: Sequence[DeviceType], bandwidth: float, policy: str,
                 static_bytes: float, layers: int) -> None:
    if not types:
        raise ConfigError("device_types: the planner needs at least one device type")
    seen: set[str] = set()
    for t, ty in enumerate(types):
        where = f"device_types[{t}]"
        if not ty.name or ty.name in seen:
            raise ConfigError(f"{where}.name: must be a unique, non-empty name, got "
                              f"{ty.name!r}")
        seen.add(ty.name)
        if not isinstance(ty.units, int) or isinstance(ty.units, bool) or ty.units < 1:
            raise ConfigError(f"{where}.units: must be an integer >= 1 (devices or nodes of "
                              f"this type), got {ty.units!r}")
        if not (math.isfinite(ty.speed) and ty.speed > 0):
            raise ConfigError(f"{where}.speed: must be a finite number > 0 (relative to the "
                              f"layer profile's device), got {ty.speed}")
        if ty.memory is not None and not (ty.memory > 0):
            raise ConfigError(f"{where}.memory: must be > 0 bytes, got {ty.memory}")
        if ty.profile is not None:
            if ty.speed != 1.0:
                raise ConfigError(f"{where}.speed: not with its own profile (the profile's "
                                  f"times are measured on it), got {ty.speed}")
            if len(ty.profile) != layers:
                raise ConfigError(f"{where}.profile: expected {layers} layers' times, got "
                                  f"{len(ty.profile)}")
            for i, row in enumerate(ty.profile):
                if len(row) != 3 or not all(math.isfinite(x) and x >= 0 for x in row):
                    raise ConfigError(f"{where}.profile[{i}]: must be 3 finite numbers >= 0 "
                                      f"(forward, backward input, backward weight s), got "
                                      f"{row!r}")
        _check_levels(ty.levels, f"{where}.levels")
    if not (bandwidth > 0):
        raise ConfigError(f"bandwidth: must be > 0 bytes/s between top-level units, got "
                          f"{bandwidth}")
    if policy not in MEMORY_POLICIES:
        raise ConfigError(f"policy: unknown weight policy {policy!r}; choose one of "
                          f"{', '.join(MEMORY_POLICIES)}")
    if not (math.isfinite(static_bytes) and static_bytes >= 0):
        raise ConfigError(f"static_bytes: must be a finite number >= 0, got {static_bytes}")


def plan(layers: Sequence[Layer], levels: Sequence[Level]) -> Plan:
    """PipeDream's partition and replication of ``layers`` over ``levels`` (first: devices per
    node, last: the top) of one device type, the profile's own, without a memory limit,
    minimising the estimated period (module docstring)."""
    _check_layers(layers)
    if not levels:
        raise ConfigError("levels: the planner needs at least one level (devices per node)")
    _check_levels(levels, "levels")
    top = levels[-1]
    return plan_cluster(layers, [DeviceType("device", top.units, tuple(levels[:-1]))],
                        top.bandwidth)


#: The DP's tables: ``replicated(k, i, j, r, times, after)`` (T_k) and ``best(k, i, j, m,
#: times, after)`` (A_k with its cuts) of one device type.
_Replicated = Callable[[int, int, int, int, int, int], float]
_Best = Callable[[int, int, int, int, int, int], tuple[float, tuple[tuple[int, int], ...]]]


def _type_tables(layers: tuple[Layer, ...], levels: tuple[Level, ...], speed: float,
                 memory: float | None, policy: str, static_bytes: float,
                 profile: tuple[tuple[float, float, float], ...] | None = None
                 ) -> tuple[_Replicated, _Best]:
    """PipeDream's DP inside one device type whose ``levels`` end with its top-level units
    (its layer times: ``profile``'s, else the layers' / ``speed``). ``times``: copies of each
    unit made by the levels above (a stage's replicas are its own times these); ``after``:
    devices after layer j in the whole pipeline (both only matter, and only enter the tables'
    keys, when ``memory`` is limited)."""
    compute, weights, acts = [0.0], [0.0], [0.0]
    for i, lay in enumerate(layers):
        compute.append(compute[-1] + (lay.compute_s if profile is None else sum(profile[i])))
        weights.append(weights[-1] + lay.weight_bytes)
        acts.append(acts[-1] + lay.activation_bytes)
    below = [math.prod(lv.units for lv in levels[:k]) for k in range(len(levels))]

    def fits(i: int, j: int, replicas: int, on: int) -> bool:
        """Layers i..j fit one device of ``replicas`` with ``on`` devices from them on."""
        if memory is None:
            return True
        n = -(-on // replicas)  # NOAM: micro-batches in flight per replica
        versions = n if policy == "stash" else 2 if policy == "2bw" else 1
        need = static_bytes + versions * (weights[j + 1] - weights[i]) + n * (acts[j + 1]
                                                                              - acts[i])
        return need <= memory * (1 + _REL_TOL)

    limited = memory is not None

    def unit(k: int, i: int, j: int, times: int, after: int) -> float:
        """Period of layers i..j on one unit of level k (one device at level 0)."""
        if k == 0:
            if not fits(i, j, times, times + after):
                return math.inf
            return (compute[j + 1] - compute[i]) / speed
        return best(k - 1, i, j, levels[k - 1].units, times, after)[0]

    def replicated(k: int, i: int, j: int, r: int, times: int, after: int) -> float:
        """T_k(i..j, r): layers i..j on r units of level k."""
        sync = 2 * (r - 1) / r * (weights[j + 1] - weights[i]) / levels[k].bandwidth
        return max(unit(k, i, j, r * times if limited else 1, after), sync) / r

    @cache
    def best(k: int, i: int, j: int, m: int, times: int, after: int
             ) -> tuple[float, tuple[tuple[int, int], ...]]:
        """(A_k(i..j, m), cut choices): the cuts as (last layer of the left part, units on
        the right part), left to right, the first part taking the units left over."""
        value, cuts = replicated(k, i, j, m, times, after), ()
        for s in range(i, j):
            comm = layers[s].output_bytes / levels[k].bandwidth
            for right in range(1, m):
                tail = replicated(k, s + 1, j, right, times, after)
                if max(comm, tail) >= value:
                    continue
                head, head_cuts = best(k, i, s, m - right, times,
                                       after + times * right * below[k] if limited else 0)
                v = max(head, comm, tail)
                if v < value:
                    value, cuts = v, (*head_cuts, (s, right))
        return value, cuts

    # Entry points: without a limit, every key has times = 1 and after = 0.
    def replicated_at(k: int, i: int, j: int, r: int, times: int, after: int) -> float:
        return replicated(k, i, j, r, times, after) if limited else replicated(k, i, j, r, 1, 0)

    def best_at(k: int, i: int, j: int, m: int, times: int, after: int
                ) -> tuple[float, tuple[tuple[int, int], ...]]:
        return best(k, i, j, m, times, after) if limited else best(k, i, j, m, 1, 0)

    return replicated_at, best_at


def plan_cluster(layers: Sequence[Layer], types: Sequence[DeviceType], bandwidth: float, *,
                 policy: str = "stash", static_bytes: float = 0.0,
                 every_node: bool = True) -> Plan:
    """The partition of ``layers`` into stages, each on replicas of one device type, over a
    cluster of ``types`` whose top-level units (nodes) are joined by ``bandwidth`` bytes/s,
    minimising the estimated period (module docstring). ``policy`` (``stash``, ``2bw``,
    ``pipemare``) and ``static_bytes`` (per device, beyond the weights) enter the memory rule
    of the types with a ``memory``. ``every_node``: every top-level unit runs a stage (as in
    PipeDream's DP); False: the plan may leave whole top-level units idle, the best over every
    number of units of each type (on a tie, the most devices). Raises :class:`ConfigError`
    when no plan fits memory."""
    _check_layers(layers)
    _check_types(types, bandwidth, policy, static_bytes, len(layers))
    if every_node and len(layers) < len(types):
        raise ConfigError(f"device_types: {len(layers)} layers cannot use every device type "
                          "(each stage runs on one type; a type needs at least one layer)")
    layers, types = tuple(layers), tuple(types)
    tables = [_type_tables(layers, (*ty.levels, Level(ty.units, bandwidth)), ty.speed,
                           ty.memory, policy, static_bytes, ty.profile) for ty in types]
    unit_devices = [ty.unit_devices for ty in types]
    limited = any(ty.memory is not None for ty in types)

    def devices(n: tuple[int, ...]) -> int:
        return sum(c * u for c, u in zip(n, unit_devices, strict=True))

    @cache
    def top(j: int, n: tuple[int, ...], total: int
            ) -> tuple[float, tuple[tuple[int, int, int], ...]]:
        """(A(0..j, n), cuts): layers 0..j on n[t] top-level units of each type t, with
        ``total`` devices in the whole plan (those after layer j are the rest; 0 stands for
        any total without a memory limit); the cuts as (last layer of the left part, type,
        units of the right part), the first part on the units left over (one type)."""
        after = total - devices(n) if limited else 0
        used = [t for t, c in enumerate(n) if c]
        value: float = math.inf
        cuts: tuple[tuple[int, int, int], ...] = ()
        if len(used) == 1:
            t = used[0]
            value = tables[t][0](len(types[t].levels), 0, j, n[t], 1, after)
        for s in range(j):
            comm = layers[s].output_bytes / bandwidth
            for t in range(len(types)):
                for right in range(1, n[t] + 1):
                    rest = (*n[:t], n[t] - right, *n[t + 1:])
                    if not any(rest):
                        continue
                    tail = tables[t][0](len(types[t].levels), s + 1, j, right, 1, after)
                    if max(comm, tail) >= value:
                        continue
                    head, head_cuts = top(s, rest, total)
                    v = max(head, comm, tail)
                    if v < value:
                        value, cuts = v, (*head_cuts, (s, t, right))
        return value, cuts

    last = len(layers) - 1
    full = tuple(ty.units for ty in types)
    counts = [full] if every_node else sorted(
        (n for n in itertools.product(*(range(c + 1) for c in full)) if any(n)),
        key=lambda n: -devices(n))
    period, cuts, chosen = math.inf, (), full
    for n in counts:
        v, c = top(last, n, devices(n) if limited else 0)
        if v < period:
            period, cuts, chosen = v, c, n
    if not math.isfinite(period):  # only a memory limit leaves no plan (checked above)
        which = "uses every device" if every_node else "fits"
        raise ConfigError(
            f"memory: no plan of the layers {which} within its memory (per device: "
            "static + weight versions x the stage's weight bytes + micro-batches in flight "
            "(PipeDream's NOAM) x its activation bytes); give the types more memory, fewer "
            "devices, or a policy with fewer versions (2bw, pipemare)")
    parts = []
    left = list(chosen)
    for _, t, right in cuts:
        left[t] -= right
    (first_type,) = [t for t, c in enumerate(left) if c]
    start, t_cur, r_cur = 0, first_type, left[first_type]
    for s, t, right in cuts:
        parts.append((start, s, t_cur, r_cur))
        start, t_cur, r_cur = s + 1, t, right
    parts.append((start, last, t_cur, r_cur))
    stages: list[Stage] = []
    after = devices(chosen)
    for n, (a, b, t, r) in enumerate(parts):
        after -= r * unit_devices[t]
        inner = _stages(tables[t][1], (*types[t].levels, Level(types[t].units, bandwidth)),
                        len(types[t].levels), a, b, r, 1, after, math.inf, t)
        if n < len(parts) - 1:  # the cut after this part crosses a top-level link
            inner[-1] = replace(inner[-1], split_level=len(types[t].levels) + 1,
                                link_bandwidth=bandwidth)
        stages += inner
    return Plan(tuple(stages), period, types)


def _stages(best: _Best, levels: tuple[Level, ...], k: int, a: int, b: int, r: int,
            times: int, after: int, bandwidth: float, device_type: int) -> list[Stage]:
    """The flattened stages of layers a..b on r units of level k, each unit copied ``times``
    over by the levels above, whose slowest link among the copies has ``bandwidth`` (bytes/s),
    with ``after`` devices after layer b."""
    bw = min(bandwidth, levels[k].bandwidth) if r > 1 else bandwidth
    if k == 0:
        return [Stage(a, b, r * times, sync_bandwidth=bw, device_type=device_type)]
    k -= 1
    m = levels[k].units
    times *= r
    _, cuts = best(k, a, b, m, times, after)
    parts = []
    start, left = a, m - sum(right for _, right in cuts)
    for s, right in cuts:
        parts.append((start, s, left))
        start, left = s + 1, right
    parts.append((start, b, left))
    below = math.prod(lv.units for lv in levels[:k])
    rest = sum(p[2] for p in parts)
    out: list[Stage] = []
    for n, (x, y, units) in enumerate(parts):
        rest -= units
        inner = _stages(best, levels, k, x, y, units, times, after + times * rest * below, bw,
                        device_type)
        if n < len(parts) - 1:  # the cut after this part crosses a link of level k
            inner[-1] = replace(inner[-1], split_level=k + 1,
                                link_bandwidth=levels[k].bandwidth)
        out += inner
    return out


def plan_problem(layers: Sequence[Layer], result: Plan, *, microbatches: int = 1,
                 static_bytes: float | None = None) -> tuple[Problem, tuple[int, ...]]:
    """The chain problem of a plan (one stage per device in it; per stage the sums of its
    layers' times on its device type (its profile's, else divided by its speed), and of their
    activation bytes;
    messages = the last layer's output over the link of the cut) and the stages' ``replicas``,
    for the asynchronous methods. With ``static_bytes``, each stage's device gets its type's
    memory as its limit and ``static_bytes`` + one copy of the stage's weights as static memory
    (the periodic model's static memory holds one version); without, neither is set."""
    st = result.stages
    n = len(st)

    def total(s: Stage, key: str) -> float:
        return math.fsum(getattr(layers[x], key) for x in range(s.first, s.last + 1))

    def timed(key: str) -> tuple[float, ...]:
        kind = ("forward_s", "backward_input_s", "backward_weight_s").index(key)
        out = []
        for s in st:
            ty = result.type_of(s)
            out.append(total(s, key) / ty.speed if ty.profile is None else
                       math.fsum(ty.profile[x][kind] for x in range(s.first, s.last + 1)))
        return tuple(out)

    lat, bwm = chain_links(n, [0.0] * (n - 1), [s.link_bandwidth for s in st[:-1]])
    memory = {} if static_bytes is None else {
        "memory_limit": tuple(result.type_of(s).memory for s in st),
        "static_memory": tuple(static_bytes + total(s, "weight_bytes") for s in st)}
    prob = Problem(devices=n, microbatches=microbatches,
                   forward=timed("forward_s"), backward_input=timed("backward_input_s"),
                   backward_weight=timed("backward_weight_s"),
                   activation_memory=tuple(total(s, "activation_bytes") for s in st),
                   latency=lat, bandwidth=bwm,
                   message_size=tuple(layers[s.last].output_bytes for s in st[:-1]),
                   meta=(("plan", result.config()),), **memory)
    return prob, tuple(s.replicas for s in st)


def plan_sync_s(layers: Sequence[Layer], result: Plan) -> tuple[float, ...]:
    """Per stage of a plan, seconds of one ring all-reduce of its layers' weight bytes among
    its replicas over their slowest link (``2 (r - 1) / r * bytes / bandwidth``, the
    planner's own ``sync``, Patarasuk and Yuan, 2009; 0 with one replica): the ``sync_s`` of
    the periodic model (:func:`pipeopt.workloads.periodic.replica_sync_bound`). One flat ring
    over the slowest link is what a stage replicated across levels costs at most; the planner
    counts each level's part apart."""
    out = []
    for s in result.stages:
        w = math.fsum(layers[x].weight_bytes for x in range(s.first, s.last + 1))
        out.append(0.0 if s.replicas == 1 else
                   all_reduce_time(s.replicas, w, 0.0, s.sync_bandwidth))
    return tuple(out)
