"""Step times when op times vary: the simulator over sampled durations.

A replay on mean op times misses what variation costs where two paths meet: an op that
waits for two inputs starts at the later of them, and ``E[max(X, Y)] > max(E[X], E[Y])``
when both are near-critical and noisy, while a single chain of ops adds up to its mean.
:class:`OpSpread` keeps how measured op times spread about the priced ones, and
:func:`sampled_iteration_times` times the same device orders with the one simulator
(:func:`pipeopt.core.simulate.time_orders` over the problem's task graph) once per draw, so a
schedule's predicted step is a statistic of these draws (:func:`sampled_step`).

A draw has two parts of an op's variation, as the profile's traces split them
(:func:`pipeopt.costs.profiler.step_trace_costs`):

* shared: a step on one rank runs all its ops and the runtime's gaps between them faster or
  slower together (the machine's moment; on a CPU also stalls that hit a stretch of a step).
  Each draw takes one factor per device and scales every op of that device by it (compute,
  residual and gap), so a chain of one device's ops moves as one and a stall hits a draw
  whole instead of a share of it hitting every draw. Where the spread holds whole measured
  steps (:attr:`OpSpread.joint`) for as many ranks as the problem has devices, a draw takes
  the factors of one measured step, every device's together: on the MLP's 2 CPU ranks the
  log factors of the two ranks in one step correlated 0.05-0.66, and independent draws
  overstate a race between devices. Otherwise each device draws from
  :attr:`OpSpread.shared` independently.
* per op: a residual drawn independently per op from its stage and kind (seconds, measured
  less priced once the shared factor is divided out), plus the runtime's gap before it and,
  for a message between devices, its delay. The delay of a message is measured up to its
  receiver's start, so it holds the receiver's gap: an op's gap and the delay of the message
  it receives are drawn at the same quantile and the message arrives their difference later
  (at least 0), so an op held up by a message waits the drawn delay, not the delay plus a
  second gap.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeopt.core.simulate import time_orders
from pipeopt.problem import Problem
from pipeopt.simulate import Orders, simulate
from pipeopt.workloads import training

#: Quantiles an :class:`OpSpread` keeps per key (mid-quantiles of its residuals; a key with
#: fewer residuals keeps them all): enough to draw from a distribution of a few hundred
#: measured ops, small enough for a profile document.
SPREAD_QUANTILES = 32
#: Draws per prediction by default: the median of 200 draws moves by about 0.1 % between
#: seeds on the MLP's and tiny GPT's schedules (2 ranks, 4-8 micro-batches).
SAMPLES = 200
#: Measured steps an :class:`OpSpread` keeps in ``joint`` at most (two schedules x the counted
#: steps of each: 6 for ``--ranking``'s tiny GPT, 22 for its MLPs, per round).
JOINT_STEPS = 64
#: The keys of :attr:`OpSpread.ops` (see :func:`spread_key`).
_KEY = re.compile(r"[FBW](0|[1-9][0-9]*)|B(0|[1-9][0-9]*) fused")
#: Statistics :func:`sampled_step` takes over the draws.
STATISTICS = ("median", "mean")


def _quantiles(xs: Sequence[float], q: int) -> tuple[float, ...]:
    """``q`` mid-quantiles of ``xs`` (linear interpolation), or ``xs`` sorted when it has at
    most ``q`` values."""
    ys = sorted(map(float, xs))
    n = len(ys)
    if n <= q:
        return tuple(ys)
    out = []
    for i in range(q):
        pos = (i + 0.5) / q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        out.append(ys[lo] + (ys[hi] - ys[lo]) * (pos - lo))
    return tuple(out)


def _values(name: str, values: Any, what: str = "seconds") -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: must be a list of numbers ({what}), got "
                         f"{type(values).__name__}")
    out = []
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"{name}[{i}]: must be a finite number ({what}), got {x!r}")
        out.append(float(x))
    return tuple(out)


def _factors(name: str, values: Any) -> tuple[float, ...]:
    out = _values(name, values, "a factor on op times")
    bad = next((i for i, x in enumerate(out) if x <= 0), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}]: must be > 0 (a factor on op times), got {out[bad]!r}")
    return out


def _joint(name: str, steps: Any) -> tuple[tuple[float, ...], ...]:
    if not isinstance(steps, (list, tuple)):
        raise ValueError(f"{name}: must be a list of lists of factors, got "
                         f"{type(steps).__name__}")
    out = tuple(_factors(f"{name}[{i}]", list(v) if isinstance(v, (list, tuple)) else v)
                for i, v in enumerate(steps))
    empty = next((i for i, v in enumerate(out) if not v), None)
    if empty is not None:
        raise ValueError(f"{name}[{empty}]: a step needs a factor per rank, got none")
    bad = next((i for i, v in enumerate(out) if len(v) != len(out[0])), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}]: every step needs one factor per rank, as many as "
                         f"step 0's ({len(out[0])}), got {len(out[bad])}")
    return out


@dataclass(frozen=True)
class OpSpread:
    """How measured op times spread about what the problem prices, as residuals (seconds,
    measured less the priced mean; either sign) and factors, each a list to draw from.

    ``ops``: per key, ``"F{k}"``, ``"B{k}"``, ``"W{k}"`` (stage ``k``'s forward, input
    backward and weight backward of a split backward) and ``"B{k} fused"`` (its fused
    backward): an op's measured compute time divided by its step and rank's shared factor,
    less the priced one; ``gap``: the runtime's time before an op divided by its step and rank's
    shared factor, less its priced mean;
    ``message``: the delay of a message between devices (its receiver's start less its
    producer's end, where it held the receiver up), less its priced mean; ``shared``: per
    step and rank the factor (dimensionless, > 0) by which that step's ops and gaps on that
    rank together ran slower than priced (as
    :func:`pipeopt.costs.profiler.step_profile_from_runs` records it); ``joint``: the same
    factors per step, every rank's in rank order (one tuple per step, all of one length), so
    that a draw can take the ranks' factors of one measured step together (the ranks of one
    step move partly together: independent draws overstate a race between them). A key that
    is missing or empty draws 0; no ``shared`` factors draw 1 (the spread of a profile
    written before they were recorded: all variation per op); no ``joint`` steps draw the
    devices' factors independently from ``shared``."""

    ops: tuple[tuple[str, tuple[float, ...]], ...] = ()
    gap: tuple[float, ...] = ()
    message: tuple[float, ...] = ()
    shared: tuple[float, ...] = ()
    joint: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        ops = self.ops.items() if isinstance(self.ops, Mapping) else self.ops
        checked = []
        for key, vals in ops:
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ValueError(f"ops: keys must be 'F{{k}}', 'B{{k}}', 'W{{k}}' or "
                                 f"'B{{k}} fused' (k a stage), got {key!r}")
            checked.append((key, _values(f"ops[{key!r}]", list(vals))))
        keys = [k for k, _ in checked]
        twice = next((k for k in keys if keys.count(k) > 1), None)
        if twice is not None:
            raise ValueError(f"ops: key {twice!r} given twice")
        object.__setattr__(self, "ops", tuple(sorted(checked)))
        object.__setattr__(self, "gap", _values("gap", list(self.gap)))
        object.__setattr__(self, "message", _values("message", list(self.message)))
        object.__setattr__(self, "shared", _factors("shared", list(self.shared)))
        object.__setattr__(self, "joint", _joint("joint", self.joint))

    @classmethod
    def from_residuals(cls, ops: Mapping[str, Sequence[float]], gap: Sequence[float] = (),
                       message: Sequence[float] = (), quantiles: int = SPREAD_QUANTILES,
                       shared: Sequence[float] = (),
                       joint: Sequence[Sequence[float]] = ()) -> OpSpread:
        """The spread of measured residuals (seconds) and shared factors, each kept as
        ``quantiles`` mid-quantiles (all of them when fewer); of the ``joint`` steps at most
        :data:`JOINT_STEPS`, evenly spaced in the order of their mean factor."""
        if quantiles < 1:
            raise ValueError(f"quantiles: must be >= 1, got {quantiles}")
        steps = sorted((tuple(v) for v in joint), key=lambda v: (sum(v) / max(len(v), 1), v))
        if len(steps) > JOINT_STEPS:
            steps = [steps[int((i + 0.5) * len(steps) / JOINT_STEPS)]
                     for i in range(JOINT_STEPS)]
        return cls(tuple((k, _quantiles(v, quantiles)) for k, v in ops.items()),
                   _quantiles(gap, quantiles), _quantiles(message, quantiles),
                   _quantiles(shared, quantiles), tuple(steps))

    def residuals(self, key: str) -> tuple[float, ...]:
        """The residuals of ``key`` (``()`` when it has none)."""
        return dict(self.ops).get(key, ())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready document (seconds; ``shared``, ``joint``: factors): ``{"ops": {key:
        [...]}, "gap": [...], "message": [...], "shared": [...], "joint": [[...], ...]}``."""
        return {"ops": {k: list(v) for k, v in self.ops}, "gap": list(self.gap),
                "message": list(self.message), "shared": list(self.shared),
                "joint": [list(v) for v in self.joint]}

    @classmethod
    def from_dict(cls, data: Any) -> OpSpread:
        """The spread of :meth:`to_dict`'s document (one without ``shared`` or ``joint``,
        written before they were recorded, has no shared part or draws the devices'
        factors independently); raises ``ValueError`` naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"op_spread: must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"ops", "gap", "message", "shared", "joint"}
        if unknown:
            raise ValueError(f"op_spread: unknown field(s) {sorted(unknown)}")
        ops = data.get("ops", {})
        if not isinstance(ops, Mapping):
            raise ValueError(f"op_spread.ops: must be a mapping, got {type(ops).__name__}")
        return cls(tuple((k, _values(f"op_spread.ops[{k!r}]", v)) for k, v in ops.items()),
                   _values("op_spread.gap", data.get("gap", [])),
                   _values("op_spread.message", data.get("message", [])),
                   _factors("op_spread.shared", data.get("shared", [])),
                   _joint("op_spread.joint", data.get("joint", [])))


