"""CrossPipe's latency-aware greedy schedules: ``crosspipe`` (one stage per device, the paper's
"UD" layout) and ``crosspipe-v`` (two chunks per device folded into a V, the "wave" layout).

Source: T. Chen, A. Kubicek, L. Huang, T. Hoefler, "CrossPipe: Towards Optimal Pipeline
Schedules for Cross-Datacenter Training", USENIX ATC 2025 (arXiv:2507.00217). Besides its
solver, CrossPipe builds schedules with a fast greedy that knows the link latencies and
bandwidths: it times every op as it places it, so a device never waits for a message it could
have worked through, and it keeps each device within its memory limit. This module re-derives
that idea from the paper's description (the authors' code is not used or copied): a list
scheduler over the whole pipeline that repeatedly commits, among all devices, the op that can
start earliest:

* an op can start once its device is free and its inputs have arrived: an activation or a
  gradient from another device arrives ``transmission + latency`` after its producer ended, its
  transmission queued behind earlier messages on the same directed link (the simulator's
  link model, :func:`pipeopt.simulate.simulate`);
* forwards of a stage run in micro-batch order and only when their activation fits under the
  device's limit (``memory.limit`` less static memory); in the V layout a chunk-0 forward may
  also keep ``reserve`` chunk-1 activations free, so that the micro-batches already started can
  still turn at the V's tip (without it the first device can fill up with chunk-0 activations
  whose chunk-1 forwards then never fit);
* latency-aware warm-up (a variant): a stage runs ahead of the micro-batches' return to its
  device (the next chunk's forward, or the stage's own backward on the last chunk) by as many
  forwards as fit in the round trip, ``1 + ceil(lead * trip / F)``; with ``lead`` 1/2 and free
  links this is 1F1B's warm-up ``p - d`` on one chunk, with ``lead`` 1 ZB-V's ``2(p - d) - 1``
  on the V; with the links' delays in ``trip`` the warm-up grows with the latency to cover;
* among the ops that could start at that moment on a device: the input-gradient backward first
  (it frees memory and lies on the critical path) or the forward first (a variant), the chunk
  nearer the end of the model first among forwards; a weight-gradient W fills the device when
  no F or B is ready, either always or only when it ends before the next F or B arrives (a
  variant), and whenever the memory limit blocks a forward.

The variants (:func:`rules`: 16 for one chunk, 32 for the V, fewer on large instances) are all
built, and the order whose estimated makespan (then largest span) is smallest is returned; a
variant that deadlocks under the memory limit is dropped. The estimate is the simulator's
timing up to the order in which messages are queued on a link, and the simulator re-times the
result. The CrossPipe authors' code was not available to this project, so no test compares
with it; the tests compare with hand-worked cases and the published ZB-H1 / ZB-V figures.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from pipeopt.problem import Op, Problem
from pipeopt.schedules.base import NotApplicable, Orders, require

#: Relative tolerance of the memory test (float round-off of sums of activations), as the
#: solvers' own limit test (``pipeopt.solvers.base.over_limit``).
_MEM_TOL = 1e-9


@dataclass(frozen=True)
class Rule:
    """One variant of the greedy.

    ``b_first``: a ready B runs before a ready F (else the F first); ``w_fill``: a W runs
    whenever no F or B is ready (else only when it ends before the next F or B arrives, or
    the memory limit blocks a forward); ``reserve``: chunk-1 activations kept free before a
    chunk-0 forward (V layout only); ``lead``: with it, a stage runs a forward only while
    fewer than ``1 + ceil(lead * trip / F)`` of its micro-batches wait for their return to
    the device, ``trip`` being the idle-pipeline time from the forward's end to that return's
    input (the ops and, with ``lead_links``, the message delays in between).
    """

    b_first: bool = True
    w_fill: bool = False
    reserve: int = 0
    lead: float | None = None
    lead_links: bool = True


@dataclass(frozen=True)
class Plan:
    """Device orders built by one :class:`Rule` and their estimated makespan and largest span
    (seconds)."""

    rule: Rule
    orders: tuple[tuple[Op, ...], ...]
    makespan: float
    span: float


class _Deadlock(Exception):
    """Ops are left but none can start: the memory limit blocks every device."""


def _limits(problem: Problem) -> list[float]:
    """Per device, the bytes its activations may use: the limit less static memory (inf when
    unlimited)."""
    out = []
    for lim, static in zip(problem.memory_limit, problem.static_memory, strict=True):
        out.append(math.inf if lim is None else lim - static)
    return out


def plan(problem: Problem, rule: Rule) -> Plan:
    """Build the device orders of ``problem`` with one variant of the greedy.

    Raises :class:`NotApplicable` when the variant deadlocks under the memory limits.
    """
    try:
        return _Greedy(problem, rule).run()
    except _Deadlock as exc:
        raise NotApplicable(f"crosspipe: {exc}") from None


class _Greedy:
    """The state of one greedy run. Ops are (kind index, stage, micro-batch), kinds 0 F, 1 B,
    2 W; times in seconds, memory in bytes."""

    def __init__(self, problem: Problem, rule: Rule) -> None:
        self.problem, self.rule = problem, rule
        p, s, m = problem.devices, problem.stages, problem.microbatches
        self.p, self.s, self.m = p, s, m
        self.sd = problem.stage_device
        self.kinds = problem.kinds
        uniform = problem.uniform_microbatches

        def per_mb(value: Callable[[int], float]) -> list[float]:
            return [value(j) for j in range(m)] if not uniform else [value(0)] * m

        self.dur = [[per_mb(lambda j, k=k, x=x: problem.duration(Op(x, k, j)))
                     for k in range(s)] for x in self.kinds]
        self.alloc = [per_mb(lambda j, k=k: problem.memory_delta(Op("F", k, j))[0])
                      for k in range(s)]
        self.release = [[per_mb(lambda j, k=k, x=x: problem.memory_delta(Op(x, k, j))[1])
                         for k in range(s)] for x in self.kinds]
        # (transmission, latency) of the activation into stage k and of the gradient into
        # stage k; a unit micro-batch's when all cost the same.
        def msg(src: int, dst: int) -> list[tuple[float, float]]:
            if uniform:
                return [problem.transfer(src, dst)] * m
            return [problem.transfer(src, dst, j) for j in range(m)]

        self.fwd_msg = [[(0.0, 0.0)] * m] + [msg(k - 1, k) for k in range(1, s)]
        self.bwd_msg = [msg(k + 1, k) for k in range(s - 1)] + [[(0.0, 0.0)] * m]
        # The next chunk's stage on the same device (V layout: the stage the micro-batch
        # comes back to), or -1.
        self.next_chunk = [-1] * s
        for k in range(s):
            later = [x for x in problem.device_stages[self.sd[k]] if x > k]
            self.next_chunk[k] = min(later) if later else -1
        self.limit = _limits(problem)
        self.cap = [m] * s  # micro-batches a stage may run ahead (lead)
        if rule.lead is not None:
            for k in range(s):
                self.cap[k] = self._cap(k, rule.lead, rule.lead_links)
        self.free = [0.0] * p  # when each device is next idle
        self.first = [math.inf] * p  # each device's first start
        self.mem = [0.0] * p
        self.link_free: dict[tuple[int, int], float] = {}
        self.f_arrival: list[list[float | None]] = [[None] * m for _ in range(s)]
        for j in range(m):
            self.f_arrival[0][j] = 0.0
        self.next_f = [0] * s
        self.b_done = [0] * s
        self.f_end = [[0.0] * m for _ in range(s)]
        self.b_ready: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]  # heaps
        self.w_ready: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]
        self.orders: list[list[Op]] = [[] for _ in range(p)]
        self.end = 0.0

    def _cap(self, k: int, lead: float, links: bool) -> int:
        """How many micro-batches stage ``k`` may have waiting for their return to its device
        (the next chunk's forward, or on the last chunk the stage's own backward):
        ``1 + ceil(lead * trip / F)``, ``trip`` the idle-pipeline time from the end of its
        forward to that return's input (with the link delays when ``links``)."""
        problem, nxt = self.problem, self.next_chunk[k]

        def hop(a: int, b: int) -> float:
            return sum(problem.transfer(a, b)) if links else 0.0

        if nxt >= 0:
            trip = sum(self.dur[0][x][0] + hop(x - 1, x) for x in range(k + 1, nxt))
            trip += hop(nxt - 1, nxt)
        else:
            trip = sum(self.dur[0][x][0] + self.dur[1][x][0] + hop(x - 1, x) + hop(x, x - 1)
                       for x in range(k + 1, self.s))
        f = self.dur[0][k][0]
        ahead = math.ceil(lead * trip / f - 1e-9) if f > 0 else self.m
        return 1 + max(0, ahead)

    # ----- messages -------------------------------------------------------------------------
    def _send(self, src: int, dst: int, ended: float, msg: tuple[float, float]) -> float:
        """Arrival of a message from stage ``src`` to stage ``dst`` whose producer ended at
        ``ended``: after its turn on the directed link, its transmission and its latency."""
        a, b = self.sd[src], self.sd[dst]
        if a == b:
            return ended
        tx, lat = msg
        if tx <= 0:
            return ended + lat
        sent = max(ended, self.link_free.get((a, b), 0.0))
        self.link_free[(a, b)] = sent + tx
        return sent + tx + lat

    # ----- choice on one device -------------------------------------------------------------
    def _forwards(self, d: int) -> tuple[list[tuple[float, int, int]], bool]:
        """The forwards device ``d`` could run next: (arrival, stage, micro-batch), the stage
        nearer the end of the model first, each within the memory limit (and its reserve);
        and whether the limit held back one whose input is known."""
        out = []
        blocked = False
        for k in reversed(self.problem.device_stages[d]):
            j = self.next_f[k]
            if j >= self.m:
                continue
            arrival = self.f_arrival[k][j]
            if arrival is None:
                continue
            need = self.alloc[k][j]
            nxt = self.next_chunk[k]
            back = self.next_f[nxt] if nxt >= 0 else self.b_done[k]
            if j - back >= self.cap[k]:
                continue
            if nxt >= 0 and self.rule.reserve:
                need += self.rule.reserve * self.alloc[nxt][j]
            if self.mem[d] + need > self.limit[d] * (1 + _MEM_TOL) + 1e-12:
                blocked = True
                continue
            out.append((arrival, k, j))
        return out, blocked

    def _candidate(self, d: int) -> tuple[float, int, int, int] | None:
        """(start, kind, stage, micro-batch) of the op device ``d`` would run next, or None."""
        t0 = self.free[d]
        fwd, blocked = self._forwards(d)
        bwd = self.b_ready[d][0] if self.b_ready[d] else None
        wgt = self.w_ready[d][0] if self.w_ready[d] else None
        next_fb = min([a for a, _, _ in fwd] + ([bwd[0]] if bwd else []), default=math.inf)
        if next_fb > t0 and wgt is not None:
            w_end = max(t0, wgt[0]) + self.dur[2][wgt[1]][wgt[2]]
            if self.rule.w_fill or blocked or w_end <= next_fb:
                return max(t0, wgt[0]), 2, wgt[1], wgt[2]
        if next_fb == math.inf:
            return None
        start = max(t0, next_fb)
        f_now = next(((k, j) for a, k, j in fwd if a <= start), None)
        b_now = bwd if bwd is not None and bwd[0] <= start else None
        if b_now is not None and (self.rule.b_first or f_now is None):
            return start, 1, b_now[1], b_now[2]
        assert f_now is not None  # one of them arrives at ``start``
        return start, 0, f_now[0], f_now[1]

    # ----- committing an op -----------------------------------------------------------------
    def _commit(self, d: int, start: float, kind: int, k: int, j: int) -> set[int]:
        """Place the op; return the devices whose next op may have changed."""
        end = start + self.dur[kind][k][j]
        self.orders[d].append(Op(self.kinds[kind], k, j))
        self.first[d] = min(self.first[d], start)
        self.free[d] = end
        self.end = max(self.end, end)
        touched = {d}
        if kind == 0:
            self.next_f[k] += 1
            self.mem[d] += self.alloc[k][j]
            self.f_end[k][j] = end
            if k + 1 < self.s:
                self.f_arrival[k + 1][j] = self._send(k, k + 1, end, self.fwd_msg[k + 1][j])
                touched.add(self.sd[k + 1])
            else:  # the last stage's backward needs only its own forward
                heapq.heappush(self.b_ready[d], (end, k, j))
        elif kind == 1:
            heapq.heappop(self.b_ready[d])
            self.b_done[k] += 1
            self.mem[d] -= self.release[1][k][j]
            if len(self.kinds) == 3:
                heapq.heappush(self.w_ready[d], (end, k, j))
            if k > 0:
                arrival = self._send(k, k - 1, end, self.bwd_msg[k - 1][j])
                dst = self.sd[k - 1]
                heapq.heappush(self.b_ready[dst], (max(arrival, self.f_end[k - 1][j]), k - 1, j))
                touched.add(dst)
        else:
            heapq.heappop(self.w_ready[d])
            self.mem[d] -= self.release[2][k][j]
        return touched

    def run(self) -> Plan:
        p = self.p
        total = self.problem.num_ops
        version = [0] * p
        heap: list[tuple[float, int, int, int, int, int]] = []

        def push(d: int) -> None:
            version[d] += 1
            cand = self._candidate(d)
            if cand is not None:
                heapq.heappush(heap, (cand[0], d, version[d], *cand[1:]))

        for d in range(p):
            push(d)
        done = 0
        while done < total:
            if not heap:
                stuck = [d for d in range(p) if any(self.next_f[k] < self.m
                                                    for k in self.problem.device_stages[d])]
                raise _Deadlock(f"every device waits (memory limit blocks the forwards on "
                                f"devices {stuck}) with {total - done} ops left")
            start, d, ver, kind, k, j = heapq.heappop(heap)
            if ver != version[d]:
                continue
            for t in self._commit(d, start, kind, k, j):
                push(t)
            done += 1
        span = max(f - s for f, s in zip(self.free, self.first, strict=True))
        return Plan(self.rule, tuple(map(tuple, self.orders)), self.end, span)


