"""Analytic per-layer costs of a GPT / Llama style transformer.

Sources of the formulas (re-derived here matmul by matmul):

- FLOPs: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, appendix: a dense block's forward is 24·b·s·h² + 4·b·s²·h FLOPs (2 FLOPs
  per multiply-add; QKV, projection and the two 4h MLP matrices, plus the two attention matmuls
  QKᵀ and softmax·V), and the LM head 2·b·s·h·V. Generalised here to grouped-query attention
  (K and V project to ``kv_heads · h/heads`` columns) and to SwiGLU MLPs (three h×f matrices).
  A causal (decoder) mask halves the two attention matmuls to 2·b·s²·h, as Dao, "FlashAttention-2:
  Faster Attention with Better Parallelism and Work Partitioning", 2023, section 4.1, counts
  causal attention (about half the score entries are computed); activation bytes are unchanged.
- Activation bytes: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", 2022, section 4: s·b·h·(34 + 5·a·s/h) bytes per block with 16-bit values and
  dropout; with tensor parallelism t and sequence parallelism everything is divided by t; without
  sequence parallelism s·b·h·(10 + 24/t + 5·a·s/(h·t)); selective recomputation drops the
  5·a·s²·b attention-core term; full recomputation keeps only the block input (2·s·b·h).
  The output layer keeps fp32 logits for the loss: 4·s·b·V/t bytes.
- Transient bytes of a recomputing backward: a block's backward first recomputes what its
  forward dropped (Korthikanti et al. 2022: full recomputation stores each layer's input and
  runs that layer's forward again during the backward; selective recomputes the attention
  core), so while it runs the block holds its no-recomputation activations; the transient is
  that minus what the forward kept (full: everything but the block input; selective: the
  attention core). It is freed as that block's backward ends.
- Parameters: 12h² + 13h per GPT block (with biases and two LayerNorms) — GPT-3 175B gives
  174.6e9 with its embeddings; Llama blocks have 2h² + 2·h·kv_dim + 3·h·f + 2h (no biases,
  RMSNorm).

Backward split used here (stated, since papers only give "backward ≈ 2× forward"): every matmul
y = x·W costs the forward's FLOPs again for the input gradient (B) and again for the weight
gradient (W). The two attention matmuls have no weights; both of their operands are activations,
so their backward (2× their forward) is all input-gradient work. Hence per block
B = linear + 2·attention, W = linear, and B + W = 2 × forward. Recomputation adds the recomputed
forward to B (full: the whole block; selective: the attention core). With FlashAttention the
attention backward is 2.5× its forward, not 2×: P = softmax(QKᵀ) is not stored, so the backward
first recomputes S = QKᵀ (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
with IO-Awareness", NeurIPS 2022, section 3.1 and algorithm 4 in appendix B), one more matmul of
the forward's two; see :func:`attention_backward_flops`.

Tensor-parallel communication (t > 1), as collectives of each op (:attr:`LayerCost.tp_collectives`,
timed by the cost model on the tensor-parallel group's links): Megatron-LM splits a block's
attention and MLP each between a column-parallel and a row-parallel matmul, so a block runs two
all-reduces of its b·s·h activations in the forward (after the attention projection and after
the MLP) and two of their gradients in the backward (Shoeybi et al., "Megatron-LM", 2019,
section 3 and figure 4; Narayanan et al. 2021, section 3.3: "two all-reduce operations in the
forward pass and two in the backward pass" per layer). With sequence parallelism each all-reduce
becomes a reduce-scatter and an all-gather (Korthikanti et al. 2022, section 4.2.2), the same
ring steps and bytes; the all-gather it redoes in the backward is overlapped there and not
counted. The backward's belong to the input gradient (B); full recomputation replays the
forward's two in B. The vocabulary-parallel embedding reduces its output (an all-reduce, a
reduce-scatter with sequence parallelism), the head gathers its input with sequence
parallelism and reduces its input gradient (an all-reduce, a reduce-scatter with sequence
parallelism), and the vocabulary-parallel cross-entropy all-reduces three fp32 values per
token (the logits' maximum, the target logit and the sum of exponentials; Megatron-LM's
``vocab_parallel_cross_entropy``) in the head's forward.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from pipeopt.costs.collectives import all_reduce_time

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class LayerCost:
    """Costs of one pipeline layer for one micro-batch on one tensor-parallel rank.

    FLOPs are per micro-batch; ``params`` is the parameter count this rank stores;
    ``activation_bytes`` is allocated when the forward starts and freed by the backward;
    ``weight_grad_bytes`` (<= activation) is the part kept after B until W; ``output_bytes`` is
    the p2p message to the next layer. ``backward_transient_bytes`` is held on top of
    ``activation_bytes`` while this layer's backward runs (what recomputation rebuilds) and
    freed when it ends. Measured times (seconds), when given, win over FLOPs;
    ``backward_time`` is a measured fused backward (input and weight gradients in one pass),
    what a schedule without split backward pays. ``input_grad`` is False for a layer whose input
    takes no gradient (the embedding's token ids).
    """

    name: str
    forward_flops: float = 0.0
    backward_input_flops: float = 0.0
    backward_weight_flops: float = 0.0
    params: float = 0.0
    activation_bytes: float = 0.0
    weight_grad_bytes: float = 0.0
    output_bytes: float = 0.0
    backward_transient_bytes: float = 0.0
    forward_time: float | None = None
    backward_input_time: float | None = None
    backward_weight_time: float | None = None
    backward_time: float | None = None
    input_grad: bool = True
    time_scale: float = 1.0
    #: Tensor-parallel collectives of one micro-batch, each ``(op, all_reduces, bytes)``:
    #: during op 0 (forward), 1 (backward-input) or 2 (backward-weight), ``all_reduces`` ring
    #: all-reduces of a ``bytes`` buffer (a reduce-scatter or an all-gather of the whole
    #: buffer counts 1/2: half the ring steps). Timed on the tensor-parallel group's links by
    #: :func:`tp_comm_times`; not scaled by ``time_scale``. Empty without tensor parallelism.
    tp_collectives: tuple[tuple[int, float, float], ...] = ()
    #: Seconds of the optimizer step over this layer's parameters, once per training step
    #: (measured by a profile; 0 otherwise): part of its stage's step tail.
    step_time: float = 0.0

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs per micro-batch."""
        return self.forward_flops + self.backward_input_flops + self.backward_weight_flops

    def times(self, flop_rate: float, efficiency: float = 1.0) -> tuple[float, float, float]:
        """(forward, backward_input, backward_weight) seconds at ``flop_rate`` FLOP/s peak and
        ``efficiency`` (a fraction of that peak); measured times are used as they are."""
        rate = flop_rate * efficiency
        out = []
        for t, f in ((self.forward_time, self.forward_flops),
                     (self.backward_input_time, self.backward_input_flops),
                     (self.backward_weight_time, self.backward_weight_flops)):
            out.append((t if t is not None else f / rate) * self.time_scale)
        return out[0], out[1], out[2]

    def fused_backward(self, flop_rate: float, efficiency: float = 1.0) -> float:
        """Seconds of the fused backward: the measured ``backward_time`` when given, else
        backward-input + backward-weight."""
        if self.backward_time is not None:
            return self.backward_time * self.time_scale
        _, b, w = self.times(flop_rate, efficiency)
        return b + w


@dataclass(frozen=True)
class TransformerShape:
    """A transformer and its training setup (see :mod:`pipeopt.costs.config` for keys)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    micro_batch_size: int = 1
    dtype: str = "bf16"
    activation: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    position_embedding: str = "learned"
    tie_embeddings: bool = False
    dropout: bool = True
    recompute: str = "none"
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    causal: bool = False
    flash_attention: bool = False

    @property
    def kv(self) -> int:
        """Number of key/value heads."""
        return self.kv_heads or self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and V) projection: kv_heads · head_dim."""
        return self.kv * (self.hidden // self.heads)

    @property
    def ffn(self) -> int:
        """MLP inner width (default 4h)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        """h×f matrices in the MLP: 2 (GeLU) or 3 (SwiGLU: gate, up, down)."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation element."""
        return DTYPE_BYTES[self.dtype]


# ----- FLOPs -------------------------------------------------------------------------------
def block_flops(shape: TransformerShape) -> tuple[float, float]:
    """(linear, attention) forward FLOPs of one block for one micro-batch (whole layer, t=1).

    linear = 2bs·(h² [Q] + 2·h·kv_dim [K, V] + h² [out] + n·h·f [MLP]);
    attention = 2·(2·b·s²·h) for QKᵀ and softmax·V, halved when ``causal`` (FlashAttention-2's
    accounting). Dense GPT (kv = heads, f = 4h, n = 2), not causal: 24bsh² + 4bs²h (Narayanan
    et al. 2021).
    """
    b, s, h = shape.micro_batch_size, shape.seq_len, shape.hidden
    weights = 2 * h * h + 2 * h * shape.kv_dim + shape.mlp_matrices * h * shape.ffn
    return 2.0 * b * s * weights, (2.0 if shape.causal else 4.0) * b * s * s * h


#: Matmuls of the attention core's backward, in units of one of its forward's two (QKᵀ, P·V):
#: dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q, and with FlashAttention S = QKᵀ recomputed
#: first (Dao et al. 2022, algorithm 4: lines 11 and 13-20). Over the forward: 4/2 = 2 and
#: 5/2 = 2.5, the FlashAttention paper's count (appendix B.4) and torch's ``FlopCounterMode``'s
#: for ``scaled_dot_product_attention``.
ATTENTION_BACKWARD_MATMULS = 4
FLASH_BACKWARD_MATMULS = 5


def attention_backward_flops(shape: TransformerShape, attention: float) -> float:
    """Backward FLOPs of an attention core whose forward takes ``attention`` FLOPs (QKᵀ and
    P·V, as :func:`block_flops` counts them, causal halving included): 2 × ``attention``, or
    2.5 × with ``flash_attention`` (the recomputed QKᵀ; causal masking halves it as it halves
    the rest, FlashAttention-2 skipping the masked blocks in the backward too). All of it is
    input-gradient work (the core has no weights)."""
    matmuls = FLASH_BACKWARD_MATMULS if shape.flash_attention else ATTENTION_BACKWARD_MATMULS
    return attention * matmuls / 2


def head_flops(shape: TransformerShape) -> float:
    """Forward FLOPs of the LM head (logits): 2·b·s·h·V."""
    return 2.0 * shape.micro_batch_size * shape.seq_len * shape.hidden * shape.vocab


def model_flops_per_iteration(shape: TransformerShape, microbatches: int = 1) -> float:
    """Forward + backward FLOPs of the whole model (no recomputation): 3 × forward.

    For GPT this is 72·b·s·L·h²·(1 + s/(6h) + V/(12hL)) per micro-batch, the expression of
    Narayanan et al. 2021.
    """
    lin, att = block_flops(shape)
    return 3.0 * (shape.layers * (lin + att) + head_flops(shape)) * microbatches


# ----- parameters --------------------------------------------------------------------------
def block_params(shape: TransformerShape) -> float:
    """Parameters of one block (whole layer, not divided by tensor parallelism)."""
    h, f, kvd = shape.hidden, shape.ffn, shape.kv_dim
    weights = 2 * h * h + 2 * h * kvd + shape.mlp_matrices * h * f
    norms = 2 * (2 * h if shape.norm == "layernorm" else h)
    biases = 0
    if shape.bias:
        # QKV, output projection, MLP inner (f per up-projection) and MLP output.
        biases = (h + 2 * kvd) + h + (shape.mlp_matrices - 1) * f + h
    return float(weights + norms + biases)


def embedding_params(shape: TransformerShape) -> float:
    """Token (and learned position) embedding parameters."""
    pos = shape.seq_len * shape.hidden if shape.position_embedding == "learned" else 0
    return float(shape.vocab * shape.hidden + pos)


def head_params(shape: TransformerShape, *, stored: bool = True) -> float:
    """Final norm + output matrix. With tied embeddings the matrix is the embedding's: it is
    *stored* again on the last stage (its copy is counted when ``stored``) but is not a new
    parameter of the model."""
    norm = 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden
    matrix = shape.vocab * shape.hidden
    if shape.tie_embeddings and not stored:
        matrix = 0
    return float(norm + matrix)


def total_params(shape: TransformerShape) -> float:
    """Unique parameters of the whole model (tied embeddings counted once)."""
    return (embedding_params(shape) + shape.layers * block_params(shape)
            + head_params(shape, stored=False))


# ----- activations -------------------------------------------------------------------------
def block_activation_bytes(shape: TransformerShape, recompute: str | None = None) -> float:
    """Bytes one block keeps for its backward, per micro-batch, on one tensor-parallel rank.

    Korthikanti et al. 2022, term by term with e bytes per value (e = 2 gives the paper's
    numbers) and one byte per dropout-mask entry:
    replicated across tensor-parallel ranks unless sequence parallel — both norm inputs (2e·sbh),
    the QKV and MLP inputs (2e·sbh), two dropout masks (2·sbh);
    split over ranks — Q, K, V (e·sb·(h + 2·kv_dim)), projection input (e·sbh), MLP inner values
    (GeLU: its input and output, 2e·sbf; SwiGLU: gate, up and their product, 3e·sbf);
    attention core — softmax output (e·a·s²b), its dropout mask (a·s²b) and dropout output
    (e·a·s²b). GPT with e = 2: sbh·(34 + 5as/h). With ``flash_attention`` the core keeps only
    the softmax statistics, one fp32 logsumexp per head and token, 4·a·s·b (Dao, "FlashAttention-2",
    2023, algorithm 1: the output and logsumexp are saved; the dropout mask is regenerated from
    the random state), split over the ranks; selective recomputation then saves nothing more.
    """
    rc = recompute or shape.recompute
    b, s, h, a = shape.micro_batch_size, shape.seq_len, shape.hidden, shape.heads
    e, t = shape.dtype_bytes, shape.tensor_parallel
    sb = s * b
    sp = t if shape.sequence_parallel else 1
    if rc == "full":
        return e * sb * h / sp
    mask = 1 if shape.dropout else 0
    replicated = 4 * e * sb * h + 2 * mask * sb * h
    mlp_inner = (3 if shape.activation == "swiglu" else 2) * e * sb * shape.ffn
    split = e * sb * (h + 2 * shape.kv_dim) + e * sb * h + mlp_inner
    core = (2 * e + mask) * a * s * sb if shape.dropout else e * a * s * sb
    if shape.flash_attention:
        core = 4 * a * sb
    if rc == "selective":
        core = 0
    return replicated / sp + (split + core) / t


def block_backward_transient_bytes(shape: TransformerShape, recompute: str | None = None
                                   ) -> float:
    """Bytes a block's backward holds beyond what its forward kept, per micro-batch on one
    tensor-parallel rank: the activations its recomputation rebuilds before the gradients are
    computed, :func:`block_activation_bytes` without recomputation less with it (0 when
    nothing is recomputed). Freed as the block's backward ends, so a stage of several blocks
    holds one block's transient at a time."""
    rc = recompute or shape.recompute
    if rc not in ("full", "selective"):
        return 0.0
    return block_activation_bytes(shape, "none") - block_activation_bytes(shape, rc)


def block_weight_grad_held_bytes(shape: TransformerShape) -> float:
    """Bytes a deferred weight-gradient op needs from the input-gradient op: the inputs of the
    four linear layers and the gradients of their outputs (the two factors of each weight
    gradient), per micro-batch on one tensor-parallel rank, whatever the recomputation (with
    ``full`` the input-gradient op recomputes them, so they exceed what the forward kept)."""
    b, s, h = shape.micro_batch_size, shape.seq_len, shape.hidden
    e, t, f = shape.dtype_bytes, shape.tensor_parallel, shape.ffn
    sb = s * b
    up = (shape.mlp_matrices - 1) * f
    inputs = e * sb * (h + h + h + f)
    out_grads = e * sb * ((h + 2 * shape.kv_dim) + h + up + h)
    return (inputs + out_grads) / t


def block_weight_grad_bytes(shape: TransformerShape) -> float:
    """Bytes still held after the input-gradient op until the weight-gradient op:
    :func:`block_weight_grad_held_bytes` capped at :func:`block_activation_bytes` (exact
    without full recomputation, where they are among the kept activations). An
    approximation: frameworks differ."""
    return min(block_weight_grad_held_bytes(shape), block_activation_bytes(shape))


def message_bytes(shape: TransformerShape) -> float:
    """P2P message between stages: one b·s·h activation (or its gradient), e bytes per value."""
    return float(shape.micro_batch_size * shape.seq_len * shape.hidden * shape.dtype_bytes)


def block_tp_collectives(shape: TransformerShape) -> tuple[tuple[int, float, float], ...]:
    """A block's tensor-parallel collectives (see :attr:`LayerCost.tp_collectives`): two
    all-reduces of the b·s·h activations (e bytes each) in the forward and two in the
    backward-input op, two more there with full recomputation (its replayed forward); none
    with t = 1 (Narayanan et al. 2021, section 3.3; Korthikanti et al. 2022, section 4.2.2)."""
    if shape.tensor_parallel == 1:
        return ()
    nbytes = message_bytes(shape)
    replay = 2.0 if shape.recompute == "full" else 0.0
    return ((0, 2.0, nbytes), (1, 2.0 + replay, nbytes))


def embedding_tp_collectives(shape: TransformerShape) -> tuple[tuple[int, float, float], ...]:
    """The vocabulary-parallel embedding's: its output's all-reduce in the forward (a
    reduce-scatter, half of one, with sequence parallelism); its input takes no gradient."""
    if shape.tensor_parallel == 1:
        return ()
    return ((0, 0.5 if shape.sequence_parallel else 1.0, message_bytes(shape)),)


def head_tp_collectives(shape: TransformerShape) -> tuple[tuple[int, float, float], ...]:
    """The head's: with sequence parallelism an all-gather of its input in the forward and a
    reduce-scatter of the input gradient in the backward, else that gradient's all-reduce; and
    the cross-entropy's three all-reduces of one fp32 value per token in the forward."""
    if shape.tensor_parallel == 1:
        return ()
    nbytes = message_bytes(shape)
    loss = (0, 3.0, 4.0 * shape.seq_len * shape.micro_batch_size)
    if shape.sequence_parallel:
        return ((0, 0.5, nbytes), loss, (1, 0.5, nbytes))
    return (loss, (1, 1.0, nbytes))


def tp_comm_times(layer: LayerCost, ranks: int, latency: float, bandwidth: float
                  ) -> tuple[float, float, float]:
    """Seconds of ``layer``'s tensor-parallel collectives in its (forward, backward-input,
    backward-weight) ops over a ring of ``ranks`` GPUs whose slowest hop has ``latency``
    seconds and ``bandwidth`` bytes/s: each all-reduce of n bytes takes
    2(t-1)·latency + 2(t-1)/t · n / bandwidth (ring all-reduce; Thakur et al. 2005, section
    4.4), none overlapped with the op's compute (Megatron-LM runs them on its critical path)."""
    out = [0.0, 0.0, 0.0]
    if ranks > 1:
        for op, count, nbytes in layer.tp_collectives:
            out[op] += count * all_reduce_time(ranks, nbytes, latency, bandwidth)
    return out[0], out[1], out[2]


def embedding_activation_bytes(shape: TransformerShape) -> float:
    """Token ids (int64, needed for the embedding's weight gradient) and the dropout mask."""
    sb = shape.seq_len * shape.micro_batch_size
    mask = sb * shape.hidden if shape.dropout else 0
    sp = shape.tensor_parallel if shape.sequence_parallel else 1
    return 8.0 * sb + mask / sp


def head_activation_bytes(shape: TransformerShape) -> float:
    """Final norm input and head input (e·sbh each) plus fp32 logits for the loss, 4·s·b·V/t
    (Korthikanti et al. 2022, section 4.3)."""
    sb = shape.seq_len * shape.micro_batch_size
    t = shape.tensor_parallel
    sp = t if shape.sequence_parallel else 1
    return 2.0 * shape.dtype_bytes * sb * shape.hidden / sp + 4.0 * sb * shape.vocab / t


# ----- the layer list ----------------------------------------------------------------------
def block_cost(shape: TransformerShape, name: str, time_scale: float = 1.0) -> LayerCost:
    """The :class:`LayerCost` of one transformer block on one tensor-parallel rank."""
    t = shape.tensor_parallel
    lin, att = block_flops(shape)
    extra = {"full": lin + att, "selective": att}.get(shape.recompute, 0.0)
    norm_params = 2 * (2 * shape.hidden if shape.norm == "layernorm" else shape.hidden)
    params = (block_params(shape) - norm_params) / t + norm_params
    act = block_activation_bytes(shape)
    return LayerCost(
        name=name, forward_flops=(lin + att) / t,
        backward_input_flops=(lin + attention_backward_flops(shape, att) + extra) / t,
        backward_weight_flops=lin / t,
        params=params, activation_bytes=act,
        weight_grad_bytes=min(act, block_weight_grad_bytes(shape)),
        output_bytes=message_bytes(shape),
        backward_transient_bytes=block_backward_transient_bytes(shape), time_scale=time_scale,
        tp_collectives=block_tp_collectives(shape))


def transformer_layers(shape: TransformerShape,
                       overrides: dict[int, dict[str, object]] | None = None
                       ) -> list[LayerCost]:
    """Embedding, ``layers`` blocks and the LM head as pipeline layers (in order).

    ``overrides`` maps a block index to changed shape fields (``ffn_hidden``, ``heads``,
    ``kv_heads``, ``activation``, ``recompute``) and an optional ``time_scale``.
    """
    t = shape.tensor_parallel
    sb = shape.seq_len * shape.micro_batch_size
    emb_act = embedding_activation_bytes(shape)
    out: list[LayerCost] = [LayerCost(
        name="embedding", params=embedding_params(shape) / t, input_grad=False,
        activation_bytes=emb_act, weight_grad_bytes=min(emb_act, 8.0 * sb),
        output_bytes=message_bytes(shape), tp_collectives=embedding_tp_collectives(shape))]
    for i in range(shape.layers):
        change = dict((overrides or {}).get(i, {}))
        scale = float(change.pop("time_scale", 1.0))  # type: ignore[arg-type]
        sh = replace(shape, **change) if change else shape
        out.append(block_cost(sh, f"block{i}", scale))
    hf = head_flops(shape) / t
    head_act = head_activation_bytes(shape)
    head_w = shape.dtype_bytes * sb * (shape.hidden + shape.vocab / t)
    norm = 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden
    out.append(LayerCost(
        name="head", forward_flops=hf, backward_input_flops=hf, backward_weight_flops=hf,
        params=(head_params(shape) - norm) / t + norm, activation_bytes=head_act,
        weight_grad_bytes=min(head_act, head_w), output_bytes=0.0,
        tp_collectives=head_tp_collectives(shape)))
    return out


def efficiency_at(flops: float, curve: float | list[tuple[float, float]]) -> float:
    """Compute efficiency for an op of ``flops`` FLOPs: a constant, or a curve of
    ``(flops, efficiency)`` points interpolated linearly in log10(flops), flat outside."""
    if isinstance(curve, int | float):
        return float(curve)
    pts = sorted(curve)
    if flops <= pts[0][0]:
        return pts[0][1]
    if flops >= pts[-1][0]:
        return pts[-1][1]
    x = math.log10(flops)
    for (f0, e0), (f1, e1) in itertools.pairwise(pts):
        if f0 <= flops <= f1:
            x0, x1 = math.log10(f0), math.log10(f1)
            return e0 + (e1 - e0) * (x - x0) / (x1 - x0) if x1 > x0 else e1
    return pts[-1][1]
