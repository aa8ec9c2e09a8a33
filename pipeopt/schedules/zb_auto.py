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

The three binary variants are all tried (a variant is not rebuilt when the flag it flips
changed no decision of one already built); the order whose estimated largest span (a device's
first op start to last op end, the paper's objective) is smallest is returned. The estimate
takes links as idle (no queueing); the simulator gives the real times.
"""

from __future__ import annotations

import itertools

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import NotApplicable, Orders, require


class _OutOfMemory(Exception):
    """The limit blocks the next op and no W is left to free memory."""


class _Build:
    """One run of the heuristic: per stage j, the orders so far (kind, micro-batch) and the
    estimated end of every op (seconds); ``n[k][j]`` ops of kind k (0 F, 1 B, 2 W) placed."""

    def __init__(self, problem: Problem, limit: list[float], fill_small_gaps: bool) -> None:
        p, m = problem.devices, problem.microbatches
        self.p, self.m = p, m
        self.limit, self.fill_small_gaps = limit, fill_small_gaps
        self.dur = [list(problem.durations[k]) for k in "FBW"]  # per kind, per stage
        self.act = list(problem.activation_memory)
        self.mem_delta = [[a - r for a, r in (problem.memory_deltas[k, j] for j in range(p))]
                          for k in "FBW"]
        self.down = [problem.delay(j, j + 1) for j in range(p - 1)]  # F's message from j
        self.up = [problem.delay(j + 1, j) for j in range(p - 1)]  # B's message into j
        self.orders: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.n = [[0] * p for _ in range(3)]
        self.end = [[[0.0] * m for _ in range(p)] for _ in range(3)]
        self.first = [0.0] * p  # start of each device's first op
        self.free = [0.0] * p  # when each device is next idle
        self.mem = [0.0] * p  # bytes held after the device's last op
        self.idle = [0.0] * p  # idle time since the first F
        self.max_idle = 0.0
        self.consulted: set[str] = set()  # the variant flags that changed a decision

    def arrival(self, kind: int, j: int, i: int) -> float:
        """When the inputs of op (kind, stage j, micro-batch i) are all at its device."""
        end = self.end
        if kind == 0:
            return end[0][j - 1][i] + self.down[j - 1] if j > 0 else 0.0
        if kind == 2:
            return end[1][j][i]
        if j == self.p - 1:
            return end[0][j][i]
        return max(end[0][j][i], end[1][j + 1][i] + self.up[j])

    def put(self, j: int, kind: int) -> None:
        i = self.n[kind][j]
        free = self.free[j]
        start = max(free, self.arrival(kind, j, i))
        if self.n[0][j]:
            self.idle[j] += start - free
            self.max_idle = max(self.max_idle, self.idle[j])
        else:
            self.first[j] = start
        self.end[kind][j][i] = self.free[j] = start + self.dur[kind][j]
        self.mem[j] += self.mem_delta[kind][j]
        self.n[kind][j] = i + 1
        self.orders[j].append((kind, i))

    def w_left(self, j: int) -> bool:
        return self.n[2][j] < self.n[1][j]

    def fill(self, j: int, ready: float) -> None:
        """W ops on stage j before an op whose input arrives at ``ready`` (rule 2)."""
        while self.w_left(j) and self.free[j] + self.dur[2][j] <= ready:
            self.put(j, 2)
        gap = ready - self.free[j]
        if self.w_left(j) and gap > 0:
            if self.idle[j] + gap <= self.max_idle:  # the gap raises no maximum
                self.consulted.add("fill")
                if not self.fill_small_gaps:
                    return
            self.put(j, 2)

    def make_room(self, j: int, need: float) -> None:
        """W ops until ``need`` more bytes fit under stage j's limit."""
        while self.mem[j] + need > self.limit[j] * (1 + 1e-9):
            if not self.w_left(j):
                raise _OutOfMemory(j)
            self.put(j, 2)

    def span(self) -> float:
        """The largest per-device span of the orders built (seconds, estimated)."""
        return max(f - s for f, s in zip(self.free, self.first, strict=True))

    def ops(self) -> Orders:
        return [[Op("FBW"[k], j, i) for k, i in order] for j, order in enumerate(self.orders)]


def _extra_forwards(b: _Build, late_f: bool) -> list[int]:
    """Per stage, the F to run after micro-batch 0's before the first B (rules 1 and 3)."""
    p, m = b.p, b.m
    extra = [0] * p
    b_end = b.end[0][p - 1][0] + b.dur[1][p - 1]
    for j in range(p - 2, -1, -1):  # estimate each stage's first B from the last stage back
        t, mem = b.free[j], b.mem[j]
        ready = b_end + b.up[j]
        f = b.dur[0][j]
        while 1 + extra[j] < m and mem + b.act[j] <= b.limit[j] * (1 + 1e-9):
            if (t + f > ready) if not late_f else (t >= ready):
                break
            t += f
            mem += b.act[j]
            extra[j] += 1
        b_end = max(t, ready) + b.dur[1][j]
    for j in range(1, p):  # rule 3: fewer F than the stage before, unless it has all m
        if 1 + extra[j - 1] < m:
            extra[j] = min(extra[j], max(0, extra[j - 1] - 1))
    return extra


def _warm_up(b: _Build, late_f: bool) -> None:
    """Micro-batch 0 through the pipeline, with extra F before each stage's first B (rule 1)."""
    p = b.p
    for j in range(p):
        b.put(j, 0)
    extra = _extra_forwards(b, late_f)
    if extra != _extra_forwards(b, not late_f):
        b.consulted.add("late")
    for j in range(p):
        for _ in range(extra[j]):
            b.put(j, 0)
    for j in range(p - 1, -1, -1):
        b.put(j, 1)


def _wants_f(b: _Build, skip_f: bool) -> list[bool]:
    """Which stages run an F in this step (rules 2 and 3)."""
    p, m, nf = b.p, b.m, b.n[0]
    want = [nf[j] < m for j in range(p)]
    for j in range(p - 1):
        if not want[j] or nf[j] < nf[j + 1] + 2:
            continue
        # Stage j+1 runs its F, then the B that stage j waits for.
        b_ready = b.free[j + 1] + b.dur[0][j + 1] + b.dur[1][j + 1] + b.up[j]
        if b.free[j] + b.dur[0][j] <= b_ready:
            continue  # the F fits before the B arrives
        if b_ready - b.free[j] <= b.max_idle - b.idle[j]:
            b.consulted.add("skip")  # skipping leaves an idle that raises no maximum
            want[j] = not skip_f
    for j in range(p - 2, -1, -1):  # a stage does not run further ahead of one that skips
        want[j] = want[j] and (want[j + 1] or nf[j + 1] >= m)
    return want


def _build(problem: Problem, limit: list[float], late_f: bool, skip_f: bool,
           fill_small_gaps: bool) -> _Build:
    b = _Build(problem, limit, fill_small_gaps)
    p, m = b.p, b.m
    _warm_up(b, late_f)
    for i in range(1, m):
        for j, want in enumerate(_wants_f(b, skip_f)):
            if not want:
                continue
            b.make_room(j, b.act[j])
            if j > 0:
                b.fill(j, b.arrival(0, j, b.n[0][j]))
            b.put(j, 0)
        for j in range(p - 1, -1, -1):
            if j < p - 1:
                b.fill(j, b.end[1][j + 1][i] + b.up[j])
            if j == 0 and b.n[0][0] == m:
                while b.w_left(0):  # stage 0's W now precede nothing that waits on them
                    b.put(0, 2)
            b.put(j, 1)
    for j in range(p):
        while b.w_left(j):
            b.put(j, 2)
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
    names = ("late", "skip", "fill")
    runs: dict[tuple[bool, ...], _Build] = {}  # every variant, built or shown equal to one
    for flags in itertools.product((False, True), repeat=3):
        # Flipping a flag that changed no decision of a run gives that run again.
        flipped = [(names[x], (*flags[:x], not flags[x], *flags[x + 1:])) for x in range(3)]
        same = next((runs[f] for name, f in flipped
                     if f in runs and name not in runs[f].consulted), None)
        if same is not None:
            runs[flags] = same
            continue
        try:
            runs[flags] = _build(problem, limit, *flags)
        except _OutOfMemory as exc:  # pragma: no cover - one activation always fits
            raise NotApplicable(f"{method}: device {exc.args[0]} ran out of memory") from None
    best = min(runs.values(), key=_Build.span)  # the first of equals, in flag order
    return best.ops()


def zb_1p(problem: Problem) -> Orders:
    """ZB-1p: the automatic heuristic at 1F1B's activation memory, ``p`` micro-batches per
    stage (Qi et al. 2024, section 3.1)."""
    return _zb_auto(problem, "zb-1p", 1)


def zb_2p(problem: Problem) -> Orders:
    """ZB-2p: the automatic heuristic at twice 1F1B's activation memory, ``2p`` micro-batches
    per stage (Qi et al. 2024, section 3.1; near-zero bubble once m >= 2p or so)."""
    return _zb_auto(problem, "zb-2p", 2)
