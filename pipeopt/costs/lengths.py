"""Per-micro-batch sequence lengths -> per-micro-batch cost ratios of a transformer.

A micro-batch is described by two numbers: its **tokens** (what the linear layers, the
activations and the stage-to-stage messages grow with) and its **attention work**, the sum
over its sequences (or packed documents) of their squared lengths (what the two attention
matmuls and the attention-core activations grow with). The reference micro-batch is the
configured one: ``micro_batch_size`` sequences of ``seq_len`` tokens.

Lengths come from ``training.sequence_lengths`` (:class:`~pipeopt.costs.config.LengthsConfig`):
a list (one length per micro-batch, or a list of packed document lengths) or a seeded
distribution, optionally packed into micro-batches of a token budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipeopt.costs.transformer import LayerCost, TransformerShape, transformer_layers


@dataclass(frozen=True)
class MicrobatchTokens:
    """One micro-batch: ``tokens`` (count) and ``attention`` (sum of squared sequence or
    document lengths, tokens^2; attention is computed within each document)."""

    tokens: float
    attention: float

    @classmethod
    def padded(cls, length: float, sequences: int) -> MicrobatchTokens:
        """``sequences`` sequences of ``length`` tokens each."""
        return cls(sequences * length, sequences * length * length)

    @classmethod
    def packed(cls, documents: Sequence[float]) -> MicrobatchTokens:
        """Documents packed into one sequence, attention within each document."""
        return cls(float(sum(documents)), float(sum(d * d for d in documents)))


def draw_lengths(spec: Any, count: int, rng: np.random.Generator | None = None) -> list[int]:
    """``count`` document lengths (tokens, >= 1) from a validated distribution ``spec``
    (:class:`~pipeopt.costs.config.LengthDistribution`), drawn from ``rng`` (default: a new
    one seeded with ``spec.seed``, so the draw is reproducible).

    * ``uniform``: integers uniform in [min, max];
    * ``lognormal``: log-normal with mean ``mean`` tokens and log-space spread ``sigma``;
    * ``zipf``: a power law (Pareto/Zipf tail), P(length >= x) = (min / x)^exponent.

    Draws outside [min, max] are clipped to it (``max`` None: no upper clip).
    """
    rng = np.random.default_rng(spec.seed) if rng is None else rng
    lo = float(spec.min)
    hi = math.inf if spec.max is None else float(spec.max)
    if spec.distribution == "uniform":
        vals = rng.integers(int(lo), int(hi), size=count, endpoint=True).astype(float)
    elif spec.distribution == "lognormal":
        mu = math.log(spec.mean) - spec.sigma ** 2 / 2  # so that E[length] = mean
        vals = rng.lognormal(mu, spec.sigma, size=count)
    else:  # zipf: inverse CDF of the Pareto law truncated at max (none: untruncated)
        u = rng.random(count)
        tail = 0.0 if math.isinf(hi) else (lo / hi) ** spec.exponent
        vals = lo / (1.0 - u * (1.0 - tail)) ** (1.0 / spec.exponent)
    return [int(max(1, min(hi, max(lo, round(float(x)))))) for x in vals]


def microbatch_tokens(spec: Any, microbatches: int, seq_len: int,
                      micro_batch_size: int) -> list[MicrobatchTokens]:
    """The ``microbatches`` micro-batches of a validated ``training.sequence_lengths``.

    A list entry that is a number is the length of each of the micro-batch's
    ``micro_batch_size`` sequences; a list entry that is a list holds the lengths of documents
    packed into it. A distribution without ``tokens_per_microbatch`` draws one length per
    micro-batch (as a number entry); with it, documents are drawn in turn and packed in that
    order, a micro-batch closing when the next document would pass the budget (documents longer
    than the budget are cut to it).
    """
    if isinstance(spec, list):
        return [MicrobatchTokens.packed(x) if isinstance(x, list)
                else MicrobatchTokens.padded(x, micro_batch_size) for x in spec]
    budget = spec.tokens_per_microbatch
    if budget is None:
        return [MicrobatchTokens.padded(x, micro_batch_size)
                for x in draw_lengths(spec, microbatches)]
    rng = np.random.default_rng(spec.seed)
    out: list[MicrobatchTokens] = []
    current: list[int] = []
    while len(out) < microbatches:
        for doc in draw_lengths(spec, 4 * microbatches, rng):  # blocks of one stream
            doc = min(doc, budget)
            if current and sum(current) + doc > budget:
                out.append(MicrobatchTokens.packed(current))
                current = []
                if len(out) == microbatches:
                    break
            current.append(doc)
    return out


@dataclass(frozen=True)
class LayerSplit:
    """Per layer and cost, the part linear in the tokens and the part linear in the attention
    work (tokens^2) of the reference micro-batch; a cost of micro-batch j is
    ``linear * tokens_j / tokens_ref + quadratic * attention_j / attention_ref``."""

    linear: np.ndarray  # (layers, 6): F, B, W FLOPs; activation, weight-grad, output bytes
    quadratic: np.ndarray


_FIELDS = ("forward_flops", "backward_input_flops", "backward_weight_flops",
           "activation_bytes", "weight_grad_bytes", "output_bytes")


def _costs(layers: list[LayerCost]) -> np.ndarray:
    return np.array([[getattr(lc, f) for f in _FIELDS] for lc in layers], float)


def split_layers(shape: TransformerShape,
                 overrides: dict[int, dict[str, object]] | None = None) -> LayerSplit:
    """:class:`LayerSplit` of the analytic layers of ``shape``: every cost is a + b·s + c·s^2
    with a = 0 (s tokens per sequence), so the costs at s and 2s give both parts exactly."""
    one = _costs(transformer_layers(shape, overrides))
    two = _costs(transformer_layers(replace(shape, seq_len=2 * shape.seq_len), overrides))
    quad = (two - 2 * one) / 2
    quad[np.abs(quad) <= 1e-9 * np.abs(one)] = 0.0  # round-off of a purely linear cost
    return LayerSplit(linear=one - quad, quadratic=quad)


@dataclass(frozen=True)
class MicrobatchRatios:
    """Per micro-batch: cost over the reference micro-batch's, for every pipeline layer
    (``flops``: (m, layers, 3) for F, B, W; ``activation``, ``weight_grad``: (m, layers)) and
    for the stage-to-stage message (``message``: (m,))."""

    flops: np.ndarray
    activation: np.ndarray
    weight_grad: np.ndarray
    message: np.ndarray
    microbatches: tuple[MicrobatchTokens, ...] = ()

    def summary(self) -> dict[str, Any]:
        """JSON-able facts for ``Problem.meta``: each micro-batch's tokens and attention work
        (sum of squared sequence or document lengths, tokens^2)."""
        return {"tokens": [mb.tokens for mb in self.microbatches],
                "attention_tokens2": [mb.attention for mb in self.microbatches]}


def microbatch_ratios(split: LayerSplit, mbs: Sequence[MicrobatchTokens],
                      reference: MicrobatchTokens) -> MicrobatchRatios:
    """Each micro-batch's costs over the reference's, layer by layer (a layer whose reference
    cost is 0 gets ratio 1)."""
    lin = np.array([mb.tokens / reference.tokens for mb in mbs])[:, None, None]
    att = np.array([mb.attention / reference.attention for mb in mbs])[:, None, None]
    ref = split.linear + split.quadratic
    cost = split.linear[None] * lin + split.quadratic[None] * att
    ratio = np.divide(cost, ref[None], out=np.ones_like(cost), where=ref[None] > 0)
    return MicrobatchRatios(flops=ratio[:, :, :3], activation=ratio[:, :, 3],
                            weight_grad=ratio[:, :, 4], message=lin[:, 0, 0].copy(),
                            microbatches=tuple(mbs))


def problem_scales(ratios: MicrobatchRatios, layer_time: np.ndarray, activation: np.ndarray,
                   stages: Sequence[tuple[int, int]] | None = None
                   ) -> dict[str, tuple[float, ...] | tuple[tuple[float, ...], ...]]:
    """The :class:`~pipeopt.problem.Problem`'s micro-batch factors from layer ratios.

    With ``stages`` (the partition: layers ``[a, b)`` per stage) the time and memory factors
    are tables, one row per stage (the problem stores a table of equal rows as one row), else
    one factor per micro-batch for the whole model. Per stage: the time factor keeps the
    stage's busy time (each layer's F, B, W reference times ``layer_time``, shape (layers, 3),
    seconds, weighted by their own ratios); the memory factor is the mean of the layers'
    activation ratios weighted by their reference ``activation`` bytes. The message factor is
    the token ratio at every boundary (exact: a message is b·s·h values).
    """
    groups = [(0, len(layer_time))] if stages is None else list(stages)
    time_rows, mem_rows = [], []
    for a, b in groups:
        busy = float(layer_time[a:b].sum())
        time_rows.append(tuple(float(x) for x in (
            (ratios.flops[:, a:b] * layer_time[None, a:b]).sum(axis=(1, 2)) / busy
            if busy > 0 else ratios.message)))
        total = float(activation[a:b].sum())
        mem_rows.append(tuple(float(x) for x in (
            ratios.activation[:, a:b] @ activation[a:b] / total if total > 0
            else ratios.message)))

    def scale(rows: list[tuple[float, ...]]) -> tuple[float, ...] | tuple[tuple[float, ...], ...]:
        return rows[0] if all(r == rows[0] for r in rows) else tuple(rows)

    return {"microbatch_scale": scale(time_rows), "microbatch_memory_scale": scale(mem_rows),
            "microbatch_message_scale": tuple(float(x) for x in ratios.message)}
