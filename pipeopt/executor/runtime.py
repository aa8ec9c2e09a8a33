"""One rank of a pipelined run on PyTorch's own runtime.

A pipeopt schedule becomes ``torch.distributed.pipelining``'s compute-only actions (F, I, W, B),
which its ``_PipelineScheduleRuntime`` lowers (send / receive insertion) and runs with its own
batched point-to-point communication. Stages are ``PipelineStage`` s whose module is a
:class:`StageModule` (the stage's layers, bf16 autocast when asked). pipeopt adds, in
:class:`TimedStage`: per-op timing (waits excluded; CUDA events on GPU), a status line per rank
for error messages, and the per-layer split backward (:class:`Segment`), used where PyTorch's
whole-stage split is slower (a stage of several layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

from pipeopt.executor import _torch
from pipeopt.executor.procs import ExecutorError, RankStatus
from pipeopt.problem import Op


# ----- stages -----------------------------------------------------------------------------------
@dataclass
class Segment:
    """Part of a stage run on its own for the per-layer split backward: its inputs (None: the
    stage's inputs), its output (None: the stage's output) and its parameters."""

    inputs: list[torch.Tensor] | None
    out: torch.Tensor | None
    params: list[nn.Parameter]


def _call(layer: nn.Module, h: Any) -> Any:
    return layer(*h) if isinstance(h, tuple) else layer(h)


def _no_view(x: Any) -> Any:
    """PyTorch's split backward detaches outputs in place, which a view refuses: copy views."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x._base is not None and x.requires_grad else x
    if isinstance(x, tuple):
        return tuple(_no_view(t) for t in x)
    return x


class StageModule(nn.Module):
    """The layers of one stage (``mod``: an ``nn.Sequential``'s children, else ``mod`` itself,
    parameters shared) run in a row (a layer's tuple output is the next layer's arguments),
    under autocast to ``autocast`` (a dtype) when given. With ``segmented``, the
    forward cuts the stage after every layer that hands on one differentiable tensor (its
    successor starts from a leaf) and appends the :class:`Segment` list to ``segments``. With
    ``recompute``, every layer is an activation checkpoint (its forward runs again in the
    backward)."""

    def __init__(self, mod: nn.Module, autocast: torch.dtype | None = None,
                 segmented: bool = False, recompute: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mod if isinstance(mod, nn.Sequential) else [mod])
        self.autocast, self.recompute = autocast, recompute
        self.segmented = segmented and len(self.layers) > 1
        self.segments: list[list[Segment]] = []

    def forward(self, *args: Any) -> Any:
        if self.autocast is None:
            return self._run(args)
        with torch.autocast(args[0].device.type, dtype=self.autocast):
            return self._run(args)

    def _run(self, args: tuple[Any, ...]) -> Any:
        h: Any = args[0] if len(args) == 1 else args
        if not (self.segmented and torch.is_grad_enabled()):
            for layer in self.layers:
                h = self._layer(layer, h)
            return _no_view(h)
        segs: list[Segment] = []
        seg_in: list[torch.Tensor] | None = None
        params: list[nn.Parameter] = []
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h)
            params += [p for p in layer.parameters() if p.requires_grad]
            cut = (i < len(self.layers) - 1 and isinstance(h, torch.Tensor)
                   and h.is_floating_point() and h.requires_grad)
            if cut:
                out = _no_view(h)
                segs.append(Segment(seg_in, out, params))
                h = out.detach().requires_grad_(True)
                seg_in, params = [h], []
        segs.append(Segment(seg_in, None, params))
        self.segments.append(segs)
        return _no_view(h)

    def _layer(self, layer: nn.Module, h: Any) -> Any:
        if self.recompute and torch.is_grad_enabled():  # keep the input, redo it in backward
            return checkpoint(_call, layer, h, use_reentrant=False)
        return _call(layer, h)


