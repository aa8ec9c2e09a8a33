"""Serving a batch of requests on a pipeline: hand-made baselines, the plan search, a bound.

Every method makes a :class:`~pipeopt.workloads.inference.Plan`, builds its task graph and
times it with the core (the plan's own order through :func:`pipeopt.core.simulate.simulate`,
or the core greedy / CP-SAT choosing the order on each device), so one simulator judges them
all. Times in seconds, throughput in output tokens per second.

* :func:`round_robin`: vLLM-like: ``stages`` micro-batch groups take turns, continuous
  batching under a token budget, first come first served, a shared queue.
* :func:`separated`: prefill and decode separated in time (TD-Pipe-like).
* :func:`search`: which requests go into which group and in what order (first come first
  served, longest output first, balanced packing of the output tokens over the groups), the
  token budget, chunked prefill or not, and the order on each device (the plan's, the core
  greedy's, or the core CP-SAT's on the best plan); the candidate with the highest
  throughput whose p99 TTFT meets the limit wins.
* :func:`throughput_bound`: an upper bound on the throughput of any plan and order.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeopt.core.greedy import Stuck, solve_greedy
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import simulate
from pipeopt.workloads.inference import (
    Chunk,
    Decode,
    Iteration,
    Metrics,
    Plan,
    Request,
    StageModel,
    Timing,
    build,
    capacity_tokens,
    check_requests,
    continuous_plan,
    metrics,
    plan_orders,
    separated_plan,
)


@dataclass(frozen=True)
class Link:
    """The links between consecutive stages (and back from the last to the first): one value
    for every hop, or one per hop (stage k to k + 1, then the last back to the first)."""

    latency: float | tuple[float, ...] = 0.0  # s
    bandwidth: float | tuple[float, ...] = math.inf  # bytes/s


@dataclass(frozen=True, eq=False)
class Served:
    """A timed plan: ``method`` names the policy and the order (``plan`` or ``greedy``)."""

    method: str
    plan: Plan
    schedule: GraphSchedule
    metrics: Metrics

    def meets(self, ttft_limit: float | None) -> bool:
        """Whether the p99 TTFT is within ``ttft_limit`` s (None: no limit)."""
        return ttft_limit is None or self.metrics.ttft_p99_s <= ttft_limit * (1 + 1e-12)


def time_plan(plan: Plan, stages: Sequence[StageModel], link: Link = Link(), *,
              order: str = "plan", method: str | None = None,
              time_limit: float = 10.0, initial: GraphSchedule | None = None) -> Served:
    """Build ``plan``'s graph and time it: ``order`` ``plan`` (each device runs the iterations
    in the plan's order), ``greedy`` (the core list scheduler picks) or ``cpsat`` (the core
    CP-SAT search, for small plans; ``time_limit`` s; ``initial``: a schedule of this plan's
    graph, e.g. another order's, that hints it)."""
    graph = build(plan, stages, latency=link.latency, bandwidth=link.bandwidth)
    if order == "plan":
        sched = simulate(graph, plan_orders(plan, len(stages)), check=False)
    elif order == "greedy":
        sched = solve_greedy(graph)
    elif order == "cpsat":
        from pipeopt.core.cpsat import solve_cpsat

        sched = solve_cpsat(graph, time_limit=time_limit, workers=1, seed=0, initial=initial)
    else:
        raise ValueError(f"order: expected 'plan', 'greedy' or 'cpsat', got {order!r}")
    name = method or f"{plan.policy}/{order}"
    sched = replace(sched, method=name)
    return Served(name, plan, sched, metrics(plan, sched))


def timing(stages: Sequence[StageModel], link: Link = Link()) -> Timing:
    """What the policies need to time their iterations when requests arrive over time."""
    return Timing(tuple(stages), link.latency, link.bandwidth)


def ridge_tokens(stages: Sequence[StageModel]) -> float:
    """The most tokens an iteration can carry and stay memory-bound on every stage (the
    roofline's ridge: linear FLOPs per token x tokens / peak = weight bytes / bandwidth); up to
    it, prefill tokens beside decodes cost almost nothing (Sarathi-Serve's piggybacking, Agrawal
    et al., OSDI 2024). At least 1."""
    return max(1.0, min(math.floor(m.weight_bytes / m.hbm_bandwidth * m.peak_flops
                                   / m.linear_flops_per_token) if m.linear_flops_per_token
                        else math.inf for m in stages))


