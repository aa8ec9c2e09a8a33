"""Per-rank replay of a schedule on torch.distributed.

Each rank holds the stages of its device and runs its ops in the schedule's order (by start
time): ``F`` runs the stage forward and sends the activation; ``B`` computes the input gradient
and sends it upstream (the whole backward when the problem fuses it); ``W`` accumulates the
weight gradients into ``.grad``. Messages follow :mod:`pipeopt.executor.comms`: every receive
of the step is posted up front (gloo) or lazily in the same order (other backends), every send
right after its producing op. Loss is the sum over micro-batches of the micro-batch mean divided
by the number of micro-batches, so gradients equal those of the whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeopt.executor.comms import RankPlan, Transfer, consumer_of
from pipeopt.problem import Op, Problem

try:  # PyTorch's own split backward (private API, pinned torch); see _backward_input.
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )
except ImportError:  # pragma: no cover - other torch versions
    stage_backward_input = stage_backward_weight = None


class ExecutorError(RuntimeError):
    """A pipelined run that failed (the message names the rank and the reason)."""


@dataclass
class Fault:
    """Testing hook: make ``rank`` fail (``raise``) or stop answering (``hang``) before its
    first op of step ``step``."""

    rank: int
    mode: str = "raise"
    step: int = 0


class RankStatus:
    """What a rank is doing right now (one line), read by a reporter thread of the worker."""

    def __init__(self) -> None:
        self.text = "starting"


@dataclass
class _Saved:
    """What a stage keeps between its F and its B / W for one micro-batch."""

    inp: torch.Tensor
    out: torch.Tensor  # stage output, or the scaled loss on the last stage
    grad_out: torch.Tensor | None = None
    param_groups: list[dict[str, Any]] | None = None
    segments: list[_Saved] | None = None  # per layer, when the stage runs layer by layer
    params: list[nn.Parameter] | None = None  # a segment's parameters


@dataclass
class RankRunner:
    """Replays one rank's part of a schedule, one training step at a time.

    ``modules`` maps each global stage of this rank to its module (already on ``device``);
    ``shapes[k]`` / ``dtypes[k]`` describe the activation leaving stage k for one micro-batch.
    """

    problem: Problem
    plan: RankPlan
    modules: dict[int, nn.Module]
    loss_fn: Any
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    device: torch.device
    post_all_receives: bool = True
    fault: Fault | None = None
    rank: int = 0
    status: RankStatus = field(default_factory=RankStatus)
    _params: dict[int, list[nn.Parameter]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._params = {k: [p for p in mod.parameters() if p.requires_grad]
                        for k, mod in self.modules.items()}
        self._layer_params = {
            k: [[p for p in layer.parameters() if p.requires_grad] for layer in mod]
            for k, mod in self.modules.items()
            if isinstance(mod, nn.Sequential) and len(mod) > 1}

    # ----- messages ------------------------------------------------------------------------
    def _buffer(self, t: Transfer) -> torch.Tensor:
        boundary = min(t.producer.stage, t.consumer.stage)
        return torch.empty(self.shapes[boundary], dtype=self.dtypes[boundary],
                           device=self.device)

    def _post_until(self, peer: int, consumer: Op | None) -> None:
        """Post the receives from ``peer`` in order, up to the one for ``consumer`` (all of
        them when ``consumer`` is None)."""
        queue = self._pending[peer]
        while queue:
            t = queue.pop(0)
            buf = self._buffer(t)
            self._recvs[t.consumer] = (buf, dist.irecv(buf, src=t.src_device))
            if t.consumer == consumer:
                return

    def _incoming(self, op: Op) -> torch.Tensor:
        """The tensor ``op`` consumes from its neighbouring stage (local or received)."""
        if op in self._local:
            return self._local.pop(op)
        t = self.plan.recv_for.get(op)
        if t is None:
            raise ExecutorError(f"rank {self.rank}: no input for {op} (local or received)")
        if op not in self._recvs:
            self._post_until(t.src_device, op)
        buf, work = self._recvs.pop(op)
        self.status.text = (f"step {self._step}: {op} waits for the output of {t.producer} "
                            f"from rank {t.src_device}")
        work.wait()
        self._ready = time.perf_counter()
        return buf

    def _emit(self, op: Op, tensor: torch.Tensor) -> None:
        """Hand ``op``'s output to its consumer: a send, or a local hand-off."""
        sends = self.plan.sends_after.get(op, ())
        for t in sends:
            data = tensor.contiguous()  # kept alive until the send completes
            self._sends.append((dist.isend(data, dst=t.dst_device), data))
        if not sends:
            cons = consumer_of(op, self.problem.stages)
            if cons is not None:
                self._local[cons] = tensor

    # ----- ops -----------------------------------------------------------------------------
    def _forward(self, op: Op, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        k, j = op.stage, op.microbatch
        inp = xs[j] if k == 0 else self._incoming(op).detach().requires_grad_(True)
        last = k == self.problem.stages - 1
        m = self.problem.microbatches
        saved = self._stage_forward(k, inp, (lambda o: self.loss_fn(o, ys[j]) / m)
                                    if last else None)
        self._saved[(k, j)] = saved
        if last:
            self._loss = self._loss + saved.out.detach()
        else:
            self._emit(op, saved.out.detach())

    def _stage_forward(self, k: int, inp: torch.Tensor, loss: Any = None) -> _Saved:
        """Forward of stage ``k`` on ``inp`` (then ``loss`` on its output, if given); returns
        what its B and W need."""
        split = self.problem.split_backward and inp.requires_grad
        mod = self.modules[k]
        if not (split and k in self._layer_params):
            out = mod(inp)
            if loss is not None:
                out = loss(out)
            elif split and out._base is not None:
                # The split backward detaches the stage output in place, which PyTorch refuses
                # for a view (a Linear on a 3-d input returns one): keep a copy instead.
                out = out.clone()
            return _Saved(inp, out)
        # Split backward of a multi-layer stage: run it layer by layer, each layer's input a
        # leaf, so that B and W are the per-layer splits chained. PyTorch's split walks the
        # autograd graph once per parameter, a cost that grows with the square of the stage's
        # depth; per layer it grows linearly, and it is what the profiler times.
        # A layer whose output is not one differentiable tensor (a tuple, integers) is no cut
        # point: its segment runs on into the next layer.
        segments = []
        h = seg_in = inp
        params: list[nn.Parameter] = []
        for i, (layer, layer_params) in enumerate(zip(mod, self._layer_params[k], strict=True)):
            o = layer(h)
            params += layer_params
            end = i == len(mod) - 1
            if loss is not None and end:
                o = loss(o)
            elif not end and not (isinstance(o, torch.Tensor) and o.is_floating_point()
                                  and o.requires_grad):
                h = o
                continue
            elif o._base is not None:
                o = o.clone()  # as above
            segments.append(_Saved(seg_in, o, params=params))
            h = seg_in = o.detach().requires_grad_(True)
            params = []
        return _Saved(inp, segments[-1].out, segments=segments)

    def _backward(self, op: Op) -> None:
        k, j = op.stage, op.microbatch
        saved = self._saved[(k, j)]
        last = k == self.problem.stages - 1
        grad_out = None if last else self._incoming(op)
        needs_input_grad = saved.inp.requires_grad
        if not self.problem.split_backward:
            # Fused: one autograd pass fills the input gradient and accumulates .grad.
            torch.autograd.backward(saved.out, grad_out)
            del self._saved[(k, j)]
            if needs_input_grad:
                self._emit(op, saved.inp.grad)
            return
        if not needs_input_grad:
            # Stage 0: no input gradient is needed; W runs the whole backward (as in PyTorch).
            saved.grad_out = grad_out
            return
        self._emit(op, self._stage_backward_input(k, saved, grad_out))

    def _stage_backward_input(self, k: int, saved: _Saved, grad_out: torch.Tensor | None
                              ) -> torch.Tensor:
        """B of stage ``k``: its input gradient, keeping what its W needs in ``saved``."""
        if saved.segments is None:
            return self._backward_input(self._params[k], saved, grad_out)
        g = grad_out
        for seg in reversed(saved.segments):
            g = self._backward_input(seg.params or [], seg, g)
        assert g is not None
        return g

    @staticmethod
    def _backward_input(params: list[nn.Parameter], saved: _Saved,
                        grad_out: torch.Tensor | None) -> torch.Tensor:
        """Input gradient only; keeps what the weight gradient of ``params`` needs in
        ``saved``."""
        if stage_backward_input is not None:
            grads, groups = stage_backward_input(
                [saved.out], None if grad_out is None else [grad_out], [saved.inp],
                iter(params))
            saved.param_groups = groups
            return grads[0]
        (dinp,) = torch.autograd.grad(saved.out, [saved.inp], grad_out, retain_graph=True)
        saved.grad_out = grad_out
        return dinp

    @staticmethod
    def _backward_weight(params: list[nn.Parameter], saved: _Saved) -> None:
        """Accumulate the weight gradients of ``params`` into ``.grad`` (after its B)."""
        if saved.param_groups is not None:
            stage_backward_weight(iter(params), saved.param_groups)
        elif params:
            grads = torch.autograd.grad(saved.out, params, saved.grad_out, allow_unused=True)
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g

    def _weight(self, op: Op) -> None:
        k, j = op.stage, op.microbatch
        saved = self._saved.pop((k, j))
        if saved.segments is not None:
            for seg in saved.segments:
                self._backward_weight(seg.params or [], seg)
        elif not saved.inp.requires_grad:
            torch.autograd.backward(saved.out, saved.grad_out)
        else:
            self._backward_weight(self._params[k], saved)

    # ----- one step ------------------------------------------------------------------------
    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor], step: int = 0) -> float:
        """Run every op of this rank once; returns this rank's share of the loss (the full
        batch loss on the rank of the last stage, 0 elsewhere). Afterwards ``trace`` holds
        (op, start, end) in seconds from the step's start, where start is when the op's input
        was there (waits excluded)."""
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._local: dict[Op, torch.Tensor] = {}
        self._recvs: dict[Op, tuple[torch.Tensor, Any]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._pending = {peer: list(lst) for peer, lst in self.plan.recvs.items()}
        self._loss = torch.zeros((), device=self.device)
        if self.post_all_receives:
            for peer in self._pending:
                self._post_until(peer, None)
        self._step = step
        if self.fault is not None and self.fault.rank == self.rank and self.fault.step == step:
            if self.fault.mode == "hang":
                self.status.text = f"step {step}: stopped answering (injected fault)"
                time.sleep(3600)
            raise RuntimeError(f"injected fault on rank {self.rank}")
        self.trace: list[tuple[Op, float, float]] = []
        t0 = time.perf_counter()
        for op in self.plan.ops:
            self.status.text = f"step {step}: running {op}"
            self._ready = time.perf_counter()
            if op.kind == "F":
                self._forward(op, xs, ys)
            elif op.kind == "B":
                self._backward(op)
            else:
                self._weight(op)
            self.trace.append((op, self._ready - t0, time.perf_counter() - t0))
        self.status.text = f"step {step}: waiting for its sends to complete"
        for work, _ in self._sends:
            work.wait()
        self.status.text = f"step {step}: done"
        if self._saved or self._local or self._recvs:
            raise ExecutorError(f"rank {self.rank}: step ended with unused state "
                                f"({len(self._saved)} saved, {len(self._local)} local, "
                                f"{len(self._recvs)} receives)")
        return float(self._loss)


def infer_shapes(stage_modules: list[nn.Module], sample: torch.Tensor
                 ) -> tuple[list[torch.Size], list[torch.dtype]]:
    """Shape and dtype of the activation leaving every stage for the micro-batch ``sample``."""
    shapes, dtypes = [], []
    h = sample
    with torch.no_grad():
        for k, mod in enumerate(stage_modules):
            h = mod(h)
            if not isinstance(h, torch.Tensor):
                raise ExecutorError(f"stage {k}: must return one tensor, got {type(h).__name__}")
            if k < len(stage_modules) - 1 and not h.is_floating_point():
                raise ExecutorError(f"stage {k}: its output ({h.dtype}) crosses a stage "
                                    "boundary and needs a gradient, so it must be floating point")
            shapes.append(h.shape)
            dtypes.append(h.dtype)
    return shapes, dtypes