#: Variants of the V layout's warm-up, (reserve, lead, lead_links), in the order tried: on
#: uniform-cost V instances (p = 4..8, latency 0..2 F, 1x and 2x 1F1B's memory) each of these
#: was the best on some instance, the first ones most often.
_CHUNK_VARIANTS: tuple[tuple[int, float | None, bool], ...] = (
    (0, None, True), (0, 0.5, False), (1, 0.25, True), (1, 0.5, True), (0, 1.0, True),
    (1, 1.0, False), (1, None, True), (0, 0.25, True))
#: The same for one chunk per device (no reserve; the lead caps forwards ahead of the stage's
#: own backward): on uniform-cost chains (p = 4..8, latency 0..2 F, 1x and 2x memory) no lead
#: or 1/2 were best most often, 1 and 1/2 without the links on some.
_ONE_CHUNK_VARIANTS: tuple[tuple[int, float | None, bool], ...] = (
    (0, None, True), (0, 0.5, True), (0, 1.0, True), (0, 0.5, False))
#: Ops times variants one call may build: past it, only the first variants of :func:`rules`
#: (at least one) are tried, which keeps a call under about a second (:data:`SECONDS_PER_OP`)
#: so that ``auto`` can afford it at a 5 s limit (its hand-made share is 1.5 s) up to a few
#: thousand ops; all 32 V variants still run at p = 8, m = 16 (768 ops).
MAX_VARIANT_OPS = 25_000
#: Wall time of one variant per op (seconds), on the 2-core development machine: 18 us at
#: p = 8, m = 16 in a V (32 variants in 0.45 s), 41 us at p = 64, m = 1024 (one variant of
#: 196,608 ops in 8.1 s); the larger is used for estimates.
SECONDS_PER_OP = 41e-6


