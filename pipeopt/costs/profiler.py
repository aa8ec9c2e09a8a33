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
after an untimed forward that builds its graph (``"timing": "warm"``). That warm loop runs
one layer alone on one process, its weights in cache: inside a pipelined step the same ops
run 1.5-3.5x slower on a CPU (the stage's other layers, its backward and optimizer step and
the other rank evict them). :func:`step_profile` (``pipeopt profile``'s default on the CPU,
``"timing": "step"``) re-times a warm profile from a real short run of the executor: ranks
replay 1F1B and ZB-H1 and every stage's F, B, W and fused backward, the runtime's gap between
two ops, the delay of the activation messages and the step tail are read from the op traces
(:func:`step_trace_costs`). The file it writes is read by :mod:`pipeopt.costs.profile`, which
the planner uses without torch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

# The profile file (format, reading, writing) is pipeopt.costs.profile's, which the cost model
# reads without torch; its names stay importable from here.
from pipeopt.costs.profile import FORMAT, ProfileError, load_profile, write_profile

__all__ = ["FORMAT", "STEP_METHODS", "ProfileError", "executor_split", "forward_only_layer",
           "kendall_tau_b", "load_profile", "measure_overheads", "optimizer_step_time",
           "profile_layer", "profile_model", "sampled_step_fit", "step_profile",
           "step_profile_from_runs", "step_schedules", "step_trace_costs",
           "trimmed_mean", "write_profile"]


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
    # Each job once, then a ping-pong of one float (4 bytes) between ranks 0 and 1.
    per_rank = spawn(_step_rank, ranks, (jobs, 1, 4, 0, reps), timeout=timeout,
                     backend="gloo")
    n = len(OVERHEAD_MICROBATCHES)
    measured = [statistics.median(max(r["runs"][j][0]["step_times"][k] for r in per_rank)
                                  for j in range(i, len(jobs), n) for k in range(1, steps))
                for i in range(n)]
    message = float(per_rank[0]["ping_pong_s"] or 0.0)

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
            "timing": "warm",
            **({"forward_only": True} if forward_only else {}),
            **({"overheads": measure_overheads()} if overheads and not forward_only else {}),
            "layers": layers}


#: The schedules whose runs time a profile's ops in a step (:func:`step_profile`): 1F1B runs
#: the fused backward, ZB-H1 the split one (B and W).
STEP_METHODS = ("1f1b", "zb-h1")


def trimmed_mean(xs: list[float], cut: float = 0.1) -> float:
    """The mean of ``xs`` without its lowest and highest ``cut`` share (0 when empty). A step's
    critical path is a sum of ops, which adds up to their mean, not their median (on a CPU an
    op's time is skewed to the right); trimming keeps a rare pre-emption of a shared machine
    from weighing on the mean."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    k = int(len(ys) * cut)
    mid = ys[k:len(ys) - k] or ys
    return sum(mid) / len(mid)


def kendall_tau_b(a: list[float], b: list[float], rel_tol: float = 1e-9) -> float:
    """Kendall's tau-b of two rankings of the same items, e.g. predicted and measured step
    times (1: the same order, -1: reversed; NaN when either ranking ties every pair or there
    are fewer than two items). Two values within ``rel_tol`` of the larger are a tie.

    Concordant less discordant pairs over ``sqrt((n0 - t_a) (n0 - t_b))``, ``n0`` the pairs,
    ``t_a`` / ``t_b`` those tied in ``a`` / ``b``: the standard statistic where a ranking has
    ties (Kendall 1945; ``scipy.stats.kendalltau``'s default). Without ties it is tau-a
    (concordant less discordant over ``n0``). A tie in one ranking only still keeps tau-b
    below 1 (at most ``sqrt((n0 - t_a) / n0)`` when only ``a`` ties), less so than tau-a
    (``(n0 - t_a) / n0``): a pair the prediction ties can never agree with a measurement."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau_b: rankings of {len(a)} and {len(b)} items")
    if not all(math.isfinite(x) for x in (*a, *b)):
        raise ValueError("kendall_tau_b: every value must be finite (a NaN or infinite time "
                         "cannot be ranked)")

    def sign(x: float, y: float) -> int:
        if abs(x - y) <= rel_tol * max(abs(x), abs(y)):
            return 0
        return 1 if x > y else -1

    n0 = tied_a = tied_b = score = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            sa, sb = sign(a[i], a[j]), sign(b[i], b[j])
            n0 += 1
            tied_a += sa == 0
            tied_b += sb == 0
            score += sa * sb
    denom = ((n0 - tied_a) * (n0 - tied_b)) ** 0.5
    return score / denom if denom else float("nan")


