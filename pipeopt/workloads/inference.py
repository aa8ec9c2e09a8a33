"""LLM inference on a pipeline as a task graph: prefill and decode iterations with a KV cache.

The workload, in three frozen pieces (times in seconds, memory in bytes, lengths in tokens):

* :class:`Request`: a prompt of ``prompt`` tokens and ``output`` generated tokens, arriving at
  ``arrival`` s (default 0: offline serving of a known batch); TTFT counts from the arrival.
* :class:`StageModel`: one pipeline stage on one device, as roofline coefficients; an
  iteration's time on the stage is ``max(FLOPs / peak, bytes read / HBM bandwidth)``
  (:meth:`StageModel.time`). :mod:`pipeopt.costs.inference` derives them from a transformer and
  a GPU.
* :class:`Plan`: the iterations (forward passes through every stage) in a fixed order, each with
  its prefill chunks and its decodes. The batching policies that make one — fixed micro-batches
  (:func:`static_plan`), continuous batching under a token budget (:func:`continuous_plan`),
  prefill and decode separated in time (:func:`separated_plan`) — live here too; which requests
  go into which micro-batch and in what order is theirs to choose.

Token accounting: a request's prefill (possibly in chunks) writes ``prompt`` KV entries and its
last chunk yields the first output token; decode step ``j`` (1 .. output - 1) feeds token ``j``,
writes its KV entry and yields token ``j + 1``; the request's KV holds
``prompt + output - 1`` entries at its end, freed then.

:func:`build` turns a plan into a :class:`TaskGraph`: task ``b * stages + k`` is iteration ``b``
on stage ``k`` (device ``k``); ``(b, k) -> (b, k + 1)`` carries the iteration's activations
(tokens x ``activation_bytes_per_token``); when a request's previous iteration yielded a
token, its last stage precedes the first stage of the request's next iteration (the sampled
token goes back, a latency-only message); after a prefill chunk that yields none, the next
chunk follows it stage by stage (each stage extends the KV it holds: chunks pipeline);
each task allocates the KV entries it writes at its start and frees the KV of the requests that
end in it at its end; each device's static memory is its stage's weights. When requests
arrive after 0, an arrival clock follows the iterations: one communication task per distinct
arrival time (device -1, holding a network resource ``arrivals`` of its own, so nothing else
contends for it), chained, each lasting the gap since the previous arrival, so it ends at its
arrival time (or later), and preceding the first stage of the first iteration of each request
arriving then: no iteration holding a request starts before it arrives. The graph's meta
records the plan (:func:`plan_meta`), so a schedule file carries its requests and
:func:`serving_metrics` re-derives the serving figures from it.
:func:`metrics` reads throughput, TTFT and TPOT off a timed schedule of that graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` tokens in, ``output`` tokens out (both >= 1), arriving at
    ``arrival`` s (>= 0; its TTFT counts from then, and no iteration holding it starts
    earlier)."""

    prompt: int
    output: int
    arrival: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt", "output"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"request.{name}: must be an integer >= 1, got {v!r}")
        a = self.arrival
        if isinstance(a, bool) or not isinstance(a, int | float) or not (
                math.isfinite(a) and a >= 0):
            raise ValueError(f"request.arrival: must be a finite number >= 0 s, got {a!r}")

    @property
    def kv_tokens(self) -> int:
        """KV entries the request holds at its end: prompt + output - 1."""
        return self.prompt + self.output - 1


def check_requests(requests: Sequence[Request]) -> tuple[Request, ...]:
    """The requests as a tuple; ValueError naming the index of a bad one."""
    out = tuple(requests)
    if not out:
        raise ValueError("requests: need at least one request")
    for i, r in enumerate(out):
        if not isinstance(r, Request):
            raise ValueError(f"requests[{i}]: expected a Request, got {r!r}")
    return out


