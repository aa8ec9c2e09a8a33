"""Measure per-layer costs of a real torch model (an ``nn.Sequential``) and read them back.

For each layer, on its real input (the previous layers' output):

- ``forward_s``: the forward with autograd recording (as in training);
- ``backward_input_s`` (B) and ``backward_weight_s`` (W): the backward split exactly as the
  executor (:mod:`pipeopt.executor.runtime`) runs it, on the layer as a one-layer stage
  (:func:`executor_split`): B is PyTorch's ``stage_backward_input`` (the input gradient, keeping
  what W needs), W is ``stage_backward_weight`` (one ``autograd.grad`` per parameter group).
  The split costs more than the fused backward (hooks keep what W needs, the weight path runs
  as separate ``autograd.grad`` calls), so B + W is what a split-backward schedule pays, not the
  fused time. On an input that takes no gradient (token ids) B is 0 and W is the whole backward, as
  the executor runs stage 0;
- ``backward_s``: the fused backward (``torch.autograd.backward``: input and weight gradients in
  one pass), what a schedule without split backward pays for its B, and what the first stage
  pays for its W when its input takes no gradient;
- ``input_grad``: whether the layer's input takes a gradient (false for token ids);
- ``activation_bytes``: bytes of the distinct tensors autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded;
- ``param_bytes`` / ``params``; ``output_bytes`` (the p2p message); FLOPs of the forward and
  backward from ``torch.utils.flop_counter.FlopCounterMode``; on CUDA the peak memory.

With ``forward_only`` (inference, ``pipeopt profile --forward-only``) each layer runs in eval
mode under ``torch.inference_mode()`` (no autograd graph, nothing saved): ``forward_s`` and
``forward_flops`` are that forward's, every backward field is 0, ``activation_bytes`` is 0
(nothing is kept for a backward) and ``input_grad`` false; the document says
``"forward_only": true``. Every profile records the example input's ``input_shape``
(``[batch, seq_len]`` for token ids), from which the serving cost model counts the tokens the
forward ran (:func:`pipeopt.costs.inference.profiled_stage_models`).

Times are medians of ``repeats`` runs after ``warmup`` runs; every backward is timed on its own,
after an untimed forward that builds its graph. The profile runs on one process: ranks that
share cores in a real run see slower ops than these. The file it writes is read by
:mod:`pipeopt.costs.profile`, which the planner uses without torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# The profile file (format, reading, writing) is pipeopt.costs.profile's, which the cost model
# reads without torch; its names stay importable from here.
from pipeopt.costs.profile import FORMAT, ProfileError, load_profile, write_profile

__all__ = ["FORMAT", "ProfileError", "executor_split", "forward_only_layer", "load_profile",
           "measure_overheads", "optimizer_step_time", "profile_layer", "profile_model",
           "write_profile"]


def _median_time(fn: Callable[[], Any], warmup: int, repeats: int, sync: Callable[[], None]
                 ) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_phases(setup: Callable[[], Any], phases: list[Callable[[Any], Any]], warmup: int,
                   repeats: int, sync: Callable[[], None]) -> list[float]:
    """Median seconds of each of ``phases``, run in order on what an untimed ``setup()``
    returns (the forward that builds the autograd graph, so it is never in a backward time)."""
    times: list[list[float]] = [[] for _ in phases]
    for rep in range(warmup + repeats):
        state = setup()
        sync()
        for i, phase in enumerate(phases):
            t0 = time.perf_counter()
            phase(state)
            sync()
            if rep >= warmup:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def executor_split(layer: Any, device: Any, loss: Callable[[Any], Any] | None = None
                   ) -> tuple[Callable[[Any], Any], Callable[[Any, Any], None],
                              Callable[[Any], None]]:
    """The executor's own forward, B and W for ``layer`` run as a stage with split backward
    (the last stage when ``loss`` maps its output to the loss): ``(f, b, w)`` where ``f(inp)``
    runs the forward as a pipeline rank does (:class:`pipeopt.executor.runtime.StageModule`:
    cut between the layers of an ``nn.Sequential``) and returns its saved state,
    ``b(state, grad_out)`` computes the input gradient (PyTorch's ``stage_backward_input`` per
    segment) keeping what W needs, and ``w(state)`` accumulates the weight gradients into
    ``.grad`` (``stage_backward_weight``; on an input that takes no gradient, e.g. token ids,
    the whole backward, as PyTorch's runtime runs stage 0)."""
    import torch

    from pipeopt.executor.runtime import Segment, StageModule, backward_input, backward_weight

    mod = StageModule(layer, segmented=True)

    def f(inp: Any) -> Any:
        out = mod(inp)
        segs = mod.segments.pop() if mod.segmented else [
            Segment(None, None, [p for p in mod.parameters() if p.requires_grad])]
        return {"inp": inp, "out": out if loss is None else loss(out), "segs": segs}

    def b(saved: Any, grad_out: Any) -> None:
        if saved["inp"].requires_grad:
            grads = None if grad_out is None else [grad_out]
            _, saved["groups"] = backward_input(saved["segs"], [saved["out"]], grads,
                                                [saved["inp"]])
        else:  # no input gradient: B is free and W runs the whole backward (stage 0)
            saved["grad_out"] = grad_out

    def w(saved: Any) -> None:
        if "groups" in saved:
            backward_weight(saved.pop("groups"))
        else:
            torch.autograd.backward(saved["out"], saved.get("grad_out"))

    return f, b, w


def forward_only_layer(layer: Any, x: Any, *, warmup: int = 2, repeats: int = 5
                       ) -> tuple[dict[str, Any], Any]:
    """Costs of one layer's inference forward on input ``x`` (``torch.inference_mode``; see
    the module docstring); returns (record, output)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    dev = x.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        forward_s = _median_time(lambda: layer(x), warmup, repeats, sync)
        with FlopCounterMode(display=False) as fc:
            out = layer(x)
        peak = None
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            layer(x)
            peak = float(torch.cuda.max_memory_allocated(dev) - base)
    record = {
        "name": type(layer).__name__,
        "forward_s": forward_s, "backward_input_s": 0.0, "backward_weight_s": 0.0,
        "backward_s": 0.0, "input_grad": False,
        "params": float(sum(p.numel() for p in layer.parameters())),
        "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        "activation_bytes": 0.0,
        "output_bytes": float(out.numel() * out.element_size()),
        "forward_flops": float(fc.get_total_flops()), "backward_flops": 0.0,
        "peak_memory_bytes": peak,
    }
    return record, out


def _backward_kept(out: Any, grad_out: Any, leaves: list[Any]) -> None:
    """The whole backward of ``out`` (``torch.autograd.backward``, which a checkpointed layer
    supports where ``torch.autograd.grad`` over its parameters does not), leaving each leaf's
    ``.grad`` as it was."""
    import torch

    kept = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    torch.autograd.backward(out, grad_out)
    for t, g in zip(leaves, kept, strict=True):
        t.grad = g


def profile_layer(layer: Any, x: Any, *, warmup: int = 2, repeats: int = 5) -> tuple[dict[str, Any],
                                                                                 Any]:
    """Costs of one layer on input ``x``; returns (record, output detached)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    dev = x.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    params = [p for p in layer.parameters() if p.requires_grad]
    needs_input = x.is_floating_point()
    inp = x.detach().requires_grad_(needs_input)

    def fwd() -> Any:
        return layer(inp)

    forward_s = _median_time(fwd, warmup, repeats, sync)
    # Saved activations: distinct storages packed by autograd, parameters excluded.
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inp)
    activation_bytes = float(sum(seen.values()))
    grad_out = torch.randn_like(out) if out.is_floating_point() else None
    wrt_in = [inp] if needs_input else []
    b_in = b_w = b_full = 0.0
    if out.requires_grad:
        # B and W as the executor runs them (see executor_split); the fused backward as the
        # executor runs it without split_backward. Gradients accumulate into .grad as in a
        # step; the layer's own .grad is restored afterwards.
        # Wrapped: a layer that is itself an nn.Sequential is one piece of its stage's split,
        # as the executor runs it (it cuts a stage only between its top-level layers).
        split_f, split_b, split_w = executor_split(torch.nn.Sequential(layer), dev)
        kept = [p.grad for p in params]

        def fresh() -> Any:
            inp.grad = None  # a fresh input every micro-batch, as in the executor
            return layer(inp)

        def fresh_split() -> Any:
            inp.grad = None
            return split_f(inp)  # untimed: a view output is copied here, as in the executor

        b_full, = _median_phases(fresh, [lambda o: torch.autograd.backward(o, grad_out)],
                                 warmup, repeats, sync)
        b_in, b_w = _median_phases(fresh_split, [lambda st: split_b(st, grad_out), split_w],
                                   warmup, repeats, sync)
        inp.grad = None
        for p, g in zip(params, kept, strict=True):
            p.grad = g
    if not needs_input:
        b_in = 0.0  # nothing to compute: the executor's stage 0 has no B
    step_s = optimizer_step_time(params, warmup, repeats, sync)
    with FlopCounterMode(display=False) as fc:
        o = layer(inp)
    fwd_flops = float(fc.get_total_flops())
    bwd_flops = 0.0
    if wrt_in or params:
        with FlopCounterMode(display=False) as fc:
            _backward_kept(o, grad_out, wrt_in + params)
        bwd_flops = float(fc.get_total_flops())
    peak = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        o = layer(inp)
        if wrt_in or params:
            _backward_kept(o, grad_out, wrt_in + params)
        peak = float(torch.cuda.max_memory_allocated(dev) - base)
    record = {
        "name": type(layer).__name__,
        "forward_s": forward_s, "backward_input_s": b_in, "backward_weight_s": b_w,
        "backward_s": b_full, "step_s": step_s, "input_grad": needs_input,
        "params": float(sum(p.numel() for p in layer.parameters())),
        "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        "activation_bytes": activation_bytes,
        "output_bytes": float(out.numel() * out.element_size()),
        "forward_flops": fwd_flops, "backward_flops": bwd_flops,
        "peak_memory_bytes": peak,
    }
    return record, out.detach()


