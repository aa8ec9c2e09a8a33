"""Step times when op times vary: the simulator over sampled durations.

A replay on mean op times misses what variation costs where two paths meet: an op that
waits for two inputs starts at the later of them, and ``E[max(X, Y)] > max(E[X], E[Y])``
when both are near-critical and noisy, while a single chain of ops adds up to its mean.
:class:`OpSpread` keeps how measured op times spread about the priced ones (residuals in
seconds per stage and op kind, and of the runtime's gap before an op), and
:func:`sampled_iteration_times` times the same device orders with the one simulator
(:func:`pipeopt.core.simulate.time_orders` over the problem's task graph) once per draw of
every op's duration (its priced duration plus a residual drawn from its stage and kind, plus
a gap residual), so a schedule's predicted step is a statistic of these draws
(:func:`sampled_step`).

Draws are independent per op: variation that is shared by every op of a step (the machine's
load moving) adds to every path alike and is not what this prices.
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
#: The keys of :attr:`OpSpread.ops` (see :func:`_key`).
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


def _values(name: str, values: Any) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: must be a list of numbers (seconds), got "
                         f"{type(values).__name__}")
    out = []
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"{name}[{i}]: must be a finite number (seconds), got {x!r}")
        out.append(float(x))
    return tuple(out)


@dataclass(frozen=True)
class OpSpread:
    """How measured op times spread about what the problem prices, as residuals (seconds,
    measured less the priced mean; either sign), each key's a list to draw from.

    ``ops``: per key, ``"F{k}"``, ``"B{k}"``, ``"W{k}"`` (stage ``k``'s forward, input
    backward and weight backward of a split backward) and ``"B{k} fused"`` (its fused
    backward); ``gap``: the runtime's time before an op, less its priced mean; ``message``:
    the delay of a message between devices (its receiver's start less its producer's end,
    where it held the receiver up), less its priced mean. A key that is missing or empty
    draws 0."""

    ops: tuple[tuple[str, tuple[float, ...]], ...] = ()
    gap: tuple[float, ...] = ()
    message: tuple[float, ...] = ()

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

    @classmethod
    def from_residuals(cls, ops: Mapping[str, Sequence[float]], gap: Sequence[float] = (),
                       message: Sequence[float] = (), quantiles: int = SPREAD_QUANTILES
                       ) -> OpSpread:
        """The spread of measured residuals (seconds), each key kept as ``quantiles``
        mid-quantiles (all of them when fewer)."""
        if quantiles < 1:
            raise ValueError(f"quantiles: must be >= 1, got {quantiles}")
        return cls(tuple((k, _quantiles(v, quantiles)) for k, v in ops.items()),
                   _quantiles(gap, quantiles), _quantiles(message, quantiles))

    def residuals(self, key: str) -> tuple[float, ...]:
        """The residuals of ``key`` (``()`` when it has none)."""
        return dict(self.ops).get(key, ())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready document (seconds): ``{"ops": {key: [...]}, "gap": [...],
        "message": [...]}``."""
        return {"ops": {k: list(v) for k, v in self.ops}, "gap": list(self.gap),
                "message": list(self.message)}

    @classmethod
    def from_dict(cls, data: Any) -> OpSpread:
        """The spread of :meth:`to_dict`'s document; raises ``ValueError`` naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"op_spread: must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"ops", "gap", "message"}
        if unknown:
            raise ValueError(f"op_spread: unknown field(s) {sorted(unknown)}")
        ops = data.get("ops", {})
        if not isinstance(ops, Mapping):
            raise ValueError(f"op_spread.ops: must be a mapping, got {type(ops).__name__}")
        return cls(tuple((k, _values(f"op_spread.ops[{k!r}]", v)) for k, v in ops.items()),
                   _values("op_spread.gap", data.get("gap", [])),
                   _values("op_spread.message", data.get("message", [])))


def _key(kind: str, stage: int, split: bool) -> str:
    return f"{kind}{stage}" if split or kind != "B" else f"B{stage} fused"


def sampled_iteration_times(problem: Problem, orders: Orders, spread: OpSpread, *,
                            samples: int = SAMPLES, seed: int = 0) -> tuple[float, ...]:
    """The iteration time (seconds: makespan, or later where a stage's step tail ends after
    it) of ``orders`` on ``problem``, once per draw: every op lasts its priced duration plus a
    residual drawn from ``spread`` for its stage and kind (a fused problem's B from
    ``"B{k} fused"``) plus a gap residual, at least 0 (on micro-batches of different cost the
    op's residual is scaled by its time factor), and every message between devices arrives
    its link's latency plus a drawn message residual after its transmission, at least 0
    after it. ``samples`` draws, reproducible by ``seed``;
    in draw order. Raises what :func:`pipeopt.simulate.simulate` raises for bad orders, and
    ``ValueError`` for ``samples`` < 1."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: must be an integer >= 1, got {samples!r}")
    simulate(problem, orders)  # checks the orders, naming a fault in the chain's terms
    graph = training.graph_of(problem)
    tasks = training.task_orders(problem, orders)
    _, stage, mb, kind = problem.op_table
    table = problem.time_table if problem.microbatch_scale else None
    split = problem.split_backward
    by_key = {k: v for k, v in spread.ops if v}
    pools = [by_key.get(_key(kd, k, split), ()) for kd, k in zip(kind, stage, strict=True)]
    scale = [table[k][j] if table else 1.0 for k, j in zip(stage, mb, strict=True)]
    gap, message = spread.gap, spread.message
    base = graph.duration
    tail = graph.tail
    lat = graph.edge_latency
    cross = [k >= 0 for k in graph.edge_link]  # edges between devices (a link)
    rng = random.Random(seed)
    pick = rng.choice
    out = []
    for _ in range(samples):
        dur = [max(0.0, t + (pick(pool) * f if pool else 0.0) + (pick(gap) if gap else 0.0))
               for t, pool, f in zip(base, pools, scale, strict=True)]
        edges = ([max(0.0, x + pick(message)) if c else x
                  for x, c in zip(lat, cross, strict=True)] if message else None)
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