@dataclass
class OpClock:
    """Per-op timing and status of one rank: ``ops`` are its compute ops in the order the
    runtime runs them (None where unknown), ``waits_for`` says for the ops that take a message
    whose output that is; ``trace`` gets (op, start, end) seconds from :meth:`start` (CUDA
    event times on GPU, resolved by :meth:`resolve`)."""

    ops: list[Op | None]
    status: RankStatus
    waits_for: dict[Op, str]
    cuda: bool = False
    step: int = 0
    trace: list[tuple[Op | None, float, float]] = field(default_factory=list)
    _i: int = 0
    _t0: float = 0.0
    _events: list[tuple[Op | None, float, Any, Any]] = field(default_factory=list)

    def start(self, step: int) -> None:
        self.step, self._i, self.trace, self._events = step, 0, [], []
        self._t0 = time.perf_counter()
        self._waiting()

    def _waiting(self) -> None:
        if self._i >= len(self.ops):
            self.status.text = f"step {self.step}: waiting for its sends to complete"
            return
        op = self.ops[self._i]
        why = None if op is None else self.waits_for.get(op)
        self.status.text = f"step {self.step}: {op or 'an op'} " + (
            f"waits for {why}" if why else "is about to run")

    def timed(self, fn: Callable[[], Any]) -> Any:
        op = self.ops[self._i] if self._i < len(self.ops) else None
        self.status.text = f"step {self.step}: running {op or 'an op'}"
        t0 = time.perf_counter()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            self._events.append((op, t0 - self._t0, a, b))
        else:
            out = fn()
            self.trace.append((op, t0 - self._t0, time.perf_counter() - self._t0))
        self._i += 1
        self._waiting()
        return out

    def resolve(self) -> None:
        """On GPU (after a synchronize): op durations from the CUDA events."""
        for op, start, a, b in self._events:
            self.trace.append((op, start, start + a.elapsed_time(b) / 1e3))
        self._events = []


class TimedStage(PipelineStage):
    """A ``PipelineStage`` whose compute calls are timed by an :class:`OpClock`, and whose
    split backward runs segment by segment when its module is segmented."""

    def __init__(self, *args: Any, clock: OpClock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self._chunk = 0
        self._segments: dict[int, list[Segment]] = {}

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        def run() -> Any:
            out = super(TimedStage, self).forward_one_chunk(fwd_chunk_id, args, kwargs,
                                                            save_forward_output)
            mod = self.submod
            if isinstance(mod, StageModule) and mod.segments:
                self._segments[fwd_chunk_id] = mod.segments.pop()
            return out
        return self.clock.timed(run)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None,
                           full_backward: bool = True, last_backward: bool = False) -> None:
        self._chunk = bwd_chunk_id
        self.clock.timed(lambda: super(TimedStage, self).backward_one_chunk(
            bwd_chunk_id, loss, full_backward, last_backward))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self._chunk = bwd_chunk_id
        self.clock.timed(lambda: super(TimedStage, self).backward_weight_one_chunk(
            bwd_chunk_id, last_backward))

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any],
                                   last_backward: bool = False) -> Any:
        segs = self._segments.get(self._chunk)
        if segs is None or backward_type == "full":
            if segs is not None:
                raise ExecutorError(f"stage {self.stage_index}: a full backward on a stage "
                                    "run for the split backward")
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "input":
            return backward_input(segs, bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"])
        del self._segments[self._chunk]
        backward_weight(bwd_kwargs["param_groups"])
        return (), None


def backward_input(segs: list[Segment], outputs: Sequence[torch.Tensor],
                   output_grads: Sequence[torch.Tensor] | None, inputs: list[Any]
                   ) -> tuple[tuple[torch.Tensor | None, ...], list[tuple[Segment, Any]]]:
    """The per-layer split's B: PyTorch's input-gradient step on each segment, last first
    (``outputs``: the stage's outputs or its loss). Returns the input gradients and what
    :func:`backward_weight` needs."""
    outs, grads = list(outputs), None if output_grads is None else list(output_grads)
    saved = []
    dinputs: tuple[torch.Tensor | None, ...] = ()
    for seg in reversed(segs):
        seg_inputs = inputs if seg.inputs is None else seg.inputs
        if seg.out is not None:
            outs = [seg.out]
        dinputs, groups = _torch.stage_backward_input(outs, grads, seg_inputs, iter(seg.params))
        saved.append((seg, groups))
        grads = [dinputs[0]]  # type: ignore[list-item]
    return dinputs, saved


def backward_weight(saved: list[tuple[Segment, Any]]) -> None:
    """The per-layer split's W: accumulate every segment's weight gradients into ``.grad``."""
    for seg, groups in saved:
        _torch.stage_backward_weight(iter(seg.params), groups)
