"""Analytic costs of a mixture-of-experts (MoE) transformer block, per micro-batch and per
expert-parallel rank.

An MoE block replaces the dense MLP with a router (gate) and ``experts`` expert MLPs, each token
sent to ``top_k`` of them; ``shared_experts`` (DeepSeek) see every token. Experts are sharded
over an expert-parallel (EP) group of ``expert_parallel`` ranks (``experts / ep`` each); every
rank holds its own micro-batch of T = b·s tokens, so a dispatch all-to-all sends each routed
token copy to the rank of its expert and a combine all-to-all brings the expert outputs back.

Formulas (2 FLOPs per multiply-add; e = bytes per value; n = 3 matrices per SwiGLU expert, 2
for GeLU; f_e = the expert's inner width; h = hidden):

* capacity: an expert takes at most ``C = c · k · T_group / E`` tokens (GShard, Lepikhin et al.
  2021, section 2.2; Switch Transformer, Fedus et al. 2022, section 2.2: "expert capacity =
  tokens per batch / number of experts × capacity factor", here with k copies per token as
  Megatron-Core counts it); implementations that pad every expert to C process ``c · k · T``
  routed token copies per rank (E/ep experts × C with T_group = ep·T). Without a capacity
  factor (dropless, as Mixtral, Jiang et al. 2024, and DeepSeek-V3 train) a balanced router
  gives ``k · T`` per rank: :func:`routed_tokens`;
* router: ``2 · T · h · E`` forward FLOPs (one h x E linear; Fedus et al. 2022, section 2.1);
* routed experts: ``routed_tokens · 2 · n · h · f_e`` forward FLOPs on each rank (Mixtral: two
  SwiGLU experts per token out of 8; DeepSeek-V3 technical report, 2024, section 2.1.2: 8 of
  256 routed plus 1 shared);
* shared experts: ``T · shared · 2 · n · h · f_s``;
* attention and everything else of the block: the dense block of :mod:`pipeopt.costs.transformer`
  without its MLP (the same Narayanan et al. 2021 / FlashAttention-2 accounting);
* backward as in :mod:`pipeopt.costs.transformer`: input gradient = forward's linear FLOPs + 2x
  the attention matmuls (2.5x with ``flash_attention``: the recomputed QKᵀ), weight gradient =
  linear FLOPs;
* parameters: attention (+ norms, biases) + router ``h · E`` + ``E · n · h · f_e`` routed +
  shared; a rank stores the attention, the router, the shared experts and ``E / ep`` routed
  experts (:func:`block_params`);
* all-to-all bytes: the dispatch buffer of a rank is ``routed_tokens · h · e_dispatch`` (e in
  the dispatch dtype: DeepSeek-V3 dispatches in FP8 and combines in BF16, section 3.3.2 of its
  report), of which ``(ep - 1) / ep`` leaves the rank; the combine buffer is
  ``routed_tokens · h · e``; :func:`pipeopt.costs.collectives.all_to_all_time` times a buffer;
* activations kept for the backward (Korthikanti et al. 2022 term by term, as the dense block):
  the dense block's without its MLP inner values, plus the router's fp32 probabilities
  ``4 · T · E`` (kept for the gate's gradient; an assumption), each routed copy's input and
  inner values ``e · routed · (h + n · f_e)``, each shared expert's inner values
  ``e · T · n · f_s``.

Tensor parallelism t > 1, with the experts split over the same t GPUs (expert tensor-parallel
size = TP, Megatron-Core's default before its "parallel folding"; EP groups carved out of data
parallelism, one per tensor-parallel index): the attention is split over the t GPUs of a rank
as the dense block's (FLOPs, weights and split activations / t; the router is replicated).
The t GPUs split each all-to-all buffer (Megatron-Core's all-to-all dispatcher of those
versions splits the tokens' hidden dimension over the TP group and all-gathers it after the
all-to-all; here the split is counted in bytes only), so a GPU's all-to-all buffers are
``dispatch_bytes / t`` and ``combine_bytes / t``; the t GPUs all-gather what they received,
run their 1/t share of every local expert's width (column- then row-parallel, as a dense
MLP: FLOPs, weights and inner values / t; each copy's input h kept whole) and reduce-scatter
the outputs before the combine; without sequence parallelism the combined outputs' t slices
are all-gathered back. Shared experts are a dense MLP split over t (FLOPs, weights, inner
values / t and an all-reduce of their output). :func:`tp_collectives` lists the
collectives; biases are divided by t with their matrices.

Full recomputation (Korthikanti et al. 2022, as the dense block): the block keeps only its
input (e·T·h, / t with sequence parallelism) and its backward-input op runs the whole forward
again (attention, router, experts, shared experts) before the gradients, including its
tensor-parallel collectives (:func:`tp_collectives`) and, in the chain of
:mod:`pipeopt.costs.moe_chain`, its dispatch and combine all-to-all.

Not modelled: load imbalance between experts (a balanced router is assumed), tokens dropped by a
capacity factor < 1 are still counted as routed, DeepSeek's node-limited routing and MLA
attention (the GQA formulas stand in).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from pipeopt.costs import transformer as tf
from pipeopt.costs.collectives import all_to_all_time
from pipeopt.costs.transformer import DTYPE_BYTES, LayerCost, TransformerShape
from pipeopt.workloads.moe import MoEBlock, MoEPipeline, Work

#: Bytes per value of an all-to-all payload: the model dtypes plus FP8 (DeepSeek-V3's dispatch).
A2A_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({**DTYPE_BYTES, "fp8": 1})


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of a model (counts and widths; see the module docstring).

    ``experts``: routed experts E; ``top_k``: experts per token k; ``expert_ffn``: an expert's
    inner width f_e; ``expert_parallel``: EP group size (must divide E); ``capacity_factor``:
    c > 0, or None for dropless routing; ``shared_experts`` of width ``shared_ffn`` (default
    f_e); blocks ``first_dense`` and after are MoE every ``every`` blocks (DeepSeek-V3: the
    first 3 dense); ``dispatch_dtype``: the dispatch payload's dtype (None: the model's).
    """

    experts: int
    top_k: int
    expert_ffn: int
    expert_parallel: int = 1
    capacity_factor: float | None = None
    shared_experts: int = 0
    shared_ffn: int | None = None
    first_dense: int = 0
    every: int = 1
    dispatch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("experts", 1), ("top_k", 1), ("expert_ffn", 1),
                          ("expert_parallel", 1), ("shared_experts", 0), ("first_dense", 0),
                          ("every", 1)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {x!r}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k: must be <= experts ({self.experts}), got {self.top_k}")
        if self.experts % self.expert_parallel:
            raise ValueError(f"expert_parallel: must divide experts ({self.experts}), got "
                             f"{self.expert_parallel}")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not (0 < c < math.inf)):
            raise ValueError(f"capacity_factor: must be a number > 0 or None, got {c!r}")
        s = self.shared_ffn
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"shared_ffn: must be an integer >= 1, got {s!r}")
        if self.dispatch_dtype is not None and self.dispatch_dtype not in A2A_DTYPE_BYTES:
            raise ValueError(f"dispatch_dtype: must be one of {', '.join(A2A_DTYPE_BYTES)}, "
                             f"got {self.dispatch_dtype!r}")

    @property
    def experts_per_rank(self) -> int:
        """Routed experts stored on one EP rank: E / ep."""
        return self.experts // self.expert_parallel

    @property
    def shared_width(self) -> int:
        """A shared expert's inner width (default: the routed experts')."""
        return self.shared_ffn or self.expert_ffn

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (0-based) is an MoE block."""
        return block >= self.first_dense and (block - self.first_dense) % self.every == 0


#: Recomputation modes of an MoE block (:func:`block_cost`).
MOE_RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")


def _check_shape(shape: TransformerShape) -> None:
    if shape.recompute not in MOE_RECOMPUTE:
        raise ValueError(f"recompute: MoE blocks support {', '.join(MOE_RECOMPUTE)}, got "
                         f"{shape.recompute!r}")


def tokens(shape: TransformerShape) -> int:
    """Tokens of one micro-batch on one rank: T = b·s."""
    return shape.micro_batch_size * shape.seq_len


def routed_tokens(shape: TransformerShape, spec: MoESpec) -> float:
    """Routed token copies one EP rank's experts process per micro-batch: c·k·T with a
    capacity factor (every expert padded to its capacity), k·T dropless (balanced)."""
    c = 1.0 if spec.capacity_factor is None else float(spec.capacity_factor)
    return c * spec.top_k * tokens(shape)


def _matrices(shape: TransformerShape) -> int:
    return shape.mlp_matrices  # 3 for SwiGLU experts, 2 for GeLU


def attention_flops(shape: TransformerShape) -> tuple[float, float]:
    """(linear, attention-core) forward FLOPs of a block without its MLP: the dense block's
    :func:`~pipeopt.costs.transformer.block_flops` less ``2·T·n·h·f`` of its MLP."""
    lin, att = tf.block_flops(shape)
    mlp = 2.0 * tokens(shape) * _matrices(shape) * shape.hidden * shape.ffn
    return lin - mlp, att


def gate_flops(shape: TransformerShape, spec: MoESpec) -> float:
    """Router forward FLOPs: 2·T·h·E."""
    return 2.0 * tokens(shape) * shape.hidden * spec.experts


def expert_flops(shape: TransformerShape, spec: MoESpec) -> float:
    """Routed experts' forward FLOPs on one rank: routed_tokens · 2·n·h·f_e."""
    return routed_tokens(shape, spec) * 2.0 * _matrices(shape) * shape.hidden * spec.expert_ffn


