"""The built-in torch models as plain ``nn.Sequential`` layer pipelines, for the profiler.

They are the executor's built-ins (:mod:`pipeopt.executor.models`), so a profile measures the
very layers a schedule later runs. torch is imported when a function is called.
"""

from __future__ import annotations

from typing import Any


def tiny_gpt(layers: int = 4, hidden: int = 64, heads: int = 4, vocab: int = 128,
             seq_len: int = 16) -> Any:
    """A GPT as ``nn.Sequential(embedding, block_0, ..., block_{layers-1}, head)``.

    Input: token ids ``(batch, seq_len)`` int64; output: logits ``(batch, seq_len, vocab)``.
    """
    from torch import nn

    from pipeopt.executor.models import tiny_gpt as spec

    return nn.Sequential(*spec(layers, hidden, heads, vocab, seq_len).layers)


def mlp(layers: int = 4, width: int = 64) -> Any:
    """``layers`` blocks of Linear(width, width) + tanh as an ``nn.Sequential``."""
    from torch import nn

    from pipeopt.executor.models import mlp as spec

    return nn.Sequential(*spec(layers, width).layers)


def loss_fn(name: str) -> Any:
    """The loss of a built-in model: ``tiny-gpt`` -> cross-entropy, ``mlp`` -> MSE."""
    from pipeopt.executor.models import mlp, tiny_gpt

    return (tiny_gpt(1) if name == "tiny-gpt" else mlp(1)).loss_fn


def sample_batch(name: str, batch: int = 2, *, seq_len: int = 16, vocab: int = 128,
                 width: int = 64, seed: int = 0) -> tuple[Any, Any]:
    """(input, target) of a built-in model for ``batch`` samples, reproducible by ``seed``."""
    from pipeopt.executor.models import mlp, tiny_gpt

    spec = tiny_gpt(1, vocab=vocab, seq_len=seq_len) if name == "tiny-gpt" else mlp(1, width)
    return spec.make_batch(batch, seed)