def optimizer_step_time(params: list[Any], warmup: int, repeats: int,
                        sync: Callable[[], None]) -> float:
    """Median seconds of one SGD step over ``params`` (the executor's default optimizer, as
    its ranks run it once per training step; learning rate 0 and zero gradients, so the
    weights do not move), every ``.grad`` left as it was; 0 without parameters."""
    import torch

    if not params:
        return 0.0
    kept = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0)
    try:
        return _median_time(opt.step, warmup, repeats, sync)
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g


#: Micro-batch counts of the trivial runs :func:`measure_overheads` fits the overheads on.
OVERHEAD_MICROBATCHES = (2, 8)


def _overhead_rank(rank: int, world: int, device: Any, jobs: list[Any], reps: int,
                   status: Any = None) -> dict[str, Any]:
    """One rank of :func:`measure_overheads`: the trivial runs, then a ping-pong of one
    float between ranks 0 and 1 (one-way seconds, measured on rank 0)."""
    import torch

    from pipeopt.executor.launch import run_rank

    runs = [run_rank(rank, world, device, s, cfg, "gloo", status=status) for s, cfg in jobs]
    return {"step_times": [r["step_times"] for r in runs],
            "message_s": ping_pong_s(rank, torch.zeros(1), reps)}


def ping_pong_s(rank: int, x: Any, reps: int) -> float | None:
    """The median one-way time (seconds) of ``x`` sent between ranks 0 and 1 and back, ``reps``
    times after a barrier (half of each round trip); None on the other ranks, which only wait at
    the barrier. Every rank of the default process group must call it."""
    import torch.distributed as dist

    one_way = []
    dist.barrier()
    for _ in range(reps):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(x, dst=1)
            dist.recv(x, src=1)
            one_way.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            dist.recv(x, src=0)
            dist.send(x, dst=0)
    return statistics.median(one_way) if one_way else None