def sample_requests(n: int, seed: int, *, prompt_median: float, output_median: float,
                    prompt_sigma: float = 1.0, output_sigma: float = 1.0,
                    max_prompt: int = 4096, max_output: int = 4096,
                    arrival_rate: float | None = None) -> tuple[Request, ...]:
    """``n`` requests whose prompt and output lengths are log-normal (median, sigma of the
    log), rounded and clipped to ``1 .. max_*``; the same ``seed`` gives the same requests.
    ``arrival_rate`` (requests/s): arrivals of a Poisson process (exponential gaps of mean
    ``1 / rate``, the first after one gap, drawn after the lengths, so the lengths are those
    without it); None: all at 0."""
    import numpy as np

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"requests.count: must be an integer >= 1, got {n!r}")
    for name, v in (("prompt_median", prompt_median), ("output_median", output_median)):
        if not v > 0:
            raise ValueError(f"requests.{name}: must be > 0, got {v!r}")
    for name, v in (("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma)):
        if not v >= 0:
            raise ValueError(f"requests.{name}: must be >= 0, got {v!r}")
    for name, v in (("max_prompt", max_prompt), ("max_output", max_output)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"requests.{name}: must be an integer >= 1, got {v!r}")
    rng = np.random.default_rng(seed)
    p = rng.lognormal(math.log(prompt_median), prompt_sigma, n)
    o = rng.lognormal(math.log(output_median), output_sigma, n)
    p = np.clip(np.rint(p), 1, max_prompt).astype(int).tolist()
    o = np.clip(np.rint(o), 1, max_output).astype(int).tolist()
    if arrival_rate is None:
        return tuple(Request(a, b) for a, b in zip(p, o, strict=True))
    if not (arrival_rate > 0 and math.isfinite(arrival_rate)):
        raise ValueError(f"requests.arrival_rate: must be a finite number > 0 requests/s, "
                         f"got {arrival_rate!r}")
    t = np.cumsum(rng.exponential(1.0 / arrival_rate, n)).tolist()
    return tuple(Request(a, b, c) for a, b, c in zip(p, o, t, strict=True))


# ----- cost of one iteration on one stage ----------------------------------------------------
@dataclass(frozen=True)
class StageModel:
    """One stage's roofline (see :meth:`time`). FLOPs per token / key; bytes; FLOP/s; bytes/s.

    ``linear_flops_per_token``: the weight matmuls of the stage's layers per token;
    ``attention_flops_per_key``: the two attention matmuls per (query token, key) pair, summed
    over the stage's layers (4 h per layer); ``head_flops_per_logit``: the LM head per token whose
    logits are needed (the last stage only); ``weight_bytes``: the stage's parameters, read once
    per iteration and held as static memory; ``kv_bytes_per_token``: the stage's KV entries per
    token; ``activation_bytes_per_token``: the message to the next stage per token;
    ``peak_flops`` and ``hbm_bandwidth``: what the device sustains; ``memory_limit``: the
    device's memory (None = unlimited).
    """

    linear_flops_per_token: float
    attention_flops_per_key: float
    weight_bytes: float
    kv_bytes_per_token: float
    peak_flops: float
    hbm_bandwidth: float
    head_flops_per_logit: float = 0.0
    activation_bytes_per_token: float = 0.0
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("linear_flops_per_token", "attention_flops_per_key", "weight_bytes",
                     "kv_bytes_per_token", "head_flops_per_logit",
                     "activation_bytes_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"stage.{name}: must be a finite number >= 0, got {v!r}")
        for name in ("peak_flops", "hbm_bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"stage.{name}: must be > 0, got {v!r}")
        lim = self.memory_limit
        if lim is not None and not (isinstance(lim, int | float) and lim >= self.weight_bytes):
            raise ValueError(f"stage.memory_limit: must be >= the weights "
                             f"({self.weight_bytes:g} bytes) or None, got {lim!r}")

    def flops(self, it: Iteration) -> float:
        """FLOPs of iteration ``it`` on this stage: linear per token, attention per
        (query, key) pair (a chunk of c tokens after p cached ones: c p + c^2 / 2 pairs, the
        causal count of :func:`pipeopt.costs.transformer.block_flops`; a decode: its context),
        the head per logit (a prefill's last chunk and every decode)."""
        return (self.linear_flops_per_token * it.tokens
                + self.attention_flops_per_key * it.attention_keys
                + self.head_flops_per_logit * it.logits)

    def bytes_read(self, it: Iteration) -> float:
        """Bytes iteration ``it`` moves through HBM on this stage: the weights once, and the KV
        entries its tokens attend to (a chunk: the cached prefix and itself; a decode: its
        context)."""
        return self.weight_bytes + self.kv_bytes_per_token * it.kv_read_tokens

    def time(self, it: Iteration) -> float:
        """Seconds: ``max(flops / peak_flops, bytes_read / hbm_bandwidth)`` (the roofline:
        Williams, Waterman, Patterson, "Roofline", CACM 2009)."""
        return max(self.flops(it) / self.peak_flops, self.bytes_read(it) / self.hbm_bandwidth)


def capacity_tokens(stages: Sequence[StageModel]) -> float:
    """KV tokens every stage holds beside its weights (the smallest over the stages; inf
    without memory limits or KV)."""
    return min(math.inf if m.memory_limit is None or m.kv_bytes_per_token == 0
               else (m.memory_limit - m.weight_bytes) / m.kv_bytes_per_token for m in stages)


# ----- plans ---------------------------------------------------------------------------------
class Chunk(NamedTuple):
    """``tokens`` prompt tokens of request ``request`` after ``cached`` already in its KV."""

    request: int
    cached: int
    tokens: int


class Decode(NamedTuple):
    """One decode step of request ``request`` whose token attends to ``context`` keys (its own
    included: prompt + tokens generated before it)."""

    request: int
    context: int


@dataclass(frozen=True)
class Iteration:
    """One forward pass through every stage: ``chunks`` of prefill and ``decodes``.

    ``group``: the micro-batch (slot) it belongs to, for labels and hand-made orders. The
    totals the stage models read (``tokens``, ``attention_keys``, ``kv_read_tokens``,
    ``logits``) are derived once, when it is made."""

    group: int
    chunks: tuple[Chunk, ...] = ()
    decodes: tuple[Decode, ...] = ()
    #: Requests whose prefill ends here (their first token comes out of this iteration).
    first_tokens: tuple[int, ...] = ()
    #: Requests that end here (their last token comes out of this iteration).
    finished: tuple[int, ...] = ()
    #: Tokens through the stage: chunk tokens plus one per decode (= KV entries written).
    tokens: int = field(init=False, compare=False)
    #: (query, key) pairs of attention, causal: c p + c^2 / 2 per chunk, context per decode.
    attention_keys: float = field(init=False, compare=False)
    #: KV entries read: cached + new per chunk, context per decode.
    kv_read_tokens: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "chunks", tuple(self.chunks))
        set_(self, "decodes", tuple(self.decodes))
        set_(self, "first_tokens", tuple(self.first_tokens))
        set_(self, "finished", tuple(self.finished))
        ctx = sum(d.context for d in self.decodes)
        set_(self, "tokens", sum(c.tokens for c in self.chunks) + len(self.decodes))
        set_(self, "attention_keys", sum(c.tokens * c.cached + c.tokens * c.tokens / 2
                                         for c in self.chunks) + ctx)
        set_(self, "kv_read_tokens", sum(c.cached + c.tokens for c in self.chunks) + ctx)

    @property
    def logits(self) -> int:
        """Tokens whose logits the head computes: one per first token and per decode."""
        return len(self.first_tokens) + len(self.decodes)

    @property
    def kv_written(self) -> int:
        """KV entries this iteration adds: every token it feeds."""
        return self.tokens


@dataclass(frozen=True)
class Plan:
    """Requests and the iterations that serve them, in their hand-made order; ``policy``
    names how it was made."""

    requests: tuple[Request, ...]
    iterations: tuple[Iteration, ...]
    policy: str = "custom"
    #: Per request, the iteration indices it appears in (derived).
    request_iterations: tuple[tuple[int, ...], ...] = field(init=False, repr=False,
                                                            compare=False)

    def __post_init__(self) -> None:
        reqs = check_requests(self.requests)
        object.__setattr__(self, "requests", reqs)
        object.__setattr__(self, "iterations", tuple(self.iterations))
        seen: list[list[int]] = [[] for _ in reqs]
        prefilled = [0] * len(reqs)
        generated = [0] * len(reqs)
        for b, it in enumerate(self.iterations):
            for c in it.chunks:
                r = self._req(b, c.request)
                if c.cached != prefilled[r] or c.tokens < 1 or generated[r]:
                    raise ValueError(f"iterations[{b}]: chunk of request {r} at {c.cached} "
                                     f"(+{c.tokens}) does not continue its prefill at "
                                     f"{prefilled[r]}")
                prefilled[r] += c.tokens
                if prefilled[r] > reqs[r].prompt:
                    raise ValueError(f"iterations[{b}]: request {r} prefills past its prompt "
                                     f"of {reqs[r].prompt}")
                seen[r].append(b)
            for r in it.first_tokens:
                if prefilled[self._req(b, r)] != reqs[r].prompt or generated[r]:
                    raise ValueError(f"iterations[{b}]: request {r} cannot yield its first "
                                     f"token here")
                generated[r] = 1
            for d in it.decodes:
                r = self._req(b, d.request)
                if not generated[r] or generated[r] >= reqs[r].output or (
                        d.context != reqs[r].prompt + generated[r]) or (seen[r] and
                                                                        seen[r][-1] == b):
                    raise ValueError(f"iterations[{b}]: decode of request {r} (context "
                                     f"{d.context}) out of turn")
                generated[r] += 1
                seen[r].append(b)
            for r in it.finished:
                if generated[self._req(b, r)] != reqs[r].output or seen[r][-1] != b:
                    raise ValueError(f"iterations[{b}]: request {r} does not end here")
        for r, g in enumerate(generated):
            if g != reqs[r].output:
                raise ValueError(f"plan: request {r} yields {g} of its {reqs[r].output} tokens")
        ends = sorted(r for it in self.iterations for r in it.finished)
        if ends != list(range(len(reqs))):
            raise ValueError("plan: every request must end (be in `finished`) exactly once")
        object.__setattr__(self, "request_iterations", tuple(map(tuple, seen)))

    def _req(self, b: int, r: int) -> int:
        if not 0 <= r < len(self.requests):
            raise ValueError(f"iterations[{b}]: request {r} is not 0..{len(self.requests) - 1}")
        return r

    @property
    def output_tokens(self) -> int:
        """Tokens generated in all."""
        return sum(r.output for r in self.requests)


class _State:
    """Progress of one request while a policy forms iterations."""

    __slots__ = ("generated", "prefilled", "request")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.prefilled = 0
        self.generated = 0


@dataclass(frozen=True)
class Timing:
    """What a policy needs to know when its iterations start, for requests that arrive over
    time: the stage models and the links between stages (latency s, bandwidth bytes/s: one
    value for every hop, or one per hop), as :func:`build` is given them."""

    stages: tuple[StageModel, ...]
    latency: float | Sequence[float] = 0.0
    bandwidth: float | Sequence[float] = math.inf


class _Clock:
    """The plan's own order timed as it is formed (what :func:`build` + the core simulator
    give when links do not queue messages): per stage the end of its last iteration, per
    request when its next iteration may start on the first stage, and a floor (s) no later
    iteration starts before (raised to the next arrival when nothing can run)."""

    def __init__(self, timing: Timing, requests: Sequence[Request]) -> None:
        self.timing = timing
        s = len(timing.stages)
        self.latency = hops(timing.latency, s, "latency")
        self.bandwidth = hops(timing.bandwidth, s, "bandwidth")
        self.free = [0.0] * len(timing.stages)
        self.ready = [r.arrival for r in requests]
        self.floor = 0.0

    def now(self, live: Sequence[int]) -> float:
        """When an iteration of the requests ``live`` (and any just arriving) would start."""
        return max(self.free[0], self.floor, *(self.ready[r] for r in live))

    def run(self, it: Iteration) -> None:
        """Time ``it`` after the iterations before it, stage by stage."""
        t = self.timing
        members = [c.request for c in it.chunks] + [d.request for d in it.decodes]
        arrive = self.now(members)
        for k, m in enumerate(t.stages):
            start = max(self.free[k], arrive)
            self.free[k] = start + m.time(it)
            arrive = self.free[k] + self.latency[k] + (
                it.tokens * m.activation_bytes_per_token / self.bandwidth[k])
        for r in (*it.first_tokens, *(d.request for d in it.decodes)):
            self.ready[r] = self.free[-1] + self.latency[-1]
        for c in it.chunks:  # a further chunk follows stage by stage (free[k] says when)
            self.ready[c.request] = max(self.ready[c.request], self.free[0])


class _Former:
    """Shared bookkeeping of the policies: KV reservations against the stages' capacity (a
    request reserves ``prompt + output - 1`` entries when admitted, so the plan's own order
    never passes a stage's memory), the iterations formed so far, and, when requests arrive
    over time, the clock that keeps a request out of iterations that start before it
    arrives (``timing`` is then required)."""

    def __init__(self, requests: Sequence[Request], capacity_tokens: float,
                 timing: Timing | None = None) -> None:
        self.requests = check_requests(requests)
        self.state = [_State(r) for r in self.requests]
        self.capacity = capacity_tokens
        self.reserved = 0
        self.iterations: list[Iteration] = []
        for i, r in enumerate(self.requests):
            if r.kv_tokens > capacity_tokens:
                raise ValueError(f"requests[{i}]: needs {r.kv_tokens} KV tokens, more than a "
                                 f"stage holds ({capacity_tokens:g})")
        self.clock: _Clock | None = None
        if any(r.arrival for r in self.requests):
            if timing is None:
                raise ValueError("timing: requests arrive over time (arrival > 0); the "
                                 "policy needs the stage models to know when they may join")
            self.clock = _Clock(timing, self.requests)

    def fits(self, r: int) -> bool:
        return self.reserved + self.requests[r].kv_tokens <= self.capacity

    def arrived(self, queue: Sequence[int], now: float) -> int | None:
        """Index in ``queue`` of its first request arrived by ``now`` s (None: none has)."""
        if self.clock is None:
            return 0 if queue else None
        reqs = self.requests
        return next((i for i, r in enumerate(queue) if reqs[r].arrival <= now), None)

    def now(self, live: Sequence[int]) -> float:
        """When the next iteration over ``live`` would start (0 without a clock)."""
        return 0.0 if self.clock is None else self.clock.now(live)

    def wait(self, queue: Sequence[int]) -> bool:
        """Nothing could run: move the clock's floor to the next arrival in ``queue`` after
        it; False when there is none (the policy is stuck for another reason)."""
        if self.clock is None:
            return False
        later = [self.requests[r].arrival for r in queue
                 if self.requests[r].arrival > self.clock.floor]
        if not later:
            return False
        self.clock.floor = min(later)
        return True

    def admit(self, r: int) -> None:
        self.reserved += self.requests[r].kv_tokens

    def iterate(self, group: int, live: list[int], budget: float, chunked: bool,
                queue: list[int] | None, *, decode: bool = True, prefill: bool = True
                ) -> bool:
        """Form one iteration of ``group`` over its ``live`` requests, admitting new ones from
        the front of ``queue`` (moved into ``live``) while the token budget and the KV capacity
        allow; returns whether anything ran. Finished requests leave ``live``."""
        st = self.state
        decodes = [Decode(r, st[r].request.prompt + st[r].generated) for r in live
                   if decode and st[r].generated and st[r].generated < st[r].request.output]
        left = budget - len(decodes)
        chunks: list[Chunk] = []
        firsts: list[int] = []

        def take(r: int) -> bool:
            nonlocal left
            rest = st[r].request.prompt - st[r].prefilled
            n = min(rest, int(left)) if chunked and left < rest else rest
            if n < 1 or (not chunked and n > left and (chunks or decodes)):
                return False
            chunks.append(Chunk(r, st[r].prefilled, n))
            left -= n
            return True

        if prefill:
            for r in live:
                if st[r].prefilled < st[r].request.prompt and not take(r):
                    break
            now = self.now(live)
            while queue and left >= 1:
                i = self.arrived(queue, now)
                if i is None or not self.fits(queue[i]) or not take(queue[i]):
                    break
                self.admit(queue[i])
                live.append(queue.pop(i))
        if not chunks and not decodes:
            return False
        for c in chunks:
            s = st[c.request]
            s.prefilled += c.tokens
            if s.prefilled == s.request.prompt:
                s.generated = 1
                firsts.append(c.request)
        for d in decodes:
            st[d.request].generated += 1
        done = [r for r in (*firsts, *(d.request for d in decodes))
                if st[r].generated == st[r].request.output]
        for r in done:
            live.remove(r)
            self.reserved -= st[r].request.kv_tokens
        it = Iteration(group, tuple(chunks), tuple(decodes), tuple(firsts), tuple(done))
        self.iterations.append(it)
        if self.clock is not None:
            self.clock.run(it)
        return True

    def stuck(self) -> ValueError:
        waiting = [i for i, s in enumerate(self.state) if s.generated < s.request.output]
        return ValueError(f"plan: no iteration can run; waiting requests {waiting[:5]}: the "
                          f"token budget or the KV capacity is too small")


def _check_policy(groups: int, budget: float) -> None:
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"policy.microbatches: must be an integer >= 1, got {groups!r}")
    if not budget >= 1:
        raise ValueError(f"policy.token_budget: must be >= 1 token, got {budget!r}")


def _assign(requests: Sequence[Request], order: Sequence[int] | None,
            groups: int, assignment: Sequence[int] | None) -> list[list[int]]:
    """Per group, its queue of request ids (``assignment[i]``: request i's group), or one
    shared queue (``[[...]]``) when ``assignment`` is None; ``order``: admission order
    (default: by arrival, ties as given)."""
    n = len(requests)
    seq = (sorted(range(n), key=lambda i: requests[i].arrival) if order is None
           else list(order))
    if sorted(seq) != list(range(n)):
        raise ValueError(f"policy.order: must be a permutation of 0..{n - 1}")
    if assignment is None:
        return [seq]
    if len(assignment) != n or not all(isinstance(g, int) and 0 <= g < groups
                                       for g in assignment):
        raise ValueError(f"policy.assignment: expected {n} group ids in 0..{groups - 1}")
    queues: list[list[int]] = [[] for _ in range(groups)]
    for r in seq:
        queues[assignment[r]].append(r)
    return queues


def continuous_plan(requests: Sequence[Request], microbatches: int, token_budget: float,
                    capacity_tokens: float = math.inf, *, chunked: bool = False,
                    order: Sequence[int] | None = None,
                    assignment: Sequence[int] | None = None,
                    policy: str = "continuous", timing: Timing | None = None) -> Plan:
    """Continuous batching over ``microbatches`` groups taking turns (round-robin, as vLLM's
    pipeline-parallel engines do): each turn, a group decodes all its live requests (decodes
    are never held back) and admits new ones from the queue while its ``token_budget`` (tokens
    per iteration, decodes included) and the KV ``capacity_tokens`` (the smallest over the
    stages) allow; a request leaves once done.

    ``order``: the admission order among the requests that have arrived (default: by
    arrival). ``assignment``: a fixed group per request (length-aware packing); None = a shared
    queue, each request joining whichever group takes its turn when it comes up. ``chunked``:
    a prompt may be split over iterations to fill the budget (chunked prefill); without it a
    prompt larger than the budget runs alone. ``timing``: required when some request arrives
    after 0; a request joins only an iteration that starts (by the plan's own timing) once it
    has arrived, and a group with nothing to run skips its turn."""
    _check_policy(microbatches, token_budget)
    f = _Former(requests, capacity_tokens, timing)
    queues = _assign(f.requests, order, microbatches, assignment)
    live: list[list[int]] = [[] for _ in range(microbatches)]
    remaining = len(f.requests)
    while remaining:
        ran = False
        for g in range(microbatches):
            q = queues[0] if assignment is None else queues[g]
            before = len(f.iterations)
            ran |= f.iterate(g, live[g], token_budget, chunked, q)
            if len(f.iterations) > before:
                remaining -= len(f.iterations[-1].finished)
        if not ran and not f.wait([r for q in queues for r in q]):
            raise f.stuck()
    return Plan(f.requests, tuple(f.iterations), policy)


def static_plan(requests: Sequence[Request], microbatches: int, batch_size: int,
                capacity_tokens: float = math.inf, *, order: Sequence[int] | None = None,
                policy: str = "static", timing: Timing | None = None) -> Plan:
    """Fixed micro-batches: the requests, in ``order``, cut into batches of ``batch_size``;
    ``microbatches`` groups take turns, each prefilling a whole batch in one iteration and
    decoding it until its last request ends (requests that end early leave it), then taking the
    next batch. No request joins a running batch. When requests arrive over time (``timing``
    required), a group that is free takes the first ``batch_size`` requests in ``order`` that
    have arrived by its iteration's start."""
    _check_policy(microbatches, 1)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"policy.batch_size: must be an integer >= 1, got {batch_size!r}")
    f = _Former(requests, capacity_tokens, timing)
    seq = _assign(f.requests, order, microbatches, None)[0]
    live: list[list[int]] = [[] for _ in range(microbatches)]
    while seq or any(live):
        ran = False
        for g in range(microbatches):
            if not live[g] and seq:
                now = f.now(())
                nxt = [r for r in seq if f.requests[r].arrival <= now][:batch_size]
                if not nxt or (f.reserved + sum(f.requests[r].kv_tokens for r in nxt)
                               > f.capacity):
                    continue
                for r in nxt:
                    seq.remove(r)
                ran |= f.iterate(g, live[g], math.inf, False, nxt)
                continue
            ran |= f.iterate(g, live[g], math.inf, False, None)
        if not ran and not f.wait(seq):
            raise f.stuck()
    return Plan(f.requests, tuple(f.iterations), policy)


def separated_plan(requests: Sequence[Request], microbatches: int, token_budget: float,
                   capacity_tokens: float = math.inf, *, order: Sequence[int] | None = None,
                   refill_fraction: float = 0.5, policy: str = "separated",
                   timing: Timing | None = None) -> Plan:
    """Prefill and decode separated in time (after TD-Pipe, Zhang et al. 2025): a prefill
    phase admits requests in ``order`` while the KV capacity allows and prefills them in
    iterations of at most ``token_budget`` tokens (independent of each other, so they stream
    through the pipeline); a decode phase spreads them over ``microbatches`` groups (each to
    the group with the fewest live requests) that take turns, until the next request in line
    fits the freed KV and at most ``refill_fraction`` of the phase's requests are still live
    (0: decode until all end), then the next prefill phase. Prefill iterations carry group
    number ``microbatches`` (one past the decode groups). ``refill_fraction`` is this
    policy's knob, not a figure from the paper (TD-Pipe decides by comparing the two phases'
    compute intensity). When requests arrive over time (``timing`` required), a prefill phase
    admits only those that have arrived."""
    _check_policy(microbatches, token_budget)
    if not 0 <= refill_fraction <= 1:
        raise ValueError(f"policy.refill_fraction: must be in [0, 1], got {refill_fraction!r}")
    f = _Former(requests, capacity_tokens, timing)
    queue = _assign(f.requests, order, microbatches, None)[0]
    groups: list[list[int]] = [[] for _ in range(microbatches)]
    while queue or any(groups):
        admitted: list[int] = []
        while queue:
            if not f.iterate(microbatches, [], token_budget, False, queue, decode=False):
                break
            admitted.extend(r for r in f.iterations[-1].first_tokens
                            if r not in f.iterations[-1].finished)
        if not admitted and not any(groups) and queue:
            if f.wait(queue):
                continue
            raise f.stuck()
        for r in admitted:
            min(groups, key=len).append(r)
        phase = sum(map(len, groups))
        while any(groups):
            for g in range(microbatches):
                f.iterate(g, groups[g], math.inf, False, None, prefill=False)
            nxt = f.arrived(queue, f.now(()))
            if nxt is not None and f.fits(queue[nxt]) and (
                    sum(map(len, groups)) <= refill_fraction * phase):
                break
    return Plan(f.requests, tuple(f.iterations), policy)


# ----- the graph -----------------------------------------------------------------------------
def task_id(stages: int, iteration: int, stage: int) -> int:
    """The task of ``iteration`` on ``stage`` in :func:`build`'s graph of ``stages`` stages."""
    return iteration * stages + stage


def plan_orders(plan: Plan, stages: int) -> list[list[int]]:
    """Per device, its tasks in the plan's iteration order (the hand-made order)."""
    n = len(plan.iterations)
    return [[b * stages + k for b in range(n)] for k in range(stages)]


#: The task group of the arrival clock's tasks (a wait, not a collective, on its own row).
ARRIVAL_GROUP = "request arrival"
#: Request ids a task label lists per kind (prefill, decode) before it says how many more.
LABEL_IDS = 3


def _ids(rs: Sequence[int]) -> str:
    shown = ",".join(map(str, rs[:LABEL_IDS]))
    return shown + (f"+{len(rs) - LABEL_IDS}" if len(rs) > LABEL_IDS else "")


def iteration_label(b: int, it: Iteration) -> tuple[str, str]:
    """The two parts of the label of iteration ``b``'s task on a stage, around the stage:
    ``("i12 g1", " P3,7 D0,1,2+5")`` (prefill requests ``P``, decoding ones ``D``, at most
    :data:`LABEL_IDS` ids each, then how many more)."""
    tail = ""
    if it.chunks:
        tail += " P" + _ids([c.request for c in it.chunks])
    if it.decodes:
        tail += " D" + _ids([d.request for d in it.decodes])
    return f"i{b} g{it.group}", tail


def iteration_kind(it: Iteration) -> str:
    """The group plots and traces colour an iteration by: ``prefill``, ``decode`` or
    ``prefill+decode``."""
    if it.chunks and it.decodes:
        return "prefill+decode"
    return "prefill" if it.chunks else "decode"


def plan_meta(plan: Plan) -> dict[str, object]:
    """``plan`` as JSON-ready data (the ``plan`` entry of :func:`build`'s graph meta, written
    in schedule JSON v2's ``graph.meta``): ``policy``; ``requests``: columns ``prompt``,
    ``output`` (tokens), ``arrival`` (s); ``iterations``: columns ``group``, ``prefill`` (per
    iteration, its chunks as ``[request, cached, tokens]``) and ``decode`` (``[request,
    context]``). :func:`plan_from_meta` reads it back."""
    reqs, its = plan.requests, plan.iterations
    return {
        "policy": plan.policy,
        "requests": {"prompt": tuple(r.prompt for r in reqs),
                     "output": tuple(r.output for r in reqs),
                     "arrival": tuple(r.arrival for r in reqs)},
        "iterations": {"group": tuple(it.group for it in its),
                       "prefill": tuple(it.chunks for it in its),  # Chunk: a 3-tuple
                       "decode": tuple(it.decodes for it in its)},  # Decode: a 2-tuple
    }


def _meta_ints(value: object, where: str, n: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) != n or not all(
            type(x) is int for x in value):
        raise ValueError(f"{where}: expected a list of {n} integers")
    return tuple(value)  # type: ignore[arg-type]


def plan_from_meta(meta: Mapping[str, object]) -> Plan:
    """The :class:`Plan` of :func:`plan_meta`'s data (lists or tuples, mappings); the first
    tokens and the ends are derived (a chunk that completes its prompt yields the first
    token; a request ends when it has yielded ``output`` tokens). ValueError naming the
    field (``plan.iterations.prefill[3]: ...``) for anything malformed."""
    if not isinstance(meta, Mapping):
        raise ValueError("plan: expected a mapping")
    reqs, its = meta.get("requests"), meta.get("iterations")
    if not isinstance(reqs, Mapping) or not isinstance(its, Mapping):
        raise ValueError("plan: expected the mappings requests and iterations")
    prompt = reqs.get("prompt")
    n = len(prompt) if isinstance(prompt, list | tuple) else -1
    prompt = _meta_ints(prompt, "plan.requests.prompt", n)
    output = _meta_ints(reqs.get("output"), "plan.requests.output", n)
    arrival = reqs.get("arrival", (0.0,) * n)
    if not isinstance(arrival, list | tuple) or len(arrival) != n or not all(
            type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in arrival):
        raise ValueError(f"plan.requests.arrival: expected {n} numbers >= 0 (s)")
    try:
        requests = tuple(Request(p, o, float(a))
                         for p, o, a in zip(prompt, output, arrival, strict=True))
    except ValueError as exc:
        raise ValueError(f"plan.requests: {exc}") from None
    group = its.get("group")
    m = len(group) if isinstance(group, list | tuple) else -1
    group = _meta_ints(group, "plan.iterations.group", m)
    columns = {}
    for key, width in (("prefill", 3), ("decode", 2)):
        col = its.get(key)
        if not isinstance(col, list | tuple) or len(col) != m:
            raise ValueError(f"plan.iterations.{key}: expected a list per iteration ({m})")
        for b, entries in enumerate(col):
            if not isinstance(entries, list | tuple) or not all(
                    isinstance(e, list | tuple) and len(e) == width
                    and all(type(x) is int for x in e) for e in entries):
                raise ValueError(f"plan.iterations.{key}[{b}]: expected a list of "
                                 f"{width}-integer lists")
        columns[key] = col
    generated = [0] * n
    iterations = []
    for b in range(m):
        chunks = tuple(Chunk(*e) for e in columns["prefill"][b])
        decodes = tuple(Decode(*e) for e in columns["decode"][b])
        for r in (*(c.request for c in chunks), *(d.request for d in decodes)):
            if not 0 <= r < n:
                raise ValueError(f"plan.iterations[{b}]: request {r} is not 0..{n - 1}")
        firsts = tuple(c.request for c in chunks if c.cached + c.tokens == prompt[c.request])
        for r in (*firsts, *(d.request for d in decodes)):
            generated[r] += 1
        done = tuple(r for r in (*firsts, *(d.request for d in decodes))
                     if generated[r] == output[r])
        iterations.append(Iteration(group[b], chunks, decodes, firsts, done))
    policy = meta.get("policy", "custom")
    try:
        return Plan(requests, tuple(iterations), policy if isinstance(policy, str) else "custom")
    except ValueError as exc:  # Plan's own rules, named under plan.
        text = str(exc)
        raise ValueError(text if text.startswith("plan:") else f"plan.{text}") from None


def arrival_times(plan: Plan) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """The distinct arrival times after 0 (s), ascending, each with the requests arriving
    then: the tasks of :func:`build`'s arrival clock, in order."""
    at: dict[float, list[int]] = {}
    for r, req in enumerate(plan.requests):
        if req.arrival > 0:
            at.setdefault(req.arrival, []).append(r)
    return tuple((t, tuple(at[t])) for t in sorted(at))


def arrival_task_count(plan: Plan) -> int:
    """Tasks of :func:`build`'s arrival clock: one per distinct arrival time after 0."""
    return len({r.arrival for r in plan.requests if r.arrival > 0})


def serving_plan(graph: TaskGraph) -> Plan | None:
    """The plan recorded in ``graph``'s meta by :func:`build` (None when the graph is not a
    serving plan's); ValueError when the record is malformed or does not match the graph
    (iterations x devices tasks)."""
    meta = dict(graph.meta)
    if meta.get("workload") != "inference" or "plan" not in meta:
        return None
    plan = plan_from_meta(meta["plan"])  # type: ignore[arg-type]
    if len(plan.iterations) * graph.devices != graph.num_tasks - arrival_task_count(plan):
        raise ValueError(f"plan: {len(plan.iterations)} iterations on {graph.devices} stages "
                         f"do not match the graph's {graph.num_tasks} tasks")
    return plan


def serving_metrics(schedule: GraphSchedule) -> Metrics | None:
    """:func:`metrics` of a schedule of a :func:`build` graph, read from the plan its meta
    records (None for any other graph)."""
    plan = serving_plan(schedule.graph)
    return None if plan is None else metrics(plan, schedule)


def hops(value: float | Sequence[float], stages: int, name: str) -> tuple[float, ...]:
    """Per hop (stage k to k + 1, then the last stage back to the first: ``stages`` values),
    ``value`` (one number for every hop, or one per hop); ValueError naming ``name``."""
    vals = (value,) * stages if isinstance(value, int | float) else tuple(value)
    if len(vals) != stages:
        raise ValueError(f"{name}: expected one value or {stages} (one per hop), got "
                         f"{len(vals)}")
    for k, v in enumerate(vals):
        ok = (v >= 0 and math.isfinite(v)) if name == "latency" else v > 0
        if not ok:
            rule = "a finite number >= 0 s" if name == "latency" else "> 0 bytes/s"
            raise ValueError(f"{name}[{k}]: must be {rule}, got {v!r}")
    return vals


def build(plan: Plan, stages: Sequence[StageModel], *, latency: float | Sequence[float] = 0.0,
          bandwidth: float | Sequence[float] = math.inf) -> TaskGraph:
    """The task graph of ``plan`` on one device per stage (see the module docstring).

    ``latency`` (s) and ``bandwidth`` (bytes/s) of the links between consecutive stages and
    from the last stage back to the first (the sampled token)."""
    models = tuple(stages)
    s = len(models)
    if s < 1:
        raise ValueError("stages: need at least one stage")
    for k, m in enumerate(models):
        if not isinstance(m, StageModel):
            raise ValueError(f"stages[{k}]: expected a StageModel, got {m!r}")
    if isinstance(latency, int | float) and not (latency >= 0 and math.isfinite(latency)):
        raise ValueError(f"latency: must be a finite number >= 0 s, got {latency!r}")
    if isinstance(bandwidth, int | float) and not bandwidth > 0:
        raise ValueError(f"bandwidth: must be > 0 bytes/s, got {bandwidth!r}")
    lat, bw = hops(latency, s, "latency"), hops(bandwidth, s, "bandwidth")
    reqs = plan.requests
    device: list[int] = []
    duration: list[float] = []
    mem_start: list[float] = []
    mem_end: list[float] = []
    label: list[str] = []
    group: list[str] = []
    src: list[int] = []
    dst: list[int] = []
    size: list[float] = []
    last_of: dict[int, tuple[int, bool]] = {}  # request -> (last iteration, yielded a token)
    for b, it in enumerate(plan.iterations):
        written = it.kv_written
        freed = sum(reqs[r].kv_tokens for r in it.finished)
        tokens = it.tokens
        name = iteration_label(b, it)
        kind = iteration_kind(it)
        for k, m in enumerate(models):
            device.append(k)
            duration.append(m.time(it))
            mem_start.append(written * m.kv_bytes_per_token)
            mem_end.append(-freed * m.kv_bytes_per_token)
            label.append(f"{name[0]} s{k}{name[1]}")
            group.append(kind)
            if k:
                src.append(b * s + k - 1)
                dst.append(b * s + k)
                size.append(tokens * models[k - 1].activation_bytes_per_token)
        after_token: set[int] = set()  # iterations whose sampled token this one feeds
        after_chunk: set[int] = set()  # iterations whose KV this one extends, stage by stage
        for r in (*(c.request for c in it.chunks), *(d.request for d in it.decodes)):
            if r in last_of:
                a, token = last_of[r]
                (after_token if token else after_chunk).add(a)
        for a in sorted(after_chunk - after_token):
            for k in range(s):  # on each stage's own device: no message
                src.append(a * s + k)
                dst.append(b * s + k)
                size.append(0.0)
        for a in sorted(after_token):
            src.append(a * s + s - 1)
            dst.append(b * s)
            size.append(0.0)  # a token id: latency only
        firsts = set(it.first_tokens)
        for c in it.chunks:
            last_of[c.request] = (b, c.request in firsts)
        for d in it.decodes:
            last_of[d.request] = (b, True)
    pairs = [(k, k + 1) for k in range(s - 1)]
    if s > 1:
        pairs.append((s - 1, 0))
    network: dict[str, object] = {}
    times = arrival_times(plan)
    if times:  # the arrival clock: a chain of waits on a resource of its own
        base = len(device)
        first = {r: its[0] for r, its in enumerate(plan.request_iterations)}
        prev = 0.0
        for j, (t, rs) in enumerate(times):
            device.append(-1)
            duration.append(t - prev)
            mem_start.append(0.0)
            mem_end.append(0.0)
            label.append(f"arrive r{_ids(rs)}")
            group.append(ARRIVAL_GROUP)
            prev = t
            if j:
                src.append(base + j - 1)
                dst.append(base + j)
                size.append(0.0)
            for b in sorted({first[r] for r in rs}):
                src.append(base + j)
                dst.append(b * s)
                size.append(0.0)
        network = {"networks": ("arrivals",),
                   "holds": ((),) * base + ((len(pairs),),) * len(times)}
    return TaskGraph(
        memory_limit=tuple(m.memory_limit for m in models),
        static_memory=tuple(m.weight_bytes for m in models),
        link_src=tuple(a for a, _ in pairs), link_dst=tuple(b for _, b in pairs),
        latency=lat[:len(pairs)], bandwidth=bw[:len(pairs)],
        device=tuple(device), duration=tuple(duration), mem_start=tuple(mem_start),
        mem_end=tuple(mem_end), label=tuple(label), src=tuple(src), dst=tuple(dst),
        bytes=tuple(size), meta=(("workload", "inference"), ("policy", plan.policy),
                                 ("task_group", tuple(group)), ("plan", plan_meta(plan))),
        **network)  # type: ignore[arg-type]


# ----- metrics -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metrics:
    """Serving figures of a timed plan (seconds; tokens/s).

    ``throughput_tokens_per_s``: output tokens / makespan; ``ttft_*``: time to first token (the
    end of the last stage of the iteration that yields it, less the request's arrival), p50 / p99 by
    linear interpolation between order statistics (numpy's default); ``tpot_s``: time per
    output token after the first, ``(last - first) / (output - 1)``, averaged over requests
    with output > 1 (0 when there is none); ``makespan_s``."""

    throughput_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_s: float
    makespan_s: float
    ttft_s: tuple[float, ...] = field(repr=False)

    def as_dict(self) -> dict[str, float]:
        """The headline figures (the schedule JSON's ``metrics`` keys)."""
        return {"throughput_tokens_per_s": self.throughput_tokens_per_s,
                "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s,
                "tpot_s": self.tpot_s, "makespan_s": self.makespan_s}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile: no values")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def metrics(plan: Plan, schedule: GraphSchedule) -> Metrics:
    """Throughput, TTFT and TPOT of ``schedule``, a timed :func:`build` graph of ``plan``."""
    g = schedule.graph
    s = g.devices
    if g.num_tasks != len(plan.iterations) * s + arrival_task_count(plan):
        raise ValueError(f"schedule: {g.num_tasks} tasks, the plan has "
                         f"{len(plan.iterations)} iterations x {s} stages")
    first = [math.nan] * len(plan.requests)
    last = [math.nan] * len(plan.requests)
    for b, it in enumerate(plan.iterations):
        t = schedule.end[b * s + s - 1]
        for r in it.first_tokens:
            first[r] = t - plan.requests[r].arrival
        for r in it.finished:
            last[r] = t
    makespan = schedule.makespan
    tpots = [(b - a - r.arrival) / (r.output - 1) for a, b, r in zip(first, last, plan.requests,
                                                                     strict=True)
             if r.output > 1]
    return Metrics(
        throughput_tokens_per_s=plan.output_tokens / makespan if makespan > 0 else math.inf,
        ttft_p50_s=percentile(first, 50), ttft_p99_s=percentile(first, 99),
        tpot_s=sum(tpots) / len(tpots) if tpots else 0.0, makespan_s=makespan,
        ttft_s=tuple(first))