def rules(problem: Problem) -> list[Rule]:
    """The variants tried on ``problem``, most often best first (without those that cannot
    differ: no W to place when the backward is fused, no reserve with one chunk per device),
    at most :data:`MAX_VARIANT_OPS` ops' worth of them (at least one)."""
    return all_rules(problem)[:max(1, MAX_VARIANT_OPS // max(1, problem.num_ops))]


def all_rules(problem: Problem) -> list[Rule]:
    """Every variant of :func:`rules`, uncut, in the same order."""
    w_fills = (False, True) if problem.split_backward else (False,)
    chunks = _CHUNK_VARIANTS if problem.virtual_stages > 1 else _ONE_CHUNK_VARIANTS
    # Warm-up variants outermost: when the list is cut, the first warm-ups are tried with every
    # priority (at p = 16, m = 64 across four datacenters the best schedule needs a warm-up cap
    # with the W filling every gap; the priorities change the makespan by up to 12% there).
    out = [Rule(b, w, r, lead, links) for (r, lead, links), w, b
           in itertools.product(chunks, w_fills, (True, False))]
    return out


def estimated_seconds(problem: Problem) -> float:
    """About how long :func:`crosspipe` / :func:`crosspipe_v` take on ``problem`` (seconds),
    so that a caller under a time limit can skip them."""
    return len(rules(problem)) * problem.num_ops * SECONDS_PER_OP


def best_plan(problem: Problem, method: str = "crosspipe") -> Plan:
    """The variant whose estimated makespan (then largest span) is smallest; the first of
    equals in :func:`rules` order. When every variant of :func:`rules` deadlocks, the next ones
    of :func:`all_rules` are tried until one finishes. Raises :class:`NotApplicable` when every
    variant deadlocks or a device cannot hold one micro-batch's activations."""
    limit = _limits(problem)
    for d, stages in enumerate(problem.device_stages):
        need = max(sum(problem.memory_delta(Op("F", k, j))[0] for k in stages)
                   for j in range(problem.microbatches))
        require(need <= limit[d] * (1 + _MEM_TOL) + 1e-12, method,
                f"device {d} cannot hold one micro-batch's activations ({need:g}) within its "
                f"memory.limit less static memory ({limit[d]:g})")
    best: Plan | None = None
    reasons = []
    budget = len(rules(problem))
    # Past the budget only while every variant so far deadlocked: at p = 16, m = 64 in a V at
    # 1F1B's memory the budget holds four priorities of the first warm-up, which deadlocks
    # under that limit, while later warm-ups (a lead cap, a reserve) finish.
    for i, rule in enumerate(all_rules(problem)):
        if i >= budget and best is not None:
            break
        try:
            cand = plan(problem, rule)
        except NotApplicable as exc:
            reasons.append(str(exc))
            continue
        if best is None or (cand.makespan, cand.span) < (best.makespan, best.span):
            best = cand
    if best is None:
        raise NotApplicable(f"{method}: every variant deadlocks: {reasons[0]}")
    return best


def crosspipe(problem: Problem) -> Orders:
    """CrossPipe's latency-aware greedy, one stage per device (its "UD" layout)."""
    require(problem.virtual_stages == 1, "crosspipe",
            f"needs one stage per device (virtual_stages: 1), got {problem.virtual_stages}; "
            "crosspipe-v covers two chunks in a V")
    return [list(o) for o in best_plan(problem, "crosspipe").orders]


def crosspipe_v(problem: Problem) -> Orders:
    """CrossPipe's latency-aware greedy on its wave layout: two chunks per device in a V
    (``virtual_stages: 2``, ``placement: vshape``)."""
    require(problem.virtual_stages == 2 and problem.placement == "vshape", "crosspipe-v",
            "needs two chunks per device in a V (virtual_stages: 2, placement: vshape), got "
            f"virtual_stages {problem.virtual_stages}, placement {problem.placement}")
    return [list(o) for o in best_plan(problem, "crosspipe-v").orders]
