"""The search over configurations: prune by memory and by proven bounds, schedule the
survivors best-bound-first, then search the best few longer (successive halving).

Round 0 takes the candidates in the order of their partition-free bound
(:func:`~pipeopt.plan.candidates.estimate`) stretched by 1F1B's bubble and schedules each
with a fast method (the hand-made 1F1B, or interleaved 1F1B for v = 2, when it fits memory;
the greedy otherwise).
A candidate whose bound exceeds the best step time scheduled so far is never scheduled:
the bound is checked once before its partition (valid for every partition) and again on
its built problem (:func:`pipeopt.bounds.iteration_lower_bound`, valid for every schedule
of that problem), so the pruned candidate cannot beat a schedule already in hand. Later
rounds keep the best ``plan.finalists`` of round 0, then 1 / ``plan.halving`` of the
previous round each time, and search each with ``plan.method`` and ``plan.halving`` times
the previous round's time limit, on the partition round 0 chose.

Candidates run in worker processes with ``plan.jobs`` > 1; Ctrl-C (KeyboardInterrupt) or
the time limit stops the search and returns what was scheduled so far.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pipeopt.bounds import iteration_lower_bound
from pipeopt.costs.build import search_plan, topology_of
from pipeopt.errors import ConfigError
from pipeopt.plan.candidates import (
    Candidate,
    Estimate,
    enumerate_candidates,
    estimate,
    model_plan,
)
from pipeopt.plan.spec import PlanSpec
from pipeopt.problem import ProblemError
from pipeopt.schedule import Schedule
from pipeopt.schedules import NotApplicable
from pipeopt.solvers import memory_floor, require_memory, solve

Status = Literal["scheduled", "pruned", "failed", "skipped"]

#: Name of round 0's method: the hand-made schedule when it fits, else the greedy.
SCREEN = "screen"
#: Name of the no-search baseline's method: Megatron-LM's defaults, the hand-made 1F1B
#: (interleaved for v = 2) on the even partition, nothing else.
MEGATRON = "megatron"


@dataclass(frozen=True)
class CandidateResult:
    """What the plan found for one candidate (seconds, bytes, FLOP/s, dollars).

    ``status``: ``scheduled`` (a validated schedule), ``pruned`` (``reason`` says why: memory
    or bound), ``failed`` (the cost model or every method refused it; ``reason``) or
    ``skipped`` (the time limit or Ctrl-C came first). ``bound_s`` is a proven lower bound on
    the step time of every schedule of this configuration (of its partition once built);
    ``step_time_s`` the best schedule's iteration time (makespan plus the gradient reduction
    still running after it)."""

    candidate: Candidate
    status: Status
    reason: str = ""
    bound_s: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: float | None = None
    bubble_ratio: float | None = None
    method: str | None = None
    rounds: int = 0
    search_time_s: float = 0.0
    stage_layers: tuple[int, ...] | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    tflops_per_gpu: float | None = None
    cost_per_step: float | None = None
    memory_floor_bytes: float | None = None
    schedule: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def gap(self) -> float | None:
        """(step time - bound) / step time, when both are known."""
        if self.step_time_s is None or self.bound_s is None or self.step_time_s <= 0:
            return None
        return max(0.0, (self.step_time_s - self.bound_s) / self.step_time_s)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record of ``pipeopt plan --json``."""
        out: dict[str, Any] = {**self.candidate.as_dict(), "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        out.update({
            "step_time_s": self.step_time_s, "bound_s": self.bound_s, "gap": self.gap,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_floor_bytes": self.memory_floor_bytes,
            "bubble_ratio": self.bubble_ratio, "method": self.method, "rounds": self.rounds,
            "search_time_s": self.search_time_s,
            "stage_layers": None if self.stage_layers is None else list(self.stage_layers)})
        if self.cost_per_step is not None:
            out["cost_per_step"] = self.cost_per_step
        return out