def measure_overheads(*, ranks: int = 2, steps: int = 6, rounds: int = 5, reps: int = 50,
                      timeout: float = 300.0) -> dict[str, Any]:
    """The executor's fixed costs on this machine, as a run pays them (seconds; the
    ``overheads`` of a profile, see :class:`pipeopt.costs.profile.Overheads`).

    ``ranks`` gloo processes replay ZB-H1 of a trivial model (one ``Linear(1, 1)`` + tanh per
    stage, one sample per micro-batch, whose compute is timed here on one process) with
    :data:`OVERHEAD_MICROBATCHES` micro-batches, ``steps`` steps each (the first not counted), in
    ``rounds`` interleaved rounds (a loaded machine's noise moves both counts alike);
    ``message_s`` is the one-way time of a one-float message (median of a ``reps``-fold
    ping-pong). ``action_s`` is the cost per F, B or W that makes the simulator's step time
    grow from the smaller to the larger count as the measured one does (bisection; the
    trivial compute and ``message_s`` priced in), and ``step_s`` the rest of the measured
    step (median over the two counts): the optimizer step of the trivial model and the step's
    closing barrier. Both are clamped at 0 (noise on a loaded machine can push a difference
    below it)."""
    import torch

    from pipeopt.costs.build import with_overheads
    from pipeopt.costs.profile import Overheads
    from pipeopt.executor.procs import RunConfig, spawn
    from pipeopt.problem import uniform_problem
    from pipeopt.simulate import simulate
    from pipeopt.solvers import solve

    layer = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Tanh())
    recs = [profile_layer(layer, torch.zeros(1, 1), repeats=9)[0] for _ in range(ranks)]
    f = tuple(r["forward_s"] for r in recs)
    b = tuple(r["backward_input_s"] for r in recs)
    w = tuple(r["backward_weight_s"] for r in recs)
    scheds, jobs = [], []
    for m in OVERHEAD_MICROBATCHES * rounds:
        prob = uniform_problem(ranks, m).replace(forward=f, backward_input=b,
                                                 backward_weight=w)
        s = solve(prob, "zb-h1")
        scheds.append(s)
        jobs.append((s, RunConfig(model="mlp", model_options=(("layers", ranks), ("width", 1)),
                                  steps=steps, batch_size=m)))
    per_rank = spawn(_overhead_rank, ranks, (jobs, reps), timeout=timeout, backend="gloo")
    n = len(OVERHEAD_MICROBATCHES)
    measured = [statistics.median(max(r["step_times"][j][k] for r in per_rank)
                                  for j in range(i, len(jobs), n) for k in range(1, steps))
                for i in range(n)]
    message = float(per_rank[0]["message_s"] or 0.0)

    def predicted(i: int, action: float) -> float:
        s = scheds[i]
        prob = with_overheads(s.problem, Overheads(action_s=action, message_s=message),
                              [0.0] * s.problem.stages)
        return simulate(prob, s.device_orders()).iteration_time

    def growth(action: float) -> float:
        return predicted(1, action) - predicted(0, action)

    target, lo, hi = measured[1] - measured[0], 0.0, max(measured)
    if growth(lo) >= target:
        action = 0.0
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if growth(mid) < target else (lo, mid)
        action = (lo + hi) / 2
    step = statistics.median(t - predicted(i, action) for i, t in enumerate(measured))
    return {"action_s": action, "message_s": message, "step_s": max(0.0, step),
            "how": f"{ranks} gloo ranks, {rounds} rounds of ZB-H1 of a trivial model with "
                   f"{' and '.join(map(str, OVERHEAD_MICROBATCHES))} micro-batches: step "
                   f"{' and '.join(f'{t * 1e3:.2f}' for t in measured)} ms",
            }


