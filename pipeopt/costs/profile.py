"""Profile files: per-layer costs measured by :mod:`pipeopt.costs.profiler`, read back as
:class:`~pipeopt.costs.transformer.LayerCost` for the cost model (``model.profile``), or, for a
forward-only profile, as a :class:`ForwardProfile` that the serving cost model reads
(``workload.costs.profile`` of an inference config; :mod:`pipeopt.costs.inference`).

Reading needs neither torch nor the executor, so the planner imports this module and never the
profiler (which runs layers through the executor's own backward split).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeopt.costs.transformer import LayerCost
from pipeopt.errors import MAX_CONFIG_BYTES

FORMAT = "pipeopt.profile/v1"


class ProfileError(ValueError):
    """An unreadable or malformed profile file."""


def write_profile(doc: dict[str, Any], path: str | Path) -> None:
    """Write a profile document atomically."""
    from pipeopt.io import write_atomic

    write_atomic(path, json.dumps(doc, indent=1) + "\n")


#: The fields a profile may have (what :func:`~pipeopt.costs.profiler.profile_model` writes);
#: others are refused, as a typo (``backwrd_s``) would otherwise be ignored.
_TOP_KEYS = ("format", "model", "device", "torch", "micro_batch_size", "warmup", "repeats",
             "backward_split", "forward_only", "input_shape", "overheads", "timing", "in_step",
             "layers")
_LAYER_KEYS = ("name", "forward_s", "backward_input_s", "backward_weight_s", "backward_s",
               "step_s", "input_grad", "params", "param_bytes", "activation_bytes",
               "output_bytes", "forward_flops", "backward_flops", "peak_memory_bytes")
#: The measured fields of a profile's ``overheads`` (seconds); ``how`` may describe the
#: measurement, any other field is refused as a typo.
OVERHEAD_KEYS = ("action_s", "message_s", "step_s")


@dataclass(frozen=True)
class Overheads:
    """The runtime's fixed costs that no layer's compute shows (seconds, each >= 0; absent =
    0): ``action_s`` is paid by every F, B and W action a rank runs (Python dispatch of the
    pipelining runtime, posting its sends and receives, the op's bookkeeping), ``message_s``
    by every message between ranks on top of the link's latency, and ``step_s`` once per step
    after each stage's last backward (the optimizer step's fixed part and the closing
    barrier); the optimizer step's per-parameter part is each layer's ``step_s``."""

    action_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.action_s or self.message_s or self.step_s)


def load_overheads(path: str | Path) -> Overheads:
    """The ``overheads`` of a profile file (all 0 when it has none)."""
    return _overheads(_read_document(path), path)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _overheads(doc: dict[str, Any], path: str | Path) -> Overheads:
    raw = doc.get("overheads")
    if raw is None:
        return Overheads()
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: overheads: expected a mapping of {', '.join(OVERHEAD_KEYS)} "
                           f"(seconds), got {raw!r}")
    from pipeopt.io import known_fields

    known_fields(raw, (*OVERHEAD_KEYS, "how"), f"{path}: overheads.", ProfileError)
    vals = {}
    for key in OVERHEAD_KEYS:
        v = raw.get(key, 0.0)
        if not _number(v):
            raise ProfileError(f"{path}: overheads.{key}: expected a number >= 0 (seconds), "
                               f"got {v!r}")
        vals[key] = float(v)
    return Overheads(**vals)


def load_profile(path: str | Path) -> list[LayerCost]:
    """Layer costs from a profile file (measured times in seconds, bytes)."""
    return _layer_costs(_read_document(path), path)


@dataclass(frozen=True)
class ForwardProfile:
    """A forward-only profile (``pipeopt profile --forward-only``): ``layers`` timed on one
    input of ``batch`` sequences of ``seq_len`` tokens each (``forward_time`` in seconds,
    ``params`` counted), on ``device`` (as the profiler names it: ``cpu``, ``cuda``)."""

    layers: tuple[LayerCost, ...]
    batch: int
    seq_len: int
    device: str


def load_forward_profile(path: str | Path) -> ForwardProfile:
    """A forward-only profile file; :class:`ProfileError` naming the field when it is not one
    (a training profile, or no ``input_shape`` ``[batch, seq_len, ...]`` to count its
    tokens)."""
    doc = _read_document(path)
    layers = _layer_costs(doc, path)
    if doc.get("forward_only") is not True:
        raise ProfileError(f"{path}: forward_only: expected true (a profile of the inference "
                           f"forward: pipeopt profile --forward-only), got "
                           f"{doc.get('forward_only')!r}")
    shape = doc.get("input_shape")
    if not (isinstance(shape, list) and len(shape) >= 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise ProfileError(f"{path}: input_shape: expected [batch, seq_len, ...] (integers >= "
                           f"1; profiles written before it was recorded: profile again), got "
                           f"{shape!r}")
    device = doc.get("device", "unknown")
    return ForwardProfile(tuple(layers), shape[0], shape[1], str(device))


def _read_document(path: str | Path) -> dict[str, Any]:
    """The checked top level of a profile file (format, known fields, a non-empty layer list)."""
    from pipeopt.io import json_int, known_fields, read_input

    try:
        doc = json.loads(read_input(path, MAX_CONFIG_BYTES, "a profile"), parse_int=json_int)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ProfileError(f"{path}: not usable JSON: nested too deeply") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f"{path}: format: expected {FORMAT!r}")
    known_fields(doc, _TOP_KEYS, f"{path}: ", ProfileError)
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ProfileError(f"{path}: layers: expected a non-empty list")
    for i, rec in enumerate(layers):
        if isinstance(rec, dict):
            known_fields(rec, _LAYER_KEYS, f"{path}: layers[{i}].", ProfileError)
    return doc


def _layer_costs(doc: dict[str, Any], path: str | Path) -> list[LayerCost]:
    """The checked layer records of a profile document as layer costs."""
    out = []
    layers = doc["layers"]
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
        fused = rec.get("backward_s")  # optional (older profiles lack it); not a LayerCost field
        if fused is not None and (not isinstance(fused, int | float) or isinstance(fused, bool)
                                  or not math.isfinite(fused) or fused < 0):
            raise ProfileError(f"{path}: layers[{i}].backward_s: expected a number >= 0, "
                               f"got {fused!r}")
        step = rec.get("step_s", 0.0)  # optional: the optimizer step of the layer's parameters
        if not _number(step):
            raise ProfileError(f"{path}: layers[{i}].step_s: expected a number >= 0, got "
                               f"{step!r}")
        input_grad = rec.get("input_grad", True)
        if not isinstance(input_grad, bool):
            raise ProfileError(f"{path}: layers[{i}].input_grad: expected true or false, "
                               f"got {input_grad!r}")
        flops: dict[str, float] = {}
        for key in ("forward_flops", "backward_flops"):  # optional: FLOPs only label the layer
            v = rec.get(key)
            if v is None:
                flops[key] = 0.0
                continue
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) \
                    or v < 0:
                raise ProfileError(f"{path}: layers[{i}].{key}: expected a number >= 0, "
                                   f"got {v!r}")
            flops[key] = float(v)
        fflops, bflops = flops["forward_flops"], flops["backward_flops"]
        out.append(LayerCost(
            name=str(rec.get("name", f"layer{i}")), forward_flops=fflops,
            backward_input_flops=bflops / 2, backward_weight_flops=bflops / 2,
            params=vals["params"], activation_bytes=vals["activation_bytes"],
            weight_grad_bytes=vals["activation_bytes"], output_bytes=vals["output_bytes"],
            forward_time=vals["forward_s"], backward_input_time=vals["backward_input_s"],
            backward_weight_time=vals["backward_weight_s"],
            backward_time=None if fused is None else float(fused), input_grad=input_grad,
            step_time=float(step)))
    return out