def rank_key(r: CandidateResult) -> tuple[Any, ...]:
    """Best first: scheduled by step time (then peak memory), then pruned by bound, then the
    rest."""
    order = {"scheduled": 0, "pruned": 1, "skipped": 2, "failed": 3}[r.status]
    memory_pruned = r.status == "pruned" and r.bound_s is None
    return (order, memory_pruned, r.step_time_s if r.step_time_s is not None else math.inf,
            r.bound_s if r.bound_s is not None else math.inf,
            r.peak_memory_bytes if r.peak_memory_bytes is not None else math.inf,
            r.candidate)


@dataclass(frozen=True)
class PlanProgress:
    """A progress report: candidates done (scheduled, pruned or failed), left, pruned, and the
    best step time so far (seconds) with its configuration."""

    elapsed_s: float
    round: int
    done: int
    left: int
    pruned: int
    scheduled: int
    best_s: float | None
    best: Candidate | None


#: Schedules in hand that prune: (step time s, peak memory bytes, cost per step $) each. A
#: candidate is pruned when one of them is faster than its bound and needs no more memory than
#: its floor (and, with prices, one is faster and costs no more than its bound's cost): no
#: schedule of it can then be on the fronts. Pruning by time alone is one point
#: (best step time, -inf, -inf).
Frontier = tuple[tuple[float, float, float], ...]


def dominated(frontier: Frontier, bound: float, floor: float, cost: float | None
              ) -> tuple[float, float, float] | None:
    """The first point of ``frontier`` that rules out a candidate of step-time ``bound``,
    memory floor ``floor`` and least cost per step ``cost`` (None: no prices), or None."""
    mem = next((p for p in frontier if p[0] < bound and p[1] <= floor), None)
    if mem is None or cost is None:
        return mem
    return mem if any(p[0] < bound and p[2] <= cost for p in frontier) else None


@dataclass(frozen=True)
class _Task:
    index: int
    candidate: Candidate
    method: str
    time_limit: float
    frontier: Frontier
    stage_layers: tuple[int, ...] | None
    round: int
    uniform: bool = False


class _Context:
    """What one process needs to evaluate candidates: the spec and the cluster's topology,
    built once, whose path searches every candidate then shares."""

    def __init__(self, spec: PlanSpec) -> None:
        self.spec = spec
        self.topology = topology_of(spec.cluster_cfg)
        models = self.topology.gpu_models
        self._peaks = [spec.cluster_cfg.peak_flops or g.peak_flops(spec.model_cfg.dtype)
                       for g in models]
        prices = dict(spec.prices)
        self._prices = [prices.get(g.name) for g in models] if prices else None

    def cost(self, cand: Candidate, step: float) -> float | None:
        """Dollars of a step of ``step`` seconds on ``cand``'s GPUs (None: no prices)."""
        if self._prices is None:
            return None
        return step / 3600 * math.fsum(p or 0.0 for p in self._prices[:cand.gpus])

    def figures(self, cand: Candidate, est: Estimate, step: float) -> dict[str, Any]:
        """Tokens/s, MFU, TFLOP/s per GPU and the cost of one step for a step time."""
        n = cand.gpus
        peak = math.fsum(self._peaks[:n])
        out = {"tokens_per_s": self.spec.tokens_per_step / step,
               "mfu": est.model_flops / (step * peak),
               "tflops_per_gpu": est.model_flops / (step * n) / 1e12}
        if self._prices is not None:
            out["cost_per_step"] = self.cost(cand, step)
        return out

    def evaluate(self, task: _Task) -> CandidateResult:
        """Build, bound and schedule one candidate; never raises for a refused candidate."""
        t0 = time.perf_counter()
        cand = task.candidate
        try:
            plan = model_plan(self.spec, cand, task.stage_layers, uniform=task.uniform,
                              topology=self.topology)
        except ConfigError as exc:
            return CandidateResult(cand, "failed", f"cost model: {exc}")
        est = estimate(self.spec, cand, plan)
        if not est.fits:
            return _memory_pruned(cand, est)
        hit = dominated(task.frontier, est.bound_s, est.memory_floor_bytes,
                        self.cost(cand, est.bound_s))
        if hit is not None:
            return _bound_pruned(cand, est.bound_s, hit, est)
        try:
            # As the model form builds it (build_from_model): with recompute: per_stage the
            # partition search also picks each stage's mode (and split or fused backward).
            plan, part, report = search_plan(plan)
            problem = plan.problem(part, {"partition_search": report}, report.get("recompute"))
        except ConfigError as exc:
            return CandidateResult(cand, "pruned", f"memory: {_after_key(exc)}",
                                   memory_floor_bytes=est.memory_floor_bytes)
        except ProblemError as exc:
            return CandidateResult(cand, "failed", f"cost model: {exc}")
        try:
            require_memory(problem, "plan")
        except NotApplicable as exc:
            return CandidateResult(cand, "pruned", f"memory: {exc}",
                                   memory_floor_bytes=est.memory_floor_bytes)
        bound = max(est.bound_s, iteration_lower_bound(problem))
        floor = max(memory_floor(problem))
        hit = dominated(task.frontier, bound, floor, self.cost(cand, bound))
        if hit is not None:
            return _bound_pruned(cand, bound, hit, est)
        try:
            sched = _schedule(problem, task.method, task.time_limit, cand.virtual_stages)
        except (NotApplicable, ValueError, RuntimeError) as exc:
            return CandidateResult(cand, "failed", f"schedule: {exc}", bound_s=bound,
                                   memory_floor_bytes=est.memory_floor_bytes)
        step = sched.iteration_time
        return CandidateResult(
            cand, "scheduled", bound_s=bound, step_time_s=step,
            peak_memory_bytes=max(sched.peak_memory), bubble_ratio=sched.bubble_ratio,
            method=sched.method, rounds=task.round + 1,
            search_time_s=time.perf_counter() - t0,
            stage_layers=tuple(b - a for a, b in part),
            memory_floor_bytes=est.memory_floor_bytes, schedule=sched,
            **self.figures(cand, est, step))


