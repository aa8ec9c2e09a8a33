"""ZB-1p and ZB-2p: the Zero Bubble automatic heuristic (Qi, Wan, Huang, Lin, "Zero Bubble
Pipeline Parallelism", ICLR 2024, section 3.1), one stage per device.

A list scheduler that builds every device's order while estimating op times with the
problem's own costs (per-stage F, B, W durations and the link delay between neighbours), under
a memory limit per stage: ``factor * p`` activations of that stage (1F1B's peak on its first
stage; ``factor`` 1 for ZB-1p, 2 for ZB-2p), or the device's own limit when that is tighter.
Its rules, as the paper states them:

1. warm-up: as many F as the limit allows before the first B reaches the stage (variant: stop
   at the last F that still ends before the B arrives, leaving a gap shorter than one F);
2. then one F and one B per step; a W fills every gap at least as long as itself, and a
   shorter gap too when leaving it idle would raise the largest idle time of any stage
   (variant: fill every such gap); a W also runs whenever the limit blocks the next F;
3. stage i always has at least one more F than stage i+1 once started; where it is two or
   more ahead it may skip an F that would otherwise delay its B, unless the skip raises the
   largest idle time (variant: never skip);
4. the W left over run last.

The three binary variants are all tried; the order whose estimated largest span (a device's
first op start to last op end, the paper's objective) is smallest is returned. The estimate
takes links as idle (no queueing); the simulator gives the real times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import NotApplicable, Orders, require


class _OutOfMemory(Exception):
    """The limit blocks the next op and no W is left to free memory."""


@dataclass
class _Build:
    """One run of the heuristic: the orders so far and the estimated times (seconds)."""

    problem: Problem
    limit: list[float]
    fill_small_gaps: bool
    orders: list[list[Op]] = field(default_factory=list)
    count: list[dict[str, int]] = field(default_factory=list)
    free: list[float] = field(default_factory=list)  # when each device is next idle
    mem: list[float] = field(default_factory=list)  # bytes held after the device's last op
    idle: list[float] = field(default_factory=list)  # idle time since the first F
    max_idle: float = 0.0  # the largest of ``idle``
    end: dict[Op, float] = field(default_factory=dict)
    dur: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per kind, per stage
    mem_delta: dict[str, list[float]] = field(default_factory=dict)  # bytes, per kind, stage
    down: list[float] = field(default_factory=list)
    up: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.problem.devices
        self.orders = [[] for _ in range(p)]
        self.count = [{"F": 0, "B": 0, "W": 0} for _ in range(p)]
        self.free, self.mem, self.idle = [0.0] * p, [0.0] * p, [0.0] * p
        pr = self.problem
        self.dur = pr.durations
        self.mem_delta = {kind: [a - r for a, r in (pr.memory_deltas[kind, k] for k in range(p))]
                          for kind in pr.kinds}
        self.down = [pr.delay(k, k + 1) for k in range(p - 1)]  # F's message from stage k
        self.up = [pr.delay(k + 1, k) for k in range(p - 1)]  # B's message into stage k

    def next_op(self, j: int, kind: str) -> Op:
        return Op(kind, j, self.count[j][kind])

    def arrival(self, op: Op) -> float:
        """When ``op``'s inputs are all at its device (seconds)."""
        k, i, end = op.stage, op.microbatch, self.end
        if op.kind == "F":
            return end[Op("F", k - 1, i)] + self.down[k - 1] if k > 0 else 0.0
        if op.kind == "W":
            return end[Op("B", k, i)]
        if k == len(self.down):
            return end[Op("F", k, i)]
        return max(end[Op("F", k, i)], end[Op("B", k + 1, i)] + self.up[k])

    def put(self, j: int, kind: str) -> None:
        op = self.next_op(j, kind)
        start = max(self.free[j], self.arrival(op))
        if self.count[j]["F"]:
            self.idle[j] += start - self.free[j]
            self.max_idle = max(self.max_idle, self.idle[j])
        self.end[op] = self.free[j] = start + self.dur[kind][j]
        self.mem[j] += self.mem_delta[kind][j]
        self.count[j][kind] += 1
        self.orders[j].append(op)

    def w_left(self, j: int) -> bool:
        return self.count[j]["W"] < self.count[j]["B"]

    def fill(self, j: int, ready: float) -> None:
        """W ops on stage j before an op whose input arrives at ``ready`` (rule 2)."""
        pr = self.problem
        while self.w_left(j) and self.free[j] + pr.duration(self.next_op(j, "W")) <= ready:
            self.put(j, "W")
        gap = ready - self.free[j]
        if self.w_left(j) and gap > 0:
            raises_max = self.idle[j] + gap > self.max_idle
            if raises_max or self.fill_small_gaps:
                self.put(j, "W")

    def make_room(self, j: int, need: float) -> None:
        """W ops until ``need`` more bytes fit under stage j's limit."""
        while self.mem[j] + need > self.limit[j] * (1 + 1e-9):
            if not self.w_left(j):
                raise _OutOfMemory(j)
            self.put(j, "W")

    def span(self) -> float:
        """The largest per-device span of the orders built (seconds, estimated)."""
        pr = self.problem
        return max(self.free[j] - (self.end[o[0]] - pr.duration(o[0]))
                   for j, o in enumerate(self.orders))


