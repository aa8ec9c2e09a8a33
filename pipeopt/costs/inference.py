"""Inference costs of a decoder transformer: KV cache bytes, prefill and decode FLOPs, the
memory-bandwidth-bound decode step, and the per-stage roofline models of
:mod:`pipeopt.workloads.inference`.

Formulas (b requests, h hidden, L layers, e bytes per value, V vocabulary):

* KV bytes per token (grouped-query attention aware): ``2 · L · kv_heads · head_dim · e`` (K and V,
  each ``kv_heads · head_dim`` values per layer; Ainslie et al., "GQA", 2023, for the shared K/V
  heads). Llama-2-70B (L = 80, 8 KV heads, head_dim 128, fp16): 327,680 bytes.
* Linear FLOPs per token and layer: ``2 · (2h² + 2·h·kv_dim + n·h·f)`` (the weight matmuls of
  :func:`pipeopt.costs.transformer.block_flops` for one token).
* Attention FLOPs per (query, key) pair and layer: ``4h`` (QKᵀ and softmax·V, 2 FLOPs per
  multiply-add). A causal prefill of s tokens has s²/2 pairs, giving ``2·s²·h`` per layer, the
  causal count of :func:`~pipeopt.costs.transformer.block_flops`; a decode token with context n
  has n pairs.
* The LM head: ``2·h·V`` per token whose logits are needed (the prompt's last token and every
  decode token).
* A decode step on a stage takes ``max(FLOPs / peak, (weights + KV bytes read) / HBM
  bandwidth)``: the roofline (Williams et al., CACM 2009); at small batches the weights' read
  dominates, which is why decode is memory-bandwidth bound (Pope et al., "Efficiently Scaling
  Transformer Inference", MLSys 2023, section 2).

A forward-only profile (``pipeopt profile --forward-only``, :func:`profiled_stage_models`)
replaces the peak FLOP/s by the rate each stage's layers reached on the profiled forward: that
forward ran ``B`` sequences of ``S`` tokens from an empty cache, every token's logits through
the head, so in this model's accounting it did ``F = B·S·lin + B·(S²/2)·attn + B·S·head``
FLOPs on a stage's layers, and the stage's rate is ``F / (Σ forward_s of its layers)``; an
iteration's compute time is then its FLOPs over that rate (the profiled forward itself gets
exactly its measured time). Weights, KV bytes and the HBM roof stay the model's and the GPU's:
one forward shape measures no bandwidth.

HBM bandwidth per GPU (vendor datasheets, peak, checked December 2026):

- A100 40GB SXM 1,555 GB/s; A100 80GB SXM 2,039 GB/s (NVIDIA A100 datasheet).
- H100 SXM 3.35 TB/s (NVIDIA H100 datasheet, HBM3).
- H200 4.8 TB/s (NVIDIA H200 datasheet, HBM3e).
- B200 8 TB/s (NVIDIA HGX B200 / DGX B200 datasheet, per GPU).
- L4 300 GB/s (NVIDIA L4 datasheet, GDDR6); L40S 864 GB/s (NVIDIA L40S datasheet, GDDR6).
- MI300X 5.3 TB/s (AMD Instinct MI300X datasheet, HBM3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from pipeopt.costs.gpus import lookup
from pipeopt.costs.profile import ForwardProfile
from pipeopt.costs.transformer import DTYPE_BYTES, TransformerShape, block_params
from pipeopt.workloads.inference import StageModel

#: Peak HBM (device memory) bandwidth per catalog GPU, bytes/s (sources in the module docstring).
HBM_BANDWIDTH: Mapping[str, float] = MappingProxyType({
    "A100-40GB": 1555e9,
    "A100-80GB": 2039e9,
    "H100-SXM": 3.35e12,
    "H200": 4.8e12,
    "B200": 8e12,
    "L4": 300e9,
    "L40S": 864e9,
    "MI300X": 5.3e12,
})


def hbm_bandwidth(gpu: str) -> float:
    """Peak HBM bandwidth of catalog GPU ``gpu`` (bytes/s); KeyError naming the known ones."""
    name = lookup(gpu).name
    if name not in HBM_BANDWIDTH:
        raise KeyError(f"no HBM bandwidth for GPU {name!r}; known: {', '.join(HBM_BANDWIDTH)}")
    return HBM_BANDWIDTH[name]


def kv_bytes_per_token(shape: TransformerShape, layers: int | None = None) -> float:
    """KV cache bytes per token over ``layers`` layers (default all):
    ``2 · layers · kv_heads · head_dim · e``."""
    n = shape.layers if layers is None else layers
    return 2.0 * n * shape.kv_dim * shape.dtype_bytes


def linear_flops_per_token(shape: TransformerShape) -> float:
    """FLOPs of one layer's weight matmuls for one token: ``2 (2h² + 2 h kv_dim + n h f)``."""
    h = shape.hidden
    return 2.0 * (2 * h * h + 2 * h * shape.kv_dim + shape.mlp_matrices * h * shape.ffn)


