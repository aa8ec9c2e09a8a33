"""How a schedule runs (:class:`RunConfig`), the non-pipelined reference (the same
micro-batches, seed, initial weights and training recipe in one process) and the comparison of
its gradients with a pipelined run's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeopt.executor.models import build_model, split_stages
from pipeopt.executor.procs import ExecutorError, Fault
from pipeopt.executor.runtime import StageModule
from pipeopt.problem import Problem

#: Default tolerance of the gradient comparison (fp32): |a - b| <= ATOL + RTOL * |b|.
RTOL = 1e-5
ATOL = 1e-5

Grads = dict[int, dict[str, np.ndarray]]


@dataclass(frozen=True)
class Comparison:
    """Largest absolute gradient difference, whether every element is within tolerance, and
    the worst parameter (``stage.name``)."""

    max_abs_grad_diff: float
    ok: bool
    worst: str
    compared: int


def batch_for(spec: Any, batch_size: int, seed: int, step: int, microbatches: int
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The micro-batches of training step ``step`` (the same in every process)."""
    x, y = spec.make_batch(batch_size, seed + 1000 + step)
    return list(x.tensor_split(microbatches)), list(y.tensor_split(microbatches))


def stage_grads(modules: dict[int, torch.nn.Module]) -> Grads:
    """The ``.grad`` of every parameter, per stage, as numpy arrays (zeros when unset)."""
    out: Grads = {}
    for k, mod in modules.items():
        out[k] = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
                  .detach().cpu().numpy().copy() for name, p in mod.named_parameters()}
    return out


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


@dataclass(frozen=True)
class RunConfig:
    """How to run a schedule: model name and factory keywords, training steps, batch size
    (default 4 per micro-batch), learning rate, seed, timeout of the whole run and of one op
    or message (seconds), backend (``auto``: nccl with CUDA, else gloo), intra-op threads per
    rank (default: cores / ranks), whether to compare with the one-process reference, the
    optimizer (``sgd``, ``adamw``), gradient clipping to a global norm, autocast (``bf16``,
    ``fp16``) and whether a split backward runs per layer (pipeopt's refinement) or as
    PyTorch's whole-stage split. ``torch_schedule``: run PyTorch's own schedule class of that
    name (e.g. ``Schedule1F1B``) on the same stages instead of the schedule's orders (a
    baseline for benchmarks). ``data_parallel``: replicas of the pipeline (rank = replica *
    devices + pipeline rank), each on its own share of a batch ``data_parallel`` times as
    large, gradients averaged over the replicas after each step. ``recompute``: ``None``
    checkpoints activations where the schedule's problem says (model form: ``full``
    recompute, see :func:`~pipeopt.executor.models.recompute_plan`), ``full`` / ``none``
    on every stage whatever it says."""

    model: str = "mlp"
    model_options: tuple[tuple[str, Any], ...] = ()
    steps: int = 1
    batch_size: int | None = None
    lr: float = 0.01
    seed: int = 0
    timeout: float = 300.0
    backend: str = "auto"
    threads: int | None = None
    check: bool = False
    rtol: float = RTOL
    atol: float = ATOL
    fault: Fault | None = None
    op_timeout: float = 120.0
    optimizer: str = "sgd"
    clip_grad_norm: float | None = None
    autocast: str | None = None
    per_layer_split: bool = True
    torch_schedule: str | None = None
    data_parallel: int = 1
    recompute: str | None = None

    def batch(self, microbatches: int) -> int:
        """The batch size for ``microbatches``; must split evenly."""
        bs = self.batch_size or 4 * microbatches
        if bs % microbatches:
            raise ExecutorError(f"batch_size: {bs} does not split into {microbatches} equal "
                                "micro-batches")
        return bs

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw") or (self.autocast or "bf16") not in AUTOCAST:
            raise ValueError(f"optimizer {self.optimizer!r} / autocast {self.autocast!r}: "
                             f"expected sgd or adamw / {', '.join(AUTOCAST)} or None")


def reference_run(problem: Problem, cfg: RunConfig, replicas: int = 1) -> dict[str, Any]:
    """Train as ``cfg`` says (optimizer, clipping, autocast, ...) without pipelining, on the
    batches of ``replicas`` pipelines split into as many micro-batches as they ran; returns
    per-step losses and step times (seconds) and the gradients of the last step per stage
    (after clipping)."""
    spec = build_model(cfg.model, problem, seed=cfg.seed, **dict(cfg.model_options))
    stages = split_stages(spec, problem)
    runs = [StageModule(mod, AUTOCAST[cfg.autocast] if cfg.autocast else None)
            for mod in stages]
    params = [p for mod in stages for p in mod.parameters()]
    opt = optimizer(cfg.optimizer, params, cfg.lr)
    m = problem.microbatches * replicas
    losses, times = [], []
    for step in range(cfg.steps):
        xs, ys = batch_for(spec, cfg.batch(problem.microbatches) * replicas, cfg.seed, step, m)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            h: Any = x
            for run in runs:
                h = run(*h) if isinstance(h, tuple) else run(h)
            loss = spec.loss_fn(h, y) / m
            loss.backward()
            total += loss.item()
        if cfg.clip_grad_norm is not None:
            clip_grads(params, cfg.clip_grad_norm)
        grads = stage_grads(dict(enumerate(stages))) if step == cfg.steps - 1 else None
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    return {"losses": losses, "step_times": times, "grads": grads}


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
