"""The immutable problem instance every solver takes.

A :class:`Problem` is fully resolved: every per-stage, per-device and per-link value is spelled
out, so solvers, the simulator and the validator never have to interpret config shorthands.
Times are in seconds and memory in bytes (any consistent units work).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from itertools import chain, repeat
from typing import Any, Literal, NamedTuple

Kind = Literal["F", "B", "W"]
#: A per-micro-batch factor list, or a table of such lists (one row per stage, or per stage
#: boundary for messages); ``()`` = not given.
Scale = tuple[float, ...] | tuple[tuple[float, ...], ...]
Placement = Literal["loop", "vshape"]
KINDS: tuple[Kind, ...] = ("F", "B", "W")


class ProblemError(ValueError):
    """A problem instance that cannot exist (the message names the field and the reason)."""


class Op(NamedTuple):
    """One operation: ``kind`` of global ``stage`` on ``microbatch``.

    ``kind`` is ``F`` (forward), ``B`` (backward for inputs, or the whole backward when the
    problem does not split it) or ``W`` (backward for weights).
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        # The compact form of torch.distributed.pipelining: stage, kind, micro-batch.
        return f"{self.stage}{self.kind}{self.microbatch}"


def stage_device_map(devices: int, virtual_stages: int, placement: str) -> tuple[int, ...]:
    """Device of every global stage for a placement (``loop``: k % p; ``vshape``: a V)."""
    p, v = devices, virtual_stages
    if placement == "loop":
        return tuple(k % p for k in range(p * v))
    if placement == "vshape":
        # Chunk c runs down the devices when c is even and back up when it is odd, so the
        # V's tip (stages p-1 and p) stays on the last device, as in ZB-V.
        out = []
        for k in range(p * v):
            c, r = divmod(k, p)
            out.append(r if c % 2 == 0 else p - 1 - r)
        return tuple(out)
    raise ProblemError(f"placement: must be 'loop' or 'vshape', got {placement!r}")


