"""A small Hugging Face-style decoder for the executor's tests (built here, no download).

``DecoderLM`` has the usual parts: token and position embeddings, a list of decoder layers
(pre-norm attention and MLP, with the residual stream handed on beside the hidden states, as
fused add-and-norm implementations do), a final RMS norm and an LM head. Between pipeline
stages travels the tuple ``(hidden, residual)``. :func:`decoder` returns its
:class:`~pipeopt.executor.models.ModelSpec` for ``pipeopt run --model decoder_model:decoder``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipeopt.executor.models import ModelSpec

Pair = tuple[torch.Tensor, torch.Tensor]


class Embeddings(nn.Module):
    """Token ids -> (token embedding, position embedding)."""

    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(seq_len, hidden)

    def forward(self, ids: torch.Tensor) -> Pair:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.embed_tokens(ids), self.embed_positions(pos).expand(ids.shape[0], -1, -1)


class DecoderLayer(nn.Module):
    """residual += hidden; hidden = attention + MLP of the normed residual (causal SDPA)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.RMSNorm(hidden)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> Pair:
        residual = residual + hidden
        x = self.input_layernorm(residual)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv_proj(x).split(c, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = residual + self.o_proj(att.transpose(1, 2).reshape(b, t, c))
        out = self.down_proj(F.silu(self.up_proj(self.post_attention_layernorm(h))))
        return out, h


class Head(nn.Module):
    """Final norm of hidden + residual, then the vocabulary projection."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden + residual))


class DecoderLM(nn.Module):
    """The whole model, as a Hugging Face causal LM lays it out."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> None:
        super().__init__()
        self.embed = Embeddings(vocab, hidden, seq_len)
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads) for _ in range(layers))
        self.head = Head(hidden, vocab)

    def pipeline_layers(self) -> list[nn.Module]:
        """The layer list a pipeline cuts into stages."""
        return [self.embed, *self.layers, self.head]


def decoder(layers: int = 4, hidden: int = 32, heads: int = 2, vocab: int = 64,
            seq_len: int = 8) -> ModelSpec:
    """A :class:`DecoderLM` as pipeline layers; random tokens, next-token cross-entropy."""
    model = DecoderLM(layers, hidden, heads, vocab, seq_len)

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    return ModelSpec("decoder", model.pipeline_layers(), make_batch, loss_fn)
