"""Replay of an asynchronous (periodic) pipeline on torch.distributed, with weight versions.

``pipeopt run async.json`` on a ``pipeopt-periodic`` document (:mod:`pipeopt.workloads.periodic`):
the pattern is unrolled for ``--steps`` x ``problem.microbatches`` micro-batches, each device
runs its tasks in the order of their unrolled start times (:func:`replay_orders`; warm-up and
drain included, never a flush), and activations and gradients cross ranks as point-to-point
messages posted in one global order (:func:`replay_messages`). PyTorch's pipelining runtime
flushes every step and keeps one weight version, so this is a small loop of its own.

Weights, per the schedule's policy (the module docstring of :mod:`pipeopt.workloads.periodic`):

* ``stash`` (PipeDream, SOSP'19, section 3.3): a forward runs on a copy of the stage's weights
  as they are at that moment (a *version*: the number of updates so far); the micro-batch's
  backward differentiates that same copy; its update applies the gradient to the newest
  weights, right after its last backward task. A copy is dropped once no micro-batch in flight
  uses it, so stage k of p holds ``p - k`` versions under 1F1B-async.
* ``2bw`` (PipeDream-2BW, ICML'21, section 3.1): as ``stash``, but the gradients of
  ``update_every`` micro-batches are averaged into one update, so at most two versions live.
* ``pipemare`` (MLSys'21): one version. The forward keeps only the stage's input; the backward
  runs the stage's forward again on the newest weights and differentiates that (the gradient at
  the weights of the backward, on the input the forward received; PipeMare itself keeps the
  forward's activations, which a generic model cannot re-weight).
* replicated stages (PipeDream's round-robin replicas, one rank each): a stage's replicas
  all-reduce the gradients of each round (one micro-batch per replica) and all apply their
  mean where the round's last backward task stands in the sequence (stash and pipemare);
  with ``2bw``, each replica sums ``update_every`` micro-batches of its own (a group of
  ``replicas x update_every`` micro-batches of the stage) before the all-reduce, as
  PipeDream-2BW's data-parallel replicas do (ICML'21, section 3.1). A group cut short by the
  end of the run is dropped (no rank joins an all-reduce that not every replica reaches).

A backward task (``B``) computes the input and the weight gradients; ``W`` (split backward)
applies the update. :func:`version_plan` derives from the sequence which version each
forward and backward uses; every rank reports the versions it used and the most it held, and
:func:`reference_async` recomputes every micro-batch's gradient in one process with the planned
versions and the same updates in the same order, which the run's gradients are compared with.
Backend: gloo (CPU). Every rank walks the same sequence of all ops and posts its messages in
the order of their producers in it (a :class:`~pipeopt.executor.procs.Mailbox`), so a rank
blocks only for an input whose producer comes earlier in the sequence, or for its round's
all-reduce, which every replica joined at its own backward, earlier too: no rank waits on a
later one. That order is made for NCCL too, but untested there (no machine here has two GPUs),
so the replay refuses it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeopt.errors import ConfigError
from pipeopt.executor.procs import (
    ExecutorError,
    Mailbox,
    RunConfig,
    check_run_flags,
    refuse,
    spawn_jobs,
    under_torchrun,
)
from pipeopt.problem import Op
from pipeopt.workloads.periodic import PeriodicSchedule

#: ``--steps`` of the async replay are iterations of the problem's ``microbatches``.
Orders = tuple[tuple[Op, ...], ...]


@dataclass(frozen=True)
class VersionPlan:
    """Which weight version (updates of the stage applied before it) each micro-batch's
    forward and backward use, per stage; the updates each stage applies in the run, and the
    most versions a stage holds at once (the newest weights and the copies in flight)."""

    forward: tuple[tuple[int, ...], ...]
    backward: tuple[tuple[int, ...], ...]
    updates: tuple[int, ...]
    held: tuple[int, ...]


def replay_sequence(schedule: PeriodicSchedule, microbatches: int) -> tuple[Op, ...]:
    """Every op of micro-batches ``0 .. microbatches - 1`` on every device, in the order of
    their start in the unrolled pattern (micro-batch j's copy starts ``j * period`` after 0's;
    ties by micro-batch, kind, then down the chain for F and up it for B and W, so that a
    producer comes before its consumer). Every rank walks this one sequence and posts its
    messages in the order of their producers in it (:func:`replay_messages`), so each pair of
    ranks posts its messages in the same order. Raises :class:`ExecutorError` for what the
    replay does not run (several stages on a device)."""
    p = schedule.problem
    if p.virtual_stages != 1 or sorted(p.stage_device) != list(range(p.devices)):
        raise ExecutorError("pipeline.virtual_stages: the async replay runs one stage per "
                            "device")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ExecutorError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    T = schedule.period
    timed = []
    for t in schedule.tasks:
        ki = p.kinds.index(t.kind)
        down = t.stage if t.kind == "F" else -t.stage
        timed += [(t.start + j * T, j, ki, down, Op(t.kind, t.stage, j))
                  for j in range(microbatches)]
    return tuple(op for *_, op in sorted(timed))


def rank_of(schedule: PeriodicSchedule, stage: int, microbatch: int) -> int:
    """The rank that runs ``microbatch`` on ``stage``: stage k's replica ``j mod replicas[k]``,
    ranks numbered stage by stage (as :func:`~pipeopt.workloads.periodic.replicated_graph`
    numbers devices; one stage per device, so stage k is device k)."""
    reps = schedule.replicas
    return sum(reps[:stage]) + microbatch % reps[stage]


def replay_orders(schedule: PeriodicSchedule, microbatches: int) -> Orders:
    """Per rank (:func:`rank_of`), its ops of :func:`replay_sequence`. Raises
    :class:`ExecutorError` as it does, and for an order a one-device loop cannot follow (a
    kind out of micro-batch order, a backward before its forward)."""
    p = schedule.problem
    rows: list[list[Op]] = [[] for _ in range(sum(schedule.replicas))]
    for op in replay_sequence(schedule, microbatches):
        rows[rank_of(schedule, op.stage, op.microbatch)].append(op)
    orders = tuple(tuple(row) for row in rows)
    for d, order in enumerate(orders):  # what the loop relies on: FIFO per kind, F < B < W
        seen: dict[str, int] = {}
        for op in order:
            r = schedule.replicas[op.stage]
            prev = p.kinds[p.kinds.index(op.kind) - 1] if op.kind != "F" else None
            if seen.get(op.kind, op.microbatch % r - r) != op.microbatch - r or (
                    prev is not None and seen.get(prev, -1) < op.microbatch):
                raise ExecutorError(f"device {d}: the pattern runs {op} out of micro-batch "
                                    "order; the replay needs each kind in micro-batch order")
            seen[op.kind] = op.microbatch
    return orders


def replay_messages(schedule: PeriodicSchedule, sequence: Sequence[Op]
                    ) -> list[tuple[Op, int, int]]:
    """The replay's point-to-point messages in the order of ``sequence``
    (:func:`replay_sequence`), each keyed by the op that sends it: a forward's output to the
    next stage, a backward's input gradient to the stage before; with the source and the
    destination rank (:func:`rank_of`)."""
    out = []
    for op in sequence:
        to = op.stage + 1 if op.kind == "F" else op.stage - 1 if op.kind == "B" else -1
        if 0 <= to < schedule.problem.stages:
            out.append((op, rank_of(schedule, op.stage, op.microbatch),
                        rank_of(schedule, to, op.microbatch)))
    return out


def update_group(schedule: PeriodicSchedule, stage: int) -> int:
    """Micro-batches of ``stage`` whose gradients one update averages: ``update_every`` per
    replica (2BW; 1 otherwise) times its replicas (one all-reduce among them per group). The
    update is applied where the group's last micro-batch's last backward task stands in
    :func:`replay_sequence`, on every replica."""
    return schedule.replicas[stage] * (schedule.update_every if schedule.policy == "2bw"
                                       else 1)


def version_plan(schedule: PeriodicSchedule, sequence: Sequence[Op]) -> VersionPlan:
    """The weight versions of a replay of this :func:`replay_sequence` (see
    :class:`VersionPlan`; ``held`` per stage: the most on one of its replicas)."""
    p = schedule.problem
    n = max((op.microbatch for op in sequence), default=-1) + 1
    last = p.kinds[-1]
    fwd = [[0] * n for _ in range(p.stages)]
    bwd = [[0] * n for _ in range(p.stages)]
    updates = [0] * p.stages
    held = [1] * p.stages
    stash = schedule.policy != "pipemare"
    in_flight: dict[int, dict[int, int]] = {}  # rank -> its micro-batches in flight -> version
    for op in sequence:
        k, j, v = op.stage, op.microbatch, updates[op.stage]
        mine = in_flight.setdefault(rank_of(schedule, k, j), {})
        if op.kind == "F":
            fwd[k][j] = v
            if stash:
                mine[j] = v
                held[k] = max(held[k], len({v, *mine.values()}))
        if op.kind == "B":
            bwd[k][j] = fwd[k][j] if stash else v
        if op.kind == last:
            mine.pop(j, None)
            if (j + 1) % update_group(schedule, k) == 0:
                updates[k] += 1  # on every replica: each holds the new weights beside its own
                for c in range(schedule.replicas[k]):
                    stashed = in_flight.get(rank_of(schedule, k, c), {}).values()
                    held[k] = max(held[k], len({updates[k], *stashed}))
    return VersionPlan(tuple(map(tuple, fwd)), tuple(map(tuple, bwd)), tuple(updates),
                       tuple(held))


# ----- the run ----------------------------------------------------------------------------------
@dataclass
class AsyncRunResult:
    """The outcome of an async replay; times in seconds (``predicted_time``: the unrolled
    pattern's makespan in the problem's time unit, seconds when it came from a profile)."""

    method: str
    policy: str
    world: int
    microbatches: int
    losses: list[float]  # per micro-batch, the loss of its forward (mean over its samples)
    wall_time: float
    predicted_time: float
    plan: VersionPlan
    held: list[int]  # per stage, the most versions the run held at once
    versions_match: bool  # every rank used the planned version for every forward / backward
    op_costs: dict[tuple[str, int], float] = field(default_factory=dict)
    max_abs_grad_diff: float | None = None
    grads_match: bool | None = None
    worst_param: str | None = None
    reference_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {"method": self.method, "policy": self.policy, "ranks": self.world,
                "microbatches": self.microbatches, "losses": self.losses,
                "wall_time": self.wall_time, "predicted_time": self.predicted_time,
                "weight_versions_held": self.held,
                "weight_versions_planned": list(self.plan.held),
                "updates": list(self.plan.updates), "versions_match": self.versions_match,
                "op_costs": {f"{kind}{k}": v for (kind, k), v in self.op_costs.items()},
                "max_abs_grad_diff": self.max_abs_grad_diff, "grads_match": self.grads_match,
                "worst_param": self.worst_param}


def _functional(mod: Any, params: dict[str, Any], x: Any) -> Any:
    from torch.func import functional_call

    return functional_call(mod, params, (x,))


def _boundaries(spec: Any, stages: Sequence[Any], x: Any) -> list[tuple[Any, Any]]:
    """(shape, dtype) of the tensor that enters each stage (stage 0: the data), from one
    micro-batch's forward (:func:`~pipeopt.executor.launch.stage_io`); ExecutorError when a
    stage hands on more than one floating-point tensor."""
    from pipeopt.executor.launch import stage_io

    outs = stage_io(stages, x)
    for k, h in enumerate(outs[1:-1]):
        if isinstance(h, tuple):
            raise ExecutorError(f"model: {spec.name}'s stage {k} hands on a tuple; the async "
                                "replay passes one floating-point tensor between stages")
    return [(tuple(h.shape), h.dtype) for h in outs[:-1]]


def _run_rank(rank: int, world: int, device: Any, schedule: PeriodicSchedule, cfg: RunConfig,
              status: Any) -> dict[str, Any]:
    """Replay ``schedule``'s rank ``rank`` (process group joined; stage k's replica c, see
    :func:`rank_of`): returns the versions its micro-batches used and the most it held, its
    micro-batches' losses (last stage), op durations (s), wall time, and with ``cfg.check``
    every micro-batch's weight gradient and the final weights. A replicated stage all-reduces
    the gradients of each round (one micro-batch per replica) and every replica applies their
    mean where the round's last backward task stands in the sequence."""
    import torch
    import torch.distributed as dist

    from pipeopt.executor.check import batch_for, optimizer
    from pipeopt.executor.models import model_stages

    prob = schedule.problem
    reps = schedule.replicas
    m = prob.microbatches
    n = cfg.steps * m
    sequence = replay_sequence(schedule, n)
    replay_orders(schedule, n)  # its checks
    firsts = [sum(reps[:i]) for i in range(prob.stages)]
    k = max(i for i in range(prob.stages) if firsts[i] <= rank)
    c, r = rank - firsts[k], reps[k]
    last_stage = k == prob.stages - 1
    # Every rank creates every replicated stage's group, in stage order (torch requires it).
    groups = {i: dist.new_group(list(range(firsts[i], firsts[i] + reps[i])), backend="gloo")
              for i in range(prob.stages) if reps[i] > 1}
    spec, stages = model_stages(cfg, prob)
    bs = cfg.batch(m)
    batches: dict[int, tuple[list[Any], list[Any]]] = {}

    def data(j: int) -> tuple[Any, Any]:
        """Micro-batch j's inputs and targets (read at its forward, in micro-batch order: one
        iteration's batch is kept at a time)."""
        it = j // m
        if it not in batches:
            batches.clear()
            batches[it] = batch_for(spec, bs, cfg.seed, it, m)
        xs, ys = batches[it]
        return xs[j % m].to(device), ys[j % m].to(device)

    io = _boundaries(spec, stages, data(0)[0].cpu())
    mod = stages[k].to(device)
    live = dict(mod.named_parameters())
    opt = optimizer(cfg.optimizer, list(live.values()), cfg.lr)
    stash = schedule.policy != "pipemare"
    group_size = update_group(schedule, k)
    last_kind = prob.kinds[-1]
    version = 0
    copies: dict[int, dict[str, Any]] = {}  # version -> the weights as they were (stash, 2bw)
    saved: dict[int, tuple[Any, ...]] = {}  # micro-batch -> what its backward needs
    used: dict[int, int] = {}  # micro-batch in flight -> its version
    wgrads: dict[int, tuple[Any, ...]] = {}
    acc: list[Any] | None = None
    reducing: dict[int, tuple[Any, Any]] = {}  # group -> (work, flat gradients) all-reducing
    losses: dict[int, float] = {}
    fwd_v: dict[int, int] = {}
    bwd_v: dict[int, int] = {}
    grads_out: dict[int, dict[str, Any]] = {}
    held = 1
    durations: dict[str, list[float]] = {}

    def buffer(src: Op) -> Any:  # stage k's input, or the gradient of its output
        shape, dtype = io[k] if src.kind == "F" else io[k + 1]
        return torch.empty(shape, dtype=dtype, device=device)

    mail = Mailbox(rank, replay_messages(schedule, sequence), buffer)

    def weights(v: int) -> dict[str, Any]:
        if v not in copies:
            copies[v] = {name: q.detach().clone().requires_grad_(True)
                         for name, q in live.items()}
        return copies[v]

    def update(total: list[Any]) -> None:
        """Apply the mean of a group's gradients (``total``: their sum) to the newest weights;
        drop the copies no micro-batch in flight reads."""
        nonlocal version, held
        for q, t in zip(live.values(), total, strict=True):
            q.grad = t / group_size
        opt.step()
        opt.zero_grad(set_to_none=True)
        version += 1
        for v in [v for v in copies if v not in used.values()]:
            del copies[v]
        held = max(held, len({version, *used.values()}))

    dist.barrier()
    t0 = time.perf_counter()
    for op in sequence:
        j, it = op.microbatch, op.microbatch // m
        a = time.perf_counter()
        mine = op.stage == k and j % r == c
        if mine and op.kind == "F":
            x, y = data(j)
            if k:
                status.text = f"step {it}: {op} waits for the output of {op.stage - 1}F{j}"
                x = mail.take(Op("F", k - 1, j)).requires_grad_(True)
            status.text = f"step {it}: running {op}"
            a = time.perf_counter()
            fwd_v[j] = version
            if stash:
                used[j] = version
                out = _functional(mod, weights(version), x)
                held = max(held, len({version, *used.values()}))
            else:
                with torch.no_grad():
                    out = _functional(mod, live, x)
            if last_stage:
                out = spec.loss_fn(out, y)
                losses[j] = float(out.detach())
            else:
                mail.send(op, out)
            saved[j] = (x, out) if stash else (x.detach(), y)
        elif mine and op.kind == "B":
            g = None
            if not last_stage:
                status.text = f"step {it}: {op} waits for the gradient of {op.stage + 1}B{j}"
                g = mail.take(Op("B", k + 1, j))
            status.text = f"step {it}: running {op}"
            a = time.perf_counter()
            if stash:
                x, out = saved.pop(j)
                params = copies[used[j]]
                bwd_v[j] = used[j]
            else:
                x, y = saved.pop(j)
                x = x.requires_grad_(k > 0)
                params = live
                bwd_v[j] = version
                out = _functional(mod, live, x)
                if last_stage:
                    out = spec.loss_fn(out, y)
            inputs = ([x] if k else []) + list(params.values())
            grads = torch.autograd.grad(out, inputs, grad_outputs=g)
            if k:
                mail.send(op, grads[0])
            wgrads[j] = grads[1:] if k else grads
        if mine and op.kind == last_kind:
            status.text = f"step {it}: running {op}"
            g_j = wgrads.pop(j)
            used.pop(j, None)
            if cfg.check:
                grads_out[j] = {name: t.detach().cpu().numpy().copy()
                                for name, t in zip(live, g_j, strict=True)}
            acc = list(g_j) if acc is None else [u + t for u, t in zip(acc, g_j, strict=True)]
            # This replica's last micro-batch of its group (in its last round): its share,
            # summed over the replicas; only for a group the run completes.
            if r > 1 and j % group_size >= group_size - r and (
                    j // group_size + 1) * group_size <= n:
                flat = torch.cat([t.reshape(-1) for t in acc])
                reducing[j // group_size] = (
                    dist.all_reduce(flat, group=groups[k], async_op=True), flat)
                acc = None
        if op.stage == k and op.kind == last_kind and (j + 1) % group_size == 0:
            if r > 1:  # the group's last backward: every replica applies the mean here
                status.text = f"step {it}: {op} waits for the all-reduce of stage {k}"
                work, flat = reducing.pop(j // group_size)
                work.wait()
                total = [t.view_as(q) for t, q in zip(
                    flat.split([q.numel() for q in live.values()]), live.values(),
                    strict=True)]
                update(total)
            else:
                assert acc is not None  # the group's gradients, summed above
                update(acc)
                acc = None
        if mine:
            durations.setdefault(f"{op.kind}{op.stage}", []).append(time.perf_counter() - a)
    status.text = f"step {cfg.steps - 1}: waiting for its sends to complete"
    mail.finish()
    wall = time.perf_counter() - t0
    for work, _ in reducing.values():  # none expected: every all-reduce is waited above
        work.wait()
    dist.barrier()
    for g in groups.values():  # this job's; left alive each keeps gloo threads and fds
        dist.destroy_process_group(g)
    final = {name: q.detach().cpu().numpy().copy() for name, q in live.items()} \
        if cfg.check else {}
    return {"stage": k, "replica": c, "forward": fwd_v, "backward": bwd_v, "held": held,
            "losses": losses, "op_durations": durations, "wall": wall, "grads": grads_out,
            "final": final}


def reference_async(schedule: PeriodicSchedule, cfg: RunConfig, plan: VersionPlan
                    ) -> dict[str, Any]:
    """One process, no pipelining: micro-batch by micro-batch, the forward through every
    stage on the version :attr:`VersionPlan.forward` names, the gradient of its loss on the
    versions :attr:`VersionPlan.backward` names (the same, but for ``pipemare``, whose backward
    runs each stage again from its input), then each stage's update, in micro-batch order, as
    the run applies them (the mean of each :func:`update_group`'s gradients). Returns per
    micro-batch its loss and per stage its weight gradients, and the final weights (numpy
    arrays)."""
    import torch

    from pipeopt.executor.check import batch_for, optimizer
    from pipeopt.executor.models import model_stages

    prob = schedule.problem
    m = prob.microbatches
    n = cfg.steps * m
    spec, stages = model_stages(cfg, prob)
    live = [dict(mod.named_parameters()) for mod in stages]
    opts = [optimizer(cfg.optimizer, list(w.values()), cfg.lr) for w in live]
    versions: list[list[dict[str, Any]]] = [[{name: q.detach().clone() for name, q in w.items()}]
                                            for w in live]
    acc: list[list[Any] | None] = [None] * prob.stages
    losses: list[float] = []
    grads: list[list[dict[str, Any]]] = []
    for j in range(n):
        xs, ys = batch_for(spec, cfg.batch(m), cfg.seed, j // m, m)
        x, y = xs[j % m], ys[j % m]

        def params(k: int, v: int) -> dict[str, Any]:
            return {name: t.clone().requires_grad_(True) for name, t in versions[k][v].items()}

        if schedule.policy != "pipemare":  # one graph through the chain, its versions
            ps = [params(k, plan.forward[k][j]) for k in range(prob.stages)]
            h = x
            for k, mod in enumerate(stages):
                h = _functional(mod, ps[k], h)
            loss = spec.loss_fn(h, y)
            flat = torch.autograd.grad(loss, [t for p_ in ps for t in p_.values()])
            got, i = [], 0
            for p_ in ps:
                got.append(dict(zip(p_, flat[i:i + len(p_)], strict=True)))
                i += len(p_)
        else:  # forward on the forward's versions, each stage's backward on its own
            inputs, h = [], x
            with torch.no_grad():
                for k, mod in enumerate(stages):
                    inputs.append(h)
                    h = _functional(mod, versions[k][plan.forward[k][j]], h)
                loss = spec.loss_fn(h, y)
            got = [{} for _ in stages]
            g = None
            for k in reversed(range(prob.stages)):
                xk = inputs[k].clone().requires_grad_(k > 0)
                pk = params(k, plan.backward[k][j])
                out = _functional(stages[k], pk, xk)
                if k == prob.stages - 1:
                    out = spec.loss_fn(out, y)
                res = torch.autograd.grad(out, ([xk] if k else []) + list(pk.values()),
                                          grad_outputs=g)
                g = res[0] if k else None
                got[k] = dict(zip(pk, res[1:] if k else res, strict=True))
        losses.append(float(loss.detach()))
        grads.append([{name: t.detach().numpy().copy() for name, t in d.items()} for d in got])
        for k in range(prob.stages):
            gk = list(got[k].values())
            acc[k] = gk if acc[k] is None else [s + t for s, t in zip(acc[k], gk, strict=True)]
            size = update_group(schedule, k)
            if (j + 1) % size == 0:
                for q, s in zip(live[k].values(), acc[k], strict=True):
                    q.grad = s / size
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
                acc[k] = None
                versions[k].append({name: q.detach().clone() for name, q in live[k].items()})
    final = [{name: q.detach().numpy().copy() for name, q in w.items()} for w in live]
    return {"losses": losses, "grads": grads, "final": final}


def _preflight(schedule: PeriodicSchedule, cfg: RunConfig) -> None:
    """Build the model, cut it into the schedule's stages and run one micro-batch forward in
    this process, as every rank will: ModelError / ExecutorError here, before any rank
    starts."""
    from pipeopt.executor.check import batch_for
    from pipeopt.executor.models import feeding, model_stages

    prob = schedule.problem
    bs = cfg.batch(prob.microbatches)
    spec, stages = model_stages(cfg, prob)
    with feeding(cfg.model, bs // prob.microbatches):
        _boundaries(spec, stages, batch_for(spec, bs, cfg.seed, 0, prob.microbatches)[0][0])


def run_async(jobs: Sequence[tuple[PeriodicSchedule, RunConfig]]) -> list[AsyncRunResult]:
    """Replay each (schedule, :class:`~pipeopt.executor.procs.RunConfig`) in one set of
    spawned gloo ranks (every schedule on the same number of devices), one after the other;
    with ``check``, compare every micro-batch's gradients, the losses and the final weights
    with :func:`reference_async` (``rtol``, ``atol`` of the config)."""
    from pipeopt.executor.check import compare_grads
    from pipeopt.executor.launch import op_costs

    if not jobs:
        return []
    world = sum(jobs[0][0].replicas)
    plans = []
    for s, c in jobs:
        if sum(s.replicas) != world:
            raise ExecutorError("run_async: every job must have the same number of ranks "
                                "(devices of every stage's replicas)")
        if c.backend == "nccl":
            raise ExecutorError("backend: the async replay runs on gloo (not yet tested on "
                                "NCCL, which needs a GPU per rank)")
        plans.append(version_plan(s, replay_sequence(s, c.steps * s.problem.microbatches)))
        _preflight(s, c)
    out = []  # each job's reports in rank order: stage by stage, replicas in order
    for (s, c), plan, reports in zip(jobs, plans, spawn_jobs(_run_rank, world, jobs, "gloo"),
                                     strict=True):
        stages = s.problem.stages
        n = c.steps * s.problem.microbatches
        owner = {(k, j): reports[rank_of(s, k, j)] for k in range(stages) for j in range(n)}
        losses = {j: owner[(stages - 1, j)]["losses"][j] for j in range(n)}
        res = AsyncRunResult(
            s.method, s.policy, world, n, [losses[j] for j in range(n)],
            max(r["wall"] for r in reports), s.span + (n - 1) * s.period, plan,
            [max(r["held"] for r in reports if r["stage"] == k) for k in range(stages)],
            all(owner[(k, j)]["forward"][j] == plan.forward[k][j]
                and owner[(k, j)]["backward"][j] == plan.backward[k][j]
                for k in range(stages) for j in range(n)),
            op_costs(reports))
        if c.check:
            ref = reference_async(s, c, plan)
            got: dict[int, dict[str, Any]] = {k: {} for k in range(stages)}
            want: dict[int, dict[str, Any]] = {k: {} for k in range(stages)}
            for k in range(stages):
                for j in range(n):
                    for name, a in owner[(k, j)]["grads"][j].items():
                        got[k][f"mb{j}.{name}"] = a
                        want[k][f"mb{j}.{name}"] = ref["grads"][j][k][name]
            for r in reports:  # every replica ends with the reference's weights
                for name, a in r["final"].items():
                    got[r["stage"]][f"final.r{r['replica']}.{name}"] = a
                    want[r["stage"]][f"final.r{r['replica']}.{name}"] = \
                        ref["final"][r["stage"]][name]
            cmp = compare_grads(got, want, c.rtol, c.atol)
            res.reference_losses = ref["losses"]
            res.max_abs_grad_diff = cmp.max_abs_grad_diff
            res.worst_param = cmp.worst
            res.grads_match = cmp.ok and all(
                math.isclose(a, b, rel_tol=c.rtol, abs_tol=c.atol)
                for a, b in zip(res.losses, ref["losses"], strict=True))
        out.append(res)
    return out


# ----- the command line -------------------------------------------------------------------------
def check_async_args(args: argparse.Namespace, schedule: PeriodicSchedule) -> None:
    """Refuse the ``run`` flags the async replay does not take, naming the flag; check its
    own (no torch imported)."""
    refuse((("--data-parallel", args.data_parallel != 1, "replicate stages in the "
                 "schedule instead (pipeline.replicas)"),
                ("--recompute", args.recompute, "not in the async replay"),
                ("--autocast", args.autocast is not None, "not in the async replay"),
                ("--clip-grad-norm", args.clip_grad_norm is not None,
                 "not in the async replay (each update is a micro-batch's own)"),
                ("--torch-split", args.torch_split, "the async replay has its own backward"),
                ("--costs-out", bool(args.costs_out), "not written for a periodic schedule"),
                ("--backend nccl", args.backend == "nccl", "the async replay runs on gloo "
                 "(not yet tested on NCCL)"),
                ("run", under_torchrun(), "the async replay starts its own ranks; not under "
                 "torchrun")))
    check_run_flags(args, sum(schedule.replicas), schedule.problem.microbatches)
    try:
        replay_orders(schedule, args.steps * schedule.problem.microbatches)
    except ExecutorError as exc:
        raise ConfigError(f"{args.schedule}: {exc}") from None


def cmd_run_async(args: argparse.Namespace, schedule: PeriodicSchedule) -> int:
    """``pipeopt run`` of a periodic schedule: replay, print, exit 1 on a mismatch (a failed
    rank: :func:`~pipeopt.executor.cli.cmd_run`)."""
    check_async_args(args, schedule)
    cfg = RunConfig.from_args(args, backend="gloo")
    (res,) = run_async([(schedule, cfg)])
    bad = not res.versions_match or (args.check and not res.grads_match)
    if args.json:
        print(json.dumps({**res.to_dict(), "schedule": args.schedule, "model": args.model,
                          "tolerance": {"rtol": cfg.rtol, "atol": cfg.atol}}))
        return 1 if bad else 0
    m = schedule.problem.microbatches
    print(f"schedule      {args.schedule} ({res.method}, async, weights: {res.policy}, "
          f"{res.world} ranks)")
    print(f"model         {args.model}, {res.microbatches} micro-batches of "
          f"{cfg.batch(m) // m} ({args.steps} x {m})")
    last = res.losses[-m:]
    print(f"loss          {statistics.fmean(last):.6g} (mean of the last {len(last)} "
          "micro-batches)")
    print(f"time          {res.wall_time:.6g} s measured, {res.wall_time / res.microbatches:.4g}"
          f" s per micro-batch (predicted {res.predicted_time:.6g} s, period "
          f"{schedule.period:.4g} s; the problem's times read as seconds)")
    print(f"versions      held {res.held} per stage (planned {list(res.plan.held)}, the "
          f"schedule's steady state {list(schedule.weight_versions)}); every forward and "
          f"backward on its planned version: {'yes' if res.versions_match else 'NO'}")
    if args.check:
        verdict = "ok" if res.grads_match else "MISMATCH"
        print(f"grad diff     {res.max_abs_grad_diff:.3g} max abs over every micro-batch's "
              f"gradients and the final weights, against one process with the same versions "
              f"({verdict}; rtol {cfg.rtol:g}, atol {cfg.atol:g}; worst {res.worst_param})")
    return 1 if bad else 0