def positive_int(name: str, value: Any) -> int:
    """``value`` as a count (an integer >= 1, not a bool); :class:`ProblemError` naming
    ``name`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProblemError(f"{name}: must be an integer >= 1, got {value!r}")
    return value


def _floats(name: str, values: Sequence[float], n: int, *, allow_inf: bool = False,
            positive: bool = False) -> tuple[float, ...]:
    vals = tuple(map(float, values))
    if len(vals) != n:
        raise ProblemError(f"{name}: expected {n} values, got {len(vals)}")
    if vals and _all_valid(vals, allow_inf=allow_inf, positive=positive):
        return vals
    for i, x in enumerate(vals):
        if math.isnan(x) or (math.isinf(x) and not allow_inf):
            raise ProblemError(f"{name}[{i}]: must be a finite number, got {x}")
        if x < 0 or (positive and x == 0):
            rel = "> 0" if positive else ">= 0"
            raise ProblemError(f"{name}[{i}]: must be {rel}, got {x}")
    return vals


def _all_valid(vals: tuple[float, ...], *, allow_inf: bool, positive: bool) -> bool:
    """Do all of ``vals`` (not empty) pass :func:`_floats`' checks? Two C-level passes instead
    of a test per value; the caller walks the values for the first bad one only when this says
    no. A NaN makes the sum NaN, an infinity makes it infinite (or NaN with one of each sign),
    and without NaN ``min`` is exact; a finite sum that overflows only sends a valid row to
    the walk."""
    total = sum(vals)
    if math.isnan(total) or (not allow_inf and math.isinf(total)):
        return False
    low = min(vals)
    return low > 0 if positive else low >= 0


@dataclass(frozen=True)
class Problem:
    """A pipeline scheduling instance.

    Per-stage tuples have ``stages = devices * virtual_stages`` entries; per-device tuples have
    ``devices`` entries; ``latency`` and ``bandwidth`` are ``devices x devices`` matrices (seconds,
    bytes/s) between any two devices; ``message_size`` has one entry per stage boundary
    (``stages - 1``; bytes of the activation sent from stage k to k+1 and of the gradient sent
    back). ``grad_reduce`` is a per-stage data-parallel gradient reduction (seconds on the
    network, after the stage's last W), counted in :attr:`iteration time` but not in the makespan.

    Micro-batches of different cost: ``microbatch_scale[j]`` (``microbatches`` entries, each
    finite and > 0; ``()`` = all 1) multiplies micro-batch j's op durations on every stage.
    ``microbatch_memory_scale[j]`` multiplies its activation and weight-gradient memory and
    ``microbatch_message_scale[j]`` its message bytes (transmission time; latency unchanged).
    The memory scale defaults to the time scale and the message scale to the memory scale (a
    message is an activation), so a cost model can give FLOPs (linear + quadratic attention in
    the sequence length) a different factor from the bytes. A scale equal to its default is
    stored as ``()``, so equal problems compare equal however they were written.

    A full table per stage x micro-batch: each of the three may instead be a table, one row of
    ``microbatches`` factors per stage (``stages`` rows for times and memory; ``stages - 1``
    rows, one per stage boundary k -> k+1, for messages), when micro-batches differ by stage
    (attention's s^2 share is larger on some stages than on others; the embedding and the head
    stages grow linearly). Defaults are taken row by row (a message table's row k defaults to
    the memory factors of stage k, the sender in the forward direction). A table whose rows
    are all equal is stored as its one row. :attr:`time_table`, :attr:`memory_table` and
    :attr:`message_table` resolve every form; :attr:`time_scale` and its kin are then
    per-micro-batch summaries (work-weighted means), for orderings and reports only.

    Sub-blocks (CrossPipe, Chen et al., USENIX ATC 2025): with ``sub_blocks = k > 1`` every
    model stage (``devices * virtual_stages`` of them, placed by ``placement``) is cut into k
    pieces, contiguous parts of its layers, which are the problem's stages: global stage
    ``q`` is piece ``q % k`` of model stage ``q // k`` and runs on that stage's device, so
    every per-stage tuple has ``stages = devices * virtual_stages * k`` entries (one per
    piece) and ``message_size`` one per piece boundary (those inside a model stage cross no
    link). F runs the pieces in order, B and W in reverse, each piece its own op, so other
    work may run between them. :func:`pipeopt.subblocks.split` makes such a problem from an
    uncut one; :func:`pipeopt.subblocks.merge` gives the uncut one back.
    """

    devices: int
    microbatches: int
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    virtual_stages: int = 1
    placement: Placement = "loop"
    split_backward: bool = True
    activation_memory: tuple[float, ...] = ()
    weight_grad_memory: tuple[float, ...] = ()
    latency: tuple[tuple[float, ...], ...] = ()
    bandwidth: tuple[tuple[float, ...], ...] = ()
    message_size: tuple[float, ...] = ()
    memory_limit: tuple[float | None, ...] = ()
    static_memory: tuple[float, ...] = ()
    grad_reduce: tuple[float, ...] = ()
    microbatch_scale: Scale = ()
    microbatch_memory_scale: Scale = ()
    microbatch_message_scale: Scale = ()
    sub_blocks: int = 1
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        p, m, v = self.devices, self.microbatches, self.virtual_stages
        for name, val in (("devices", p), ("microbatches", m), ("virtual_stages", v),
                          ("sub_blocks", self.sub_blocks)):
            positive_int(name, val)
        if self.placement not in ("loop", "vshape"):
            raise ProblemError(f"placement: must be 'loop' or 'vshape', got {self.placement!r}")
        s = p * v * self.sub_blocks
        set_ = object.__setattr__
        set_(self, "forward", _floats("forward", self.forward, s))
        set_(self, "backward_input", _floats("backward_input", self.backward_input, s))
        set_(self, "backward_weight", _floats("backward_weight", self.backward_weight, s))
        act = self.activation_memory or (0.0,) * s
        set_(self, "activation_memory", _floats("activation_memory", act, s))
        wgm = self.weight_grad_memory or self.activation_memory
        set_(self, "weight_grad_memory", _floats("weight_grad_memory", wgm, s))
        for k, (a, w) in enumerate(zip(self.activation_memory, self.weight_grad_memory,
                                       strict=True)):
            if w > a:
                raise ProblemError(
                    f"weight_grad_memory[{k}]: must be <= activation_memory[{k}] ({a}), got {w}")
        lat = self.latency or tuple((0.0,) * p for _ in range(p))
        bw = self.bandwidth or tuple((math.inf,) * p for _ in range(p))
        set_(self, "latency", _matrix("latency", lat, p, allow_inf=False))
        set_(self, "bandwidth", _matrix("bandwidth", bw, p, allow_inf=True, positive=True))
        msg = self.message_size or (0.0,) * (s - 1)
        set_(self, "message_size", _floats("message_size", msg, s - 1))
        static = self.static_memory or (0.0,) * p
        set_(self, "static_memory", _floats("static_memory", static, p))
        limit = self.memory_limit or (None,) * p
        if len(limit) != p:
            raise ProblemError(f"memory_limit: expected {p} values, got {len(limit)}")
        lim: list[float | None] = []
        for i, x in enumerate(limit):
            if x is None or (isinstance(x, float) and math.isinf(x)):
                lim.append(None)
                continue
            x = float(x)
            if math.isnan(x) or x < 0:
                raise ProblemError(f"memory_limit[{i}]: must be >= 0 or null, got {x}")
            lim.append(x)
        set_(self, "memory_limit", tuple(lim))
        red = self.grad_reduce or (0.0,) * s
        set_(self, "grad_reduce", _floats("grad_reduce", red, s))
        # Each scale is resolved to a table (rows x micro-batches) and stored as () when it
        # equals its default (all 1 / the time table / the memory table's rows), as its one row
        # when its rows are equal, else as the table: the canonical form of a problem does not
        # depend on how it was given.
        ones = ((1.0,) * m,) * s
        time_t = _scale_table("microbatch_scale", self.microbatch_scale, s, m, "stage")
        mem_t = _scale_table("microbatch_memory_scale", self.microbatch_memory_scale, s, m,
                             "stage")
        msg_t = _scale_table("microbatch_message_scale", self.microbatch_message_scale, s - 1,
                             m, "stage boundary")
        time_t = time_t or ones
        mem_t = mem_t or time_t
        set_(self, "microbatch_scale", _canonical(time_t, ones))
        set_(self, "microbatch_memory_scale", _canonical(mem_t, time_t))
        set_(self, "microbatch_message_scale", _canonical(msg_t or mem_t[:s - 1], mem_t[:s - 1]))
        if not isinstance(self.meta, tuple):
            set_(self, "meta", tuple(dict(self.meta).items()))

    # ----- derived structure ---------------------------------------------------------------
    @cached_property
    def stages(self) -> int:
        """Number of global stages ``devices * virtual_stages * sub_blocks`` (with sub-blocks,
        each piece is a stage: see :attr:`sub_blocks`)."""
        return self.devices * self.virtual_stages * self.sub_blocks

    @cached_property
    def stage_device(self) -> tuple[int, ...]:
        """Device of each global stage (the ``sub_blocks`` pieces of a model stage share its
        device)."""
        whole = stage_device_map(self.devices, self.virtual_stages, self.placement)
        if self.sub_blocks == 1:
            return whole
        return tuple(d for d in whole for _ in range(self.sub_blocks))

    @cached_property
    def device_stages(self) -> tuple[tuple[int, ...], ...]:
        """Stages held by each device, in increasing stage order."""
        out: list[list[int]] = [[] for _ in range(self.devices)]
        for k, d in enumerate(self.stage_device):
            out[d].append(k)
        return tuple(tuple(x) for x in out)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Op kinds of this problem: F, B, W, or F, B when the backward is fused."""
        return ("F", "B", "W") if self.split_backward else ("F", "B")

    # ----- micro-batches of different cost ----------------------------------------------------
    @cached_property
    def stage_scales(self) -> bool:
        """True when some scale is a table (micro-batches differ by stage, not by one factor)."""
        return any(_is_table(x) for x in (self.microbatch_scale, self.microbatch_memory_scale,
                                          self.microbatch_message_scale))

    @cached_property
    def time_table(self) -> tuple[tuple[float, ...], ...]:
        """Per stage k, per micro-batch j: the factor on the durations of F/B/W(k, j)."""
        return _rows(self.microbatch_scale, self.stages) or ((1.0,) * self.microbatches,
                                                             ) * self.stages

    @cached_property
    def memory_table(self) -> tuple[tuple[float, ...], ...]:
        """Per stage k, per micro-batch j: the factor on (k, j)'s activation and
        weight-gradient memory (resolved)."""
        return _rows(self.microbatch_memory_scale, self.stages) or self.time_table

    @cached_property
    def message_table(self) -> tuple[tuple[float, ...], ...]:
        """Per stage boundary k (k -> k+1 and back), per micro-batch j: the factor on the
        message bytes (resolved; latency is not scaled)."""
        return (_rows(self.microbatch_message_scale, self.stages - 1)
                or self.memory_table[:self.stages - 1])

    @cached_property
    def time_scale(self) -> tuple[float, ...]:
        """Factor on micro-batch j's op durations, one per micro-batch (all 1 by default). From
        a table: the mean over stages weighted by a unit micro-batch's F + B + W per stage."""
        if _is_table(self.microbatch_scale):
            weights = [f + b + w for f, b, w in zip(self.forward, self.backward_input,
                                                    self.backward_weight, strict=True)]
            return _summary(self.time_table, weights)
        return self.microbatch_scale or (1.0,) * self.microbatches  # type: ignore[return-value]

    @cached_property
    def memory_scale(self) -> tuple[float, ...]:
        """Factor on micro-batch j's activation and weight-gradient memory (resolved). From a
        table: the mean over stages weighted by their activation memory."""
        if self._memory_is_table:
            return _summary(self.memory_table, self.activation_memory)
        return self.microbatch_memory_scale or self.time_scale  # type: ignore[return-value]

    @cached_property
    def message_scale(self) -> tuple[float, ...]:
        """Factor on micro-batch j's message bytes (resolved; latency is not scaled). From a
        table: the mean over boundaries weighted by their message size."""
        mu = self.microbatch_message_scale
        if self.stages > 1 and (_is_table(mu) or (not mu and self._memory_is_table)):
            return _summary(self.message_table, self.message_size)
        return mu or self.memory_scale  # type: ignore[return-value]

    @property
    def _memory_is_table(self) -> bool:
        mm = self.microbatch_memory_scale
        return _is_table(mm) or (not mm and _is_table(self.microbatch_scale))

    @cached_property
    def uniform_microbatches(self) -> bool:
        """True when every micro-batch costs the same (every scale is 1)."""
        return not (self.microbatch_scale or self.microbatch_memory_scale
                    or self.microbatch_message_scale)

    @cached_property
    def microbatch_key(self) -> tuple[tuple[float, ...], ...]:
        """Micro-batch j's factors: (time, memory, message) scale, or with a table its whole
        columns. Micro-batches with equal keys are interchangeable (any schedule stays valid,
        with the same times, when they swap)."""
        if not self.stage_scales:
            return tuple(zip(self.time_scale, self.memory_scale, self.message_scale,
                             strict=True))
        cols = [tuple(zip(*t, strict=True)) if t else ((),) * self.microbatches
                for t in (self.time_table, self.memory_table, self.message_table)]
        return tuple(a + b + c for a, b, c in zip(*cols, strict=True))

    @cached_property
    def distinct_microbatches(self) -> tuple[int, ...]:
        """One micro-batch of each distinct :attr:`microbatch_key`, lowest index first
        (``(0,)`` when all are equal)."""
        if self.uniform_microbatches:
            return (0,)
        seen: dict[tuple[float, ...], int] = {}
        for j, key in enumerate(self.microbatch_key):
            seen.setdefault(key, j)
        return tuple(seen.values())

    def permute_microbatches(self, order: Sequence[int]) -> Problem:
        """The same problem with micro-batches relabelled: its micro-batch i is this problem's
        micro-batch ``order[i]``. Running a FIFO order (hand-made schedules) on it runs the
        micro-batches in ``order``."""
        m = self.microbatches
        order = [int(j) for j in order]
        if sorted(order) != list(range(m)):
            raise ProblemError(f"order: must be a permutation of 0..{m - 1}, got {order}")
        if order == list(range(m)) or self.uniform_microbatches:
            return self

        def perm(scale: Scale) -> Scale:
            if _is_table(scale):
                return tuple(tuple(row[j] for j in order) for row in scale)  # type: ignore[index]
            return tuple(scale[j] for j in order) if scale else ()  # type: ignore[misc]

        # Every scale as stored (a default stays a default: it follows the one it copies).
        return replace(self, microbatch_scale=perm(self.microbatch_scale),
                       microbatch_memory_scale=perm(self.microbatch_memory_scale),
                       microbatch_message_scale=perm(self.microbatch_message_scale))

    def duration(self, op: Op) -> float:
        """Duration of ``op`` in seconds (scaled by its micro-batch's time scale)."""
        k = op.stage
        if op.kind == "F":
            t = self.forward[k]
        elif op.kind == "B":
            t = self.backward_input[k]
            if not self.split_backward:
                t += self.backward_weight[k]
        elif op.kind == "W":
            t = self.backward_weight[k]
        else:
            raise ProblemError(f"unknown op kind {op.kind!r}")
        return t * self.time_table[k][op.microbatch] if self.microbatch_scale else t

    def op_durations(self) -> tuple[float, ...]:
        """Duration of every op in seconds, indexed by op id (the numbering of
        :attr:`op_table`): the values of :meth:`duration`, read once per (kind, stage) when
        every micro-batch costs the same (:attr:`uniform_microbatches`), else once per op."""
        if not self.uniform_microbatches:
            return tuple(map(self.duration, self.ops()))
        m = self.microbatches
        out: list[float] = []
        for kind in self.kinds:
            for k in range(self.stages):
                out += [self.duration(Op(kind, k, 0))] * m
        return tuple(out)

    def op_memory_deltas(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(allocated at start, released at end) of every op in bytes, as two columns indexed
        by op id: the values of :meth:`memory_delta`, read as :meth:`op_durations` reads."""
        if not self.uniform_microbatches:
            allocs, frees = zip(*map(self.memory_delta, self.ops()), strict=True)
            return tuple(allocs), tuple(frees)
        m = self.microbatches
        alloc: list[float] = []
        free: list[float] = []
        for kind in self.kinds:
            for k in range(self.stages):
                a, f = self.memory_delta(Op(kind, k, 0))
                alloc += [a] * m
                free += [f] * m
        return tuple(alloc), tuple(free)

    @cached_property
    def durations(self) -> dict[str, tuple[float, ...]]:
        """Per-stage duration of each op kind for a unit micro-batch (seconds); micro-batch j
        takes ``time_table[k][j]`` times as long on stage k (see :meth:`duration`)."""
        if self.split_backward:
            return {"F": self.forward, "B": self.backward_input, "W": self.backward_weight}
        fused = tuple(b + w for b, w in zip(self.backward_input, self.backward_weight,
                                            strict=True))
        return {"F": self.forward, "B": fused}

    @cached_property
    def op_table(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                tuple[str, ...]]:
        """Columns (device, stage, microbatch, kind) of every op, indexed by op id
        ``(kind_index * stages + stage) * microbatches + microbatch`` in :attr:`kinds` order."""
        s, m = self.stages, self.microbatches
        sd = self.stage_device
        nk = len(self.kinds)
        # Runs of repeated values joined in C (a generator per op was 0.02-0.05 s of CPU at
        # p = 64, m = 1024, paid once per problem by the simulator and the greedy).
        dev = tuple(chain.from_iterable(repeat(sd[k], m) for k in range(s))) * nk
        stage = tuple(chain.from_iterable(repeat(k, m) for k in range(s))) * nk
        mb = tuple(range(m)) * (nk * s)
        kind = tuple(chain.from_iterable(repeat(x, s * m) for x in self.kinds))
        return dev, stage, mb, kind

    def inputs(self, op: Op) -> list[Op]:
        """The ops whose outputs ``op`` needs: F(k) needs F(k-1); B(k) needs F(k) and, below
        the last stage, B(k+1); W(k) needs B(k)."""
        k, j = op.stage, op.microbatch
        if op.kind == "F":
            return [Op("F", k - 1, j)] if k > 0 else []
        if op.kind == "B":
            return [Op("F", k, j)] + ([Op("B", k + 1, j)] if k < self.stages - 1 else [])
        return [Op("B", k, j)]

    def ops(self) -> Iterator[Op]:
        """Every op of the problem exactly once."""
        for kind in self.kinds:
            for k in range(self.stages):
                for j in range(self.microbatches):
                    yield Op(kind, k, j)

    @property
    def num_ops(self) -> int:
        """Number of ops (``len(kinds) * stages * microbatches``)."""
        return len(self.kinds) * self.stages * self.microbatches

    def device_work(self, device: int) -> float:
        """Total busy time of ``device`` over one iteration (seconds), every micro-batch at its
        own cost."""
        stages = self.device_stages[device]
        if not self.microbatch_scale:
            return self.microbatches * sum(self.forward[k] + self.backward_input[k]
                                           + self.backward_weight[k] for k in stages)
        if not _is_table(self.microbatch_scale):
            per_mb = sum(self.forward[k] + self.backward_input[k] + self.backward_weight[k]
                         for k in stages)
            return per_mb * math.fsum(self.microbatch_scale)  # type: ignore[arg-type]
        return math.fsum((self.forward[k] + self.backward_input[k] + self.backward_weight[k])
                         * math.fsum(self.time_table[k]) for k in stages)

    # ----- links ---------------------------------------------------------------------------
    def transfer(self, src_stage: int, dst_stage: int, microbatch: int | None = None
                 ) -> tuple[float, float]:
        """(transmission seconds, latency seconds) of one message between two adjacent stages.

        The transmission occupies the directed link between the two devices; the latency is a
        pure delay after it. Both are 0 when the stages share a device. With ``microbatch`` the
        message's bytes are scaled by its message scale; without it, a unit micro-batch's.
        """
        a, b = self.stage_device[src_stage], self.stage_device[dst_stage]
        if a == b:
            return 0.0, 0.0
        boundary = min(src_stage, dst_stage)
        size = self.message_size[boundary]
        if microbatch is not None and not self.uniform_microbatches:
            size *= self.message_table[boundary][microbatch]
        bw = self.bandwidth[a][b]
        tx = 0.0 if size == 0 or math.isinf(bw) else size / bw
        return tx, self.latency[a][b]

    def delay(self, src_stage: int, dst_stage: int, microbatch: int | None = None) -> float:
        """Delay of one message between adjacent stages on an idle link (seconds); see
        :meth:`transfer` for ``microbatch``."""
        tx, lat = self.transfer(src_stage, dst_stage, microbatch)
        return tx + lat

    @cached_property
    def has_link_contention(self) -> bool:
        """True when some message occupies its link for a positive time (links serialize)."""
        return any(self.transfer(k, k + 1)[0] > 0 or self.transfer(k + 1, k)[0] > 0
                   for k in range(self.stages - 1))

    @cached_property
    def has_link_delay(self) -> bool:
        """True when some message between adjacent stages takes a positive time on an idle link
        (latency or transmission), in either direction."""
        return any(self.delay(k, k + 1) > 0 or self.delay(k + 1, k) > 0
                   for k in range(self.stages - 1))

    # ----- memory --------------------------------------------------------------------------
    def memory_delta(self, op: Op) -> tuple[float, float]:
        """(allocated at op start, released at op end) in bytes for ``op`` (scaled by its
        factor in :attr:`memory_table`)."""
        try:
            alloc, free = self.memory_deltas[(op.kind, op.stage)]
        except KeyError:
            raise ProblemError(f"no op {op} in this problem") from None
        if self.uniform_microbatches:
            return alloc, free
        c = self.memory_table[op.stage][op.microbatch]
        return alloc * c, free * c

    @cached_property
    def memory_deltas(self) -> dict[tuple[str, int], tuple[float, float]]:
        """(allocated at start, released at end) in bytes of every (kind, stage) for a unit
        micro-batch; micro-batch j's on stage k are ``memory_table[k][j]`` times these."""
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for k in range(self.stages):
            act, wgm = self.activation_memory[k], self.weight_grad_memory[k]
            out[("F", k)] = (act, 0.0)
            out[("B", k)] = (0.0, (act - wgm) if self.split_backward else act)
            if self.split_backward:
                out[("W", k)] = (0.0, wgm)
        return out

    def replace(self, **changes: Any) -> Problem:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field plus ``stages`` and ``stage_device``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            val = getattr(self, f.name)
            if (f.name in _SCALES and not val) or (f.name == "sub_blocks" and val == 1):
                continue  # default; keeps files of uniform / uncut problems as they were
            if f.name in _SCALES and _is_table(val):
                out[f.name] = [list(row) for row in val]
            elif f.name == "meta":
                out[f.name] = dict(val)
            elif f.name in ("latency", "bandwidth"):
                out[f.name] = [_json_row(row) for row in val]
            elif isinstance(val, tuple):
                out[f.name] = [_json_float(x) for x in val]
            else:
                out[f.name] = val
        out["stages"] = self.stages
        out["stage_device"] = list(self.stage_device)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        """Inverse of :meth:`to_dict` (derived keys are checked, not trusted)."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, val in data.items():
            if key in ("stages", "stage_device"):
                continue
            if key not in known:
                raise ProblemError(f"problem.{key}: unknown field")
            if key == "meta":
                kwargs[key] = tuple((val or {}).items())
            elif key in ("latency", "bandwidth"):
                kwargs[key] = tuple(tuple(_from_json_float(x) for x in row) for row in val)
            elif isinstance(val, list):
                kwargs[key] = tuple(_from_json_float(x) if x is not None else None for x in val)
            else:
                kwargs[key] = val
        try:
            prob = cls(**kwargs)
        except TypeError as exc:
            raise ProblemError(f"problem: {exc}") from None
        if "stage_device" in data and list(data["stage_device"]) != list(prob.stage_device):
            raise ProblemError("problem.stage_device: does not match devices/placement")
        return prob


_SCALES = ("microbatch_scale", "microbatch_memory_scale", "microbatch_message_scale")


def _is_table(scale: Any) -> bool:
    """Is this scale a table (rows of factors) rather than one factor per micro-batch?"""
    return bool(scale) and isinstance(scale[0], (tuple, list))


def _scale_table(name: str, values: Any, rows: int, m: int, row_name: str
                 ) -> tuple[tuple[float, ...], ...]:
    """Validated factors (each finite and > 0) as ``rows`` rows of ``m``: a list is every
    row, a table (a list of lists) gives each row; () when none are given."""
    if not values:
        return ()
    if not isinstance(values, (tuple, list)):
        raise ProblemError(f"{name}: expected a list of factors or a table, got {values!r:.60}")
    nested = [isinstance(x, (tuple, list)) for x in values]
    if not any(nested):
        return (_floats(name, values, m, positive=True),) * rows
    if not all(nested):
        i = nested.index(False)
        raise ProblemError(f"{name}[{i}]: a table's rows must all be lists (one per "
                           f"{row_name}), got {values[i]!r:.60}")
    if len(values) != rows:
        raise ProblemError(f"{name}: a table needs {rows} rows (one per {row_name}), got "
                           f"{len(values)}")
    return tuple(_floats(f"{name}[{k}]", row, m, positive=True) for k, row in enumerate(values))


def _canonical(table: tuple[tuple[float, ...], ...], default: tuple[tuple[float, ...], ...]
               ) -> Scale:
    """How a resolved scale is stored: () when it is the default, its row when all rows are
    equal, else the table."""
    if table == default:
        return ()
    if all(row == table[0] for row in table):
        return table[0]
    return table


def _rows(scale: Scale, rows: int) -> tuple[tuple[float, ...], ...]:
    """A stored scale as a table of ``rows`` rows (() when it is the default)."""
    if not scale or _is_table(scale):
        return scale  # type: ignore[return-value]
    return (scale,) * rows  # type: ignore[return-value]


def _summary(table: tuple[tuple[float, ...], ...], weights: Sequence[float]
             ) -> tuple[float, ...]:
    """Per micro-batch, the mean of its column weighted by ``weights`` (plain when they sum
    to 0)."""
    total = math.fsum(weights)
    if total <= 0:
        weights, total = [1.0] * len(table), float(len(table))
    return tuple(math.fsum(w * x for w, x in zip(weights, col, strict=True)) / total
                 for col in zip(*table, strict=True))


def _matrix(name: str, rows: Sequence[Sequence[float]], p: int, *, allow_inf: bool,
            positive: bool = False) -> tuple[tuple[float, ...], ...]:
    if len(rows) != p:
        raise ProblemError(f"{name}: expected a {p}x{p} matrix, got {len(rows)} rows")
    out = tuple(tuple(map(float, row)) for row in rows)
    # Whole rows at a time (a million values at p = 1024); only a matrix that fails, or has a
    # row of the wrong length, is walked value by value for the message.
    if all(len(row) == p and _all_valid(row, allow_inf=allow_inf, positive=positive)
           for row in out):
        return out
    return tuple(_floats(f"{name}[{i}]", row, p, allow_inf=allow_inf, positive=positive)
                 for i, row in enumerate(out))


def _json_float(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _json_row(row: tuple[float, ...]) -> list[Any]:
    """A matrix row as :func:`_json_float` writes each value; rows with no infinity (the
    latency rows) or only infinities (an unlimited bandwidth) are written without a call per
    value, which is most of the header of a 1024-device schedule."""
    infs = row.count(math.inf)
    if infs == len(row):
        return ["inf"] * infs
    if not infs and -math.inf not in row:
        return list(row)
    return [_json_float(x) for x in row]


def _from_json_float(x: Any) -> Any:
    if isinstance(x, str) and x in ("inf", "-inf", ".inf", "Infinity"):
        return math.inf if not x.startswith("-") else -math.inf
    return x


def chain_links(devices: int, latency: Sequence[float], bandwidth: Sequence[float]
                ) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """Device-to-device latency and bandwidth matrices from per-neighbour values.

    ``latency[i]`` / ``bandwidth[i]`` describe the link between devices i and i+1. Devices that
    are not neighbours (the interleaved wrap-around from the last device to device 0) talk
    through the slowest tier between them, as in a switched hierarchy: the largest latency and
    the smallest bandwidth on the chain between them. Pass full matrices to ``Problem`` for
    anything else.
    """
    p = devices
    lat = [[0.0] * p for _ in range(p)]
    bw = [[math.inf] * p for _ in range(p)]
    for a in range(p):
        worst_lat, worst_bw = -math.inf, math.inf  # over the links a .. b-1, one more each step
        for b in range(a + 1, p):
            worst_lat = max(worst_lat, float(latency[b - 1]))
            worst_bw = min(worst_bw, float(bandwidth[b - 1]))
            lat[a][b] = lat[b][a] = worst_lat
            bw[a][b] = bw[b][a] = worst_bw
    return tuple(map(tuple, lat)), tuple(map(tuple, bw))


def uniform_problem(devices: int, microbatches: int, f: float = 1.0, b: float = 1.0,
                    w: float = 1.0, *, virtual_stages: int = 1, placement: Placement = "loop",
                    split_backward: bool = True, activation: float = 1.0,
                    weight_grad: float | None = None, latency: float = 0.0,
                    memory_limit: float | None = None) -> Problem:
    """A problem whose stages all cost the same; ``f, b, w`` are per-device times split evenly
    over the device's ``virtual_stages`` chunks (the convention of the published formulas)."""
    p, v = devices, virtual_stages
    s = p * v
    lat, bw = chain_links(p, [latency] * (p - 1), [math.inf] * (p - 1))
    return Problem(
        devices=p, microbatches=microbatches, virtual_stages=v, placement=placement,
        split_backward=split_backward,
        forward=(f / v,) * s, backward_input=(b / v,) * s, backward_weight=(w / v,) * s,
        activation_memory=(activation / v,) * s,
        weight_grad_memory=((activation if weight_grad is None else weight_grad) / v,) * s,
        latency=lat, bandwidth=bw,
        memory_limit=(memory_limit,) * p,
    )


def rechunk(problem: Problem, virtual_stages: int, placement: Placement) -> Problem:
    """The same devices and work with every device's share cut into ``virtual_stages`` equal
    chunks (stage costs, activation memory and gradient reductions divided evenly).

    Only for problems with one stage per device; it assumes each device's layers split into
    equal parts. Messages between the new stages all have the largest original message size.
    """
    if problem.virtual_stages != 1:
        raise ProblemError("virtual_stages: rechunking needs a problem with one stage per "
                           f"device, got {problem.virtual_stages}")
    if problem.sub_blocks != 1:
        raise ProblemError("sub_blocks: rechunking needs a problem whose stages are not cut "
                           f"into sub-blocks, got {problem.sub_blocks} (rechunk first, then "
                           "pipeopt.subblocks.split)")
    v = virtual_stages
    p = problem.devices
    sd = stage_device_map(p, v, placement)
    msg = max(problem.message_size, default=0.0)

    def per(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(values[d] / v for d in sd)

    return replace(
        problem, virtual_stages=v, placement=placement,
        forward=per(problem.forward), backward_input=per(problem.backward_input),
        backward_weight=per(problem.backward_weight),
        activation_memory=per(problem.activation_memory),
        weight_grad_memory=per(problem.weight_grad_memory),
        grad_reduce=per(problem.grad_reduce),
        message_size=(msg,) * (p * v - 1),
        # The per-layer partition no longer describes these stages.
        meta=tuple((k, x) for k, x in problem.meta if k not in ("partition", "stage_costs")),
    )


def format_memory(value: float, problem: Problem, scaled: str = ".2f", plain: str = "g") -> str:
    """``value`` for people: in KiB/MiB/GiB (number format ``scaled``) when the problem's memory
    is in bytes (built from a model and cluster, ``meta['cost_model']``), else as the plain
    number (format ``plain``) of the config's own unit (an explicit config may count memory in
    any unit, e.g. micro-batches' activations)."""
    if "cost_model" not in dict(problem.meta):
        return f"{value:{plain}}"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:{scaled}} {unit}"
    return f"{value:{plain}} B"