def attention_flops_per_key(shape: TransformerShape) -> float:
    """FLOPs of one layer's two attention matmuls per (query, key) pair: ``4h``."""
    return 4.0 * shape.hidden


def head_flops_per_logit(shape: TransformerShape) -> float:
    """FLOPs of the LM head for one token's logits: ``2 h V``."""
    return 2.0 * shape.hidden * shape.vocab


def prefill_flops(shape: TransformerShape, prompt: int) -> float:
    """FLOPs of prefilling one prompt of ``prompt`` tokens through the whole model (causal):
    ``L (lin · s + 4h · s²/2) + 2hV`` (logits of the last token only)."""
    s = prompt
    return (shape.layers * (linear_flops_per_token(shape) * s
                            + attention_flops_per_key(shape) * s * s / 2)
            + head_flops_per_logit(shape))


def decode_flops(shape: TransformerShape, context: int) -> float:
    """FLOPs of one decode token attending to ``context`` keys: ``L (lin + 4h·n) + 2hV``."""
    return (shape.layers * (linear_flops_per_token(shape)
                            + attention_flops_per_key(shape) * context)
            + head_flops_per_logit(shape))


def weight_bytes(shape: TransformerShape) -> float:
    """Bytes of all weights at the shape's dtype: L blocks, the embedding and the LM head
    (untied: stored twice)."""
    h, v = shape.hidden, shape.vocab
    emb = v * h
    head = (0 if shape.tie_embeddings else v * h) + h
    return float((shape.layers * block_params(shape) + emb + head) * shape.dtype_bytes)


def decode_step_time(shape: TransformerShape, gpu: str, contexts: Sequence[int], *,
                     efficiency: float = 1.0, bandwidth_efficiency: float = 1.0) -> float:
    """Seconds of one decode step of a batch (one context per request) of the whole model on
    one GPU: ``max(Σ FLOPs / peak, (weights + Σ context · kv) / HBM bandwidth)``."""
    g = lookup(gpu)
    flops = sum(decode_flops(shape, n) for n in contexts)
    bytes_ = weight_bytes(shape) + kv_bytes_per_token(shape) * sum(contexts)
    return max(flops / (g.peak_flops(shape.dtype) * efficiency),
               bytes_ / (hbm_bandwidth(gpu) * bandwidth_efficiency))


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """``layers`` over ``stages`` as evenly as possible, the extra ones on the first stages."""
    if not isinstance(stages, int) or stages < 1 or stages > layers:
        raise ValueError(f"stages: must be an integer in 1..{layers} (layers), got {stages!r}")
    q, r = divmod(layers, stages)
    return tuple(q + (k < r) for k in range(stages))