def _promise(cand: Candidate, est: Estimate) -> tuple[float, int, Candidate]:
    """The order of round 0 (an order only, never a reason to prune): the partition-free
    bound stretched by the bubble of 1F1B, (p - 1) / (v m) of the ideal time (Narayanan et al.
    2021, section 2.2), then larger tensor-parallel groups first (less gradient traffic
    between replicas); the bound alone ties for every configuration of one recompute mode,
    as the total work does not depend on the split."""
    bubble = (cand.pp - 1) / (cand.virtual_stages * cand.microbatches)
    return est.bound_s * (1 + bubble), -cand.tp, cand


def _after_key(exc: Exception) -> str:
    text = str(exc)
    return text[len("memory: "):] if text.startswith("memory: ") else text


def _memory_pruned(cand: Candidate, est: Estimate) -> CandidateResult:
    return CandidateResult(
        cand, "pruned", f"memory: needs at least {_bytes(est.memory_floor_bytes)} per device "
        f"on average (weights, gradients, optimizer state and one micro-batch's activations "
        f"over {cand.pp} ranks), over the {_bytes(est.memory_limit_bytes)} limit",
        memory_floor_bytes=est.memory_floor_bytes)


def _bytes(x: float) -> str:
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 / 10 else f"{x:.4g} bytes"


def _bound_pruned(cand: Candidate, bound: float, hit: tuple[float, float, float],
                  est: Estimate) -> CandidateResult:
    if hit[1] == -math.inf:
        why = f"bound: {bound:.4g} s > best step time {hit[0]:.4g} s already scheduled"
    else:
        why = (f"bound: {bound:.4g} s > {hit[0]:.4g} s of a schedule in hand that needs "
               f"{_bytes(hit[1])}, no more than this one's memory floor (dominated)")
    return CandidateResult(cand, "pruned", why, bound_s=bound,
                           memory_floor_bytes=est.memory_floor_bytes)


def _schedule(problem: Any, method: str, time_limit: float, v: int) -> Schedule:
    if method not in (SCREEN, MEGATRON):
        # time_tolerance 0: the fastest schedule, not a leaner one within 1 % of it.
        return solve(problem, method, time_limit=time_limit, time_tolerance=0.0)
    classic = "1f1b" if v == 1 else "interleaved-1f1b"
    if method == MEGATRON:
        return solve(problem, classic)
    try:
        return solve(problem, classic)
    except NotApplicable:  # over the memory limit, or m not a multiple of p
        return solve(problem, "greedy", time_limit=time_limit)