def _op_of(name: str) -> Any:
    """``"1F0"`` -> Op("F", 1, 0) (stage, kind, micro-batch: :class:`pipeopt.problem.Op`'s
    string form)."""
    from pipeopt.problem import Op

    i = next(k for k, c in enumerate(name) if c.isalpha())
    return Op(name[i], int(name[:i]), int(name[i + 1:]))


def step_trace_costs(schedule: Any, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What runs of ``schedule`` measured, op by op (seconds); ``runs[rank][round]`` is
    :func:`pipeopt.executor.launch.run_rank`'s report (its ``step_traces`` and
    ``step_times``); the first step of every round (warm-up) is left out when there are more.

    Returns ``ops`` (``"F1"`` -> every duration of stage 1's forwards), ``where`` (per key
    of ``ops``, in the same order: the ``(step, rank)`` each duration was measured in, ``step``
    an index into ``steps``), ``gaps`` (an op whose inputs are all on its rank: its start
    less the end of what it waited for, the runtime's time between two ops) and
    ``gap_where`` (the ``(step, rank)`` of each gap), ``delays`` (an op held up by a message
    from another rank: its start less the producer's end), ``leads`` (per step, the first
    op's start: the runtime's work before it), ``tails`` ((seconds, rank) per step: the
    step's end less the last op's end, on the rank that ran it: the optimizer step,
    zero-grad and the closing barrier) and ``steps`` (per step, the longest rank's step
    time)."""
    from pipeopt.problem import Op

    stages = schedule.problem.stages
    ops: dict[str, list[float]] = {}
    where: dict[str, list[tuple[int, int]]] = {}
    gaps: list[float] = []
    gap_where: list[tuple[int, int]] = []
    delays: list[float] = []
    tails: list[tuple[float, int]] = []
    leads: list[float] = []
    steps: list[float] = []
    for rnd in range(len(runs[0])):
        n = len(runs[0][rnd]["step_traces"])
        for st in range(1 if n > 1 else 0, n):
            start: dict[Any, float] = {}
            end: dict[Any, float] = {}
            prev: dict[Any, float | None] = {}
            rank_of: dict[Any, int] = {}
            step_s, last = 0.0, (-1.0, 0)
            for r, rank_runs in enumerate(runs):
                rep = rank_runs[rnd]
                trace = rep["step_traces"][st]
                step_s = max(step_s, rep["step_times"][st])
                before = None
                for name, a, b in trace:
                    op = _op_of(name)
                    start[op], end[op], prev[op], rank_of[op] = a, b, before, r
                    before = b
                    ops.setdefault(f"{op.kind}{op.stage}", []).append(b - a)
                    where.setdefault(f"{op.kind}{op.stage}", []).append((len(steps), r))
                if trace:
                    last = max(last, (trace[-1][2], r))
            steps.append(step_s)
            if last[0] >= 0:
                tails.append((step_s - last[0], last[1]))
                leads.append(min(start.values()))
            for op, a in start.items():
                near = [x for x in (Op("F", op.stage, op.microbatch) if op.kind == "B" else None,
                                    Op("B", op.stage, op.microbatch) if op.kind == "W" else None)
                        if x is not None and x in end]
                ready = max([prev[op] or 0.0] + [end[x] for x in near])
                far = (Op("F", op.stage - 1, op.microbatch) if op.kind == "F" and op.stage > 0
                       else Op("B", op.stage + 1, op.microbatch)
                       if op.kind == "B" and op.stage + 1 < stages else None)
                if far is not None and far in end and end[far] > ready:
                    delays.append(a - end[far])
                elif prev[op] is not None:
                    gaps.append(a - ready)
                    gap_where.append((len(steps) - 1, rank_of[op]))
    return {"ops": ops, "where": where, "gaps": gaps, "gap_where": gap_where,
            "delays": delays, "leads": leads, "tails": tails, "steps": steps}


def _step_rank(rank: int, world: int, device: Any, jobs: list[Any], rounds: int,
               message_bytes: int, warmup: int = 0, reps: int = 50, status: Any = None
               ) -> dict[str, Any]:
    """One rank of :func:`step_profile` and :func:`measure_overheads`: every (schedule,
    config) job ``warmup + rounds`` times, interleaved; per job, this rank's report of every
    round after the first ``warmup`` (traces and step times); then the one-way time of a
    ``message_bytes`` message between ranks 0 and 1 (median of a ``reps``-fold ping-pong,
    seconds; on rank 0, for comparison with the delays the traces show)."""
    import torch

    from pipeopt.executor.launch import run_rank

    out: list[list[dict[str, Any]]] = [[] for _ in jobs]
    for rnd in range(warmup + rounds):
        for i, (sched, cfg) in enumerate(jobs):
            rep = run_rank(rank, world, device, sched, cfg, "gloo", status=status)
            if rnd >= warmup:
                out[i].append({"step_traces": rep["step_traces"],
                               "step_times": rep["step_times"]})
    msg = torch.zeros(max(1, message_bytes // 4))
    return {"runs": out, "ping_pong_s": ping_pong_s(rank, msg, reps)}


def _rescale(layers: list[dict[str, Any]], keys: tuple[str, ...], basis: str,
             measured: float | None) -> float | None:
    """Scale ``keys`` of ``layers`` by ``measured`` / their summed ``basis`` (what the run
    measured for these layers together against the warm loop); returns that factor, None
    (nothing changed) when nothing was measured or the warm loop timed nothing."""
    total = sum(rec[basis] for rec in layers)
    if measured is None or total <= 0:
        return None
    factor = measured / total
    for rec in layers:
        for key in keys:
            rec[key] = rec[key] * factor
    return factor


def profile_problem(doc: dict[str, Any], devices: int, microbatches: int,
                    stage_layers: list[int] | None = None) -> Any:
    """The :class:`~pipeopt.problem.Problem` the config form (``model: {profile: ...}``)
    builds from the profile document ``doc`` (written to a temporary file for it), on
    ``devices`` devices with ``microbatches`` micro-batches; ``stage_layers``: layers per
    stage (else the config's own partition)."""
    import tempfile
    from pathlib import Path

    from pipeopt.config import parse_config

    training = {} if stage_layers is None else {"training": {"stage_layers": stage_layers}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        write_profile(doc, path)
        return parse_config({"pipeline": {"devices": devices, "microbatches": microbatches},
                             "model": {"profile": str(path)}, **training}).problem


def step_problem(doc: dict[str, Any], microbatches: int | None = None) -> Any:
    """The :class:`~pipeopt.problem.Problem` the config form (``model: {profile: ...}``)
    builds from the step-timed profile ``doc`` (:func:`step_profile`) on the partition its
    runs measured (``in_step.partition``: its in-step factors hold for that partition; another
    would reuse them per layer), with ``microbatches`` micro-batches (default: the runs',
    ``in_step.microbatches``). Raises ``ValueError`` when ``doc`` was not timed in steps."""
    st = doc.get("in_step") or {}
    missing = next((k for k in ("partition", "microbatches") if k not in st), None)
    if missing is not None:
        raise ValueError(f"in_step.{missing}: missing (a profile timed in steps records it; "
                         "re-time the profile with pipeopt profile --timing step)")
    part = [(int(a), int(b)) for a, b in st["partition"]]
    m = int(st["microbatches"]) if microbatches is None else microbatches
    return profile_problem(doc, len(part), m, [b - a for a, b in part])


def _fit_step(doc: dict[str, Any], scheds: list[Any], traced: list[dict[str, Any]],
              part: list[tuple[int, int]], microbatches: int
              ) -> tuple[float, list[dict[str, Any]]]:
    """The fixed cost per step (seconds, >= 0; ``doc.overheads.step_s`` is the measured tail
    and lead) with which ``doc`` predicts the runs of :func:`step_profile` on average (their
    median step, the slowest rank's, steps after the first of each round: ``traced[i]`` is
    :func:`step_trace_costs` of ``scheds[i]``'s runs), and per schedule its measured step
    against the predictions with the measured tail and with that cost (ms)."""
    from pipeopt.simulate import simulate

    prob = profile_problem(doc, len(part), microbatches, [b - a for a, b in part])
    return _fit_cost(prob, scheds, [statistics.median(t["steps"]) for t in traced],
                     doc["overheads"]["step_s"],
                     lambda p, orders: simulate(p, orders).iteration_time)


def _fit_cost(prob: Any, scheds: list[Any], measured: list[float], tail: float,
              step_time: Any) -> tuple[float, list[dict[str, Any]]]:
    """The per-step cost (seconds, >= 0) that makes ``step_time(problem, orders)``
    (seconds) of ``scheds``' orders on ``prob`` (whose step tail is ``tail``, the measured
    one; a fused schedule on its fused variant) meet their ``measured`` steps (seconds) on
    average: ``tail`` plus the mean of measured less predicted. Per schedule its measured
    step against the predictions with ``tail`` and with that cost (ms)."""
    from pipeopt.costs.build import with_overheads
    from pipeopt.costs.profile import Overheads
    from pipeopt.schedules import fused_variant

    def predicted(extra: float) -> list[float]:
        more = with_overheads(prob, Overheads(), [extra] * prob.stages) if extra else prob
        return [step_time(more if s.problem.split_backward else fused_variant(more),
                          s.device_orders()) for s in scheds]

    base = predicted(0.0)
    fit = max(0.0, tail + statistics.mean(t - x for t, x in zip(measured, base, strict=True)))
    rows = [{"method": s.method, "measured_ms": t * 1e3, "predicted_parts_ms": x * 1e3,
             "predicted_ms": f * 1e3}
            for s, t, x, f in zip(scheds, measured, base, predicted(fit - tail), strict=True)]
    return fit, rows


def _shared_factors(runs: list[tuple[dict[str, Any], dict[str, float]]], action: float
                    ) -> dict[tuple[int, int, int], float]:
    """Per ``(run, step, rank)`` of ``runs`` (each :func:`step_trace_costs` with its priced
    compute per key, seconds): how much slower than priced that step ran on that rank, its
    ops' measured compute and gaps summed over what they are priced at (each gap at
    ``action``), i.e. the mean of measured / priced weighted by the priced time.

    A factor, not an offset, since one rank's ops differ 10-80x in size (the MLP's stage 0 B
    of 27 us beside its W of 1.5 ms) and a slow moment of the machine slows each in
    proportion. A ratio of sums rather than a median of ratios: on the MLP's traces the ops
    that ran over their priced time by more than 1 ms cluster in steps (ZB-H1 at 8
    micro-batches: none in 45 of 66 steps and ranks, 4-8 of 24 in 10; the count's variance 4.4
    against 1.0 if they fell independently), which a median leaves in the per-op residuals,
    to be drawn into every simulated step; the sum takes such a cluster into its step's
    factor and leaves residuals that add up to 0 over each step and rank. Gaps count: a slow
    moment stretches the runtime's work between ops as well. A step and rank with nothing
    priced above 0 gets none (1 where used)."""
    sums: dict[tuple[int, int, int], list[float]] = {}
    for i, (run, priced) in enumerate(runs):
        for key, xs in run["ops"].items():
            mid = priced.get(key, 0.0)
            for x, (st, rank) in zip(xs, run["where"][key], strict=True):
                acc = sums.setdefault((i, st, rank), [0.0, 0.0])
                acc[0] += x
                acc[1] += mid
        for x, (st, rank) in zip(run["gaps"], run["gap_where"], strict=True):
            acc = sums.setdefault((i, st, rank), [0.0, 0.0])
            acc[0] += x
            acc[1] += action
    return {at: x / p for at, (x, p) in sums.items() if p > 0}


def _op_spread(fused: dict[str, Any], split: dict[str, Any], stages: int, action: float
               ) -> Any:
    """How the op times of the runs (:func:`step_trace_costs` of the fused and the split
    schedule) spread about what the step-timed document prices (seconds): per step and rank
    the factor its ops and gaps ran at (:func:`_shared_factors`, against the trimmed means
    that are priced and ``action``); per stage, F (both runs pooled, as priced), the split
    run's B and W, the fused run's B (``"B{k} fused"``), each op's time divided by its step
    and rank's factor less the trimmed mean, so that ``measured = factor * (priced +
    residual)`` op by op; the gaps, each divided by its step and rank's factor, less
    ``action`` (the priced gap); the message delays less their trimmed mean (the priced gap
    plus ``message_s``; a delay between two ranks is not scaled by either's factor); the
    factors also per step, every rank's together (``joint``)."""
    from pipeopt.costs.variation import OpSpread, spread_key

    # The priced compute per key of each run: what the document prices that run's ops at.
    pools = {f"F{k}": ((fused, f"F{k}"), (split, f"F{k}")) for k in range(stages)}
    pools.update({f"B{k}": ((split, f"B{k}"),) for k in range(stages)})
    pools.update({f"W{k}": ((split, f"W{k}"),) for k in range(stages)})
    pools.update({spread_key("B", k, False): ((fused, f"B{k}"),) for k in range(stages)})
    mids = {key: trimmed_mean([x for run, k in src for x in run["ops"].get(k, [])])
            for key, src in pools.items()}
    priced: list[dict[str, float]] = [{}, {}]
    for key, src in pools.items():
        for run, k in src:
            priced[0 if run is fused else 1][k] = mids[key]
    factor = _shared_factors([(fused, priced[0]), (split, priced[1])], action)
    ops: dict[str, list[float]] = {}
    for key, src in pools.items():
        residuals = [x / factor.get((0 if run is fused else 1, st, rank), 1.0) - mids[key]
                     for run, k in src
                     for x, (st, rank) in zip(run["ops"].get(k, []), run["where"].get(k, []),
                                              strict=True)]
        if residuals:
            ops[key] = residuals
    gaps = [x / factor.get((i, st, rank), 1.0) - action
            for i, run in enumerate((fused, split))
            for x, (st, rank) in zip(run["gaps"], run["gap_where"], strict=True)]
    delays = fused["delays"] + split["delays"]
    mid = trimmed_mean(delays)
    # Every rank's factor of one step together (ranks = stages here), where all have one.
    steps = sorted({(i, st) for i, st, _ in factor})
    joint = [tuple(factor[(i, st, r)] for r in range(stages)) for i, st in steps
             if all((i, st, r) in factor for r in range(stages))]
    return OpSpread.from_residuals(ops, gaps, [x - mid for x in delays],
                                   shared=list(factor.values()), joint=joint)


def sampled_step_fit(doc: dict[str, Any], *, samples: int | None = None, seed: int = 0,
                     statistic: str = "median") -> dict[str, Any]:
    """The step-timed document ``doc`` (:func:`step_profile_from_runs`) with its per-step
    cost fitted again, against the sampled prediction
    (:func:`pipeopt.costs.variation.sampled_step`: each op's duration drawn from the spread
    its runs measured, ``in_step.op_spread``) instead of the replay on mean op times: the
    step tail the runs measured (``in_step.step_measured_ms``) adjusted (>= 0) by the mean
    of the runs' median step less the sampled prediction of the same orders, so that it
    carries only what the sampling does not explain. ``overheads.step_s`` is that cost
    (seconds); ``in_step.sampled`` records it (``step_fit_ms``), the draws and, per schedule
    of the runs, the measured step against the sampled predictions with the measured tail
    and with the fitted cost (ms). Raises ``ValueError`` when ``doc`` has no ``op_spread``
    (a profile not timed in steps, or written before it was recorded)."""
    from pipeopt.costs.variation import SAMPLES, OpSpread, sampled_step
    from pipeopt.solvers import solve

    st = doc.get("in_step") or {}
    if "op_spread" not in st:
        raise ValueError("in_step.op_spread: missing (a step-timed profile records it; "
                         "re-time the profile with pipeopt profile --timing step)")
    spread = OpSpread.from_dict(st["op_spread"])
    n = SAMPLES if samples is None else samples
    tail = float(st["step_measured_ms"]) / 1e3
    base_doc = {**doc, "overheads": {**doc["overheads"], "step_s": tail}}
    prob = step_problem(base_doc)
    measured = {r["method"]: r["measured_ms"] / 1e3 for r in st["replayed"]}
    scheds = [solve(prob, meth) for meth in st["methods"]]
    fit, rows = _fit_cost(prob, scheds, [measured[s.method] for s in scheds], tail,
                          lambda p, orders: sampled_step(p, orders, spread, samples=n,
                                                         seed=seed, statistic=statistic))
    out = {**doc, "overheads": {**doc["overheads"], "step_s": fit}}
    out["in_step"] = {**st, "sampled": {"step_fit_ms": fit * 1e3, "samples": n, "seed": seed,
                                        "statistic": statistic, "replayed": rows}}
    return out


def step_schedules(doc: dict[str, Any], ranks: int, microbatches: int
                   ) -> tuple[dict[str, Any], list[tuple[int, int]], list[Any]]:
    """What :func:`step_profile` runs for the warm training profile ``doc`` on ``ranks``
    stages and ``microbatches`` micro-batches: the document as a pipeline sees it (a copy,
    the first layer's ``input_grad`` false: a pipeline's first input, the data, takes no
    gradient), the partition the config form (``model: {profile: ...}``) gives its layers
    (``[first, end)`` per stage) and the schedules of :data:`STEP_METHODS` on it (both are
    order generators that ignore costs, so the same partition always gives the same orders).
    Raises ``ValueError`` on a forward-only profile or fewer layers than ``ranks``."""
    import copy

    from pipeopt.solvers import solve

    if doc.get("forward_only"):
        raise ValueError("step timing: a forward-only profile has no training step to run")
    if len(doc["layers"]) < ranks:
        raise ValueError(f"step timing: {len(doc['layers'])} layer(s) cannot fill {ranks} "
                         "stages; use fewer ranks")
    layers = copy.deepcopy(doc["layers"])
    layers[0]["input_grad"] = False
    warm = {**doc, "layers": layers}
    prob = profile_problem(warm, ranks, microbatches)
    part = [(int(a), int(b)) for a, b in dict(prob.meta)["partition"]]
    return warm, part, [solve(prob, meth) for meth in STEP_METHODS]


def step_profile(doc: dict[str, Any], model: str,
                 options: tuple[tuple[str, Any], ...] = (), *, ranks: int = 2,
                 microbatches: int = 8, rounds: int = 2, steps: int = 4, warmup: int = 1,
                 timeout: float = 600.0) -> dict[str, Any]:
    """``doc`` (a warm training profile of :func:`profile_model`, on the CPU) re-timed as a
    pipelined step runs its ops; returns the new document (``"timing": "step"``).

    The config form (``model: {profile: ...}``) partitions the warm profile's layers over
    ``ranks`` stages (:func:`step_schedules`); ``ranks`` gloo processes then run the executor
    on ``model`` (an executor model name: ``tiny-gpt``, ``mlp`` or ``MODULE:FACTORY``, with
    ``options``), ``microbatches`` micro-batches of the profile's ``micro_batch_size``,
    replaying each schedule of :data:`STEP_METHODS` ``steps`` steps a round (the first not
    counted, unless it is the only one) for ``rounds`` interleaved rounds, after ``warmup``
    rounds that are not counted at all (fresh ranks ran their first round of 1F1B 5-30 %
    slower than the next in most profiles of ``benchmarks/executor.py --ranking``, and a
    later run of the same schedule in a benchmark, as in ``pipeopt run``, as fast as the
    second); ``timeout`` (seconds) is for the counted rounds, the whole run gets it scaled by
    ``(warmup + rounds) / rounds``. The document is built from the runs' op traces by
    :func:`step_profile_from_runs` (which says what each number is); ``in_step`` also
    records the run's model, rounds, steps, warm-up rounds, a ping-pong of one activation
    message between ranks 0 and 1 (``message_ping_pong_ms``, for comparison with the delays
    the traces show) and its wall time. Another partition of the same layers (more ranks,
    another balance) keeps the per-layer factors, measured on this one."""
    from pipeopt.executor.procs import RunConfig, spawn

    if warmup < 0 or rounds < 1:
        raise ValueError(f"step timing: warmup must be >= 0 and rounds >= 1 (got {warmup} "
                         f"and {rounds})")
    t0 = time.perf_counter()
    warm, part, scheds = step_schedules(doc, ranks, microbatches)
    cfg = RunConfig(model=model, model_options=tuple(options), steps=steps,
                    batch_size=microbatches * int(doc["micro_batch_size"]), timeout=timeout)
    boundary = int(warm["layers"][part[0][1] - 1]["output_bytes"])  # stage 0's message
    reports = spawn(_step_rank, ranks, ([(s, cfg) for s in scheds], rounds, boundary, warmup),
                    timeout=timeout * (warmup + rounds) / rounds, backend="gloo")
    out = step_profile_from_runs(doc, [r["runs"] for r in reports], microbatches=microbatches,
                                 model=model, warmup=warmup)
    out["in_step"].update(message_ping_pong_ms=(reports[0]["ping_pong_s"] or 0.0) * 1e3,
                          wall_s=time.perf_counter() - t0)
    return out


def step_profile_from_runs(doc: dict[str, Any], runs: list[list[list[dict[str, Any]]]], *,
                           microbatches: int, model: str = "", warmup: int = 0
                           ) -> dict[str, Any]:
    """The warm training profile ``doc`` re-timed on runs of its :func:`step_schedules`
    (``runs[rank][i][round]``: :func:`pipeopt.executor.launch.run_rank`'s report, its
    ``step_traces`` and ``step_times``, of the ``i``-th schedule of :data:`STEP_METHODS` on
    ``len(runs)`` ranks and ``microbatches`` micro-batches; ``warmup``: rounds run before
    these and left out, for the record); returns the new document (``"timing": "step"``).
    :func:`step_profile` spawns the ranks and calls it; a benchmark that runs the same
    schedules between its own measured runs calls it on each round's reports.

    From the op traces (:func:`step_trace_costs`, trimmed means):

    - each stage's F (both runs), B and W (ZB-H1) and fused backward (1F1B): every layer's
      time scaled by the stage's measured time over its layers' warm sum, so that the stages
      of this partition add up to what the run measured (on the first stage, which takes no
      input gradient in a pipeline, the whole backward: every backward field of its layers
      scaled alike, and the first layer's ``input_grad`` false);
    - ``overheads``: ``action_s`` the runtime's gap before an op, ``message_s`` the delay of
      an activation message beyond that gap, ``step_s`` the step tail beyond the optimizer
      step of the layers (``step_s`` per layer, warm) of the rank that ran the last op, plus
      the wait before a step's first op beyond the gap, then adjusted (>= 0) by the mean of
      the runs' median step less what the new document predicts for them (a step is the
      longest path over ops whose times vary, longer than the path over their means).

    ``in_step`` records the partition, sizes, the measured stage times and factors (ms), each
    schedule's measured step against what the new document predicts for it with the measured
    parts and with the adjusted step cost (``replayed``)."""
    ranks = len(runs)
    if ranks < 1 or any(len(r) != len(STEP_METHODS) for r in runs):
        raise ValueError(f"step timing: runs[rank][i] of the {len(STEP_METHODS)} schedules "
                         f"{', '.join(STEP_METHODS)} on every rank expected")
    warm, part, scheds = step_schedules(doc, ranks, microbatches)
    layers = warm["layers"]
    prob = scheds[0].problem
    fused, split = (step_trace_costs(s, [runs[r][i] for r in range(ranks)])
                    for i, s in enumerate(scheds))

    def measured(*runs_keys: tuple[dict[str, Any], str]) -> float | None:
        pooled = [x for run, key in runs_keys for x in run["ops"].get(key, [])]
        return trimmed_mean(pooled) if pooled else None

    rows = []
    for k, (a, b) in enumerate(part):
        seg = layers[a:b]
        f = measured((fused, f"F{k}"), (split, f"F{k}"))
        row: dict[str, Any] = {"stage": k, "layers": [a, b], "forward_ms": f and f * 1e3,
                               "forward_factor": _rescale(seg, ("forward_s",), "forward_s", f)}
        if k == 0:  # the whole backward: 1F1B's B, ZB-H1's W
            whole = measured((fused, "B0"), (split, "W0"))
            row["backward_ms"] = whole and whole * 1e3
            row["backward_factor"] = _rescale(
                seg, ("backward_s", "backward_input_s", "backward_weight_s"), "backward_s",
                whole)
        else:
            bi, bw, fb = (measured((split, f"B{k}")), measured((split, f"W{k}")),
                          measured((fused, f"B{k}")))
            row.update({"backward_input_ms": bi and bi * 1e3,
                        "backward_weight_ms": bw and bw * 1e3,
                        "backward_ms": fb and fb * 1e3})
            row["backward_input_factor"] = _rescale(seg, ("backward_input_s",),
                                                    "backward_input_s", bi)
            row["backward_weight_factor"] = _rescale(seg, ("backward_weight_s",),
                                                     "backward_weight_s", bw)
            row["backward_factor"] = _rescale(seg, ("backward_s",), "backward_s", fb)
        rows.append(row)
    gaps = fused["gaps"] + split["gaps"]
    action = max(0.0, trimmed_mean(gaps))
    delays = fused["delays"] + split["delays"]
    message = max(0.0, trimmed_mean(delays) - action) if delays else 0.0
    opt = [sum(rec.get("step_s", 0.0) for a, b in (part[k] for k in prob.device_stages[d])
               for rec in layers[a:b]) for d in range(ranks)]
    tails = fused["tails"] + split["tails"]
    # The simulator starts the first op at 0 and pays action_s in it: the runtime's work
    # before the first op beyond that is paid once a step, as the tail is.
    lead = max(0.0, trimmed_mean(fused["leads"] + split["leads"]) - action)
    step = max(0.0, trimmed_mean([t - opt[r] for t, r in tails]) + lead)
    out = {**warm, "timing": "step", "layers": layers,
           "overheads": {"action_s": action, "message_s": message, "step_s": step}}
    rounds, steps = len(runs[0][0]), len(runs[0][0][0]["step_times"])
    how = (f"{ranks} gloo ranks running {' and '.join(STEP_METHODS)} of this model, "
           f"{microbatches} micro-batches, {warmup} round(s) not counted, then {rounds} rounds "
           f"x {steps} steps (the first not counted): trimmed means of the delay of an "
           f"activation message beyond the runtime's gap before an op ({len(delays)}), of the "
           f"step tail beyond the layers' optimizer step and of the wait before the first op "
           f"beyond that gap ({len(tails)} steps), that step cost adjusted until the runs' "
           f"median steps are predicted on average (the waits a step's longest path adds over "
           f"the mean op times); per action: the gap ({len(gaps)} ops)")
    fit, replayed = _fit_step(out, scheds, [fused, split], part, microbatches)
    out["overheads"].update(step_s=fit, how=how)
    return {**out,
            "in_step": {"replayed": replayed, "step_measured_ms": step * 1e3,
                        "op_spread": _op_spread(fused, split, len(part), action).to_dict(),
                        "step_fit_ms": fit * 1e3,
                        "model": model, "ranks": ranks, "microbatches": microbatches,
                        "rounds": rounds, "steps": steps, "warmup_rounds": warmup,
                        "methods": list(STEP_METHODS),
                        "partition": [list(x) for x in part], "stages": rows,
                        "gap_ms": action * 1e3,
                        "message_delay_ms": trimmed_mean(delays) * 1e3,
                        "message_bytes": int(layers[part[0][1] - 1]["output_bytes"]),
                        "tail_ms": trimmed_mean([t for t, _ in tails]) * 1e3,
                        "lead_ms": lead * 1e3}}
