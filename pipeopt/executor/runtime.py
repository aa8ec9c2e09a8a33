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
from pipeopt.executor.procs import ExecutorError, Fault, RankStatus
from pipeopt.problem import Op


# ----- stages -----------------------------------------------------------------------------------
@dataclass
class Segment:
    """Part of a stage run on its own for the per-layer split backward: its inputs (None: the
    stage's inputs), its output (None: the stage's output) and its parameters."""

    inputs: list[torch.Tensor] | None
    out: torch.Tensor | None
    params: list[nn.Parameter]


def call(layer: nn.Module, h: Any) -> Any:
    """``layer`` on ``h``, a tuple being its arguments (how stages hand on tuples)."""
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
            return checkpoint(call, layer, h, use_reentrant=False)
        return call(layer, h)


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
    before: Callable[[Op | None], None] | None = None  # called as each op is about to run
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
        if self.before is not None:
            self.before(op)
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
        self.grads_ready: Callable[[], None] | None = None  # after the last backward's scaling
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

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """PyTorch's end of the stage's backward (gradients scaled), then ``grads_ready``."""
        super().perform_reduce_grad(grad_scale_factor)
        if self.grads_ready is not None:
            self.grads_ready()

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


# ----- data-parallel collectives in the schedule's order -----------------------------------------
def bucket_params(params: Sequence[nn.Parameter], buckets: int) -> list[list[nn.Parameter]]:
    """``params`` in backward order (last first, as DDP fills its buckets) cut into ``buckets``
    consecutive groups of about equal element counts (some may be empty)."""
    rev = list(reversed(params))
    total = sum(p.numel() for p in rev)
    out: list[list[nn.Parameter]] = [[] for _ in range(buckets)]
    seen = 0
    for p in rev:
        out[min(buckets - 1, seen * buckets // max(total, 1))].append(p)
        seen += p.numel()
    return out


def _flat(tensors: Sequence[torch.Tensor], parts: int, device: torch.device,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensors flattened into one new ``dtype`` buffer on ``device``, zero-padded to a
    multiple of ``parts`` (at least ``parts`` elements)."""
    n = sum(t.numel() for t in tensors)
    out = torch.zeros(max(1, -(-n // parts)) * parts, dtype=dtype, device=device)
    if tensors:
        torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors], out=out[:n])
    return out


def _unflat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view_as(t).to(t.dtype))
        i += t.numel()
    return out


class Reducer:
    """One rank's data-parallel collectives of a :class:`~pipeopt.executor.collectives
    .GraphRun` on its stage's replica group ``group``: launched asynchronously in the schedule's
    order at their places among the compute ops (:meth:`before_op`, :meth:`end_step`), waited
    where their result is needed (semantics: :mod:`pipeopt.executor.collectives`).
    ``make_opt`` builds the optimizer over the given tensors (the stage's parameters, or with
    ZeRO-1 this replica's shards); ``status`` says which collective it waits for. ``log``:
    ``step:op`` per compute op and ``launch LABEL`` per collective, in the order they
    happened. ``fault`` (a :class:`~pipeopt.executor.procs.Fault`, tests only): train wrongly
    in iteration ``fault.step`` as its mode says (``scale_grads``, ``skip_reduce``)."""

    def __init__(self, plan: Any, replica: int, rank: int, params: list[nn.Parameter],
                 group: Any, make_opt: Callable[[list[Any]], torch.optim.Optimizer],
                 status: RankStatus, fault: Fault | None = None) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.replicas, self.status = dist, group, plan.replicas, status
        self.delay, self.zero = plan.delay, plan.reduction == "reduce_scatter"
        self.fault, self.replica = fault, replica
        self.own: list[torch.Tensor] = []  # skip_reduce: the faulty iteration's own gradients
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype = params[0].dtype if params else torch.float32
        self.buckets = bucket_params(params, plan.buckets[rank])
        self.todo = [c for _, _, c in plan.launches[replica][rank]]
        self.key = {(c.kind, c.iteration, c.bucket): i for i, c in enumerate(self.todo)}
        self.at: dict[tuple[int, int], int] = {}  # (step, n) -> last todo index placed there
        for i, (step, n, _) in enumerate(plan.launches[replica][rank]):
            self.at[(step, n)] = i
        self.next = 0  # todo[:next] are launched
        self.work: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        self.packed: dict[int, list[torch.Tensor]] = {}  # iteration -> bucket gradients
        self.applied: set[int] = set()
        self.step, self.n, self.log = 0, 0, list[str]()
        if self.zero:
            r, rep = replica, self.replicas
            self.shards = [nn.Parameter(f.view(rep, -1)[r].clone()) for f in (
                _flat(b, rep, self.device, self.dtype) for b in self.buckets)]
            self.opt = make_opt(self.shards)
        else:
            self.opt = make_opt(params)

    # hooks of the training loop
    def grads_ready(self) -> None:
        """The stage's backward of this step ended: copy its gradients to the bucket buffers."""
        self.packed[self.step] = [
            _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in b],
                  self.replicas, self.device, self.dtype) for b in self.buckets]
        if self._faulty(self.step, "scale_grads"):
            for buf in self.packed[self.step]:
                buf.mul_(self.fault.factor)  # type: ignore[union-attr]
        if self._faulty(self.step, "skip_reduce"):  # its own gradients, times R: kept apart
            self.own = [buf * self.replicas for buf in self.packed[self.step]]

    def begin_step(self, step: int) -> None:
        """Before step ``step``: launch what is placed before its first op, then wait for what
        it needs (the reduction of step - D applied, or with ZeRO-1 its all-gather)."""
        self.step, self.n = step, 0
        self._launch_at(step, 0)
        if self.zero:
            self._gathered(step)
        elif step - self.delay >= 0:
            self._update(step - self.delay)

    def before_op(self, op: Op | None) -> None:
        """Compute op number ``n`` of this step is about to run."""
        self._launch_at(self.step, self.n)
        self.log.append(f"{self.step}:{op}")
        self.n += 1

    def end_step(self) -> None:
        """After the step's last op: launch what is placed after it."""
        for (step, n), _ in sorted(self.at.items()):
            if step == self.step and n >= self.n:
                self._launch_at(step, n)

    def finish(self, steps: int) -> None:
        """After the last step: every reduction of steps run launched, waited and applied (with
        ZeRO-1, a last all-gather of the shards, outside the schedule)."""
        for c in self.todo[self.next:]:
            if c.iteration < steps and c.kind != "AG":
                self._launch_upto(self.key[(c.kind, c.iteration, c.bucket)])
        for u in range(steps):
            self._update(u)
        for works, _ in self.work.values():
            for w in works:
                w.wait()
        if self.zero:
            for b, shard in zip(self.buckets, self.shards, strict=True):
                full = shard.new_empty(shard.numel() * self.replicas)
                self.dist.all_gather_single(full, shard.detach(), group=self.group)
                self._copy_params(b, full)

    # the collectives
    def _launch_at(self, step: int, n: int) -> None:
        i = self.at.get((step, n))
        if i is not None:
            self._launch_upto(i)

    def _launch_upto(self, i: int) -> None:
        """Launch ``todo[next..i]`` in order (every replica launches them in this order)."""
        while self.next <= i:
            c = self.todo[self.next]
            self.log.append(f"launch {c.label}")
            if c.kind == "AG":
                if c.iteration - self.delay >= 0:
                    self._update(c.iteration - self.delay)
                outs = [s.new_empty(s.numel() * self.replicas) for s in self.shards]
                works = [self.dist.all_gather_single(o, s.detach(), group=self.group,
                                                     async_op=True)
                         for o, s in zip(outs, self.shards, strict=True)]
            else:
                buf = self.packed[c.iteration][c.bucket]
                out = buf if c.kind == "AR" else buf.new_empty(buf.numel() // self.replicas)
                works = [self.dist.all_reduce(buf, group=self.group, async_op=True)
                         if c.kind == "AR" else self.dist.reduce_scatter_single(
                             out, buf, group=self.group, async_op=True)]
                outs = [out]
            self.work[self.next] = (works, outs)
            self.next += 1

    def _result(self, kind: str, iteration: int, bucket: int) -> list[torch.Tensor]:
        i = self.key[(kind, iteration, bucket)]
        self._launch_upto(i)
        self.status.text = f"step {self.step}: waits for {self.todo[i].label} (its replicas)"
        works, outs = self.work[i]
        for w in works:
            w.wait()
        return outs

    def _update(self, u: int) -> None:
        """The optimizer step on iteration ``u``'s averaged gradients (once): from its
        all-reduce into the stage's parameters, or with ZeRO-1 from its reduce-scatter into
        this replica's shards."""
        if u in self.applied or u not in self.packed:
            return
        self.applied.add(u)
        skip = self._faulty(u, "skip_reduce")
        if self.zero:
            for k, shard in enumerate(self.shards):
                (out,) = self._result("RS", u, k)
                if skip:  # this replica's shard of its own gradients
                    out = self.own[k].view(self.replicas, -1)[self.replica]
                shard.grad = out / self.replicas
        else:
            for k, b in enumerate(self.buckets):
                (flat,) = self._result("AR", u, k)
                if skip:
                    flat = self.own[k]
                for p, g in zip(b, _unflat(flat / self.replicas, b), strict=True):
                    p.grad = g.clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        del self.packed[u]

    def _faulty(self, iteration: int, mode: str) -> bool:
        return self.fault is not None and self.fault.mode == mode \
            and self.fault.step == iteration

    def _gathered(self, step: int) -> None:
        """ZeRO-1: step ``step``'s parameters from its all-gather."""
        if ("AG", step, 0) not in self.key:
            return
        for b, full in zip(self.buckets, self._result("AG", step, 0), strict=True):
            self._copy_params(b, full)

    @staticmethod
    def _copy_params(params: list[nn.Parameter], full: torch.Tensor) -> None:
        with torch.no_grad():
            for p, x in zip(params, _unflat(full, params), strict=True):
                p.copy_(x)