# ----- running tasks: in this process, or in worker processes ------------------------------
def _worker(spec: PlanSpec, tasks: Any, results: Any) -> None:
    """A worker process: evaluate tasks until None arrives. Ctrl-C is the parent's to handle
    (it stops the workers); an unexpected error is reported as the candidate's failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = _Context(spec)
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            res = ctx.evaluate(task)
        except Exception as exc:  # one candidate's bug must not stop the plan
            res = CandidateResult(task.candidate, "failed", f"{type(exc).__name__}: {exc}")
        results.put((task.index, res))


Item = _Task | CandidateResult


class _Runner:
    """Runs tasks from a generator (which may prune instead, yielding results) one at a time
    in this process or ``jobs`` at a time in worker processes; ``deadline`` in perf_counter
    seconds."""

    def __init__(self, spec: PlanSpec, jobs: int, deadline: float) -> None:
        self.spec, self.jobs, self.deadline = spec, jobs, deadline
        self._ctx: _Context | None = None
        self._procs: list[Any] = []
        self._tasks: Any = None
        self._results: Any = None

    def context(self) -> _Context:
        if self._ctx is None:
            self._ctx = _Context(self.spec)
        return self._ctx

    def _start(self) -> None:
        if self._procs:
            return
        mp = multiprocessing.get_context("spawn")
        self._tasks, self._results = mp.Queue(), mp.Queue()
        for _ in range(self.jobs):
            p = mp.Process(target=_worker, args=(self.spec, self._tasks, self._results),
                           daemon=True)
            p.start()
            self._procs.append(p)

    def close(self, kill: bool = False) -> None:
        """Stop the workers (at once with ``kill``)."""
        for p in self._procs:
            if kill:
                p.terminate()
            else:
                self._tasks.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        self._procs = []

    def run(self, items: Iterator[Item], handle: Callable[[CandidateResult], None]) -> None:
        """Evaluate every task of ``items`` (results are handed on as they are)."""
        if self.jobs == 1:
            for item in items:
                res = (item if isinstance(item, CandidateResult)
                       else self.context().evaluate(self._limited(item)))
                handle(res)
                if res.schedule is not None and res.schedule.solver.detail("interrupted"):
                    # The search took the Ctrl-C and kept its best: stop the plan here too.
                    raise KeyboardInterrupt
            return
        self._start()
        running = 0
        exhausted = False
        while True:
            while not exhausted and running < self.jobs:
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif isinstance(item, CandidateResult):
                    handle(item)
                else:
                    self._tasks.put(self._limited(item))
                    running += 1
            if running == 0:
                return
            try:
                _, res = self._results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    raise RuntimeError("plan: every worker process died") from None
                continue
            running -= 1
            handle(res)

    def _limited(self, task: _Task) -> _Task:
        left = self.deadline - time.perf_counter()
        return replace(task, time_limit=max(0.1, min(task.time_limit, left)))


# ----- the plan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The result of a plan: every enumerated candidate's result, best first.

    ``enumerated`` candidates in the search space, ``scheduled`` of them got a schedule;
    ``wall_time_s`` in seconds; ``interrupted`` when Ctrl-C or the time limit stopped the
    search early (the results are then the best found so far)."""

    spec: PlanSpec
    results: tuple[CandidateResult, ...]
    wall_time_s: float
    interrupted: bool = False
    stopped_by: str = ""

    @property
    def enumerated(self) -> int:
        """Candidates in the search space."""
        return len(self.results)

    @property
    def scheduled(self) -> tuple[CandidateResult, ...]:
        """The candidates that got a schedule, fastest first."""
        return tuple(r for r in self.results if r.status == "scheduled")

    def count(self, status: str, reason: str = "") -> int:
        """Candidates of ``status`` whose reason starts with ``reason``."""
        return sum(r.status == status and r.reason.startswith(reason) for r in self.results)

    @property
    def best(self) -> CandidateResult | None:
        """The fastest scheduled candidate (None when none was scheduled)."""
        s = self.scheduled
        return s[0] if s else None

    def pareto(self, objective: Literal["memory", "cost"] = "memory"
               ) -> tuple[CandidateResult, ...]:
        """The scheduled candidates no other beats on both step time and peak memory (or
        cost per step), fastest first."""
        def other(r: CandidateResult) -> float:
            val = r.peak_memory_bytes if objective == "memory" else r.cost_per_step
            return math.inf if val is None else val

        front: list[CandidateResult] = []
        for r in self.scheduled:  # by step time, then memory
            if not front or other(r) < other(front[-1]):
                front.append(r)
        return tuple(front)

    def config(self, result: CandidateResult | None = None, time_limit: float = 60.0
               ) -> dict[str, Any]:
        """The solvable model-form config (a mapping) of ``result`` (default: the best), with
        its partition fixed and the method that found its schedule (an MoE model's with
        ``model.moe``, its EP size in ``expert_parallel``)."""
        from pipeopt.plan.candidates import config_of

        r = result or self.best
        if r is None:
            raise ValueError("plan: no candidate was scheduled")
        # "auto:zb-h1" is auto's choice, a method of its own; a reordered run is auto's.
        method = (r.method or "").split(":")[-1]
        if not method or "+" in method:
            method = self.spec.plan.method
        return config_of(self.spec, r.candidate, list(r.stage_layers or ()) or None,
                         method=method, time_limit=time_limit)