def _warm_up(b: _Build, late_f: bool) -> None:
    """Micro-batch 0 through the pipeline, with extra F before each stage's first B (rule 1)."""
    pr = b.problem
    p, m = pr.devices, pr.microbatches
    for j in range(p):
        b.put(j, "F")
    extra = [0] * p
    b_end = b.end[Op("F", p - 1, 0)] + pr.duration(Op("B", p - 1, 0))
    for j in range(p - 2, -1, -1):  # estimate each stage's first B from the last stage back
        t, mem = b.free[j], b.mem[j]
        ready = b_end + pr.delay(j + 1, j)
        f = Op("F", j, 0)
        while 1 + extra[j] < m and mem + pr.activation_memory[j] <= b.limit[j] * (1 + 1e-9):
            if (t + pr.duration(f) > ready) if not late_f else (t >= ready):
                break
            t += pr.duration(f)
            mem += pr.activation_memory[j]
            extra[j] += 1
        b_end = max(t, ready) + pr.duration(Op("B", j, 0))
    for j in range(1, p):  # rule 3: fewer F than the stage before, unless it has all m
        if 1 + extra[j - 1] < m:
            extra[j] = min(extra[j], max(0, extra[j - 1] - 1))
    for j in range(p):
        for _ in range(extra[j]):
            b.put(j, "F")
    for j in range(p - 1, -1, -1):
        b.put(j, "B")


def _wants_f(b: _Build, skip_f: bool) -> list[bool]:
    """Which stages run an F in this step (rules 2 and 3)."""
    pr = b.problem
    p, m = pr.devices, pr.microbatches
    want = [b.count[j]["F"] < m for j in range(p)]
    if skip_f:
        for j in range(p - 1):
            if not want[j] or b.count[j]["F"] < b.count[j + 1]["F"] + 2:
                continue
            # Stage j+1 runs its F, then the B that stage j waits for.
            nf, nb = b.next_op(j + 1, "F"), b.next_op(j + 1, "B")
            b_ready = b.free[j + 1] + pr.duration(nf) + pr.duration(nb) + pr.delay(j + 1, j)
            if b.free[j] + pr.duration(b.next_op(j, "F")) <= b_ready:
                continue  # the F fits before the B arrives
            if b_ready - b.free[j] <= b.max_idle - b.idle[j]:
                want[j] = False  # skipping leaves an idle that raises no maximum
    for j in range(p - 2, -1, -1):  # a stage does not run further ahead of one that skips
        want[j] = want[j] and (want[j + 1] or b.count[j + 1]["F"] >= m)
    return want


def _build(problem: Problem, limit: list[float], late_f: bool, skip_f: bool,
           fill_small_gaps: bool) -> _Build:
    p, m = problem.devices, problem.microbatches
    b = _Build(problem, limit, fill_small_gaps)
    _warm_up(b, late_f)
    for i in range(1, m):
        for j, want in enumerate(_wants_f(b, skip_f)):
            if not want:
                continue
            f = b.next_op(j, "F")
            b.make_room(j, problem.activation_memory[j])
            if j > 0:
                b.fill(j, b.arrival(f))
            b.put(j, "F")
        for j in range(p - 1, -1, -1):
            if j < p - 1:
                b.fill(j, b.end[Op("B", j + 1, i)] + problem.delay(j + 1, j))
            if j == 0 and b.count[0]["F"] == m:
                while b.w_left(0):  # stage 0's W now precede nothing that waits on them
                    b.put(0, "W")
            b.put(j, "B")
    for j in range(p):
        while b.w_left(j):
            b.put(j, "W")
    return b


def _zb_auto(problem: Problem, method: str, factor: int) -> Orders:
    require(problem.split_backward, method, "needs split_backward: true (separate B and W ops)")
    require(problem.virtual_stages == 1, method,
            f"needs one stage per device (virtual_stages: 1), got {problem.virtual_stages}")
    p = problem.devices
    limit = []
    for j in range(p):
        lim = factor * p * problem.activation_memory[j]
        dev = problem.memory_limit[j]
        if dev is not None:
            lim = min(lim, dev - problem.static_memory[j])
        limit.append(lim)
    for j, lim in enumerate(limit):
        act = problem.activation_memory[j]
        require(act <= lim * (1 + 1e-9), method,
                f"device {j} cannot hold one micro-batch's activations ({act:g}) within "
                f"{lim:g} ({factor} x devices x activation_memory, or memory.limit less "
                f"static memory)")
    best: _Build | None = None
    for flags in itertools.product((False, True), repeat=3):
        try:
            b = _build(problem, limit, *flags)
        except _OutOfMemory as exc:  # pragma: no cover - one activation always fits
            raise NotApplicable(f"{method}: device {exc.args[0]} ran out of memory") from None
        if best is None or b.span() < best.span():
            best = b
    assert best is not None
    return best.orders


def zb_1p(problem: Problem) -> Orders:
    """ZB-1p: the automatic heuristic at 1F1B's activation memory, ``p`` micro-batches per
    stage (Qi et al. 2024, section 3.1; table 3's ZB-1p)."""
    return _zb_auto(problem, "zb-1p", 1)


def zb_2p(problem: Problem) -> Orders:
    """ZB-2p: the automatic heuristic at twice 1F1B's activation memory, ``2p`` micro-batches
    per stage (Qi et al. 2024, section 3.1; near-zero bubble once m >= 2p or so)."""
    return _zb_auto(problem, "zb-2p", 2)