def shared_flops(shape: TransformerShape, spec: MoESpec) -> float:
    """Shared experts' forward FLOPs: T · shared · 2·n·h·f_s."""
    return (tokens(shape) * spec.shared_experts * 2.0 * _matrices(shape) * shape.hidden
            * spec.shared_width)


def expert_params(shape: TransformerShape, width: int) -> float:
    """Parameters of one expert MLP of inner width ``width``: n·h·f (+ biases n-1 f + h)."""
    n, h = _matrices(shape), shape.hidden
    return float(n * h * width + (((n - 1) * width + h) if shape.bias else 0))


def attention_params(shape: TransformerShape) -> float:
    """Parameters of a block without its MLP (attention, norms, their biases): the dense
    :func:`~pipeopt.costs.transformer.block_params` less its MLP."""
    return tf.block_params(shape) - expert_params(shape, shape.ffn)


def block_params(shape: TransformerShape, spec: MoESpec) -> tuple[float, float]:
    """(whole block, one EP rank's share) parameters of an MoE block: attention + router h·E +
    shared + E (rank: E / ep) routed experts."""
    common = (attention_params(shape) + shape.hidden * spec.experts
              + spec.shared_experts * expert_params(shape, spec.shared_width))
    one = expert_params(shape, spec.expert_ffn)
    return common + spec.experts * one, common + spec.experts_per_rank * one