class _State:
    """The search's running figures (local to one :func:`plan` call): the round, the best
    scheduled result and the progress callback."""

    def __init__(self, t0: float, total: int,
                 on_progress: Callable[[PlanProgress], None] | None) -> None:
        self.t0, self.total, self.on_progress = t0, total, on_progress
        self.round = 0
        self.best: CandidateResult | None = None

    @property
    def best_s(self) -> float | None:
        return None if self.best is None else self.best.step_time_s

    def frontier(self, pareto: bool, results: dict[Candidate, CandidateResult]) -> Frontier:
        """The schedules in hand that prune (see :data:`Frontier`): the best step time, or
        with ``pareto`` every scheduled candidate's time, memory and cost."""
        if not pareto:
            b = self.best_s
            return () if b is None else ((b, -math.inf, -math.inf),)
        return tuple((r.step_time_s, r.peak_memory_bytes or 0.0,
                      r.cost_per_step if r.cost_per_step is not None else -math.inf)
                     for r in results.values()
                     if r.status == "scheduled" and r.step_time_s is not None)

    def update(self, res: CandidateResult, results: dict[Candidate, CandidateResult]) -> None:
        if res.status == "scheduled" and res.step_time_s is not None and (
                self.best_s is None or res.step_time_s < self.best_s):
            self.best = res
        self.report(results)

    def report(self, results: dict[Candidate, CandidateResult]) -> None:
        if self.on_progress is None:
            return
        done = len(results)
        self.on_progress(PlanProgress(
            time.perf_counter() - self.t0, self.round, done, self.total - done,
            sum(r.status == "pruned" for r in results.values()),
            sum(r.status == "scheduled" for r in results.values()), self.best_s,
            None if self.best is None else self.best.candidate))