def stage_models(shape: TransformerShape, gpu: str | Sequence[str],
                 stages: int | Sequence[int], *,
                 efficiency: float = 1.0, bandwidth_efficiency: float = 1.0,
                 memory_fraction: float = 1.0) -> tuple[StageModel, ...]:
    """One :class:`StageModel` per pipeline stage of ``shape`` on GPUs ``gpu`` (one catalog
    name for every stage, or one per stage: mixed devices).

    ``stages``: a count (layers split by :func:`split_layers`) or the layers per stage. The
    embedding sits on the first stage, the final norm and LM head on the last. ``efficiency``
    and ``bandwidth_efficiency``: fractions of the peak FLOP/s and HBM bandwidth reached (1 =
    the ideal roofline); ``memory_fraction``: the share of the GPU's memory usable for weights
    and KV cache (vLLM's ``gpu_memory_utilization``; 1 = all)."""
    if shape.tensor_parallel != 1:
        shape = replace(shape, tensor_parallel=1)  # tensor parallelism: not modelled here
    per = split_layers(shape.layers, stages) if isinstance(stages, int) else tuple(stages)
    if sum(per) != shape.layers or min(per, default=0) < 1:
        raise ValueError(f"stages: layers per stage {list(per)} must be >= 1 each and sum to "
                         f"{shape.layers}")
    for name, v in (("efficiency", efficiency), ("bandwidth_efficiency", bandwidth_efficiency),
                    ("memory_fraction", memory_fraction)):
        if not 0 < v <= 1:
            raise ValueError(f"{name}: must be in (0, 1], got {v!r}")
    names = [gpu] * len(per) if isinstance(gpu, str) else list(gpu)
    if len(names) != len(per):
        raise ValueError(f"gpu: {len(names)} GPUs for {len(per)} stages")
    e = DTYPE_BYTES[shape.dtype]
    h, v = shape.hidden, shape.vocab
    out = []
    for k, n in enumerate(per):
        g = lookup(names[k])
        peak = g.peak_flops(shape.dtype) * efficiency
        bw = hbm_bandwidth(names[k]) * bandwidth_efficiency
        params = n * block_params(shape)
        if k == 0:
            params += v * h
        last = k == len(per) - 1
        if last:
            params += (0 if shape.tie_embeddings else v * h) + h
        usable = g.memory_bytes * memory_fraction
        if usable <= params * e:
            raise ValueError(f"stages[{k}]: the weights of {n} layers ({params * e / 1e9:.1f} GB)"
                             f" do not fit the {g.name}'s usable {usable / 1e9:.1f} GB")
        out.append(StageModel(
            linear_flops_per_token=n * linear_flops_per_token(shape),
            attention_flops_per_key=n * attention_flops_per_key(shape),
            weight_bytes=params * e, kv_bytes_per_token=kv_bytes_per_token(shape, n),
            peak_flops=peak, hbm_bandwidth=bw,
            head_flops_per_logit=head_flops_per_logit(shape) if last else 0.0,
            activation_bytes_per_token=0.0 if last else float(h * e),
            memory_limit=usable))
    return tuple(out)



def profiled_stage_models(shape: TransformerShape, gpu: str | Sequence[str],
                          stages: int | Sequence[int], profile: ForwardProfile, *,
                          bandwidth_efficiency: float = 1.0,
                          memory_fraction: float = 1.0) -> tuple[StageModel, ...]:
    """:func:`stage_models` with each stage's FLOP rate measured by a forward-only ``profile``
    instead of the GPU's peak (formula in the module docstring).

    The profile's layers must be the model's pipeline layers: the embedding, ``shape.layers``
    blocks, the head (``pipeopt profile --model tiny-gpt``'s layout), each block with
    :func:`~pipeopt.costs.transformer.block_params` parameters; stage k's time is the sum of
    ``forward_s`` over its blocks, plus the embedding on the first stage and the head on the
    last. ValueError (``costs.profile: ...``) when the profile does not fit the model."""
    per = split_layers(shape.layers, stages) if isinstance(stages, int) else tuple(stages)
    models = stage_models(shape, gpu, per, bandwidth_efficiency=bandwidth_efficiency,
                          memory_fraction=memory_fraction)
    prof = profile.layers
    if len(prof) != shape.layers + 2:
        raise ValueError(f"costs.profile: {len(prof)} layers, expected {shape.layers + 2} (the "
                         f"embedding, model.layers = {shape.layers} blocks, the head)")
    want = block_params(shape)
    for i in range(1, shape.layers + 1):
        if prof[i].params != want:
            raise ValueError(f"costs.profile: layers[{i}] ({prof[i].name}) has "
                             f"{prof[i].params:.0f} parameters, a block of the model has "
                             f"{want:.0f}: the profile is of another model")
    b, s = profile.batch, profile.seq_len
    out = []
    first = 1
    for k, (n, m) in enumerate(zip(per, models, strict=True)):
        idx = list(range(first, first + n))
        first += n
        if k == 0:
            idx.insert(0, 0)
        if k == len(per) - 1:
            idx.append(shape.layers + 1)
        seconds = sum(prof[i].forward_time for i in idx)
        if seconds <= 0:
            raise ValueError(f"costs.profile: layers {idx[0]}..{idx[-1]} (stage {k}) measured "
                             f"0 s: no FLOP rate to derive")
        flops = (m.linear_flops_per_token * b * s + m.attention_flops_per_key * b * s * s / 2
                 + m.head_flops_per_logit * b * s)
        out.append(replace(m, peak_flops=flops / seconds))
    return tuple(out)
