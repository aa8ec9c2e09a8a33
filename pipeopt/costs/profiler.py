"""Measure per-layer costs of a real torch model (an ``nn.Sequential``) and read them back.

For each layer, on its real input (the previous layers' output):

- ``forward_s``: the forward with autograd recording (as in training);
- ``backward_input_s``: ``torch.autograd.grad`` of the output w.r.t. the layer's *input* only;
- ``backward_weight_s``: the full backward (input and parameters) minus the input-only one —
  timing the parameter gradients alone would recompute the gradients they share with the input
  path, so the difference is the honest extra cost of W;
- ``activation_bytes``: bytes of the distinct tensors autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded;
- ``param_bytes`` / ``params``; ``output_bytes`` (the p2p message); FLOPs of the forward and
  backward from ``torch.utils.flop_counter.FlopCounterMode``; on CUDA the peak memory.

Times are medians of ``repeats`` runs after ``warmup`` runs. torch is imported lazily, so the
planner (``load_profile``) never needs it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeopt.costs.transformer import LayerCost

FORMAT = "pipeopt.profile/v1"


class ProfileError(ValueError):
    """An unreadable or malformed profile file."""


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

    def bwd_input() -> Any:
        o = layer(inp)
        return torch.autograd.grad(o, wrt_in, grad_out) if wrt_in else None

    def bwd_full() -> Any:
        o = layer(inp)
        return torch.autograd.grad(o, wrt_in + params, grad_out) if wrt_in + params else None

    def fwd_only() -> Any:
        return layer(inp)

    # Each backward timing includes a forward (the graph is rebuilt); subtract it.
    f_again = _median_time(fwd_only, warmup, repeats, sync)
    b_in = max(0.0, _median_time(bwd_input, warmup, repeats, sync) - f_again) if wrt_in else 0.0
    b_full = max(0.0, _median_time(bwd_full, warmup, repeats, sync) - f_again) if (
        wrt_in or params) else 0.0
    with FlopCounterMode(display=False) as fc:
        o = layer(inp)
    fwd_flops = float(fc.get_total_flops())
    bwd_flops = 0.0
    if wrt_in or params:
        with FlopCounterMode(display=False) as fc:
            torch.autograd.grad(o, wrt_in + params, grad_out)
        bwd_flops = float(fc.get_total_flops())
    peak = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        o = layer(inp)
        if wrt_in or params:
            torch.autograd.grad(o, wrt_in + params, grad_out)
        peak = float(torch.cuda.max_memory_allocated(dev) - base)
    record = {
        "name": type(layer).__name__,
        "forward_s": forward_s, "backward_input_s": b_in,
        "backward_weight_s": max(0.0, b_full - b_in),
        "params": float(sum(p.numel() for p in layer.parameters())),
        "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        "activation_bytes": activation_bytes,
        "output_bytes": float(out.numel() * out.element_size()),
        "forward_flops": fwd_flops, "backward_flops": bwd_flops,
        "peak_memory_bytes": peak,
    }
    return record, out.detach()


def profile_model(model: Any, example_input: Any, *, device: str | None = None,
                  warmup: int = 2, repeats: int = 5, name: str = "model") -> dict[str, Any]:
    """Profile every layer of an ``nn.Sequential`` on ``example_input`` (one micro-batch);
    returns the profile document (see :data:`FORMAT`)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev).train()
    x = example_input.to(dev)
    layers = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # One thread: small layers time far more steadily than with a contended thread pool.
        torch.set_num_threads(1)
    try:
        for i, layer in enumerate(model):
            rec, x = profile_layer(layer, x, warmup=warmup, repeats=repeats)
            rec["name"] = f"{i}:{rec['name']}"
            layers.append(rec)
    finally:
        torch.set_num_threads(threads)
    return {"format": FORMAT, "model": name, "device": str(dev), "torch": torch.__version__,
            "micro_batch_size": int(example_input.shape[0]), "warmup": warmup,
            "repeats": repeats, "layers": layers}


def write_profile(doc: dict[str, Any], path: str | Path) -> None:
    """Write a profile document atomically."""
    from pipeopt.io import write_atomic

    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def load_profile(path: str | Path) -> list[LayerCost]:
    """Layer costs from a profile file (measured times in seconds, bytes)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f"{path}: format: expected {FORMAT!r}")
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ProfileError(f"{path}: layers: expected a non-empty list")
    out = []
    for i, rec in enumerate(layers):
        vals: dict[str, float] = {}
        for key in ("forward_s", "backward_input_s", "backward_weight_s", "params",
                    "activation_bytes", "output_bytes"):
            v = rec.get(key) if isinstance(rec, dict) else None
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) \
                    or v < 0:
                raise ProfileError(f"{path}: layers[{i}].{key}: expected a number >= 0, "
                                   f"got {v!r}")
            vals[key] = float(v)
        fflops = float(rec.get("forward_flops") or 0.0)
        bflops = float(rec.get("backward_flops") or 0.0)
        out.append(LayerCost(
            name=str(rec.get("name", f"layer{i}")), forward_flops=fflops,
            backward_input_flops=bflops / 2, backward_weight_flops=bflops / 2,
            params=vals["params"], activation_bytes=vals["activation_bytes"],
            weight_grad_bytes=vals["activation_bytes"], output_bytes=vals["output_bytes"],
            forward_time=vals["forward_s"], backward_input_time=vals["backward_input_s"],
            backward_weight_time=vals["backward_weight_s"]))
    return out