def plan(spec: PlanSpec, *, time_limit: float | None = None, jobs: int | None = None,
         on_progress: Callable[[PlanProgress], None] | None = None,
         baseline: bool = False) -> Plan:
    """Search ``spec``'s configurations (see the module docstring); ``time_limit`` (seconds)
    and ``jobs`` override ``plan.time_limit`` and ``plan.jobs``. Ctrl-C returns the plan so
    far with ``interrupted`` set.

    With ``baseline``, the no-search baseline of Megatron-LM's defaults: every configuration
    with a uniform recompute mode (``per_stage`` left out) on the even partition with the
    hand-made 1F1B (interleaved for v = 2) only, refused when that is over the memory limit,
    and no later rounds (the same pruning, whose bounds hold for these schedules too)."""
    pl = spec.plan
    limit = pl.time_limit if time_limit is None else time_limit
    jobs = pl.jobs if jobs is None else jobs
    if not (0 < limit < math.inf):
        raise ConfigError(f"time_limit: must be a finite number of seconds > 0, got {limit}")
    if jobs < 1:
        raise ConfigError(f"jobs: must be >= 1, got {jobs}")
    t0 = time.perf_counter()
    deadline = t0 + limit
    cands = enumerate_candidates(spec)
    if baseline:  # Megatron-LM's recompute is one mode for every block
        cands = [c for c in cands if c.recompute != "per_stage"]
    if not cands:
        raise ConfigError("plan: no configuration divides the GPUs and the global batch "
                          f"({spec.global_batch_size} sequences); check plan.gpus, "
                          "plan.tensor_parallel, plan.pipeline_parallel and "
                          "plan.micro_batch_size")
    results: dict[Candidate, CandidateResult] = {}
    est: dict[Candidate, Estimate] = {}
    state = _State(t0, len(cands), on_progress)
    runner = _Runner(spec, jobs, deadline)

    def handle(res: CandidateResult) -> None:
        old = results.get(res.candidate)
        if old is not None and old.status == "scheduled" and old.step_time_s is not None and (
                res.step_time_s is None or res.step_time_s >= old.step_time_s):
            # A longer search that did no better (or stopped) keeps the earlier schedule.
            res = replace(old, rounds=max(old.rounds, res.rounds),
                          search_time_s=old.search_time_s + res.search_time_s)
        results[res.candidate] = res
        state.update(res, results)

    interrupted, stopped_by = False, ""
    try:
        ctx = runner.context()
        for c in cands:
            try:
                est[c] = estimate(spec, c, model_plan(spec, c, uniform=baseline,
                                                      topology=ctx.topology))
            except ConfigError as exc:
                results[c] = CandidateResult(c, "failed", f"cost model: {exc}")
        for c, e in est.items():
            if not e.fits:
                results[c] = _memory_pruned(c, e)
        state.report(results)
        order = sorted((c for c in est if c not in results), key=lambda c: _promise(c, est[c]))

        def round0() -> Iterator[Item]:
            for i, c in enumerate(order):
                if time.perf_counter() >= deadline:
                    return
                front = state.frontier(pl.pareto, results)
                hit = dominated(front, est[c].bound_s, est[c].memory_floor_bytes,
                                ctx.cost(c, est[c].bound_s))
                if hit is not None:
                    yield _bound_pruned(c, est[c].bound_s, hit, est[c])
                else:
                    yield _Task(i, c, MEGATRON if baseline else SCREEN,
                                pl.screen_time_limit, front, None, 0, uniform=baseline)

        runner.run(round0(), handle)
        pool = sorted((r for r in results.values() if r.status == "scheduled"), key=rank_key)
        keep, rnd, limit_r = min(pl.finalists, len(pool)), 0, pl.screen_time_limit
        while pool and not baseline and time.perf_counter() < deadline:
            rnd += 1
            state.round = rnd
            state.report(results)  # a round starts: say so before its first result
            limit_r *= pl.halving
            finalists = pool[:keep]

            def later(finalists: list[CandidateResult] = finalists, rnd: int = rnd,
                      limit_r: float = limit_r) -> Iterator[Item]:
                for i, r in enumerate(finalists):
                    if time.perf_counter() >= deadline:
                        return
                    b = state.best_s
                    if b is not None and r.bound_s is not None and r.bound_s > b:
                        continue  # it cannot beat the best any more
                    yield _Task(i, r.candidate, pl.method, limit_r, (), r.stage_layers, rnd)

            runner.run(later(), handle)
            if keep == 1:
                break
            pool = sorted((results[r.candidate] for r in finalists), key=rank_key)
            keep = max(1, math.ceil(keep / pl.halving))
        if time.perf_counter() >= deadline and len(results) < len(cands):
            interrupted, stopped_by = True, "time limit"
    except KeyboardInterrupt:
        interrupted, stopped_by = True, "interrupted"
        runner.close(kill=True)
    else:
        runner.close()
    for c in cands:
        if c not in results:
            results[c] = CandidateResult(
                c, "skipped", f"not scheduled: {stopped_by or 'time limit'} first",
                bound_s=est[c].bound_s if c in est else None)
    ranked = tuple(sorted(results.values(), key=rank_key))
    return Plan(spec=spec, results=ranked, wall_time_s=time.perf_counter() - t0,
                interrupted=interrupted, stopped_by=stopped_by)