def model_params(shape: TransformerShape, spec: MoESpec) -> tuple[float, float]:
    """(total, active per token) parameters of the model: embedding, blocks (dense or MoE),
    head (tied embeddings counted once). Active counts k routed experts of each MoE block."""
    dense = tf.block_params(shape)
    total = tf.embedding_params(shape) + tf.head_params(shape, stored=False)
    active = total
    one = expert_params(shape, spec.expert_ffn)
    for i in range(shape.layers):
        if spec.is_moe(i):
            whole, _ = block_params(shape, spec)
            total += whole
            active += whole - (spec.experts - spec.top_k) * one
        else:
            total += dense
            active += dense
    return total, active


def dispatch_bytes(shape: TransformerShape, spec: MoESpec) -> float:
    """A rank's dispatch all-to-all buffer: routed_tokens · h · bytes of the dispatch dtype
    (the fraction (ep - 1) / ep leaves the rank: :func:`bytes_leaving`)."""
    e = A2A_DTYPE_BYTES[spec.dispatch_dtype or shape.dtype]
    return routed_tokens(shape, spec) * shape.hidden * e


def combine_bytes(shape: TransformerShape, spec: MoESpec) -> float:
    """A rank's combine all-to-all buffer: routed_tokens · h · bytes of the model dtype."""
    return routed_tokens(shape, spec) * shape.hidden * shape.dtype_bytes


