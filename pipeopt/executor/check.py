"""The non-pipelined reference of a run (the same micro-batches, seed, initial weights and
training recipe as :class:`~pipeopt.executor.procs.RunConfig` says, in one process) and the
comparison of its gradients with a pipelined run's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeopt.executor.models import model_stages
from pipeopt.executor.procs import ATOL, AUTOCAST_NAMES, RTOL, RunConfig
from pipeopt.executor.runtime import StageModule, call
from pipeopt.problem import Problem

Grads = dict[int, dict[str, np.ndarray]]


@dataclass(frozen=True)
class Comparison:
    """Largest absolute gradient difference, whether every element is within tolerance, and
    the worst parameter (``stage.name``)."""

    max_abs_grad_diff: float
    ok: bool
    worst: str
    compared: int


def batch_for(spec: Any, batch_size: int, seed: int, step: int, microbatches: int,
              dtype: str = "float32") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The micro-batches of training step ``step`` (the same in every process), floating
    tensors in ``dtype`` (token ids stay integers)."""
    x, y = (cast(t, dtype) for t in spec.make_batch(batch_size, seed + 1000 + step))
    return list(x.tensor_split(microbatches)), list(y.tensor_split(microbatches))


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def cast(x: Any, dtype: str) -> Any:
    """A floating tensor, or a module's parameters and buffers (in place), in ``dtype``
    (:data:`DTYPES`); anything else as it is."""
    if isinstance(x, torch.nn.Module):
        return x.to(DTYPES[dtype])
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(DTYPES[dtype])
    return x


def stage_weights(modules: dict[int, torch.nn.Module], grads: bool = False) -> Grads:
    """Every parameter's value (with ``grads``: its ``.grad``, zeros when unset), per stage,
    as numpy arrays."""
    return {k: {name: (p if not grads else p.grad if p.grad is not None
                       else torch.zeros_like(p)).detach().cpu().numpy().copy()
                for name, p in mod.named_parameters()} for k, mod in modules.items()}


def stage_grads(modules: dict[int, torch.nn.Module]) -> Grads:
    """The ``.grad`` of every parameter, per stage, as numpy arrays (zeros when unset)."""
    return stage_weights(modules, grads=True)


AUTOCAST = dict(zip(AUTOCAST_NAMES, (torch.bfloat16, torch.float16), strict=True))


def optimizer(name: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """``sgd`` or ``adamw`` (torch's defaults besides the learning rate)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer: must be sgd or adamw, got {name!r}")


def clip_grads(params: list[torch.nn.Parameter], max_norm: float,
               total: Callable[[torch.Tensor], object] = lambda t: None) -> None:
    """torch's ``clip_grad_norm_`` of ``params`` to the global norm ``max_norm``; ``total`` sums
    the squared norm over processes in place (an all-reduce) when the parameters are spread
    over several."""
    sq = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).double()
    sq = sq.pow(2)
    total(sq)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


def reference_run(problem: Problem, cfg: RunConfig, replicas: int = 1,
                  delay: int | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says (optimizer, clipping, autocast, ...) without pipelining, on the
    batches of ``replicas`` pipelines split into as many micro-batches as they ran; returns
    per-step losses and step times (seconds), the gradients of the last step per stage
    (after clipping) and the final weights, all in ``cfg.dtype``. ``delay`` D: step t's
    gradients go through the optimizer after step t + D - 1 (D = 2: one step late), the last
    ones after the last step (:mod:`pipeopt.executor.collectives`); None: right after step
    t."""
    spec, stages = model_stages(cfg, problem)
    stages = [cast(mod, cfg.dtype) for mod in stages]
    runs = [StageModule(mod, AUTOCAST[cfg.autocast] if cfg.autocast else None)
            for mod in stages]
    params = [p for mod in stages for p in mod.parameters()]
    opt = optimizer(cfg.optimizer, params, cfg.lr)
    m = problem.microbatches * replicas
    losses, times = [], []
    pending: list[list[torch.Tensor]] = []

    def update(grads: list[torch.Tensor]) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    for step in range(cfg.steps):
        xs, ys = batch_for(spec, cfg.batch(problem.microbatches) * replicas, cfg.seed, step, m,
                           cfg.dtype)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            h: Any = x
            for run in runs:
                h = call(run, h)
            loss = spec.loss_fn(h, y) / m
            loss.backward()
            total += loss.item()
        if cfg.clip_grad_norm is not None:
            clip_grads(params, cfg.clip_grad_norm)
        grads = stage_grads(dict(enumerate(stages))) if step == cfg.steps - 1 else None
        if delay is None:
            opt.step()
        else:
            pending.append([p.grad if p.grad is not None else torch.zeros_like(p)
                            for p in params])
            if len(pending) >= delay:
                update(pending.pop(0))
        times.append(time.perf_counter() - t0)
        losses.append(total)
    while pending:
        update(pending.pop(0))
    return {"losses": losses, "step_times": times, "grads": grads,
            "weights": stage_weights(dict(enumerate(stages)))}


def compare_replicas(got: list[Grads], ref: Grads, rtol: float = RTOL, atol: float = ATOL
                     ) -> Comparison:
    """:func:`compare_grads` of every replica's gradients (or weights) with the one reference
    (each replica must hold them all after the average): the worst difference, ok only when
    every replica is, the worst parameter named with its replica (``stage.name (replica r)``)
    when there are several."""
    worst: Comparison | None = None
    ok, n = True, 0
    for r, g in enumerate(got):
        c = compare_grads(g, ref, rtol, atol)
        ok, n = ok and c.ok, n + c.compared
        if len(got) > 1:
            c = Comparison(c.max_abs_grad_diff, c.ok, f"{c.worst} (replica {r})", c.compared)
        if worst is None or c.max_abs_grad_diff > worst.max_abs_grad_diff:
            worst = c
    if worst is None:
        return Comparison(float("inf"), False, "no replica", 0)
    return Comparison(worst.max_abs_grad_diff, ok, worst.worst, n)


def compare_grads(got: Grads, ref: Grads, rtol: float = RTOL, atol: float = ATOL
                  ) -> Comparison:
    """Compare pipelined gradients ``got`` with the reference, parameter by parameter."""
    worst, worst_name, ok, n = 0.0, "", True, 0
    for k, ref_params in ref.items():
        if k not in got:
            return Comparison(float("inf"), False, f"stage {k} (missing)", n)
        for name, b in ref_params.items():
            a = got[k].get(name)
            if a is None or a.shape != b.shape:
                return Comparison(float("inf"), False, f"{k}.{name} (missing)", n)
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            d = float(diff.max(initial=0.0))
            if not np.all(diff <= atol + rtol * np.abs(b)):
                ok = False
            if d >= worst:
                worst, worst_name = d, f"{k}.{name}"
            n += 1
    return Comparison(worst, ok, worst_name, n)
