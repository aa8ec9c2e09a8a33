"""A small Llama-style model for the memory tests (built here, no download).

Blocks as Llama-2 has them: RMSNorm before attention and MLP (fused: x and the reciprocal
RMS kept), no biases, grouped-query
attention (fewer K/V heads than Q heads) through torch's fused ``scaled_dot_product_attention``
(causal; its backward keeps the fp32 logsumexp, not the s x s scores, as FlashAttention does),
and a SwiGLU MLP whose backward recomputes SiLU from the gate (Megatron-LM's fused
``bias_swiglu``: it keeps the gate and up projections, not SiLU's output), so what a block saves
is what the cost model counts for ``model.flash_attention: true``. :class:`Recomputed` wraps a
block for ``recompute: full`` (torch's non-reentrant checkpoint: only the block input is kept;
the backward runs the block's forward again). Rotary embeddings are left out: they save no
per-token tensor beyond the rotated Q and K that attention saves in their place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

#: RMSNorm's epsilon (Llama-2's ``rms_norm_eps``).
EPS = 1e-5


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only (SiLU recomputed in the backward)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


class _RMSNorm(torch.autograd.Function):
    """x / rms(x) * weight, keeping x and the fp32 reciprocal rms per token (fused RMSNorm
    kernels such as Apex's; torch's composite ``nn.RMSNorm`` also keeps the normalised x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, rstd, weight = ctx.saved_tensors
        xhat = x * rstd
        gw = (grad * xhat).reshape(-1, x.shape[-1]).sum(0)
        gy = grad * weight
        gx = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
        return gx, gw


class RMSNorm(nn.Module):
    """RMSNorm through :class:`_RMSNorm`."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight)


class LlamaBlock(nn.Module):
    """Pre-norm Llama block: x + attention(norm(x)), then + SwiGLU MLP(norm(.))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1 = RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
                for z in self.kv(y).chunk(2, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(_SwiGLU.apply(gate, up))


class Recomputed(nn.Module):
    """``block`` under full recomputation: its forward keeps only its input."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


#: The small model's shape: Llama-2 70B's ratios at toy size (8 query heads sharing 2 K/V
#: heads, SwiGLU width 176 ~ 8h/3 rounded to a multiple of 16, as Llama sizes it).
HIDDEN, HEADS, KV_HEADS, FFN = 64, 8, 2, 176


def recomputed(layers: int = 2, seq_len: int = 32, batch: int = 2
               ) -> tuple[nn.Sequential, torch.Tensor]:
    """``layers`` Llama blocks under full recomputation and an example input of ``batch``
    sequences of ``seq_len`` tokens (fp32), for ``pipeopt profile --model
    llama_model:recomputed``."""
    torch.manual_seed(0)
    blocks = [Recomputed(LlamaBlock(HIDDEN, HEADS, KV_HEADS, FFN)) for _ in range(layers)]
    return nn.Sequential(*blocks), torch.randn(batch, seq_len, HIDDEN)