def bytes_leaving(nbytes: float, spec: MoESpec) -> float:
    """The part of an all-to-all buffer that leaves the rank: bytes · (ep - 1) / ep."""
    ep = spec.expert_parallel
    return nbytes * (ep - 1) / ep


@dataclass(frozen=True)
class MoEBlockCost:
    """One MoE block on one GPU of an EP rank for one micro-batch: ``attention`` (attention,
    norms and router), ``experts`` (routed) and ``shared`` (None without shared experts) as
    :class:`~pipeopt.costs.transformer.LayerCost` (FLOPs, bytes), and the all-to-all buffers
    ``dispatch_bytes`` / ``combine_bytes`` (bytes per EP rank, the whole buffer; with tensor
    parallelism t each of its GPUs sends 1/t of it)."""

    attention: LayerCost
    experts: LayerCost
    shared: LayerCost | None
    dispatch_bytes: float
    combine_bytes: float

    @property
    def params(self) -> float:
        """Parameters this rank stores for the block."""
        return (self.attention.params + self.experts.params
                + (self.shared.params if self.shared else 0.0))


def block_cost(shape: TransformerShape, spec: MoESpec, name: str = "moe") -> MoEBlockCost:
    """The :class:`MoEBlockCost` of one MoE block on one GPU (see the module docstring for
    every term; with tensor parallelism t the GPU's share, the experts split over t as a
    dense MLP). With full recomputation the block keeps only its input (the attention part
    holds it) and each part's backward-input op runs its forward again. Raises ValueError
    for another recompute mode."""
    _check_shape(shape)
    if shape.recompute == "full":
        kept = tf.block_activation_bytes(shape)  # the block input: e·T·h (/ t with SP)
        none = block_cost(replace(shape, recompute="none"), spec, name)

        def replay(part: LayerCost, act: float) -> LayerCost:
            return replace(part, backward_input_flops=part.backward_input_flops
                           + part.forward_flops, activation_bytes=act,
                           weight_grad_bytes=min(act, part.weight_grad_bytes))

        return replace(none, attention=replay(none.attention, kept),
                       experts=replay(none.experts, 0.0),
                       shared=None if none.shared is None else replay(none.shared, 0.0))
    t, h, e, n = tokens(shape), shape.hidden, shape.dtype_bytes, _matrices(shape)
    tp = shape.tensor_parallel
    lin, att = attention_flops(shape)
    gate = gate_flops(shape, spec)  # the router is replicated on every tensor-parallel rank
    extra = att / tp if shape.recompute == "selective" else 0.0
    dense_inner = n * e * t * shape.ffn / tp
    att_act = tf.block_activation_bytes(shape) - dense_inner + 4.0 * t * spec.experts
    att_wg = e * t * ((4 * h + 2 * shape.kv_dim) / tp + spec.experts)
    norms = 2 * (2 * h if shape.norm == "layernorm" else h)
    attention = LayerCost(
        name=f"{name}.attention", forward_flops=(lin + att) / tp + gate,
        backward_input_flops=(lin + tf.attention_backward_flops(shape, att)) / tp + gate
        + extra,
        backward_weight_flops=lin / tp + gate,
        params=(attention_params(shape) - norms) / tp + norms + h * spec.experts,
        activation_bytes=att_act, weight_grad_bytes=min(att_act, att_wg),
        output_bytes=float(t * h * e))
    r = routed_tokens(shape, spec)
    ef = expert_flops(shape, spec) / tp
    e_act = e * r * (h + n * spec.expert_ffn / tp)
    experts = LayerCost(
        name=f"{name}.experts", forward_flops=ef, backward_input_flops=ef,
        backward_weight_flops=ef,
        params=spec.experts_per_rank * expert_params(shape, spec.expert_ffn) / tp,
        activation_bytes=e_act,
        weight_grad_bytes=min(e_act, e * r * (2 * h + n * spec.expert_ffn / tp)))
    shared = None
    if spec.shared_experts:
        sf = shared_flops(shape, spec) / tp
        s_act = e * t * spec.shared_experts * n * spec.shared_width / tp
        shared = LayerCost(
            name=f"{name}.shared", forward_flops=sf, backward_input_flops=sf,
            backward_weight_flops=sf,
            params=spec.shared_experts * expert_params(shape, spec.shared_width) / tp,
            activation_bytes=s_act, weight_grad_bytes=s_act)
    return MoEBlockCost(attention, experts, shared, dispatch_bytes(shape, spec),
                        combine_bytes(shape, spec))


