"""``greedy``: a memory-aware list scheduler for instances too large for an exact search.

The scheduler walks time forward over all devices at once (event-driven). Whenever a device is
free it picks one of the ops whose inputs have arrived:

* a backward ``B`` (it unblocks the stage before it and frees activation memory), or, in some
  variants, the ready ``F`` when the device just ran a B (1F1B) or when the F's receiver idles;
* a forward ``F``, if memory allows it and the stage's in-flight cap is not reached;
* a weight gradient ``W`` when nothing else is ready or memory blocks the F (or before the F
  when too many W are pending).

Each stage runs its F, B and W in micro-batch order. An ``F`` of stage ``k`` on device ``d``
only starts when memory can still hold it *and* the activations that one micro-batch needs on
``d``'s later stages. That headroom makes a memory deadlock impossible: the earliest unfinished
micro-batch can always take its next step (see :func:`_run`). So the greedy finds a schedule
whenever any exists: every schedule holds all of one micro-batch's activations on a device at
the start of that device's last F of it (:func:`min_memory`).

Several stages per device under tight memory (the V of ZB-V, V-Half, V-Min): the headroom
need not be free memory. Memory held by micro-batches that have run their last F on the device
will be freed by their B's and W's alone, so ``reclaim`` variants count it towards the
headroom (the published V schedules fill memory to the limit in their steady state and keep
this rule; the deadlock argument still holds: see :func:`_run`). Their fitted caps share the
device's memory among its stages in proportion to their 1F1B warm-up (V-Half and V-Min keep
about a half or a third of it per stage).

Latency: without a cap, a device keeps starting F's while memory allows, so devices before a
slow link hold as many micro-batches in flight as their memory permits; capped variants allow
each stage its 1F1B warm-up plus the micro-batches that its links' round trip would leave idle.
Where messages queue on a link (a transmission time), ``link_wait`` variants hold an F back
until its message would leave at once, so the B messages made meanwhile are not queued behind
forwards that are not yet needed. Several stages per device and a link that delays messages
(the V across two datacenters): ``reserve`` variants keep free memory, when they admit a new
micro-batch on a device, for the later stages of those already admitted that will need it
before the device's reclaimable memory comes back, so a device behind the slow link keeps
every slot filled round after round instead of letting a new micro-batch take the slot an
admitted one needs on its way back (see :class:`Policy`).
Variants (:data:`POLICIES`: caps, F/B order, W lag and look-ahead, chunk order) and seeded
random restarts are tried within a work budget that shrinks with the instance (all on small
instances, two passes at p=64, m=1024); the best by its own timing becomes the returned
schedule through the simulator: where its start times are exactly the simulator's for its
orders (no message queues on a link; :func:`pipeopt.simulate.from_starts` checks it with
numpy) they are kept, else :func:`pipeopt.simulate.simulate` times the orders again.
:func:`restart_search` runs such restarts for a given time instead of a budget (``auto`` on
instances too large for its CP-SAT windows to help), and on large instances first runs with a
seeded idle guard (on some devices an F waits for a B about to arrive, so the B's round trip
is not held up; :attr:`Policy.guard`), then, once they stop improving, a local search that
toggles a few of the best run's flipped choices.

Micro-batches of different cost: "micro-batch order" above is one permutation of the
micro-batches, the same on every stage, so the deadlock-freedom argument is unchanged (the
scheduler runs on :meth:`Problem.permute_microbatches` and maps the ops back). Its memory
headroom is for the largest micro-batch (see :func:`_run`). Several permutations are tried
with the variants (:func:`microbatch_orders`: short ones at both ends and long ones in the
middle in a few proportions, shortest first, given, longest first, alternating, and the long
ones in one block near the end when they are a class apart); the chosen one
is ``details['microbatch_order']`` (also :attr:`Schedule.microbatch_order`). Then a seeded
iterated local search over the order, from the two best variants (policy and order): swap two
micro-batches of different cost or move one, keep a change that is no worse under that
variant's policy, restart from the best order with a few random moves when stuck; the best
order found is timed again with every variant (:func:`_order_search`); chains that stop
improving early run again from the best order with other seeds while that pays, a few rounds
at most. It runs until those rounds end, within the time the variants leave of half the time
limit (``auto`` gives CP-SAT the rest), or of most of it with ``long_search`` (``auto`` asks
for it when CP-SAT's full model would not run after the greedy: only its neighbourhood search
would).
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from itertools import repeat
from typing import Any

from pipeopt._gc import cyclic_gc_paused
from pipeopt.clock import MAX_SLOWDOWN, MIN_CPU_SAMPLE_S, Stopwatch
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Schedule, SolverInfo
from pipeopt.schedules import NotApplicable
from pipeopt.simulate import from_starts, simulate
from pipeopt.solvers.base import (
    OutOfTime,
    SolveOptions,
    fits_memory,
    lower_bound,
    memory_floor,
    require_memory,
    run_classic,
)
from pipeopt.workloads import training

logger = logging.getLogger("pipeopt.greedy")
logger.addHandler(logging.NullHandler())

#: Total number of ops the fixed variants may process together: p=64, m=1024 (196608 ops) gets
#: two passes (0.3-0.5 s each in pure Python) while small instances try every variant.
_WORK_BUDGET_OPS = 400_000
#: Random restarts after the fixed variants (small instances only): at most this many, within
#: this many ops in all, with these probabilities of flipping a choice.
_MAX_RESTARTS = 256
_RESTART_BUDGET_OPS = 150_000
_NOISE = (0.02, 0.05, 0.1, 0.2, 0.3)
#: Micro-batches of different cost: after the variants, an iterated local search over the
#: micro-batch order (:func:`_order_search`) from the best :data:`_ORDER_STARTS` variants (policy
#: and order), within this many ops per round (:data:`_ORDER_ROUNDS`) and at most
#: :data:`_ORDER_SEARCH_ITERS` timings per start and round (so small instances stop well
#: before the time limit and a seed gives one answer; where rounds run, on micro-batches a
#: class apart, the last round may end at the deadline, and then the load moves the answer).
#: On the 9 instances of ``benchmarks/variable_microbatches.py`` with p >= 8 the first version
#: (first-improvement swaps and moves from the best variant, 400k ops) shortened the best
#: variant's makespan by 0.3-6 % (2.4 % geomean; e.g. p16 m64 lognormal 233.1 -> 219.2 s).
#: This one, against it (greedy alone, 30 s limit, the same lightly loaded machine): shorter
#: or equal on all 8 of them, e.g. p8 m32 text/image 77.49 -> 76.01 s, p8 m64 zipf 136.65 ->
#: 135.61, p16 m64 text/image 169.45 -> 168.23, p16 m64 lognormal 219.20 -> 219.18.
_ORDER_SEARCH_OPS = 3_200_000
_ORDER_SEARCH_ITERS = 2000
_ORDER_STARTS = 2
#: A swap is only tried between micro-batches whose time scales differ by more than this share
#: of the larger of the two (swapping two of about the same cost rarely changes the schedule);
#: a near move shifts one micro-batch by at most this many places; after this many timings
#: without a better order a chain restarts from its best order moved by this many random
#: moves. Tuned by hand on ``benchmarks/variable_microbatches.py`` (see benchmarks/README.md).
_SWAP_MIN_DIFF = 0.1
_NEAR_MOVE = 3
_STALL = 150
_KICK = 3
#: A chain of the order search ends after this many kicks in a row that found no better
#: order than its best: it has stopped improving, and the time left goes to ``auto``'s CP-SAT
#: and LNS instead of up to half the time limit. Each kick follows :data:`_STALL` timings
#: without a better order, so a chain ends after 3 x 150 = 450 of them. Chosen by hand; the
#: effect on ``benchmarks/variable_microbatches.py`` is in benchmarks/README.md.
_STALL_KICKS = 3
#: ``long_search`` (``auto`` passes it when CP-SAT's full model would not run after the
#: greedy, so only its neighbourhood search would, which on the p >= 8 instances of
#: ``benchmarks/variable_microbatches.py`` never improved the greedy's answer): the order
#: search may run until this share of the time limit instead of half, its chains end after
#: this many fruitless kicks instead of :data:`_STALL_KICKS`, and its iteration and op caps
#: are this many times larger. Chosen by hand; ``auto`` at 30 s against the defaults, on a
#: loaded machine (2026-12-04, load 7-14, share 0.85 and 8 kicks with the default caps):
#: p8 m32 text/image 75.98 -> 75.62 s, p16 m64 text/image 169.92 -> 168.98, p8 m64 zipf
#: 135.56 -> 135.22, p12 m48 lognormal 78.21 both; the suite: benchmarks/README.md.
_LONG_SHARE = 0.85
#: Chains that all ended (converged, or stopped by their iteration cap) before the order search's
#: time was up run again, with other seeds, from the best order found so far, up to this many rounds
#: in all, while each round finds a better order than the last (a round without one ends the search,
#: so where the order search finds nothing the time goes to CP-SAT as before): where the chains end
#: early, which order they end at depends much on the seed. On the p = 8, m = 32 text / image
#: instance of ``benchmarks/variable_microbatches.py`` (from the block orders of
#: :func:`_long_blocks`), one round with seeds 0-3 ended at 74.88, 75.36, 74.57 and 75.56 s
#: (``long``, 4-9 s each at load 4); the greedy alone (30 s limit, load 3-4), seeds 0 / 1: 74.88 /
#: 75.36 s with one round, 74.88 / 75.36 with 4 rounds from the starts, 74.88 / 74.63 with 4 rounds
#: from the best order, 74.81 / 75.02 with 8 (seed 2: 74.57; the rounds end at the deadline there,
#: so load moves them). The seed offset of round r is r times :data:`_ROUND_SEED` (a prime far from
#: the chain offsets), so round 0 draws what the single round drew before. :func:`solve_greedy` runs
#: rounds only where the long micro-batches are a class apart (:func:`_class_apart`) or where
#: ``auto`` passes ``order_share`` (the time of its restarts, which would follow), so every other
#: instance keeps the path it had: on p = 8, m = 32 lognormal they improved the greedy (135.8
#: against 136.3 s) but took time from CP-SAT, and ``auto`` ended at 135.74 s against 135.38 s
#: without them (30 s, back to back, load 1.3-1.7; a third run without them, tests beside it: 135.75
#: s, so within CP-SAT's spread there: no measured gain).
_ORDER_ROUNDS = 8
_ROUND_SEED = 1_000_003
_LONG_STALL_KICKS = 8
_LONG_CAPS = 2
#: Share of the order search's time left for timing its best order with every variant and
#: with noisy restarts.
_POLISH_SHARE = 0.2
#: With serialized links the simulator re-times this many of the best variants.
_RETIME_BEST = 3
_INF = math.inf


@dataclass(frozen=True)
class Policy:
    """One priority variant of the list scheduler.

    ``cap_slack``: None = in-flight micro-batches per stage limited by memory only, else
    (stages from k to the last) + (link round trip after k / device cycle) + ``cap_slack``.
    ``w_lag``: how many W may wait on device ``d`` before they go ahead of F: ``'lazy'``
    (unlimited), ``'rank'`` (``d``, as in ZB-H1) or ``'tail'`` (``p - 1 - d``). ``deep``: among
    several chunks, prefer the later stage's F (depth-first) to the earlier one. ``lookahead``:
    when a B arrives while an F or W would run, run a shorter op or wait for the B if that idles
    the device less. ``wait_w``: do not start a W that would still run when an F or B
    arrives, if waiting for that op idles the device less than it would delay it. ``fb``, when
    both a B and an F are ready: ``'b'`` B first, ``'alt'`` alternate (1F1B), ``'starve'`` the
    one whose receiving device is idle. ``mem_caps``: instead, caps scaled to the device's
    memory (the stages of a device share it in proportion to their 1F1B warm-up and link
    round trip): ``'fit'`` the largest that fit, ``'share'`` the warm-ups times the device's
    memory over what they would hold, rounded (:meth:`_Context.caps`). ``reclaim``: the
    headroom an F leaves may be taken from memory that will be freed without any other F on
    the device (see :func:`_run`).
    ``link_wait``: an F whose message would queue on a serialized link waits until it would
    not, so that B messages made in the meantime go first. ``reserve`` (with ``reclaim``;
    None = off): an F of a device's earlier stage also leaves free memory for the later
    stages of the micro-batches already admitted there that have not run them yet, as many
    as a later stage's round trip holds at once, and only those whose later stage's input can
    arrive earlier than ``reserve`` device cycles (per-micro-batch work on the device, s)
    before the device's reclaimable memory comes back (see :func:`_run`): a new micro-batch
    does not take the slot an admitted one needs when it comes back through the device, nor
    wait for slots that will be free again by then. ``guard`` (a share of the F's duration,
    0 = off) on the devices of ``guard_devices``: an F that would still run when a B's input
    arrives within ``guard`` x the F's duration is held back until that input arrives, the
    device idle meanwhile; then the F / B rule ``fb`` decides again (``'b'``: the B goes
    first, so its round trip is not held up; ``'alt'`` may still run the F: then the guard
    only delayed it). Chosen per run by :func:`restart_search`'s seeded draws. ``noise``: the
    probability of flipping an F/B or F/W choice (random restarts, seeded by ``seed``);
    ``flips`` (with ``noise`` > 0) instead: exactly the choices of these indices are flipped
    (the i-th choice where noise could act, counted from 0; the restarts' local search).
    """

    cap_slack: float | None = None
    w_lag: str = "lazy"
    deep: bool = True
    lookahead: bool = False
    fb: str = "b"
    wait_w: bool = False
    reclaim: bool = False
    mem_caps: str | None = None
    link_wait: bool = False
    reserve: float | None = None
    guard: float = 0.0
    guard_devices: frozenset[int] = frozenset()
    noise: float = 0.0
    seed: int = 0
    flips: frozenset[int] | None = None

    @property
    def name(self) -> str:
        cap = (self.mem_caps or ("mem" if self.cap_slack is None
                                 else f"path+{self.cap_slack:g}"))
        la = (("+la" if self.lookahead else "") + ("+ww" if self.wait_w else "")
              + ("+rc" if self.reclaim else "") + ("+lw" if self.link_wait else "")
              + ("" if self.reserve is None else f"+rs{self.reserve:g}")
              + (f"+gd{self.guard:g}@{','.join(map(str, sorted(self.guard_devices)))}"
                 if self.guard else ""))
        noise = f",noise={self.noise:g}/{self.seed}" if self.noise else ""
        if self.flips is not None:
            noise += f"+{len(self.flips)}flips"
        return (f"cap={cap},w={self.w_lag},{'deep' if self.deep else 'wide'}{la},"
                f"fb={self.fb}{noise}")


#: Variants in the order they are tried. The first two cover most cases and are all that run
#: on p=64, m=1024 (memory-bound F's suit relaxed memory, capped ones tight memory). Measured
#: over 216 instances (uniform, heterogeneous, 2 and 4 datacenters, tight / relaxed / no memory
#: limit): no single variant is best everywhere. The next nine (fitted caps, reclaim, link
#: wait) are those of about 40 combinations tried that were best on some instance of
#: ``benchmarks/search.py --families`` (two chunks per device under tight memory, links with
#: latency or transmission time; p = 8 and 16; see benchmarks/README.md); the tenth (reclaim
#: alone) was best on most V shapes with p = 2 and m <= 6 at the least memory; the next two
#: (caps shared in proportion instead of fitted) were best on the V with latency 8 F at p = 8
#: (0.992 x ``crosspipe-v``), V-Half at p = 16 (1.011 x) and the V with transmission 2 F at
#: p = 16 (282 s against 286 s) among 20 such combinations. Variants that
#: cannot differ from another on a problem are skipped there (:func:`policies_for`).
POLICIES: tuple[Policy, ...] = (
    Policy(fb="alt", wait_w=True),
    Policy(cap_slack=1.0, wait_w=True),
    Policy(mem_caps="fit", reclaim=True, fb="alt"),
    Policy(mem_caps="fit", reclaim=True),
    Policy(mem_caps="fit", reclaim=True, fb="alt", wait_w=True),
    Policy(mem_caps="fit", reclaim=True, wait_w=True),
    Policy(mem_caps="fit", wait_w=True),
    Policy(link_wait=True, wait_w=True),
    Policy(mem_caps="fit", fb="alt", wait_w=True),
    Policy(link_wait=True, wait_w=True, fb="starve"),
    Policy(mem_caps="fit", reclaim=True, fb="starve", wait_w=True),
    Policy(reclaim=True, fb="alt"),
    Policy(mem_caps="share", reclaim=True, fb="alt"),
    Policy(mem_caps="share", wait_w=True, link_wait=True),
    Policy(fb="alt"),
    Policy(),
    Policy(fb="starve"),
    Policy(cap_slack=3.0, fb="alt"),
    Policy(cap_slack=3.0, fb="alt", wait_w=True),
    Policy(lookahead=True, fb="alt"),
    Policy(lookahead=True, wait_w=True),
    Policy(cap_slack=1.0),
    Policy(cap_slack=0.0),
    Policy(w_lag="rank", fb="alt"),
    Policy(deep=False, fb="alt"),
    Policy(cap_slack=1.0, w_lag="tail"),
    # Reserve (needs several stages on a device and a link that delays messages): the six
    # best of the 23 variants above that take reclaim, each with a lead of 0, 0.5 or 1 device
    # cycles, on the V with latency 2 or 8 F (p = 4, 8, 16), 8 F at p = 4 with m = 8, and
    # transmission 2 F at p = 8 (benchmarks/README.md, "Keeping the slots behind a slow link
    # full"); best there, in this order: p = 4, m = 16 lat8 (122.7 s against 130.8 s
    # without), p = 4, m = 8 lat8 (72.8 s against 83.6 s; CP-SAT's optimum is 72.5 s),
    # p = 8 lat8, p = 16 lat8, p = 8 bw2, p = 8 lat2 (as good as without).
    Policy(fb="starve", reclaim=True, reserve=0.5),
    Policy(fb="alt", wait_w=True, reclaim=True, reserve=0.5),
    Policy(lookahead=True, wait_w=True, reclaim=True, reserve=0.0),
    Policy(mem_caps="fit", reclaim=True, fb="alt", wait_w=True, reserve=1.0),
    Policy(link_wait=True, wait_w=True, fb="starve", reclaim=True, reserve=0.0),
    Policy(mem_caps="fit", reclaim=True, fb="starve", wait_w=True, reserve=1.0),
)


#: Tried first where a device holds several stages (large instances run only the first one or
#: two variants). On the V at p = 32, m = 128, one run each: 1.006-1.035 x V-Half's and V-Min's
#: iteration time at their memory where the first two of :data:`POLICIES` gave 1.18-1.23 x;
#: 1.014 x ZB-V's at 1F1B's memory (1.027-1.033 x); level (0.3 % apart) at twice its memory.
_NESTED_FIRST: tuple[Policy, ...] = (
    Policy(mem_caps="fit", reclaim=True, fb="alt", wait_w=True),
    Policy(mem_caps="fit", reclaim=True, fb="alt"),
)


def policies_for(problem: Problem) -> tuple[Policy, ...]:
    """:data:`POLICIES` in the order tried on ``problem``, less those that would repeat another
    there: ``reclaim`` needs a device with more than one stage (else no F leaves headroom),
    ``link_wait`` a link with a transmission time (else no message queues); ``reserve`` is
    only tried where a link also delays messages (the case it is for: a later stage held
    across a slow link's round trip). With several stages on a device,
    :data:`_NESTED_FIRST` go first."""
    nested = any(len(x) > 1 for x in problem.device_stages)
    queues = problem.has_link_contention
    delays = problem.has_link_delay
    out = tuple(pol for pol in POLICIES
                if (nested or not pol.reclaim) and (queues or not pol.link_wait)
                and (delays or pol.reserve is None))
    if nested:
        out = _NESTED_FIRST + tuple(pol for pol in out if pol not in _NESTED_FIRST)
    return out


class _Context:
    """Per-problem constants shared by every variant: flat per-stage lists (index k), or, when
    micro-batches differ (``scaled``), per-op lists (index ``k * m + j``) for durations, memory
    and messages."""

    def __init__(self, problem: Problem) -> None:
        pr = problem
        s, p, m = pr.stages, pr.devices, pr.microbatches
        self.problem = pr
        self.split = pr.split_backward
        self.scaled = not pr.uniform_microbatches
        self.dur = {kind: list(pr.durations[kind]) for kind in pr.kinds}
        self.act = list(pr.activation_memory)
        # Per stage, an average micro-batch's activation (bytes): the fitted caps' unit.
        self.act_mean = ([a * math.fsum(row) / m for a, row in
                          zip(pr.activation_memory, pr.memory_table, strict=True)]
                         if self.scaled else list(pr.activation_memory))
        if self.split:
            self.b_free = [a - w for a, w in zip(pr.activation_memory, pr.weight_grad_memory,
                                                 strict=True)]
        else:
            self.b_free = list(pr.activation_memory)
        self.w_free = list(pr.weight_grad_memory)
        # Half the validator's slack: absorbs float drift in the running memory sums, and the
        # peak still passes the validator.
        self.limit = [_INF if x is None else x * (1 + 5e-10) + 5e-13 for x in pr.memory_limit]
        self.static = list(pr.static_memory)
        sd = pr.stage_device
        # Headroom: one micro-batch's activations on the device's later stages (the largest
        # micro-batch's when they differ: any earlier one may still need them).
        big = [max(row) for row in pr.memory_table] if self.scaled else [1.0] * s
        self.headroom = [sum(self.act[q] * big[q] for q in pr.device_stages[sd[k]] if q > k)
                         for k in range(s)]
        # Messages: (transmission s, latency s) into stage k from k-1 and from k+1.
        self.tx_f = [(0.0, 0.0)] + [pr.transfer(k - 1, k) for k in range(1, s)]
        self.tx_b = [pr.transfer(k + 1, k) for k in range(s - 1)] + [(0.0, 0.0)]
        self.contention = pr.has_link_contention
        cycle = [sum(pr.forward[q] + pr.backward_input[q] + pr.backward_weight[q]
                     for q in pr.device_stages[d]) for d in range(p)]
        if self.scaled:  # the caps' notion of a device cycle: an average micro-batch
            mean = math.fsum(pr.time_scale) / m
            cycle = [c * mean for c in cycle]
        self.cycle = [max(c, 1e-12) for c in cycle]
        # The per-stage message times above are the caps' (a unit micro-batch's); the
        # scheduler reads per-op ones when micro-batches differ.
        self.msg_f, self.msg_b = self.tx_f, self.tx_b
        if self.scaled:
            # Per stage k (boundary for messages), per micro-batch j: index k * m + j.
            tt, mt, ut = pr.time_table, pr.memory_table, pr.message_table
            self.dur = {kind: [t * c for t, row in zip(per, tt, strict=True) for c in row]
                        for kind, per in self.dur.items()}
            self.act = [a * c for a, row in zip(self.act, mt, strict=True) for c in row]
            self.b_free = [a * c for a, row in zip(self.b_free, mt, strict=True) for c in row]
            self.w_free = [a * c for a, row in zip(self.w_free, mt, strict=True) for c in row]
            # Into stage k from k-1 crosses boundary k-1; from k+1, boundary k.
            self.msg_f = [(0.0, 0.0)] * m + [
                (tx * c, lat) for (tx, lat), row in zip(self.tx_f[1:], ut, strict=True)
                for c in row]
            self.msg_b = [(tx * c, lat) for (tx, lat), row in zip(self.tx_b[:-1], ut,
                                                                  strict=True)
                          for c in row] + [(0.0, 0.0)] * m
        # Does a B's output leave the device? (B of k feeds k-1.)
        self.b_cross = [k > 0 and sd[k - 1] != sd[k] for k in range(s)]
        # Reclaimable memory (policies with ``reclaim``): after the F of a device's last stage,
        # a micro-batch holds its activations of every stage of the device (index k, or
        # k * m + j when micro-batches differ), all of which its B's and W's will free.
        self.last_on_device = [max(dstg) if dstg else -1 for dstg in pr.device_stages]
        self.held = [0.0] * (s * m if self.scaled else s)
        for dstg in pr.device_stages:
            if not dstg:
                continue
            top = max(dstg)
            if self.scaled:
                for j in range(m):
                    self.held[top * m + j] = math.fsum(self.act[q * m + j] for q in dstg)
            else:
                self.held[top] = math.fsum(self.act[q] for q in dstg)
        self.nested = any(h > 0 for h in self.headroom)
        # ``reserve`` policies: per stage k, (q, n, a) for each later stage q on k's device:
        # the stage's F-to-B round trip (the durations and link delays from F of q to the end
        # of B of q, seconds, an average micro-batch) over the device cycle, rounded up, is
        # the n micro-batches whose stage-q activations (a bytes each, an average
        # micro-batch) are held at once. Behind a slow link, every admitted one; where the V
        # turns on the device with no link between, one.
        durs = pr.durations
        mean_t = math.fsum(pr.time_scale) / m if self.scaled else 1.0
        trip = [0.0] * s  # F of q to the end of B of q, over the stages after q
        for q in range(s - 1, -1, -1):
            here = (durs["F"][q] + durs["B"][q]) * mean_t
            trip[q] = here if q == s - 1 else (
                here + trip[q + 1] + sum(self.tx_f[q + 1]) + sum(self.tx_b[q]))
        self.reserve: list[tuple[tuple[int, int, float], ...]] = []
        for k in range(s):
            d = sd[k]
            later = []
            for q in pr.device_stages[d]:
                if q > k:
                    n_q = math.ceil(trip[q] / self.cycle[d] - 1e-9)
                    later.append((q, max(1, min(n_q, m)), self.act_mean[q]))
            self.reserve.append(tuple(later))
        # A waiting micro-batch's slot is only held back when its later stage's input could
        # arrive before the device's reclaimable memory comes back: ``reach[q]``, the least
        # time from F of stage 0's start to F of q's input (seconds), and per device
        # ``ret[d]``, from F of its last stage's start to the end of B of its first stage
        # (an average micro-batch).
        self.reach = [0.0] * s
        for q in range(1, s):
            self.reach[q] = self.reach[q - 1] + durs["F"][q - 1] * mean_t + sum(self.tx_f[q])
        self.ret = [0.0] * p
        for d, dstg in enumerate(pr.device_stages):
            if dstg:
                lo, hi = min(dstg), max(dstg)
                self.ret[d] = (trip[hi] + sum(durs["B"][lo:hi]) * mean_t
                               + sum(sum(self.tx_b[q]) for q in range(lo, hi)))

    @cached_property
    def op_list(self) -> list[Op]:
        """Every op of the problem in op-id order (:attr:`Problem.op_table`), made when first
        read (:meth:`orders`)."""
        _, stage, mb, kind = self.problem.op_table
        return list(map(tuple.__new__, repeat(Op), zip(kind, stage, mb, strict=True)))

    def orders(self, ids: list[list[int]]) -> list[list[Op]]:
        """A variant's per-device op ids (:func:`_run`) as orders of this context's problem.
        Made only for the orders a caller times or keeps: where the greedy's own starts
        stand (:func:`pipeopt.simulate.from_starts`), no op tuple is made at all."""
        op_at = self.op_list.__getitem__
        return [list(map(op_at, x)) for x in ids]

    def caps(self, policy: Policy) -> list[int]:
        """In-flight cap per stage (micro-batches with F done and B not done): one per stage
        from k to the last (1F1B's warm-up), plus the micro-batches that the links' round-trip
        delay after stage k would otherwise leave the device idle for, plus ``cap_slack``."""
        m = self.problem.microbatches
        if policy.cap_slack is None and not policy.mem_caps:
            return [m] * self.problem.stages
        sd = self.problem.stage_device
        s = self.problem.stages
        needs = []
        for k in range(s):
            links = sum(sum(self.tx_f[q]) + sum(self.tx_b[q - 1]) for q in range(k + 1, s))
            needs.append((s - k) + links / self.cycle[sd[k]])
        if policy.mem_caps == "fit":
            return self._fit_caps(needs)
        if policy.mem_caps == "share":
            return self._share_caps(needs)
        out = []
        for k in range(s):
            need = needs[k] + policy.cap_slack
            out.append(max(1, min(m, math.ceil(min(need, m) - 1e-9))))  # need may be inf
        return out

    def _share_caps(self, needs: list[float]) -> list[int]:
        """Caps ``round(rho * needs[k])`` (at least 1, at most m) with ``rho`` the share of
        the device's memory less static memory in what every stage's ``needs`` would hold
        (at most 1): the warm-ups scaled to memory, rounded instead of fitted."""
        pr = self.problem
        m = pr.microbatches
        caps = [m] * pr.stages
        for d, dstg in enumerate(pr.device_stages):
            want = math.fsum(self.act_mean[k] * min(needs[k], m) for k in dstg)
            room = self.limit[d] - self.static[d]
            rho = 1.0 if want <= room else room / want
            for k in dstg:
                caps[k] = max(1, min(m, math.floor(rho * min(needs[k], m) + 0.5)))
        return caps

    def _fit_caps(self, needs: list[float]) -> list[int]:
        """Caps scaled to the device's memory: ``floor(rho * needs[k]) + 1`` per stage k
        (at most m), with one ``rho`` in (0, 1] per device, the largest whose caps' activations
        (a micro-batch of average memory per stage) fit in its limit less static memory.

        So the stages of a device share its memory in proportion to their 1F1B warm-up (plus
        link round trips), as the controllable-memory V schedules do (V-Half, V-Min: about
        half or a third of 1F1B's in-flight micro-batches per stage; Qi et al., NeurIPS 2024).
        Raising rho raises the caps one stage at a time, at rho = c / needs[k]; caps that step
        at the same rho step together, and the last group that still fits is kept."""
        pr = self.problem
        m = pr.microbatches
        caps = [m] * pr.stages
        for d, dstg in enumerate(pr.device_stages):
            room = self.limit[d] - self.static[d]
            cur = {k: 1 for k in dstg}
            used = math.fsum(self.act_mean[k] for k in dstg)
            # Steps (rho, stage): stage k's cap goes from c to c + 1 at rho = c / needs[k].
            steps = sorted((c / needs[k], k) for k in dstg if needs[k] > 0
                           for c in range(1, min(m, math.ceil(min(needs[k], m))) + 1))
            i = 0
            while i < len(steps):
                rho = steps[i][0]
                group = []
                while i < len(steps) and steps[i][0] == rho:
                    group.append(steps[i][1])
                    i += 1
                extra = math.fsum(self.act_mean[k] for k in group)
                if rho > 1.0 or used + extra > room:
                    break
                used += extra
                for k in group:
                    cur[k] += 1
            for k in dstg:
                caps[k] = max(1, min(m, cur[k]))
        return caps

    def w_lags(self, policy: Policy) -> list[float]:
        """Per device, how many W may wait before they go ahead of F."""
        p = self.problem.devices
        if policy.w_lag == "rank":
            return [float(d) for d in range(p)]
        if policy.w_lag == "tail":
            return [float(p - 1 - d) for d in range(p)]
        return [_INF] * p


def min_memory(problem: Problem) -> tuple[float, ...]:
    """Per device, the least memory any schedule needs (bytes; see
    :func:`pipeopt.solvers.base.memory_floor`)."""
    return memory_floor(problem)


def check_memory(problem: Problem) -> None:
    """Raise :class:`NotApplicable` naming the first device whose limit no schedule can keep."""
    require_memory(problem, "greedy")


class _Stuck(RuntimeError):
    """A variant stopped with ops left (should not happen; the caller falls back)."""


class _OutOfTime(Exception):
    """A variant passed its deadline (perf_counter seconds) and was abandoned."""


#: CPU seconds per op of timing the chosen orders with the simulator after the variants (the
#: final :func:`~pipeopt.simulate.simulate`), kept out of the variants' deadline once
#: multiplied by the run's slowdown (:class:`pipeopt.clock.Stopwatch`). Measured on the 2-core
#: development machine, 2026-12-04: 1.43 s of CPU for zb-h1's 921,600 ops at p = 1024 (1.55 us
#: per op; latency-only links, order checks included), rounded up.
_RETIME_S_PER_OP = 2e-6

#: CPU seconds per op of one variant (:func:`_run`), an upper estimate: 0.45 s for each of
#: the two variants at p = 64, m = 1024 (196,608 ops) on the 2-core development machine,
#: 2026-12-04, before the loop was trimmed; only used to tell whether a time limit is so far
#: off that the slowdown need not be probed (:func:`_reserve_slowdown`).
_RUN_S_PER_OP = 3e-6

#: Reserved CPU seconds above which the slowdown is probed (50 ms) when too little CPU has
#: been used to measure it: below, a misjudged reserve costs less than the probe.
_CALIBRATE_CPU_S = 0.2

#: Ops scheduled between two looks at the clock (each look costs about 50 ns).
_CLOCK_EVERY = 4096


def _reserve_slowdown(watch: Stopwatch, reserve_cpu: float, deadline: float, ops: int
                      ) -> float:
    """The slowdown (wall per CPU second) by which ``reserve_cpu`` is scaled before the next
    variant: this run's own once it has used enough CPU to tell; before that, when the time
    left to ``deadline`` (perf_counter seconds) holds the reserve and the variant's expected
    CPU time (:data:`_RUN_S_PER_OP` per op) even at :data:`~pipeopt.clock.MAX_SLOWDOWN`, that
    bound, without a probe (its 50 ms of busy loop buy nothing there: only a variant eight
    times slower than expected would be cut earlier); otherwise a probe when the reserve is
    worth one (:data:`_CALIBRATE_CPU_S`)."""
    if time.process_time() - watch.cpu >= MIN_CPU_SAMPLE_S:
        return watch.slowdown()
    expect = _RUN_S_PER_OP * ops
    if deadline - time.perf_counter() > MAX_SLOWDOWN * (reserve_cpu + expect):
        return MAX_SLOWDOWN
    return watch.slowdown(calibrate=reserve_cpu > _CALIBRATE_CPU_S)


def _noise_source(policy: Policy, flipped: list[int] | None
                  ) -> tuple[Callable[[], float], list[int]]:
    """The draws ``_run`` compares with ``policy.noise`` (a choice flips below it) and a
    one-item list counting them. Seeded draws by default; with ``policy.flips`` a draw is 0
    (flip) exactly at those indices and 1 elsewhere. ``flipped`` gets each flipped index."""
    calls = [0]
    flips = policy.flips
    if flips is None and flipped is None:
        return random.Random(policy.seed).random, calls
    draw = random.Random(policy.seed).random
    noise = policy.noise

    def rand() -> float:
        i = calls[0]
        calls[0] = i + 1
        x = (0.0 if i in flips else 1.0) if flips is not None else draw()
        if flipped is not None and x < noise:
            flipped.append(i)
        return x

    return rand, calls


def _run(ctx: _Context, policy: Policy, deadline: float = _INF,
         flipped: list[int] | None = None
         ) -> tuple[list[list[int]], float, list[float], list[float]]:
    """One pass of the list scheduler: per-device orders as op ids (:meth:`_Context.orders`
    makes them ops), makespan, spans and every op's start (seconds; ids and starts in op-id
    order, :attr:`Problem.op_table`). Raises :class:`_OutOfTime` once ``perf_counter()``
    passes ``deadline``. ``flipped``: when given, gets the indices of the choices that the
    policy's noise flipped, then the number of choices noise could act on, last.

    Each op starts at its event time, by the simulator's rules; where no message queues on a
    link these are the simulator's times for the orders, which
    :func:`pipeopt.simulate.from_starts` checks before they stand for them.

    Why it cannot deadlock: stages run F, B and W in micro-batch order, and an F of stage k only
    starts when memory also has room for the micro-batch's later stages on the device. Take the
    earliest unfinished micro-batch j0: every earlier one is done, no later one is ahead of it
    on any stage it still needs, and every F admitted since the device last had room for it
    left that room. So j0's next op is never blocked by memory or by a cap, B and W never are,
    and some op can always run. With micro-batches of different memory the room left is for
    the largest micro-batch's later stages, so it holds j0's whatever j0 is.

    With ``reclaim`` the room may be memory ``R`` held by micro-batches that have run the F of
    the device's last stage (their ops left on the device are B's and W's). Suppose every
    device waits and j0's next op is an F of stage k on device d. All micro-batches before j0
    are done, so d holds only the activations of micro-batches j >= j0 on stages before k.
    Take the last F of such a micro-batch on d: when it was admitted, d held all of those but
    its own, plus ``R`` (micro-batches that had run their last F on d, so earlier than j0,
    now done and freed), and the admission left room for the headroom beyond ``R``. So now
    d has room for that headroom, which covers stage k's activation: a contradiction.
    """
    pr = ctx.problem
    p, m, s = pr.devices, pr.microbatches, pr.stages
    sd = pr.stage_device
    dstages = pr.device_stages
    split = ctx.split
    d_f, d_b = ctx.dur["F"], ctx.dur["B"]
    d_w = ctx.dur["W"] if split else None
    act, b_free, w_free = ctx.act, ctx.b_free, ctx.w_free
    headroom, limit = ctx.headroom, ctx.limit
    caps = ctx.caps(policy)
    w_lag = ctx.w_lags(policy)
    # Per-stage lists are indexed by k; with micro-batches of different cost (sc) the
    # durations, memory and messages are per op, indexed by k * m + j.
    sc = ctx.scaled
    tx_f, tx_b = ctx.msg_f, ctx.msg_b
    contention = ctx.contention
    b_cross = ctx.b_cross
    deep, lookahead, fb, wait_w = policy.deep, policy.lookahead, policy.fb, policy.wait_w
    guard = policy.guard
    g_devs = policy.guard_devices
    # reclaim: memory that micro-batches past their last F on the device hold counts as free
    # for the headroom (never for the F's own activation): see the docstring.
    reclaim = policy.reclaim and ctx.nested
    link_wait = policy.link_wait and contention
    # reserve (with reclaim): memory held back for admitted micro-batches (see the F check).
    reserve = policy.reserve is not None and reclaim
    reserve_of, reach, ret = ctx.reserve, ctx.reach, ctx.ret
    lead = [(policy.reserve or 0.0) * c for c in ctx.cycle]  # seconds, per device
    fpos = [0] * m  # per micro-batch, the last stage whose F has started
    back = _INF
    res_d = soon_made = False  # res_d: reserve applies on this wake's device
    soon: list[tuple[float, float]] = []
    rec = [0.0] * p
    top_stage, held = ctx.last_on_device, ctx.held
    last_b = [False] * p  # was the device's last F-or-B a B?
    noise = policy.noise
    rand, calls = _noise_source(policy, flipped)
    last = s - 1
    link_free: dict[tuple[int, int], float] = {}

    n = s * m
    f_ready = [_INF] * n  # arrival of F's input activation
    for j in range(m):
        f_ready[j] = 0.0
    f_end = [_INF] * n
    # B's ready time: the later of its F's end and its input gradient's arrival, set when the
    # later of the two is known (the last stage's B needs no gradient). The gradient of
    # B(k + 1, j) always arrives after F(k, j) ends (B(k + 1, j) starts after F(k + 1, j)
    # ends, which starts after F(k, j)'s activation arrived; durations and latencies >= 0), so
    # for k < last it is that arrival.
    b_ready = [_INF] * n
    # Latency into stage k from k - 1 and from k + 1 (seconds), read where links only delay.
    lat_f = [x[1] for x in ctx.tx_f]
    lat_b = [x[1] for x in ctx.tx_b]
    nf = [0] * s
    nb = [0] * s
    nw = [0] * s
    mem = list(ctx.static)
    pend_w = [0] * p
    free = [0.0] * p
    wake = [0.0] * p
    seq: list[list[int]] = [[] for _ in range(p)]  # per device, its op ids in order
    # Start of every op in op-id order: F at k * m + j, B at n + k * m + j, W at 2n + ...
    starts = [math.nan] * (len(pr.kinds) * n)
    heap = [(0.0, d) for d in range(p)]
    heapq.heapify(heap)
    remaining = pr.num_ops
    push, pop, pushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
    choose = fb != "b" or bool(noise)  # may an F go before a ready B?

    def arrive(src_dev: int, dst_dev: int, end: float, tx: tuple[float, float]) -> float:
        if not contention or tx[0] <= 0:
            return end + tx[1]
        key = (src_dev, dst_dev)
        t0 = max(end, link_free.get(key, 0.0))
        link_free[key] = t0 + tx[0]
        return t0 + tx[0] + tx[1]

    b_r = f_r = 0.0  # the chosen B's and F's ready times (parts of their keys)
    # The device's own next wake is pushed with the next pop (heappushpop: one sift for both,
    # and none when it is the earliest); the heap holds the same events either way.
    pend: tuple[float, int] | None = None
    while True:
        if pend is None:
            if not heap:
                break
            t, d = pop(heap)
        else:
            t, d = pushpop(heap, pend)
            pend = None
        if t != wake[d]:
            continue  # stale event
        # Ready candidates: best B, best F, best W; the earliest future ready time of a B
        # (next_b) and of an F (next_f).
        bk = fk = wk = -1
        next_f = next_b = _INF
        lim = limit[d]
        cur = mem[d]
        cur_h = cur - rec[d] if reclaim else cur  # what the headroom check counts
        if reserve:
            # Worked out only below a finite limit (below an infinite one every F that passes
            # the other checks has room whatever is held back), and there only for an F that
            # passes every other check.
            res_d = lim < _INF
            if res_d:
                # When the device's reclaimable memory comes back (the next micro-batch past
                # its last stage here ends B of its first stage, no sooner than now), less the
                # lead; never when none is reclaimable.
                i0 = nb[dstages[d][0]]
                top = top_stage[d]
                back = _INF
                if nf[top] > i0:
                    back = starts[top * m + i0] + ret[d]
                    back = (back if back > t else t) - lead[d]
                soon_made = False  # ``soon`` is built once per wake, when first needed
        for k in dstages[d]:
            base = k * m
            jb, j = nb[k], nf[k]  # the next B's and the next F's micro-batch
            if jb < j:
                r = b_ready[base + jb]
                if r <= t:
                    # Prefer a B whose output leaves the device, then the earliest ready, then
                    # the later stage (the key tuple is only built to compare two).
                    if bk < 0 or (not b_cross[k], r, -k) < (not b_cross[bk], b_r, -bk):
                        bk, b_r = k, r
                elif r < next_b:
                    next_b = r
            if split and nw[k] < jb and (wk < 0 or nw[k] < nw[wk]):
                wk = k
            if not (j < m and j - jb < caps[k]
                    and cur_h + (a_ := act[base + j if sc else k]) + headroom[k] <= lim
                    and (not reclaim or cur + a_ <= lim)):
                continue
            if res_d and reserve_of[k]:
                # Free memory kept for admitted micro-batches (bytes): the later stages q of
                # those admitted before j that have not run them yet, at most n_q of them, and
                # only those whose stage-q input may arrive before ``back``: a later one finds
                # the reclaimable memory back. (The new micro-batch's own headroom may still
                # be reclaimable memory.)
                held_back = 0.0
                first = _INF
                for q, n_q, a_q in reserve_of[k]:
                    jq = nf[q]
                    if jq >= j or t + reach[q] - reach[fpos[jq] + 1] >= back:
                        # None of them can: each one's time below is at least the first's
                        # with its input at ``t`` (fpos falls as i grows, reach grows with
                        # the stage, and float rounding keeps both orders), so none would
                        # count; the scan is skipped, nothing else changes.
                        continue
                    waiting = 0
                    for i in range(jq, j):
                        # Its next F's input at the earliest (not before now), then the least
                        # time from there to stage q's input.
                        r = fpos[i]
                        a = f_end[r * m + i] + lat_f[r + 1]
                        e = (a if a > t else t) + reach[q] - reach[r + 1]
                        if e < back:
                            waiting += 1
                            if e < first:
                                first = e
                            if waiting == n_q:
                                break
                    held_back += a_q * waiting
                if held_back > 0:
                    if not soon_made:
                        # What the B's whose input gradient is on its way (ready time known)
                        # will free, and when (that time, not before now, plus their
                        # duration): (seconds, bytes).
                        soon.clear()
                        for q in dstages[d]:
                            for i in range(q * m + nb[q], q * m + nf[q]):
                                r = b_ready[i]
                                if r == _INF:
                                    break
                                x = i if sc else q
                                soon.append(((r if r > t else t) + d_b[x], b_free[x]))
                        soon_made = True
                    if soon:
                        # Less what those B's free before the first of them needs its slot
                        # (never below none: the F's own activation needs free memory now).
                        held_back = max(0.0, held_back - math.fsum(x for e, x in soon
                                                                   if e <= first))
                    if cur + a_ + held_back > lim:
                        continue
            r = f_ready[base + j]
            if link_wait and k < last and sd[k + 1] != d:
                # Not before its message would leave at once: the B messages made in the
                # meantime go first on the link.
                q = link_free.get((d, sd[k + 1]), 0.0) - d_f[base + j if sc else k]
                if q > r:
                    r = q
            if r <= t:
                if fk < 0 or ((-k, r) < (-fk, f_r) if deep else (k, r) < (fk, f_r)):
                    fk, f_r = k, r
            elif r < next_f:
                next_f = r
        if choose and bk >= 0 and fk >= 0:
            # Both ready: "alt" alternates like 1F1B; "starve" feeds an idle neighbour first.
            if fb == "b":
                use_f = False
            elif fb == "alt":
                use_f = last_b[d]
            else:
                df = sd[fk + 1] if fk < last else d
                db = sd[bk - 1] if bk > 0 else d
                use_f = (df != d and wake[df] > t) and not (db != d and wake[db] > t)
            if noise and rand() < noise:
                use_f = not use_f
            if use_f:
                bk = -1
        if bk >= 0:
            k, kind = bk, "B"
        elif fk >= 0 or wk >= 0:
            if fk >= 0 and (wk < 0 or pend_w[d] <= w_lag[d]) and not (
                    noise and wk >= 0 and rand() < noise):
                k, kind, dur = fk, "F", d_f[fk * m + nf[fk] if sc else fk]
            else:
                k, kind, dur = wk, "W", d_w[wk * m + nw[wk] if sc else wk]
            if lookahead and t + dur > next_b:
                # A B arrives while this op would run: prefer an op that ends by then, else
                # wait for the B when that idles the device less than the B would wait. A swap
                # takes the other op's duration too: the checks below judge the op that runs.
                if kind == "F" and wk >= 0 and t + (
                        other := d_w[wk * m + nw[wk] if sc else wk]) <= next_b:
                    k, kind, dur = wk, "W", other
                elif kind == "W" and fk >= 0 and t + (
                        other := d_f[fk * m + nf[fk] if sc else fk]) <= next_b:
                    k, kind, dur = fk, "F", other
                elif next_b - t < t + dur - next_b:
                    wake[d] = next_b
                    pend = (next_b, d)
                    continue
            if (guard and kind == "F" and d in g_devs and t + dur > next_b
                    and next_b - t <= guard * dur) and not (noise and rand() < noise):
                # A B arrives soon while this F would run: the F is held back and the device
                # idles until the B's input arrives; then the F / B rule decides again (with
                # ``fb='b'`` the B goes first; with ``'alt'`` the same F may).
                wake[d] = next_b
                pend = (next_b, d)
                continue
            if wait_w and kind == "W":
                next_t = next_b if next_b < next_f else next_f
                if t + dur > next_t and next_t - t < t + dur - next_t:
                    # An F or B arrives soon: keep the device free for it, the W can wait.
                    wake[d] = next_t
                    pend = (next_t, d)
                    continue
        else:
            next_t = next_b if next_b < next_f else next_f
            wake[d] = next_t
            if next_t < _INF:
                pend = (next_t, d)
            continue
        # Run op (kind, k, j) from t.
        if kind == "F":
            j = nf[k]
            nf[k] = j + 1
            i = k * m + j
            x = i if sc else k
            end = t + d_f[x]
            f_end[i] = end
            fpos[j] = k
            starts[i] = t
            oid = i
            mem[d] = cur + act[x]
            last_b[d] = False
            if reclaim and k == top_stage[d]:
                rec[d] += held[x]
            if k < last:
                dd = sd[k + 1]
                a = (arrive(d, dd, end, tx_f[i + m if sc else k + 1]) if contention
                     else end + lat_f[k + 1])
                f_ready[i + m] = a
                if dd != d:
                    w_ = a if a > free[dd] else free[dd]
                    if w_ < wake[dd]:
                        wake[dd] = w_
                        push(heap, (w_, dd))
            else:
                b_ready[i] = end
        elif kind == "B":
            j = nb[k]
            nb[k] = j + 1
            i = k * m + j
            x = i if sc else k
            end = t + d_b[x]
            oid = n + i
            starts[oid] = t
            mem[d] = cur - b_free[x]
            last_b[d] = True
            if reclaim:
                rec[d] -= b_free[x]
            if split:
                pend_w[d] += 1
            if k > 0:
                dd = sd[k - 1]
                a = (arrive(d, dd, end, tx_b[i - m if sc else k - 1]) if contention
                     else end + lat_b[k - 1])
                b_ready[i - m] = a  # after F(k - 1, j)'s end (see b_ready)
                if dd != d:
                    w_ = a if a > free[dd] else free[dd]
                    if w_ < wake[dd]:
                        wake[dd] = w_
                        push(heap, (w_, dd))
        else:
            j = nw[k]
            nw[k] = j + 1
            i = k * m + j
            x = i if sc else k
            end = t + d_w[x]
            oid = 2 * n + i
            starts[oid] = t
            mem[d] = cur - w_free[x]
            pend_w[d] -= 1
            if reclaim:
                rec[d] -= w_free[x]
        seq[d].append(oid)
        free[d] = end
        wake[d] = end
        pend = (end, d)
        remaining -= 1
        if not remaining % _CLOCK_EVERY:
            if not remaining:
                break
            if time.perf_counter() > deadline:
                raise _OutOfTime
    if remaining:
        raise _Stuck(f"greedy variant {policy.name} stopped with {remaining} ops left")
    makespan = max(free)
    # A device's span runs from its first op's start (the first in its order) to its end.
    spans = [max(0.0, free[d] - starts[ids[0]]) if ids else 0.0 for d, ids in enumerate(seq)]
    if flipped is not None:
        flipped.append(calls[0])
    return seq, makespan, spans, starts


def microbatch_orders(problem: Problem) -> list[tuple[int, ...]]:
    """Micro-batch permutations worth trying, best guesses first, without repeats.

    Most are the ascending order (shortest first) with every q-th micro-batch moved to a tail
    in descending order, so the pipeline fills with short micro-batches, runs the long ones in
    the middle and drains with short ones again (as in a flow shop whose stages all scale
    alike): q = 3, then q = infinity (shortest first), q = 2, q = 4; then the given order,
    longest first, and longest and shortest alternating; then :func:`_long_blocks` (the long
    ones in one block). Costs compare by time, then memory, then message scale.

    Measured on the 11 instances of ``benchmarks/variable_microbatches.py`` (every variant of
    :data:`POLICIES` per order, best makespan): q = 3 was within 0.05 % of the best of the four
    on average, q = 4 0.4 %, q = 2 1.3 %, shortest first 3 %; each is best somewhere, and the
    four together are 1.2 % better than shortest first and q = 2 alone. Only the given order
    when every micro-batch costs the same."""
    m = problem.microbatches
    ident = tuple(range(m))
    if problem.uniform_microbatches:
        return [ident]
    ts, ms, mu = problem.time_scale, problem.memory_scale, problem.message_scale
    shortest = sorted(ident, key=lambda j: (ts[j], ms[j], mu[j], j))
    longest = sorted(ident, key=lambda j: (-ts[j], -ms[j], -mu[j], j))

    def short_ends(q: int) -> tuple[int, ...]:
        tail = shortest[q - 1::q]
        return tuple([j for i, j in enumerate(shortest) if i % q != q - 1] + tail[::-1])

    alternate = [longest[i // 2] if i % 2 == 0 else shortest[i // 2] for i in range(m)]
    alternate = list(dict.fromkeys(alternate))  # each once, first position kept
    placed = set(alternate)
    alternate += [j for j in longest if j not in placed]
    out: list[tuple[int, ...]] = []
    for order in (short_ends(3), tuple(shortest), short_ends(2), short_ends(4), ident,
                  tuple(longest), tuple(alternate)):
        if order not in out:
            out.append(order)
    out += [o for o in _long_blocks(problem, shortest) if o not in out]
    return out


#: :func:`_long_blocks`: a micro-batch is long when its time scale is more than this many
#: times the median one's, and the long ones are a class apart (as images among texts) when
#: the shortest of them is at least this many times the longest of the others.
_LONG_CLASS = 2.0


def _long_cut(problem: Problem) -> float:
    """The time scale above which a micro-batch is long: :data:`_LONG_CLASS` times the median
    one's (a factor of the reference micro-batch's times, like :attr:`Problem.time_scale`)."""
    ts = sorted(problem.time_scale)
    m = len(ts)
    median = ts[m // 2] if m % 2 else 0.5 * (ts[m // 2 - 1] + ts[m // 2])
    return _LONG_CLASS * median


def _class_apart(problem: Problem) -> bool:
    """Are some micro-batches long (:func:`_long_cut`), some not, and the long ones a class
    apart: the shortest of them at least :data:`_LONG_CLASS` times the longest other? The
    block orders (:func:`_long_blocks`) and the order search's rounds are for these only."""
    cut = _long_cut(problem)
    long = [x for x in problem.time_scale if x > cut]
    short = [x for x in problem.time_scale if x <= cut]
    return bool(long and short) and min(long) >= _LONG_CLASS * max(short)


def _long_blocks(problem: Problem, shortest: list[int]) -> list[tuple[int, ...]]:
    """Orders that run the long micro-batches (time scale above :data:`_LONG_CLASS` times the
    median) in one block, shortest of them first, after the others longest first, with the
    ``t`` shortest after the block (t = 1 and half the devices); none unless some are long
    and they are a class apart (:func:`_class_apart`).

    Why a block: a long micro-batch holds every device for its F, B and W in turn, and the
    short ones behind it wait; long ones spread among short ones make that bubble once each,
    in one block they make it about once. On the p = 8, m = 32 text / image instance of
    ``benchmarks/variable_microbatches.py`` (7 images of 1.9-2.4 among 25 texts of
    0.23-0.45) the best variant on a block order was 77.9 s against 79.6 s on the orders
    above (and 82.6 s with the images spread evenly among the texts), and the order search
    from it reached 74.9 s in 25 s against 75.3 s from those. Where the long ones are no
    class apart they helped on some instances (p = 8, m = 32 lognormal: ``auto`` 135.0 s,
    the proven optimum, against 135.6 s) and not on others (p = 16, m = 64 lognormal: 219.5
    against 218.7 s, 30 s, load 2: the order search starts elsewhere), so they are left out
    there."""
    if not _class_apart(problem):
        return []
    ts = problem.time_scale
    cut = _long_cut(problem)
    long = [j for j in shortest if ts[j] > cut]
    short = [j for j in shortest if ts[j] <= cut]
    out = []
    for t in sorted({1, problem.devices // 2}):
        t = min(t, len(short))
        out.append(tuple(short[t:][::-1] + long + short[:t][::-1]))
    return out


def _orders_of(ctx: _Context, ids: list[list[int]], order: tuple[int, ...]) -> list[list[Op]]:
    """A variant's op ids in ``ctx`` (micro-batches in ``order``) as orders of the problem."""
    return _relabel(ctx.orders(ids), order)


def _relabel(orders: list[list[Op]], order: tuple[int, ...]) -> list[list[Op]]:
    """Orders of ``problem.permute_microbatches(order)`` as orders of ``problem``."""
    if order == tuple(range(len(order))):
        return orders
    return [[Op(o.kind, o.stage, order[o.microbatch]) for o in ops] for ops in orders]


def _relabel_starts(starts: list[float], order: tuple[int, ...]) -> list[float]:
    """Starts of ``problem.permute_microbatches(order)``'s ops (op-id order) as those of
    ``problem``'s: micro-batch j of the permuted problem is ``order[j]``."""
    m = len(order)
    if order == tuple(range(m)):
        return starts
    out = [math.nan] * len(starts)
    for base in range(0, len(starts), m):
        for j, oj in enumerate(order):
            out[base + oj] = starts[base + j]
    return out


def sequential_orders(problem: Problem) -> list[list[Op]]:
    """One micro-batch at a time through the whole pipeline: the least memory any schedule
    needs (:func:`min_memory`), and the slowest."""
    orders: list[list[Op]] = [[] for _ in range(problem.devices)]
    sd = problem.stage_device
    for j in range(problem.microbatches):
        for k in range(problem.stages):
            orders[sd[k]].append(Op("F", k, j))
        for k in range(problem.stages - 1, -1, -1):
            orders[sd[k]].append(Op("B", k, j))
            if problem.split_backward:
                orders[sd[k]].append(Op("W", k, j))
    return orders


@cyclic_gc_paused()  # list scheduling builds tuples per op and no cycles (pipeopt._gc)
def solve_greedy(problem: Problem, options: SolveOptions, *,
                 optional: bool = False, long_search: bool = False,
                 order_share: float | None = None) -> Schedule:
    """Schedule ``problem`` with the memory-aware list scheduler (see the module docstring).

    Tries priority variants while the total work stays within a small budget (all of them on
    small instances, two on p=64, m=1024) and keeps the best by ``options.objective``. With
    micro-batches of different cost, every variant runs with each of :func:`microbatch_orders`
    (twice the work budget; the first two variants on each order before the others). A
    variant still running at the time limit, less the time the final simulation of the chosen
    orders will take (:data:`_RETIME_S_PER_OP` per op times the run's slowdown), is abandoned;
    when that is the first, the greedy returns a hand-made schedule instead
    (:func:`_hand_made`, its method ``greedy:NAME``, a ``fallback`` detail saying why), or with
    ``optional`` (the caller has another schedule) raises :class:`~pipeopt.solvers.OutOfTime`.
    Raises :class:`NotApplicable` when some device's memory limit is below what any schedule
    needs. With micro-batches of different cost, the order search (:func:`_order_search`) runs
    until half the time limit, or with ``long_search`` (nothing but a neighbourhood search will
    run after it) until :data:`_LONG_SHARE` of it, with longer chains. ``order_share``
    (``auto`` passes it where its restarts would follow): the search runs until this share of
    the time limit instead, with its rounds (:data:`_ORDER_ROUNDS`); where the long
    micro-batches are a class apart with the chains it has without ``long_search`` (the greedy
    alone's), elsewhere with the chains ``long_search`` gives (so its first round is the long
    search's, and the rounds go on from its best order).
    """
    t0 = time.perf_counter()
    watch = Stopwatch(t0, time.process_time())
    deadline = t0 + options.time_limit
    # The variants stop early enough for the final timing of the best ones to end by the
    # deadline: the limit covers the whole solve, not only the search.
    retime_cpu = _RETIME_S_PER_OP * problem.num_ops * (
        _RETIME_BEST if problem.has_link_contention else 1)
    check_memory(problem)
    mb_orders = microbatch_orders(problem)
    contexts: dict[int, _Context] = {}  # per micro-batch order, built when first used
    n = max(1, problem.num_ops)
    orders_ = range(len(mb_orders))
    policies = policies_for(problem)
    pairs = ([(policy, c) for c in orders_ for policy in policies[:2]]
             + [(policy, c) for policy in policies[2:] for c in orders_])
    budget = _WORK_BUDGET_OPS * (2 if len(mb_orders) > 1 else 1)
    runs = pairs[:max(1, budget // n)]
    # Random restarts: every policy in turn with a little noise in the F/B/W choices, on the
    # two micro-batch orders that did best so far (order -1 - r: the r-th best, chosen when
    # the restart runs).
    restarts = min(_MAX_RESTARTS, _RESTART_BUDGET_OPS // n) if len(runs) == len(pairs) else 0
    for i in range(restarts):
        runs.append((replace(policies[i % len(policies)], noise=_NOISE[i % len(_NOISE)],
                             seed=options.seed * 7919 + i), -1 - i % min(2, len(mb_orders))))
    span_obj = options.objective == "span"
    bound = lower_bound(problem, options.objective)
    # The greedy's own makespan is the simulator's (no queues on links) and the objective's.
    exact_timing = not problem.has_link_contention and not any(problem.grad_reduce)
    # (objective, run, its orders (made when called), policy name, micro-batch order, starts
    # of the ops in that order's problem: relabelled for the few timed at the end)
    found: list[tuple[float, int, Callable[[], list[list[Op]]], str, int,
                      list[float] | None]] = []
    by_name: dict[str, Policy] = {}
    best_of_order: dict[int, float] = {}
    tried = 0
    interrupted = late = False
    for policy, c in runs:
        if tried and time.perf_counter() - t0 > max(0.05, 0.5 * options.time_limit):
            break
        if c < 0:
            ranked = sorted(best_of_order, key=lambda x: (best_of_order[x], x)) or [0]
            c = ranked[min(-1 - c, len(ranked) - 1)]
        try:
            if c not in contexts:
                contexts[c] = _Context(problem.permute_microbatches(mb_orders[c]))
            retime = retime_cpu * _reserve_slowdown(watch, retime_cpu, deadline, n)
            ids, makespan, spans, starts = _run(contexts[c], policy, deadline - retime)
        except _Stuck:
            continue
        except _OutOfTime:
            if not tried and optional:
                raise OutOfTime(f"greedy: the time limit ({options.time_limit:.3g} s) ended "
                                "before its first schedule") from None
            late = not tried
            break
        except KeyboardInterrupt:
            if not found:
                raise
            interrupted = True  # Ctrl-C: keep the best variant so far
            break
        val = max(spans) if span_obj else makespan
        by_name[policy.name] = policy
        found.append((val, tried, partial(_orders_of, contexts[c], ids, mb_orders[c]),
                      policy.name, c, starts))
        best_of_order[c] = min(val, best_of_order.get(c, _INF))
        logger.debug("greedy: variant %s, micro-batch order %d -> %.6g s", policy.name, c, val)
        tried += 1
        if val <= bound * (1 + 1e-9) and exact_timing:
            break  # meets the lower bound: optimal, nothing left to gain
    if late:
        return _hand_made(problem, options, bound, t0)
    found.sort(key=lambda x: (x[0], x[1]))
    extra_details: tuple[tuple[str, Any], ...] = ()  # ("order_share", s) where it applied
    if found and len(mb_orders) > 1 and not interrupted and not (
            found[0][0] <= bound * (1 + 1e-9) and exact_timing):
        starts: list[tuple[Policy, tuple[int, ...], float]] = []
        for val, _, _, pname, c, _ in found:  # the best distinct (policy, order) pairs
            if len(starts) == _ORDER_STARTS:
                break
            if all((pol.name, o) != (pname, mb_orders[c]) for pol, o, _ in starts):
                starts.append((by_name[pname], mb_orders[c], val))
        # Until half the time limit from the start, like the variants: auto's CP-SAT runs after
        # (with micro-batches of different cost it moves the greedy's answer little; the order
        # does: see the module docstring). With long_search, most of the limit.
        share = _LONG_SHARE if long_search else 0.5
        # Rounds only where the long micro-batches are a class apart (block orders tried):
        # there the order is the lever; elsewhere CP-SAT's time after the greedy is worth more
        # (see _ORDER_ROUNDS).
        classes = _class_apart(problem)
        long, rounds = long_search, None if classes else 1
        if order_share is not None:  # the time auto's restarts would take: to the rounds
            share, rounds = order_share, None
            extra_details += (("order_share", share),)
            if classes:  # the chains of the greedy alone, with more time
                long = False
        better = _order_search(problem, starts, options.seed,
                               t0 + max(0.05, share * options.time_limit), span_obj,
                               long=long, rounds=rounds)
        if better is not None:
            mb_orders.append(better[2])
            found.insert(0, (better[0], -1, partial(list, better[1]), better[3].name,
                             len(mb_orders) - 1,
                             None))
    if not found:
        found = [(0.0, 0, partial(sequential_orders, problem), "sequential", 0, None)]
    # The greedy's own timing is the simulator's when links only delay; when messages queue on
    # a link it is an estimate, so the simulator re-times the few best.
    shortlist = found[:_RETIME_BEST] if problem.has_link_contention else found[:1]
    info = SolverInfo(status="heuristic", lower_bound=bound, objective=options.objective)
    best, k = _best_timed(problem, [f[2] for f in shortlist], "greedy", info, span_obj,
                          [None if f[5] is None else _relabel_starts(f[5], mb_orders[f[4]])
                           for f in shortlist])
    name, chosen = shortlist[k][3], shortlist[k][4]
    logger.info("greedy: %d priority variant(s) tried in %.2f s; best %s: %s %.6g s (lower "
                "bound %.6g s)%s", tried, time.perf_counter() - t0, name,
                "span" if span_obj else "iteration time", _objective(best, span_obj), bound,
                ", interrupted" if interrupted else "")
    details: tuple[tuple[str, Any], ...] = (("policy", name), ("variants_tried", tried),
                                            *extra_details)
    if len(mb_orders) > 1:
        details += (("microbatch_order", mb_orders[chosen]),)
    if interrupted:
        details += (("interrupted", True),)
    return best.relabel(solver=replace(info, wall_time=time.perf_counter() - t0,
                                       details=details))


#: Hand-made schedules the greedy returns, the first that fits every memory limit, when the
#: time limit ends before its first variant does; sequential orders (one micro-batch at a
#: time, within any limit :func:`check_memory` accepts) after them.
_FALLBACKS = ("zb-h1", "1f1b")


def _hand_made(problem: Problem, options: SolveOptions, bound: float, t0: float) -> Schedule:
    """The schedule of the first of :data:`_FALLBACKS` that fits (else sequential orders),
    named ``greedy:NAME`` with a ``fallback`` detail saying why. Its timing is the final
    simulation the variants' deadline kept time for."""
    for name in _FALLBACKS:
        try:
            sched = run_classic(problem, name, require_fit=True)
        except NotApplicable:
            continue
        # run_classic checks the orders' peak only when every op lasts > 0; this is exact.
        if fits_memory(sched, problem):
            break
    else:
        name = "sequential"
        sched = simulate(problem, sequential_orders(problem), method=name)
    note = (f"greedy: the {options.time_limit:.3g} s it was given ended before its first "
            f"schedule; returned the hand-made {name} schedule instead")
    logger.info("%s", note)
    info = SolverInfo(status="heuristic", lower_bound=bound, objective=options.objective,
                      wall_time=time.perf_counter() - t0,
                      details=(("policy", name), ("variants_tried", 0), ("fallback", note)))
    return sched.relabel(method=f"greedy:{name}", solver=info)


def _differ(problem: Problem, a: int, b: int) -> bool:
    """Do micro-batches ``a`` and ``b`` differ in time scale by more than
    :data:`_SWAP_MIN_DIFF` of the larger of the two? (Swapping two of nearly equal cost is
    wasted work.)"""
    ta, tb = problem.time_scale[a], problem.time_scale[b]
    return abs(ta - tb) > _SWAP_MIN_DIFF * max(ta, tb)


def _neighbour(problem: Problem, cur: list[int], rand: random.Random) -> list[int] | None:
    """One random change of the micro-batch order ``cur``: swap two micro-batches of different
    cost, move one anywhere, or move one by at most :data:`_NEAR_MOVE` places (a third each);
    None when the draw changes nothing worth timing."""
    m = len(cur)
    new = list(cur)
    a = rand.randrange(m)
    u = rand.random()
    if u < 1 / 3:
        b = rand.randrange(m)
        if not _differ(problem, new[a], new[b]):
            return None
        new[a], new[b] = new[b], new[a]
        return new
    if u < 2 / 3:
        b = rand.randrange(m)
    else:
        b = min(m - 1, max(0, a + rand.choice((-1, 1)) * rand.randint(1, _NEAR_MOVE)))
    if a == b:
        return None
    new.insert(b, new.pop(a))
    return new


def _order_search(problem: Problem, starts: list[tuple[Policy, tuple[int, ...], float]],
                  seed: int, deadline: float, span: bool = False, long: bool = False,
                  rounds: int | None = None
                  ) -> tuple[float, list[list[Op]], tuple[int, ...], Policy] | None:
    """Iterated local search over the micro-batch order, one chain per start
    ``(policy, order, objective)`` (the best variants so far), each with an equal share of
    the iterations and of the time left.

    A chain draws a neighbour (:func:`_neighbour`: swap, move, near move; seeded) and times it
    with its ``policy``; it moves to a neighbour that is no worse (sideways moves cross the
    plateaus that many orders of equal makespan form, when the devices' spans add up to no more
    than before) and, after :data:`_STALL` draws without
    improvement, restarts from its best order with :data:`_KICK` random moves; after
    :data:`_STALL_KICKS` such restarts in a row without a better order the chain ends. When
    every chain has ended and time is left, they run again with other seeds from the best
    order so far, up to ``rounds`` rounds (None: :data:`_ORDER_ROUNDS`), while each round
    improves on the last.
    Within
    :data:`_ORDER_SEARCH_OPS` ops per round (none on larger instances) and until ``deadline``
    (perf_counter seconds), less :data:`_POLISH_SHARE` of the time left, in which the best
    order is timed with every variant of :data:`POLICIES` and with seeded noisy restarts.
    ``long``: :data:`_LONG_STALL_KICKS` kicks and :data:`_LONG_CAPS` times the caps.
    Returns (objective, orders of ``problem``, order, policy) of the best order found, None if
    none beat its start."""
    m = problem.microbatches
    caps = _LONG_CAPS if long else 1
    stall_kicks = _LONG_STALL_KICKS if long else _STALL_KICKS
    iters = min(caps * _ORDER_SEARCH_ITERS,
                caps * _ORDER_SEARCH_OPS // max(1, problem.num_ops) // max(1, len(starts)))
    # The best so far: (objective, its context, its op ids, order, policy); its orders are
    # made once, on return.
    best: tuple[float, _Context, list[list[int]], tuple[int, ...], Policy] | None = None
    # Only an order better than every start counts (the caller keeps the best start).
    top = min(value for _, _, value in starts)
    now = time.perf_counter()
    chains_end = now + (1 - _POLISH_SHARE) * max(0.0, deadline - now)
    round_top = _INF  # the best value when the current round began
    n_rounds = _ORDER_ROUNDS if rounds is None else rounds
    for r, c in ((r, c) for r in range(n_rounds) for c in range(len(starts))):
        if c == 0:
            # A round that found no better order ends the search (so does the time).
            if r and (time.perf_counter() > chains_end or top >= round_top - 1e-9):
                break
            round_top = top
        policy, order, value = starts[c]
        if r and best is not None:  # later rounds: on from the best order so far
            order, value = best[3], best[0]
        # Round 0's seeds as before rounds existed; a later round's chains draw other moves.
        rand = random.Random(seed * 7919 + c + _ROUND_SEED * r)
        left = (chains_end - time.perf_counter()) / (len(starts) - c)
        stop = min(chains_end, time.perf_counter() + left)
        cur_val, cur, cur_tie = value, list(order), _INF
        chain_best, chain_val = list(order), value
        stall = kicks = 0
        for _ in range(iters):
            if time.perf_counter() > stop:
                break
            if stall >= _STALL:  # kick: a few random moves away from the chain's best
                if kicks >= stall_kicks:
                    break  # converged: no better order since the last kicks
                kicks += 1
                cur = list(chain_best)
                for _ in range(_KICK):
                    a, b = rand.randrange(m), rand.randrange(m)
                    cur.insert(b, cur.pop(a))
                cur_val, stall, cur_tie = _INF, 0, _INF
            new = _neighbour(problem, cur, rand)
            if new is None:
                continue
            try:
                ctx_new = _Context(problem.permute_microbatches(new))
                ids, makespan, spans, _ = _run(ctx_new, policy, stop)
            except (_Stuck, _OutOfTime):
                break
            val = max(spans) if span else makespan
            stall = 0 if val < chain_val - 1e-9 else stall + 1
            # A sideways move (the same objective) only when the devices' spans add up to no
            # more: a plateau of equal makespans is crossed towards less idle time.
            tie = sum(spans)
            if val < cur_val - 1e-9 or (val <= cur_val + 1e-9 and tie <= cur_tie + 1e-9):
                cur_val, cur, cur_tie = val, new, tie
            if val < chain_val - 1e-9:
                chain_val, chain_best, kicks = val, new, 0
            if val < top - 1e-9:
                top = val
                best = (val, ctx_new, ids, tuple(new), policy)
    if best is not None and time.perf_counter() < deadline:
        # The chains timed their order with one policy each: another may suit it better, and
        # so may a seeded restart with a little noise in the F/B/W choices (as after the
        # variants; the order search leaves a share of its time for them).
        ctx = _Context(problem.permute_microbatches(best[3]))
        noisy = [replace(POLICIES[i % len(POLICIES)], noise=_NOISE[i % len(_NOISE)],
                         seed=seed * 7919 + _MAX_RESTARTS + i)
                 for i in range(min(_MAX_RESTARTS, _RESTART_BUDGET_OPS // max(1, problem.num_ops)))]
        for policy in (*POLICIES, *noisy):
            try:
                ids, makespan, spans, _ = _run(ctx, policy, deadline)
            except (_Stuck, _OutOfTime):
                continue
            val = max(spans) if span else makespan
            if val < best[0] - 1e-9:
                best = (val, ctx, ids, best[3], policy)
    if best is None:
        return None
    val, ctx, ids, order, policy = best
    return val, _orders_of(ctx, ids, order), order, policy


def _objective(schedule: Schedule, span: bool) -> float:
    return schedule.max_span if span else schedule.iteration_time


def _best_timed(problem: Problem, candidates: Sequence[Callable[[], list[list[Op]]]],
                method: str,
                info: SolverInfo, span: bool,
                starts: Sequence[list[float] | None] = ()) -> tuple[Schedule, int]:
    """Each of the (non-empty) ``candidates`` orders (each made by calling it) timed by the
    simulator, the problem's graph built once; the best by the objective (the first among
    equals) and its index.
    ``starts``: per candidate, the greedy's own start times of its ops (op-id order) or None;
    where they are exactly the simulator's times (:func:`~pipeopt.simulate.from_starts`
    checks), the orders are not timed again."""
    graph: training.ChainGraph | None = None
    best: Schedule | None = None
    chosen = 0
    for k, orders in enumerate(candidates):
        sched = None
        if k < len(starts) and starts[k] is not None:
            sched = from_starts(problem, starts[k], method=method, solver=info)
        if sched is None:
            if graph is None and len(candidates) > 1:
                graph = training.chain_graph(problem)
            sched = simulate(problem, orders(), method=method, solver=info, graph=graph)
        if best is None or _objective(sched, span) < _objective(best, span) - 1e-12:
            best, chosen = sched, k
    assert best is not None
    return best, chosen


#: :func:`restart_search`: the noise levels of its restarts and how many of the best noiseless
#: variants they perturb. Measured on ``benchmarks/search.py``'s cross-datacenter chains
#: (latency 8 x T_F, 1F1B's memory; load average 13 on 2 cores), restarts cycling over the four
#: best variants: at p = 16, m = 64 (40 s, 1,520 runs) the best with noise 0.02 / 0.05 / 0.1
#: were 267.4 / 265.8 / 269.2 s (noiseless 270.4 s); at p = 32, m = 128 (60 s, 453 runs)
#: 476.0 / 480.0 / 485.4 s (noiseless 481.8 s). The fifth best variant and beyond was 1-2 %
#: behind the best noiseless one on both.
_RESTART_NOISE = (0.02, 0.05)
_RESTART_TOP = 4
#: After this many seeded restarts in a row without a better run, :func:`restart_search`
#: turns to a local search around its best run instead: each run flips the same choices as
#: the current one but for one or two indices toggled (:attr:`Policy.flips`), and replaces it
#: when better, or as good and at least as compact (the sum of its op starts no larger).
#: Measured at xdc p = 16, m = 64 (40 s): the seeded restarts' best was 266.0 s after 1,674
#: runs (8.7 s, load 1.0) and still 266.0 s after 12,751 runs (38 s); with the local search
#: accepting any run as good 265.6 s (load 6-9, 4,400 runs, the last better one at 12.6 s),
#: with the compactness rule 264.8 s (load 5-6, 7,865 runs, the last better one at 5.6 s).
#: Only on instances of at least _LOCAL_MIN_OPS ops: on ``crosspipe-v`` p = 8, m = 32 (1,536
#: ops, ``auto`` at 20 s, load 8-10) the seeded restarts alone kept finding better runs,
#: 110.9 / 160.5 / 140.5 s (lat2 / lat8 / bw2), the first local search after them 111.1 /
#: 160.7 / 140.6 s.
_LOCAL_MIN_OPS = 1600
_LOCAL_STALL = 300
_LOCAL_TOGGLES = (1, 2)
#: The local search's kick: after this many runs without a run better than its best, it
#: goes on from its best with this many more choices toggled at once (iterated local search).
_KICK_AFTER = 500
_KICK_TOGGLES = 6
#: On instances of at least :data:`_LOCAL_MIN_OPS` ops, the first this many restarts after the
#: noiseless variants are noiseless runs of one of the :data:`_RESTART_TOP` best variants with
#: an idle guard (:attr:`Policy.guard`) drawn by the seed: a share of :data:`_GUARD_SHARES` on
#: a random range of consecutive devices. Measured at xdc p = 16, m = 64 (load 2-3): the
#: best noiseless variant 270.4 s; guards on every device 266.0 s at best (share 0.3), on
#: devices 1-6 264.6 s, on a drawn range 263.2 s after 814 / 1,822 draws (seeds 0 / 1;
#: devices 2-6 or 2-5, share 0.6 or 0.8), where the seeded restarts and their local search
#: stop at 264.8 s; neither that local search nor toggling single devices of the range
#: improved 263.2 s in 30 s.
_GUARD_RUNS = 2000
#: ... and at most this many ops in all (a count, so the sequence of runs stays fixed for a
#: seed): a run at p = 64, m = 1024 takes about 0.2 s, so 2,000 guard runs would fill any
#: time limit there and leave no noisy restarts, where the guard's gain was measured at
#: p = 16 and 32 only (3,072 and 12,288 ops: 2,000 runs either way; 127 at 196,608 ops).
_GUARD_OPS = 25_000_000
_GUARD_SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def restart_search(problem: Problem, options: SolveOptions, deadline: float, *,
                   max_runs: int | None = None) -> Schedule | None:
    """Seeded random restarts of the list scheduler until ``deadline`` (a
    :func:`time.perf_counter` value), for callers with time to spare (``auto`` on instances
    too large for its CP-SAT windows to help).

    Every variant of :func:`policies_for` runs once without noise; then the
    :data:`_RESTART_TOP` best of them in turn, with each noise level of
    :data:`_RESTART_NOISE` in turn (the probability of flipping an F/B or F/W choice), seeds
    drawn from ``options.seed``; micro-batches in the problem's order. Returns the best by
    ``options.objective`` (method ``greedy-restarts``, its orders timed by the simulator; where
    messages queue on links, the :data:`_RETIME_BEST` best by the greedy's own timing), or None
    when no run ended by the deadline. For a given seed the sequence of runs is fixed; only the
    deadline, or ``max_runs`` (noiseless ones included), decides where it stops; a run that
    meets the lower bound ends it. On instances of at least :data:`_LOCAL_MIN_OPS` ops, the
    first :data:`_GUARD_RUNS` restarts draw an idle guard instead of noise (see there), and
    after them and :data:`_LOCAL_STALL` restarts in a row without a better run, the rest is a
    local search in the best run's choices (see there).
    """
    t0 = time.perf_counter()
    watch = Stopwatch(t0, time.process_time())
    keep = _RETIME_BEST if problem.has_link_contention else 1
    retime_cpu = _RETIME_S_PER_OP * problem.num_ops * keep
    check_memory(problem)
    ctx = _Context(problem)
    span_obj = options.objective == "span"
    bound = lower_bound(problem, options.objective)
    # The greedy's own makespan is the simulator's (no queues on links) and the objective's.
    exact_timing = not problem.has_link_contention and not any(problem.grad_reduce)
    policies = policies_for(problem)
    # The best few: (value, run, its orders (made when called), policy name, starts of ops).
    found: list[tuple[float, int, Callable[[], list[list[Op]]], str, list[float]]] = []
    noiseless: list[tuple[float, int]] = []  # (value, index in policies)
    runs = 0
    interrupted = False
    rng = random.Random(options.seed)
    # The local search's current run: (value, its policy without flips, the choices it
    # flipped, how many choices noise could act on); stall: restarts since a better run.
    cur: tuple[float, Policy, frozenset[int], int] | None = None
    top_run = cur  # the best run so far, as ``cur``
    stall, local, local_runs = 0, False, 0
    cur_sum = top_sum = math.inf  # the sum of the current / best run's op starts (s)
    may_walk = problem.num_ops >= _LOCAL_MIN_OPS
    guard_runs = min(_GUARD_RUNS, _GUARD_OPS // max(1, problem.num_ops)) if may_walk else 0
    # This run re-counts ``cur``'s choices (``cur`` is the best run; in place of a kick).
    counting = from_top = recount_kick = False
    while max_runs is None or runs < max_runs:
        local = local or (may_walk and stall >= _LOCAL_STALL and cur is not None
                          and runs >= len(policies) + guard_runs)
        if runs < len(policies):
            policy = policies[runs]
        elif local:
            assert cur is not None and top_run is not None
            kick = stall >= _KICK_AFTER
            if kick:  # from the best run, further away
                cur, stall, cur_sum = top_run, 0, top_sum
            _, base, flips, choices = cur
            from_top = cur is top_run
            if base.noise == 0:
                # A noiseless variant's run counted no choices (noise never drew): replay it
                # with an empty ``flips`` (the same run) to count them, then toggle those.
                policy = replace(base, noise=_RESTART_NOISE[0], flips=frozenset())
                counting, recount_kick = True, kick
            else:
                toggle = {rng.randrange(max(1, choices)) for _ in
                          range(_KICK_TOGGLES if kick else rng.choice(_LOCAL_TOGGLES))}
                policy = replace(base, flips=flips.symmetric_difference(toggle))
        else:
            if not noiseless:
                break  # no variant ran to the end: nothing to perturb
            top = [policies[i] for _, i in sorted(noiseless)[:_RESTART_TOP]]
            r = runs - len(policies) - guard_runs
            if r < 0:
                # An idle guard on a drawn range of devices, no choice flipped (an empty
                # ``flips`` counts the choices, so the local search can start from this run).
                lo = rng.randrange(problem.devices)
                hi = rng.randrange(lo + 1, problem.devices + 1)
                policy = replace(top[(r + guard_runs) % len(top)],
                                 guard=rng.choice(_GUARD_SHARES),
                                 guard_devices=frozenset(range(lo, hi)),
                                 noise=_RESTART_NOISE[0], flips=frozenset())
            else:
                policy = replace(top[r % len(top)],
                                 noise=_RESTART_NOISE[(r // len(top)) % len(_RESTART_NOISE)],
                                 seed=rng.randrange(1 << 30))
        retime = retime_cpu * watch.slowdown(calibrate=retime_cpu > _CALIBRATE_CPU_S)
        if time.perf_counter() >= deadline - retime:
            break
        flipped: list[int] = []
        local_runs += local and runs >= len(policies)
        try:
            ids, makespan, spans, starts = _run(ctx, policy, deadline - retime, flipped)
        except _Stuck:
            runs += 1
            stall += 1
            continue
        except _OutOfTime:
            break
        except KeyboardInterrupt:
            if not found:
                raise
            interrupted = True
            break
        val = max(spans) if span_obj else makespan
        if runs < len(policies):
            noiseless.append((val, runs))
        choices = flipped.pop()
        state = (val, replace(policy, flips=None), frozenset(flipped), choices)
        if counting:  # the same run as ``cur``, now with its choices counted: take its place
            counting = False
            cur = state
            if from_top:
                top_run = state
            if recount_kick:  # the kick it stood in for comes next
                stall = _KICK_AFTER
            runs += 1
            continue
        if top_run is None or val < top_run[0] * (1 - 1e-12):
            top_run, cur, stall = state, state, 0
            cur_sum = top_sum = math.fsum(starts)
        else:
            stall += 1
            if local and cur is not None and (val < cur[0] * (1 - 1e-12) or (
                    val <= cur[0] * (1 + 1e-12) and math.fsum(starts) <= cur_sum)):
                cur, cur_sum = state, math.fsum(starts)  # no worse, no less compact
        found.append((val, runs, partial(ctx.orders, ids), policy.name, starts))
        found.sort(key=lambda x: (x[0], x[1]))
        del found[keep:]
        runs += 1
        if val <= bound * (1 + 1e-9) and exact_timing:
            break  # meets the lower bound: optimal, nothing left to gain
    if not found:
        return None
    info = SolverInfo(status="heuristic", lower_bound=bound, objective=options.objective)
    best, k = _best_timed(problem, [f[2] for f in found], "greedy-restarts", info, span_obj,
                          [f[4] for f in found])
    name = found[k][3]
    logger.info("greedy: %d restart run(s) in %.2f s; best %s: %.6g s", runs,
                time.perf_counter() - t0, name, _objective(best, span_obj))
    details: tuple[tuple[str, Any], ...] = (("policy", name), ("restart_runs", runs),
                                            ("local_runs", local_runs))
    if interrupted:
        details += (("interrupted", True),)
    return best.relabel(solver=replace(info, wall_time=time.perf_counter() - t0,
                                       details=details))