def profile_model(model: Any, example_input: Any, *, device: str | None = None,
                  warmup: int = 2, repeats: int = 5, name: str = "model",
                  forward_only: bool = False, overheads: bool = False) -> dict[str, Any]:
    """Profile every layer of an ``nn.Sequential`` on ``example_input`` (one micro-batch);
    returns the profile document (see :data:`FORMAT`). ``forward_only``: the inference
    forward alone (module docstring). ``overheads``: also measure the executor's fixed costs
    (:func:`measure_overheads`: spawns 2 gloo ranks, a few seconds)."""
    import torch

    from pipeopt._malloc import steady_cpu_allocator

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev)
    model = model.eval() if forward_only else model.train()
    x = example_input.to(dev)
    layers = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # One thread: small layers time far more steadily than with a contended thread pool.
        torch.set_num_threads(1)
        # As the executor's CPU ranks do (pipeopt._malloc): freed tensors stay in the heap.
        steady_cpu_allocator()
    try:
        for i, layer in enumerate(model):
            measure = forward_only_layer if forward_only else profile_layer
            rec, x = measure(layer, x, warmup=warmup, repeats=repeats)
            rec["name"] = f"{i}:{rec['name']}"
            layers.append(rec)
    finally:
        torch.set_num_threads(threads)
    return {"format": FORMAT, "model": name, "device": str(dev), "torch": torch.__version__,
            "micro_batch_size": int(example_input.shape[0]),
            "input_shape": [int(n) for n in example_input.shape], "warmup": warmup,
            "repeats": repeats,
            "backward_split": ("none: forward only" if forward_only else
                               "pipeopt.executor.runtime.StageModule (per layer)"),
            **({"forward_only": True} if forward_only else {}),
            **({"overheads": measure_overheads()} if overheads and not forward_only else {}),
            "layers": layers}