def tp_collectives(shape: TransformerShape, spec: MoESpec
                   ) -> tuple[tuple[int, float, float], ...]:
    """An MoE block's tensor-parallel collectives with t > 1 (the format of
    :attr:`pipeopt.costs.transformer.LayerCost.tp_collectives`: op, all-reduces, bytes; a
    reduce-scatter or an all-gather counts 1/2), in the forward and mirrored in the
    backward-input op (see the module docstring, "Tensor parallelism"): the attention's two
    halves of the dense block's (one all-reduce of the b·s·h activations, T·h·e bytes);
    without sequence parallelism the all-gather of the t slices of the combined outputs
    (T·h·e, 1/2); the expert-TP group's all-gather of the dispatched copies before the
    experts (``dispatch_bytes``, 1/2; its gradient in the model dtype) and reduce-scatter
    of their outputs (``combine_bytes``, 1/2); the shared experts' output all-reduce (T·h·e,
    as a dense MLP's); full recomputation replays the forward's in the backward-input op.
    () with t = 1."""
    if shape.tensor_parallel == 1:
        return ()
    msg = tf.message_bytes(shape)
    tokens_ar = 1.0 + (0.0 if shape.sequence_parallel else 0.5) + (
        1.0 if spec.shared_experts else 0.0)
    fwd = ((0, tokens_ar, msg), (0, 0.5, dispatch_bytes(shape, spec)),
           (0, 0.5, combine_bytes(shape, spec)))
    bwd = ((1, tokens_ar, msg), (1, 1.0, combine_bytes(shape, spec)))
    replay = tuple((1, n, b) for _, n, b in fwd) if shape.recompute == "full" else ()
    return fwd + bwd + replay


def _work(cost: LayerCost, rate: float) -> Work:
    """A :class:`~pipeopt.workloads.moe.Work` (seconds at ``rate`` FLOP/s, bytes) of a cost."""
    f, b, w = cost.times(rate)
    return Work(f, b, w, cost.activation_bytes, cost.weight_grad_bytes)


def _plus(a: Work, b: Work) -> Work:
    return Work(*(x + y for x, y in zip(a, b, strict=True)))