def round_robin(requests: Sequence[Request], stages: Sequence[StageModel],
                token_budget: float, link: Link = Link()) -> Served:
    """vLLM-like pipelining: one group per stage, first come first served, continuous batching
    under ``token_budget`` tokens per iteration, the plan's order on every device."""
    plan = continuous_plan(requests, len(stages), token_budget, capacity_tokens(stages),
                           policy="round-robin", timing=timing(stages, link))
    return time_plan(plan, stages, link, method="round-robin")


def separated(requests: Sequence[Request], stages: Sequence[StageModel], token_budget: float,
              link: Link = Link()) -> Served:
    """TD-Pipe-like: prefill phases and decode phases (one group per stage) in turn."""
    plan = separated_plan(requests, len(stages), token_budget, capacity_tokens(stages),
                          policy="separated", timing=timing(stages, link))
    return time_plan(plan, stages, link, method="separated")


def longest_output_first(requests: Sequence[Request]) -> list[int]:
    """Request ids by output length, longest first (ties: the given order)."""
    return sorted(range(len(requests)), key=lambda i: -requests[i].output)


def balanced_groups(requests: Sequence[Request], groups: int) -> list[int]:
    """Per request its group: longest processing time first (Graham 1969) over the output
    lengths, each request to the group with the fewest output tokens so far (ties: fewer
    prompt tokens, then the lower group), so the long requests spread over the groups."""
    load = [(0, 0)] * groups
    out = [0] * len(requests)
    for i in longest_output_first(requests):
        g = min(range(groups), key=lambda k: (*load[k], k))
        out[i] = g
        load[g] = (load[g][0] + requests[i].output, load[g][1] + requests[i].prompt)
    return out


@dataclass(frozen=True)
class SearchResult:
    """The best candidate (``best``) and every candidate tried, with the wall time (s)."""

    best: Served
    candidates: tuple[Served, ...]
    met_limit: bool
    wall_time: float
    complete: bool = True  # False: the time limit stopped the search before every candidate


def search(requests: Sequence[Request], stages: Sequence[StageModel], *,
           ttft_limit: float | None = None, budgets: Sequence[float] | None = None,
           link: Link = Link(), greedy: bool = True, greedy_tries: int = 3,
           time_limit: float | None = None, cpsat_time: float = 0.0) -> SearchResult:
    """Try admission orders x groupings x token budgets x chunking (see the module docstring;
    ``budgets`` default: :func:`ridge_tokens`, 1024 and 8192 tokens per iteration),
    each timed in the plan's order, and with ``greedy`` the ``greedy_tries`` best of them
    again by the core greedy (its own order on each device); with ``cpsat_time`` > 0 (s) the
    core CP-SAT then reorders the best plan so far, hinted by its schedule (so it is never
    longer; for small plans: its model grows with the tasks per device); return the highest
    throughput whose p99 TTFT is within ``ttft_limit`` s (when none is, the lowest p99 TTFT,
    with ``met_limit`` False). With ``time_limit`` (s) no new candidate is started once that
    much wall time has passed, except the first (a search always returns a plan);
    ``complete`` says whether every candidate was tried."""
    t0 = time.perf_counter()
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit: must be > 0 s, got {time_limit!r}")

    def out_of_time() -> bool:
        return time_limit is not None and bool(out) and time.perf_counter() - t0 > time_limit

    reqs = check_requests(requests)
    if budgets is None:
        budgets = (ridge_tokens(stages), 1024, 8192)
    if not budgets or min(budgets) < 1:
        raise ValueError(f"budgets: need token budgets >= 1, got {list(budgets)!r}")
    if ttft_limit is not None and not ttft_limit > 0:
        raise ValueError(f"ttft_limit: must be > 0 s, got {ttft_limit!r}")
    if not (isinstance(cpsat_time, int | float) and 0 <= cpsat_time < math.inf):
        raise ValueError(f"cpsat_time: must be a finite number >= 0 s, got {cpsat_time!r}")
    groups = len(stages)
    cap = capacity_tokens(stages)
    clock = timing(stages, link)
    longest = longest_output_first(reqs)
    # (admission order, fixed group per request or a shared queue)
    packings = {"fcfs/shared": (None, None), "longest/shared": (longest, None),
                "longest/balanced": (longest, balanced_groups(reqs, groups))}
    out: list[Served] = []
    complete = True
    for budget in budgets:
        for chunked in (False, True):
            for pname, (order, assign) in packings.items():
                if out_of_time():
                    complete = False
                    break
                name = f"{pname}/budget {budget:g}" + ("/chunked" if chunked else "")
                try:
                    plan = continuous_plan(reqs, groups, budget, cap, chunked=chunked,
                                           order=order, assignment=assign, policy=name,
                                           timing=clock)
                except ValueError:
                    continue  # this policy cannot serve every request
                out.append(time_plan(plan, stages, link))
    if greedy:  # the core greedy reorders the best few plans on each device
        ok = [c for c in out if c.meets(ttft_limit)] or out
        for c in sorted(ok, key=lambda c: -c.metrics.throughput_tokens_per_s)[:greedy_tries]:
            if out_of_time():
                complete = False
                break
            with contextlib.suppress(Stuck):
                out.append(time_plan(c.plan, stages, link, order="greedy"))
    if cpsat_time > 0 and out:
        if out_of_time():
            complete = False
        else:
            hint, _ = pick(out, ttft_limit)
            left = cpsat_time if time_limit is None else min(
                cpsat_time, max(time_limit - (time.perf_counter() - t0), 1e-3))
            with contextlib.suppress(ValueError):  # nothing found in time, greedy stuck
                out.append(time_plan(hint.plan, stages, link, order="cpsat", time_limit=left,
                                     initial=hint.schedule))
    if not out:
        raise ValueError("search: no candidate serves every request within the KV capacity")
    best, met = pick(out, ttft_limit)
    return SearchResult(best, tuple(out), met, time.perf_counter() - t0, complete)


