"""Running schedules: configuration, the per-rank training job on PyTorch's runtime, the
reference check, measured costs, and the entry points (spawned ranks or torchrun).

:func:`run_pipelines` replays schedules on ranks started by
:func:`pipeopt.executor.procs.spawn` and, on request, checks the gradients against the
one-process reference; :func:`run_rank` is one rank's job.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeopt.costs.build import with_step_tail
from pipeopt.executor import _torch
from pipeopt.executor.check import (
    AUTOCAST,
    batch_for,
    cast,
    clip_grads,
    compare_replicas,
    optimizer,
    reference_run,
    stage_grads,
    stage_weights,
)
from pipeopt.executor.collectives import GraphRun, plan_schedule
from pipeopt.executor.export import schedule_rows
from pipeopt.executor.models import ModelSpec, model_stages, recompute_plan
from pipeopt.executor.procs import (
    ATOL,
    ATOL64,
    RTOL,
    RTOL64,
    ExecutorError,
    RankStatus,
    RunConfig,
    first_line,
    resolve_backend,
    spawn_jobs,
    start,
    under_torchrun,
)
from pipeopt.executor.runtime import OpClock, Reducer, StageModule, TimedStage, call
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Schedule, SolverInfo
from pipeopt.schedules import fused_variant, split_variant
from pipeopt.simulate import simulate


@dataclass
class RunResult:
    """The outcome of a pipelined run; times in seconds except ``predicted_step_time``, which
    is in the schedule's own time unit (seconds when it came from a profile)."""

    method: str
    world: int
    losses: list[float]
    step_times: list[float]
    predicted_step_time: float
    reference_losses: list[float] = field(default_factory=list)
    reference_step_time: float | None = None
    max_abs_grad_diff: float | None = None
    grads_match: bool | None = None
    worst_param: str | None = None
    op_costs: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, stage) -> s
    peak_memory: list[float] = field(default_factory=list)  # bytes, per rank
    compared: str = "gradients"  # or "weights" (a data-parallel graph schedule's final ones)
    dtype: str = "float32"  # of the parameters and inputs, in the ranks and the reference
    rtol: float = RTOL  # the comparison's tolerance: |a - b| <= atol + rtol |b|
    atol: float = ATOL
    collectives: list[list[str]] = field(default_factory=list)  # per rank: Reducer.log

    @property
    def loss(self) -> float:
        """Loss of the last step (mean over the whole batch)."""
        return self.losses[-1]

    @property
    def step_time(self) -> float:
        """Measured step time (seconds): median of the steps after the first, when there are
        several (the first pays warm-up costs)."""
        times = self.step_times[1:] or self.step_times
        return statistics.median(times)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (``ranks`` for ``world``; op costs keyed like ``0F``)."""
        out = {**asdict(self), "ranks": self.world, "loss": self.loss,
               "step_time": self.step_time, "op_costs": {
                   f"{k}{kind}": t for (kind, k), t in sorted(self.op_costs.items(),
                                                              key=lambda x: x[0][::-1])},
               "tolerance": {"rtol": self.rtol, "atol": self.atol}}
        for key in ("world", "rtol", "atol"):
            del out[key]
        return out


# ----- the replay job --------------------------------------------------------------------------
def stage_io(stages: list[nn.Module], sample: torch.Tensor) -> list[Any]:
    """The micro-batch ``sample`` and every stage's output for it (no gradients): the example
    tensors PyTorch's stages take instead of inferring shapes through messages."""
    out: list[Any] = [sample]
    with torch.no_grad():
        for k, mod in enumerate(stages):
            h = call(mod, out[-1])
            if k < len(stages) - 1:
                for t in h if isinstance(h, tuple) else (h,):
                    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                        raise ExecutorError(
                            f"stage {k}: what it hands to stage {k + 1} must be a floating-point "
                            f"tensor or a tuple of them (it carries a gradient back), got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
            out.append(h)
    return out


def _build(schedule: Schedule, cfg: RunConfig
           ) -> tuple[ModelSpec, list[nn.Module], list[StageModule], list[Any]]:
    """The model, its stages, their stage modules and a micro-batch's way through them."""
    prob = schedule.problem
    spec, stages = model_stages(cfg, prob)
    stages = [cast(mod, cfg.dtype) for mod in stages]
    amp = AUTOCAST[cfg.autocast] if cfg.autocast else None
    checkpointed, _ = recompute_plan(prob, cfg.recompute)
    mods = [StageModule(mod, amp, prob.split_backward and k > 0 and cfg.per_layer_split,
                        checkpointed[k]) for k, mod in enumerate(stages)]
    xs, _ = batch_for(spec, cfg.batch(prob.microbatches), cfg.seed, 0, prob.microbatches,
                      cfg.dtype)
    return spec, stages, mods, stage_io(mods, xs[0])


def _groups(p: int, dp: int, device: torch.device, backend: str, op_timeout: float
            ) -> tuple[Any, Any]:
    """This rank's pipeline group and data-parallel group (None with one replica): the two
    dimensions of a DeviceMesh, data x pipeline (rank = replica * p + pipeline rank), whose
    groups time out after ``op_timeout`` seconds."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = ((dp, p), ("dp", "pp")) if dp > 1 else ((p,), ("pp",))
    opts = _torch.group_options(backend, op_timeout)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names,
                            backend_override={n: (backend, opts) for n in names})
    return mesh["pp"].get_group(), mesh["dp"].get_group() if dp > 1 else None


def _free_groups(*groups: Any) -> None:
    """Destroy this job's process groups (None skipped). Each job builds its own (:func:`_groups`);
    left alive, a gloo group keeps 3 threads and 5 file descriptors per rank, so a process that
    runs job after job (``run_pipelines``, the benchmarks' rounds) piles them up: 8 MLP jobs x 7
    rounds on 2 ranks ended with 175 threads per rank instead of 7, and a job's voluntary
    context switches grew from about 330 to 2,600 (issue 17's diagnostic)."""
    for g in groups:
        if g is not None and g is not dist.GroupMember.WORLD:  # never the default group
            dist.destroy_process_group(g)


def _grad_example(x: Any) -> Any:
    """A copy of ``x`` (or of each tensor of a tuple) that takes a gradient where it can: the
    example outputs PyTorch's stage builds its gradient buffers from."""
    if isinstance(x, tuple):
        return tuple(_grad_example(t) for t in x)
    return x.clone().requires_grad_(x.is_floating_point())


def _waits_for(schedule: Schedule, rank: int) -> dict[Op, str]:
    """For the ops of ``rank`` that take a message: whose output from which rank, as words."""
    prob = schedule.problem
    out = {}
    for op in schedule.device_orders()[rank]:
        src = Op("F", op.stage - 1, op.microbatch) if op.kind == "F" else Op(
            "B", op.stage + 1, op.microbatch)
        if op.kind != "W" and 0 <= src.stage < prob.stages \
                and prob.stage_device[src.stage] != rank:
            out[op] = f"the output of {src} from rank {prob.stage_device[src.stage]}"
    return out


def run_rank(rank: int, world: int, device: torch.device, schedule: Schedule,
             cfg: RunConfig, backend: str = "gloo", plan: GraphRun | None = None,
             status: RankStatus | None = None) -> dict[str, Any]:
    """Train ``cfg.steps`` steps of ``schedule`` as ``rank`` on PyTorch's pipelining runtime
    (process group already joined); returns per-step losses and times (seconds), the last
    step's gradients, its op trace ((op, start, end) seconds from the step's start, ops named
    as pipeopt does, e.g. ``1B0``), every step's trace of ops (``step_traces``, same form), the
    op durations of the steps after the first and the peak memory (bytes). With ``plan`` (a
    data-parallel graph schedule), step s replays its iteration s with its collectives in its
    order (:class:`Reducer`), and the report adds the final weights (``weights``) and the
    rank's ``collectives`` log."""
    prob = schedule.problem
    status = status or RankStatus()
    p, dp = prob.devices, cfg.data_parallel
    if world != p * dp:
        raise ExecutorError(f"world size {world} does not match the schedule's {p} devices "
                            f"x {dp} replica(s)")
    spec, stages, mods, io = _build(schedule, cfg)
    m, bs = prob.microbatches, cfg.batch(prob.microbatches)
    rows, order = schedule_rows(schedule)
    replica, rank = divmod(rank, p)  # from here on, rank is the pipeline rank
    group, dp_group = _groups(p, dp, device, backend, cfg.op_timeout)
    clock = OpClock(list[Op | None](schedule.device_orders()[rank]), status,
                    _waits_for(schedule, rank), cuda=device.type == "cuda")
    mine = sorted(prob.device_stages[rank])
    pstages = [TimedStage(mods[k].to(device), k, prob.stages, device,
                          input_args=io[k] if k == 0 else _grad_example(io[k]),
                          output_args=_grad_example(io[k + 1]), group=group, clock=clock)
               for k in mine]
    if cfg.torch_schedule:
        from torch.distributed.pipelining import schedules as tsched

        cls = getattr(tsched, cfg.torch_schedule)
        clock.ops, clock.waits_for = [], {}  # its own order: ops are not known
        single = issubclass(cls, tsched.PipelineScheduleSingle)
        runtime = cls(pstages[0] if single else pstages, m, loss_fn=spec.loss_fn,
                      scale_grads=True)
    else:
        runtime = _torch.runtime(pstages, m, spec.loss_fn, _torch.rows_to_actions(rows))
    params = [p for k in mine for p in stages[k].parameters()]
    opt = optimizer(cfg.optimizer, params, cfg.lr)
    reducer = None
    if plan is not None:
        fault = cfg.fault if cfg.fault is not None and cfg.fault.rank == replica * p + rank \
            and cfg.fault.mode in ("scale_grads", "skip_reduce") else None
        reducer = Reducer(plan, replica, rank, params, dp_group,
                          lambda ts: optimizer(cfg.optimizer, ts, cfg.lr), status, fault)
        clock.before = reducer.before_op
        for st in pstages:
            st.grads_ready = reducer.grads_ready
    losses, times, grads = [], [], None
    step_traces: list[list[tuple[str, float, float]]] = []
    durations: dict[str, list[float]] = {}  # "F3" -> seconds of each stage-3 forward run
    last = prob.stages - 1
    for step in range(cfg.steps):
        if plan is not None:
            order = _iteration(plan, replica, rank, step, runtime, clock)
        x_mb, y_mb = batch_for(spec, bs * dp, cfg.seed, step, m * dp, cfg.dtype)  # its share:
        x = torch.cat([x_mb[replica * m + j] for j in order]).to(device)
        y = torch.cat([y_mb[replica * m + j] for j in order]).to(device)
        opt.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        dist.barrier()
        if cfg.fault is not None and cfg.fault.rank == replica * p + rank \
                and cfg.fault.step == step and cfg.fault.mode in ("raise", "hang"):
            if cfg.fault.mode == "hang":
                status.text = f"step {step}: stopped answering (injected fault)"
                time.sleep(3600)
            raise RuntimeError(f"injected fault on rank {rank}")
        t0 = time.perf_counter()
        clock.start(step)
        try:
            if reducer is not None:
                reducer.begin_step(step)
            runtime.step(*((x,) if 0 in mine else ()),
                         **({"target": y, "losses": mb_losses} if last in mine else {}))
        except Exception as exc:
            raise ExecutorError(f"rank {rank}: {status.text}: {type(exc).__name__}: "
                                f"{first_line(exc)}") from exc
        if reducer is not None:
            reducer.end_step()
        elif dp_group is not None:
            for p_ in params:
                if p_.grad is not None:
                    dist.all_reduce(p_.grad, group=dp_group)
                    p_.grad.div_(dp)
        if cfg.clip_grad_norm is not None:
            clip_grads(params, cfg.clip_grad_norm, lambda t: dist.all_reduce(t, group=group))
        if step == cfg.steps - 1:
            grads = stage_grads({k: stages[k] for k in mine})
        if reducer is None:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        clock.resolve()
        step_traces.append([(str(op), a, b) for op, a, b in clock.trace if op is not None])
        losses.append(sum(float(v.detach()) for v in mb_losses) / m if mb_losses else 0.0)
        if step > 0 or cfg.steps == 1:  # the first step pays warm-up costs
            for op, a, b in clock.trace:
                if op is not None:
                    durations.setdefault(f"{op.kind}{op.stage}", []).append(b - a)
    trace = [(str(op), a, b) for op, a, b in clock.trace]
    extra = {}
    if reducer is not None:
        reducer.finish(cfg.steps)
        extra = {"weights": stage_weights({k: stages[k] for k in mine}),
                 "collectives": reducer.log}
    _free_groups(group, dp_group)
    return {"losses": losses, "step_times": times, "grads": grads, "trace": trace,
            "step_traces": step_traces,
            "op_durations": durations, "peak_memory": peak_memory(device), **extra}


def _iteration(plan: GraphRun, replica: int, rank: int, step: int, runtime: Any,
               clock: OpClock) -> list[int]:
    """Load ``replica``'s compute order of iteration ``step`` into the runtime and the clock;
    returns its micro-batch relabelling (:func:`schedule_rows`)."""
    sched = plan_schedule(plan, replica, step)
    rows, order = schedule_rows(sched)
    _torch.load_actions(runtime, _torch.rows_to_actions(rows))
    clock.ops, clock.waits_for = list(sched.device_orders()[rank]), _waits_for(sched, rank)
    return order


def peak_memory(device: torch.device) -> float:
    """Peak memory of this rank (bytes): the CUDA allocator's peak on GPU, else the process's
    peak resident set (what the process can see on CPU)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def op_costs(reports: Sequence[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """Median seconds per (kind, stage) over the ``op_durations`` of rank reports (those of
    :func:`run_rank`; several per rank, e.g. one per round, are fine)."""
    merged: dict[str, list[float]] = {}
    for r in reports:
        for key, vals in r.get("op_durations", {}).items():
            merged.setdefault(key, []).extend(vals)
    return {(key[0], int(key[1:])): statistics.median(vals)
            for key, vals in merged.items() if vals}


def measured_problem(schedule: Schedule, result: RunResult) -> Problem:
    """The split problem of ``schedule`` with each stage's F, B and W durations replaced by
    the medians measured in ``result`` (seconds; time from the op's input being there to its
    end, steps after the first), so that it prices fused and split backward alike. A run of a
    fused schedule measures the fused backward, which goes to ``meta.fused_backward`` (what a
    fused schedule is priced at, see :func:`pipeopt.schedules.fused_variant`); its B and W
    stay those of the split problem the schedule was fused from (``meta
    .split_backward_costs``; else the problem's own B and W). A split run keeps the
    ``fused_backward`` it had. The step tail (:func:`pipeopt.costs.build.with_step_tail`)
    becomes what the run measured beyond the ops: its step time less the same orders timed on
    these costs (the optimizer step, the closing barrier, the runtime between ops; 0 when
    the run recorded no step time). Links, memory and everything else stay as they were."""
    out = _measured_ops(schedule, result)
    timed = out if schedule.problem.split_backward else fused_variant(out)
    if not any(result.step_times):
        return out
    span = simulate(with_step_tail(timed, [0.0] * out.stages),
                    schedule.device_orders()).iteration_time
    tail = max(0.0, result.step_time - span)
    return with_step_tail(out, [tail] * out.stages, step_from="run: step time - ops")


def _measured_ops(schedule: Schedule, result: RunResult) -> Problem:
    prob, costs = schedule.problem, result.op_costs
    split = prob if prob.split_backward else split_variant(prob)
    if not split.split_backward:  # fused from the start: B and W in their own proportion
        split = prob.replace(split_backward=True)
    meta = dict(split.meta)
    meta["measured_costs"] = {"from_run_of": schedule.method, "ranks": result.world,
                              "steps": len(result.step_times)}
    f = tuple(costs.get(("F", k), x) for k, x in enumerate(prob.forward))
    if not prob.split_backward:
        meta["fused_backward"] = [costs.get(("B", k), prob.durations["B"][k])
                                  for k in range(prob.stages)]
        return split.replace(forward=f, meta=tuple(meta.items()))
    return split.replace(
        forward=f, meta=tuple(meta.items()),
        backward_input=tuple(costs.get(("B", k), x) for k, x in enumerate(prob.backward_input)),
        backward_weight=tuple(costs.get(("W", k), x)
                              for k, x in enumerate(prob.backward_weight)))


def measured_schedule(schedule: Schedule, result: RunResult) -> Schedule:
    """``schedule``'s own orders re-timed on :func:`measured_problem` (its fused variant for a
    fused schedule): what ``pipeopt run --costs-out`` writes."""
    prob = measured_problem(schedule, result)
    if not schedule.problem.split_backward:
        prob = fused_variant(prob)
    return simulate(prob, schedule.device_orders(), method=schedule.method,
                    solver=SolverInfo(status="heuristic"))


def _assemble(schedule: Schedule, cfg: RunConfig, per_rank: Sequence[dict[str, Any]],
              plan: GraphRun | None = None) -> RunResult:
    """Merge the ranks' reports (and compare with the reference when asked); with ``plan``,
    the final weights against the reference with the plan's delay."""
    steps, dp = len(per_rank[0]["losses"]), cfg.data_parallel
    losses = [sum(r["losses"][i] for r in per_rank) / dp for i in range(steps)]
    times = [max(r["step_times"][i] for r in per_rank) for i in range(steps)]
    res = RunResult(schedule.method, len(per_rank), losses, times,
                    schedule.iteration_time if plan is None else plan.iteration_s)
    res.op_costs = op_costs(per_rank)
    res.peak_memory = [r.get("peak_memory", 0.0) for r in per_rank]
    res.collectives = [r.get("collectives", []) for r in per_rank]
    res.dtype, res.rtol, res.atol = cfg.dtype, cfg.rtol, cfg.atol
    if cfg.check:
        # every replica's gradients or weights (each must hold the same after the average)
        what, p = "grads" if plan is None else "weights", schedule.problem.devices
        got = [{k: g for r in per_rank[i * p:(i + 1) * p] for k, g in r[what].items()}
               for i in range(dp)]
        ref = reference_run(schedule.problem, cfg, replicas=dp,
                            delay=None if plan is None else plan.delay)
        res.compared = "gradients" if plan is None else "weights"
        cmp = compare_replicas(got, ref[what], cfg.rtol, cfg.atol)
        res.reference_losses = ref["losses"]
        res.reference_step_time = statistics.median(ref["step_times"][1:]
                                                    or ref["step_times"])
        res.max_abs_grad_diff = cmp.max_abs_grad_diff
        res.grads_match = cmp.ok
        res.worst_param = cmp.worst
    return res


def run_pipelines(jobs: Sequence[tuple[Schedule, RunConfig]]) -> list[RunResult]:
    """Replay several schedules (same number of devices) one after the other in one set of
    spawned processes; returns one result per job. Timeout: the sum of the jobs' timeouts."""
    if not jobs:
        return []
    world = jobs[0][0].problem.devices * jobs[0][1].data_parallel
    for s, c in jobs:
        if s.problem.devices * c.data_parallel != world:
            raise ExecutorError("run_pipelines: every job must have the same ranks (devices "
                                "x replicas)")
    for s, c in jobs:  # fail here, once and clearly, not in every worker
        _preflight(s, c)
    backend = resolve_backend(jobs[0][1].backend)
    reports = spawn_jobs(run_rank, world, jobs, backend, backend)
    return [_assemble(s, c, r) for (s, c), r in zip(jobs, reports, strict=True)]


def _preflight(schedule: Schedule, cfg: RunConfig) -> None:
    """PyTorch's own validation and lowering of the schedule, then the model built, cut into
    the schedule's stages and fed one micro-batch in this process, as every rank will: before
    any process starts (ExecutorError, :class:`~pipeopt.executor.models.ModelError`)."""
    from pipeopt.executor.models import feeding

    prob = schedule.problem
    rows, _ = schedule_rows(schedule)
    try:
        _torch.lower(_torch.rows_to_actions(rows), prob.stages, prob.microbatches)
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise ExecutorError(f"{schedule.method}: PyTorch's runtime refuses the schedule: "
                            f"{exc}") from None
    with feeding(cfg.model, cfg.batch(prob.microbatches) // prob.microbatches):
        _build(schedule, cfg)


def run_graph(plan: GraphRun, cfg: RunConfig) -> RunResult:
    """Replay a data-parallel graph schedule (:func:`pipeopt.executor.collectives.graph_run`)
    on ``devices x replicas`` spawned ranks, or as this rank under torchrun (the result then
    on rank 0 only, others get None); step s is the schedule's iteration s."""
    if cfg.steps > plan.iterations:
        raise ExecutorError(f"steps: the schedule holds {plan.iterations} iteration(s), one per "
                            f"step, got {cfg.steps}")
    cfg = replace(cfg, data_parallel=plan.replicas)
    if check_dtype(cfg) != cfg.dtype:
        cfg = replace(cfg, dtype=check_dtype(cfg), rtol=RTOL64, atol=ATOL64)
    sched = plan_schedule(plan, 0, 0)
    _preflight(sched, cfg)
    backend = resolve_backend(cfg.backend)
    per_rank = start(run_rank, sched.problem.devices * plan.replicas,
                     (sched, cfg, backend, plan), cfg, backend)
    return None if per_rank is None else _assemble(sched, cfg, per_rank, plan)  # type: ignore


def check_dtype(cfg: RunConfig) -> str:
    """The dtype a data-parallel graph replay runs in: ``float64`` under ``--check`` (both
    the ranks and the reference), so that the order in which float32 would round the sums of
    gradients (the replicas' reduction against the reference's one sum, which AdamW's division
    by sqrt(v) + eps magnifies up to ``lr`` per element where a gradient nearly cancels) stays
    far below the tolerance while a wrong replay still moves the weights by about ``lr``;
    ``cfg.dtype`` otherwise, and under ``--autocast`` (which leaves float64 uncast). The
    float64 check compares with :data:`~pipeopt.executor.procs.RTOL64` / ``ATOL64``."""
    return "float64" if cfg.check and cfg.autocast is None else cfg.dtype


def run_pipeline(schedule: Schedule, cfg: RunConfig | None = None) -> RunResult:
    """Replay ``schedule`` on spawned local workers, or as this rank under torchrun (when
    ``RANK`` and ``WORLD_SIZE`` are set; the result then exists on rank 0 only, others get
    None)."""
    cfg = cfg or RunConfig()
    if not under_torchrun():
        return run_pipelines([(schedule, cfg)])[0]
    backend = resolve_backend(cfg.backend)
    per_rank = start(run_rank, schedule.problem.devices * cfg.data_parallel,
                     (schedule, cfg, backend), cfg, backend)
    return None if per_rank is None else _assemble(schedule, cfg, per_rank)  # type: ignore