def stage_blocks(layers: int, stages: int) -> list[range]:
    """An even split of ``layers`` blocks over ``stages`` stages (the first ``layers % stages``
    stages take one more). Raises ValueError when a stage would get no block."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages: must be an integer >= 1, got {stages!r}")
    if layers < stages:
        raise ValueError(f"stages: {stages} stages need at least as many blocks, the model has "
                         f"{layers}")
    q, r = divmod(layers, stages)
    out, first = [], 0
    for s in range(stages):
        n = q + (s < r)
        out.append(range(first, first + n))
        first += n
    return out


@dataclass(frozen=True)
class Cluster:
    """What prices an MoE pipeline: ``flop_rate`` (FLOP/s, peak × efficiency), the EP group's
    slowest hop (``ep_latency`` s, ``ep_bandwidth`` bytes/s per direction), the pipeline links
    between stages (``link_latency`` s, ``link_bandwidth`` bytes/s), ``memory_limit`` (bytes per
    device, None = unlimited) and ``bytes_per_param`` (weights + gradients + optimizer state;
    16 for mixed-precision Adam: Rajbhandari et al., "ZeRO", SC'20, section 3.1)."""

    flop_rate: float
    ep_latency: float
    ep_bandwidth: float
    link_latency: float = 0.0
    link_bandwidth: float = math.inf
    memory_limit: float | None = None
    bytes_per_param: float = 16.0


def pipeline_of(shape: TransformerShape, spec: MoESpec, stages: int, microbatches: int,
                cluster: Cluster, *, split_backward: bool = True,
                stage_layers: Sequence[int] | None = None) -> MoEPipeline:
    """The :class:`~pipeopt.workloads.moe.MoEPipeline` of a model: ``shape.layers`` blocks over
    ``stages`` devices (an even split, or ``stage_layers`` blocks per stage), MoE blocks where
    ``spec.is_moe``. Work before a stage's first MoE block (the embedding, dense blocks) joins
    that block's attention; dense blocks after an MoE block join the next MoE block's
    attention, or the stage's ``post`` after the last (with the LM head on the last stage).
    Dispatch and combine seconds: :func:`~pipeopt.costs.collectives.all_to_all_time` of the
    buffers over ``spec.expert_parallel`` ranks. Static memory: stored parameters ×
    ``bytes_per_param``."""
    if stage_layers is not None:
        if len(stage_layers) != stages or sum(stage_layers) != shape.layers or min(
                stage_layers) < 1:
            raise ValueError(f"stage_layers: expected {stages} counts >= 1 summing to "
                             f"{shape.layers}, got {list(stage_layers)}")
        parts, first = [], 0
        for n in stage_layers:
            parts.append(range(first, first + n))
            first += n
    else:
        parts = stage_blocks(shape.layers, stages)
    if shape.recompute not in ("none", "selective"):
        raise ValueError("recompute: the MoE pipeline workload supports 'none' or "
                         f"'selective', got {shape.recompute!r}")
    if shape.tensor_parallel != 1:
        raise ValueError("tensor_parallel: the MoE pipeline workload is modelled without "
                         "tensor parallelism (experts are sharded by expert_parallel; "
                         f"pipeopt plan and the model form take it), got "
                         f"{shape.tensor_parallel}")
    rate = cluster.flop_rate
    ep = spec.expert_parallel
    moe_cost = block_cost(shape, spec)
    dense_cost = tf.block_cost(shape, "dense")
    emb, *_, head = tf.transformer_layers(replace(shape, layers=1))
    d_s = all_to_all_time(ep, moe_cost.dispatch_bytes, cluster.ep_latency, cluster.ep_bandwidth)
    c_s = all_to_all_time(ep, moe_cost.combine_bytes, cluster.ep_latency, cluster.ep_bandwidth)
    out: list[tuple[MoEBlock, ...]] = []
    posts: list[Work] = []
    static: list[float] = []
    for s, blocks in enumerate(parts):
        pending = _work(emb, rate) if s == 0 else Work(0.0)
        params = emb.params if s == 0 else 0.0
        mine: list[MoEBlock] = []
        for i in blocks:
            if spec.is_moe(i):
                sh = moe_cost.shared
                mine.append(MoEBlock(_plus(pending, _work(moe_cost.attention, rate)),
                                     _work(moe_cost.experts, rate), d_s, c_s,
                                     _work(sh, rate) if sh is not None else None))
                pending = Work(0.0)
                params += moe_cost.params
            else:
                pending = _plus(pending, _work(dense_cost, rate))
                params += dense_cost.params
        if s == len(parts) - 1:
            pending = _plus(pending, _work(head, rate))
            params += head.params
        out.append(tuple(mine))
        posts.append(pending)
        static.append(params * cluster.bytes_per_param)
    return MoEPipeline(
        stages=tuple(out), microbatches=microbatches, post=tuple(posts),
        split_backward=split_backward, message_bytes=tf.message_bytes(shape),
        latency=cluster.link_latency, bandwidth=cluster.link_bandwidth,
        memory_limit=(cluster.memory_limit,) * stages, static_memory=tuple(static))