def spread_key(kind: str, stage: int, split: bool) -> str:
    """The key of :attr:`OpSpread.ops` an op of ``kind`` (``"F"``, ``"B"``, ``"W"``) on
    ``stage`` draws from: ``"B{k} fused"`` for a fused problem's (``split`` false) backward,
    else ``"{kind}{k}"``."""
    return f"{kind}{stage}" if split or kind != "B" else f"B{stage} fused"


def _priced_gap(problem: Problem) -> float:
    """The runtime's gap before an op that ``problem`` prices in every F, B and W
    (``meta.overheads.action_s``, seconds, :func:`pipeopt.costs.build.with_overheads`; 0
    without)."""
    over = dict(problem.meta).get("overheads")
    gap = over.get("action_s") if isinstance(over, Mapping) else None
    return float(gap) if isinstance(gap, (int, float)) and math.isfinite(gap) else 0.0


def sampled_iteration_times(problem: Problem, orders: Orders, spread: OpSpread, *,
                            samples: int = SAMPLES, seed: int = 0) -> tuple[float, ...]:
    """The iteration time (seconds: makespan, or later where a stage's step tail ends after
    it) of ``orders`` on ``problem``, once per draw (see the module docstring).

    Per draw, the devices take one measured step's factors from ``spread.joint`` where its
    steps have one per device, else each device draws one from ``spread.shared`` (1 when it
    has none);
    every op then lasts that factor times the sum of its priced compute, a residual drawn
    from ``spread`` for its stage and kind (a fused problem's B from ``"B{k} fused"``; on
    micro-batches of different cost the residual is scaled by the op's time factor), its
    priced gap (``meta.overheads.action_s``) and a gap residual drawn at a uniform quantile
    ``u`` of ``spread.gap``, at least 0. A message between devices arrives so that its
    receiver, if the message holds it up, starts its compute the priced delay (link latency
    + priced gap) plus the message residual at the same quantile ``u`` of ``spread.message``
    (0 when it has none) after the producer's end: its latency is that delay less the
    receiver's scaled gap, at least 0. ``samples`` draws, reproducible by
    ``seed``; in draw order. Raises what :func:`pipeopt.simulate.simulate` raises for bad
    orders, and ``ValueError`` for ``samples`` < 1."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: must be an integer >= 1, got {samples!r}")
    simulate(problem, orders)  # checks the orders, naming a fault in the chain's terms
    graph = training.graph_of(problem)
    tasks = training.task_orders(problem, orders)
    _, stage, mb, kind = problem.op_table
    table = problem.time_table if problem.microbatch_scale else None
    split = problem.split_backward
    by_key = {k: v for k, v in spread.ops if v}
    pools = [by_key.get(spread_key(kd, k, split), ()) for kd, k in zip(kind, stage, strict=True)]
    scale = [table[k][j] if table else 1.0 for k, j in zip(stage, mb, strict=True)]
    base = graph.duration
    # The priced gap in each op (scaled with it, as the problem's durations are) and its
    # compute.
    action = _priced_gap(problem)
    priced_gap = [min(t, action * f) for t, f in zip(base, scale, strict=True)]
    compute = [t - a for t, a in zip(base, priced_gap, strict=True)]
    device = graph.device
    devices = max(device, default=-1) + 1
    # Sorted, so that one quantile u picks an op's gap and the delay of its message alike.
    gap, message, shared = sorted(spread.gap), sorted(spread.message), spread.shared
    # The ranks' factors of one measured step together where the problem has as many devices.
    joint = spread.joint if spread.joint and len(spread.joint[0]) == devices else ()
    n_gap, n_msg = len(gap), len(message)
    tail = graph.tail
    lat = graph.edge_latency
    # Edges between devices (a link) and their receivers: their delay holds the gap.
    cross = [(e, j) for e, (k, j) in enumerate(zip(graph.edge_link, graph.dst, strict=True))
             if k >= 0]
    coupled = bool(cross) and bool(n_gap or n_msg or shared or joint)  # else every delay as priced
    rng = random.Random(seed)
    pick, uniform = rng.choice, rng.random
    ones = [1.0] * devices
    zeros = [0.0] * len(base)
    out = []
    for _ in range(samples):
        factor = (list(pick(joint)) if joint else [pick(shared) for _ in range(devices)]
                  if shared else ones)
        u = [uniform() for _ in base] if n_gap or n_msg else zeros
        g = [gap[int(x * n_gap)] for x in u] if n_gap else zeros
        # The gap each op pays: its priced one and the drawn residual, both scaled.
        paid = [factor[d] * (a + r) for d, a, r in zip(device, priced_gap, g, strict=True)]
        dur = [max(0.0, factor[d] * (w + (pick(pool) * f if pool else 0.0)) + x)
               for w, pool, f, d, x in zip(compute, pools, scale, device, paid, strict=True)]
        edges = None
        if coupled:
            edges = list(lat)
            for e, j in cross:
                edges[e] = max(0.0, lat[e] + priced_gap[j] - paid[j]
                               + (message[int(u[j] * n_msg)] if n_msg else 0.0))
        _, end, _ = time_orders(graph.with_durations(dur, edges), tasks, check=False)
        out.append(max(e + t for e, t in zip(end, tail, strict=True)))
    return tuple(out)


def sampled_step(problem: Problem, orders: Orders, spread: OpSpread, *,
                 samples: int = SAMPLES, seed: int = 0, statistic: str = "median") -> float:
    """The ``statistic`` (``median`` or ``mean``) of :func:`sampled_iteration_times`
    (seconds): the predicted step of ``orders`` when op times vary as ``spread`` says."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic: must be one of {', '.join(STATISTICS)}, got "
                         f"{statistic!r}")
    times = sampled_iteration_times(problem, orders, spread, samples=samples, seed=seed)
    return statistics.median(times) if statistic == "median" else statistics.fmean(times)