def pick(candidates: Sequence[Served], ttft_limit: float | None) -> tuple[Served, bool]:
    """The highest throughput among ``candidates`` whose p99 TTFT is within ``ttft_limit`` s
    and True; when none is, the lowest p99 TTFT and False."""
    if not candidates:
        raise ValueError("candidates: none to pick from")
    ok = [c for c in candidates if c.meets(ttft_limit)]
    if ok:
        return max(ok, key=lambda c: c.metrics.throughput_tokens_per_s), True
    return min(candidates, key=lambda c: c.metrics.ttft_p99_s), False


def throughput_bound(requests: Sequence[Request], stages: Sequence[StageModel]) -> float:
    """Output tokens / the least makespan any plan and order can reach (tokens/s).

    The makespan is at least (a) a request's chain, from its arrival: its prefill, in any
    chunks, takes on some
    stage k at least the time of the whole prompt there (the chunks' FLOPs add up to the whole
    prompt's and their bytes to at least its bytes; sum of max >= max of sums), after its first
    chunk passed the stages before k and before its last chunk passes those after k (each pass
    at least an empty iteration's time, the weights' read); then its ``output - 1`` decodes
    run one after another through every stage, each at least its time alone; and (b) per
    stage, all its work as one roofline: every token's FLOPs over the peak, or the bytes over
    the bandwidth: the weights once per iteration, at least ``max output`` iterations, plus
    every KV entry read by attention (whole prompts: chunking only adds reads)."""
    reqs = check_requests(requests)
    if not stages:
        raise ValueError("stages: need at least one stage")
    # (a) the longest chain: the prefill, then each decode alone through every stage.
    empty = [m.time(Iteration(0)) for m in stages]  # the least time of any iteration
    chain = 0.0
    for r in reqs:
        whole = Iteration(0, chunks=(Chunk(0, 0, r.prompt),), first_tokens=(0,))
        prefill = max(m.time(whole) - e for m, e in zip(stages, empty, strict=True))
        decodes = [Iteration(0, decodes=(Decode(0, r.prompt + j),))
                   for j in range(1, r.output)]
        chain = max(chain, r.arrival + sum(empty) + prefill + sum(m.time(it) for it in decodes
                                                                  for m in stages))
    # (b) per stage, all work as one roofline.
    iters = max(r.output for r in reqs)
    tokens = sum(r.prompt + r.output - 1 for r in reqs)
    keys = sum(r.prompt * r.prompt / 2 + sum(r.prompt + j for j in range(1, r.output))
               for r in reqs)
    kv_read = sum(r.prompt + sum(r.prompt + j for j in range(1, r.output)) for r in reqs)
    logits = sum(r.output for r in reqs)
    work = 0.0
    for m in stages:
        flops = (m.linear_flops_per_token * tokens + m.attention_flops_per_key * keys
                 + m.head_flops_per_logit * logits)
        bytes_ = m.weight_bytes * iters + m.kv_bytes_per_token * kv_read
        work = max(work, flops / m.peak_flops, bytes_ / m.hbm_bandwidth)
    return sum(r.output for r in reqs) / max(chain, work)

