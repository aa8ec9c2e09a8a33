"""Models the executor can run: small built-ins for tests and demos, and user factories.

A :class:`ModelSpec` bundles what a pipelined training step needs besides the layers: how to
draw a batch and the loss. Built-ins: ``mlp`` and ``tiny-gpt``. A user model is named
``MODULE:FACTORY``; the factory returns an ``nn.Sequential``, a list of stage modules, or a
:class:`ModelSpec`.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeopt.executor.procs import ModelError, RunConfig, first_line
from pipeopt.problem import Problem

Batch = tuple[torch.Tensor, torch.Tensor]


@contextmanager
def feeding(model: str, microbatch: int) -> Iterator[None]:
    """Turn an error of feeding ``model`` a micro-batch of ``microbatch`` samples through its
    stages into a :class:`ModelError` saying so (a ModelError passes as it is)."""
    try:
        yield
    except ModelError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ModelError(f"model: {model} cannot run a micro-batch of {microbatch} through its "
                         f"stages: {type(exc).__name__}: {first_line(exc)}") from None


@dataclass
class ModelSpec:
    """Layers (or ready-made stage modules) plus data and loss.

    ``layers`` is cut into stages by :func:`split_stages`; when ``stage_modules`` is true the
    list already holds one module per stage. ``make_batch(batch_size, seed)`` returns inputs
    and targets; ``loss_fn(output, target)`` returns the mean loss of a (micro-)batch.
    """

    name: str
    layers: list[nn.Module]
    make_batch: Callable[[int, int], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    stage_modules: bool = False


# ----- built-in models ---------------------------------------------------------------------
class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq_len, hidden) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ModelError(f"hidden: must be a multiple of heads ({heads}), got {hidden}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Explicit QK^T, softmax, .V (not SDPA) so FLOP counters see the 4*b*t^2*c of it.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final norm and the vocabulary projection."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def token_batches(vocab: int, seq_len: int) -> Callable[[int, int], Batch]:
    """``make_batch`` of random token sequences whose targets are the next tokens."""
    def make_batch(batch_size: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return make_batch


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (..., vocab) against token ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tiny_gpt(layers: int = 4, hidden: int = 64, heads: int = 4, vocab: int = 128,
             seq_len: int = 16) -> ModelSpec:
    """A GPT of ``layers`` blocks as ``layers + 2`` pipeline layers (embedding, blocks, head);
    random tokens, next-token cross-entropy."""
    mods: list[nn.Module] = [Embedding(vocab, hidden, seq_len)]
    mods += [Block(hidden, heads) for _ in range(layers)]
    mods.append(Head(hidden, vocab))
    return ModelSpec("tiny-gpt", mods, token_batches(vocab, seq_len), token_loss)


def mlp(layers: int = 4, width: int = 64) -> ModelSpec:
    """``layers`` Linear+tanh layers of ``width`` on random regression data, MSE loss."""
    mods: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.Tanh())
                             for _ in range(layers)]

    def make_batch(batch_size: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, width, generator=g),
                torch.randn(batch_size, width, generator=g))

    return ModelSpec("mlp", mods, make_batch, F.mse_loss)


BUILTIN = ("tiny-gpt", "mlp")


def _layers_for(problem: Problem, extra: int) -> int:
    """Layer count of a built-in model: the partition's, else enough for every stage."""
    part = partition_of(problem)
    if part is not None:
        return max(1, part[-1][1] - extra)
    return max(4, problem.stages - extra)


def build_model(name: str, problem: Problem, seed: int = 0, **kwargs: Any) -> ModelSpec:
    """Build model ``name`` (``tiny-gpt``, ``mlp`` or ``MODULE:FACTORY``) with parameters drawn
    from ``seed``; built-ins get as many layers as the problem's partition (or stages) needs.
    The profiler (:mod:`pipeopt.models`) times these same built-ins."""
    torch.manual_seed(seed)
    if name in BUILTIN:
        kwargs.setdefault("layers", _layers_for(problem, 2 if name == "tiny-gpt" else 0))
        factory: Callable[..., Any] = tiny_gpt if name == "tiny-gpt" else mlp
    else:
        factory = factory_of(name)
    if not callable(factory):
        raise ModelError(f"model: {name} is not a function that builds a model")
    _check_keywords(name, factory, kwargs)
    try:
        made = factory(**kwargs)
    except ModelError:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a negative size
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ModelError(f"model: {name}({shown}) failed: {type(exc).__name__}: "
                         f"{first_line(exc)}") from None
    return _wrap(name, made)


def _check_keywords(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse a keyword the factory does not take (``--model-arg``), with a "did you mean"."""
    import difflib
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [k for k, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ModelError(f"model: {name} takes no argument {key!r}; {hint}it takes "
                             f"{', '.join(known) or 'none'}")


def factory_of(name: str) -> Callable[..., Any]:
    """The factory function of a ``MODULE:FACTORY`` model name (imports the module)."""
    if ":" not in name:
        raise ModelError(f"model: unknown model {name!r}; use {' or '.join(BUILTIN)} "
                         "or MODULE:FACTORY")
    module, func = name.split(":", 1)
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"model: cannot load {name!r}: {exc}") from None


def _wrap(name: str, made: Any) -> ModelSpec:
    """A ModelSpec for whatever a user factory returned (float inputs, MSE loss by default)."""
    if isinstance(made, ModelSpec):
        return made
    if isinstance(made, nn.Sequential):
        layers, stage_modules = list(made), False
    elif isinstance(made, Sequence) and all(isinstance(x, nn.Module) for x in made):
        layers, stage_modules = list(made), True
    else:
        raise ModelError(f"model: {name} must return an nn.Sequential, a list of stage modules "
                         f"or a ModelSpec, got {type(made).__name__}")
    first = next((mod for layer in layers for mod in layer.modules()
                  if isinstance(mod, nn.Linear | nn.Embedding)), None)
    if isinstance(first, nn.Embedding):  # sequences of 16 tokens
        make_batch, loss_fn = token_batches(first.num_embeddings, 16), token_loss
    elif isinstance(first, nn.Linear):
        width = first.in_features
        seq = nn.Sequential(*layers)

        def make_batch(batch_size: int, seed: int) -> Batch:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(batch_size, width, generator=g)
            with torch.no_grad():
                shape = seq(x[:1]).shape[1:]
            return x, torch.randn(batch_size, *shape, generator=g)

        loss_fn = F.mse_loss
    else:
        raise ModelError(f"model: {name} has no Linear or Embedding layer to infer its inputs "
                         "from; return a ModelSpec instead")
    return ModelSpec(name, layers, make_batch, loss_fn, stage_modules)


def partition_of(problem: Problem) -> list[tuple[int, int]] | None:
    """The layer ranges ``[first, last)`` per stage from ``problem.meta['partition']``."""
    raw = dict(problem.meta).get("partition")
    if raw is None:
        return None
    try:
        part = [(int(a), int(b)) for a, b in raw]
    except (TypeError, ValueError):
        raise ModelError("problem.meta.partition: expected a list of [first, last) layer "
                         f"ranges, got {raw!r:.80}") from None
    if len(part) != problem.stages:
        raise ModelError(f"problem.meta.partition: expected {problem.stages} ranges (one per "
                         f"stage), got {len(part)}")
    prev = 0
    for k, (a, b) in enumerate(part):
        if a != prev or b <= a:
            raise ModelError(f"problem.meta.partition[{k}]: ranges must be contiguous and "
                             f"non-empty from layer 0, got [{a}, {b})")
        prev = b
    return part


def split_stages(spec: ModelSpec, problem: Problem) -> list[nn.Module]:
    """One module per global stage: the partition's layer ranges, else an even split."""
    s = problem.stages
    if spec.stage_modules:
        if len(spec.layers) != s:
            raise ModelError(f"model: {spec.name} gives {len(spec.layers)} stage modules, "
                             f"the schedule has {s} stages")
        return list(spec.layers)
    n = len(spec.layers)
    part = partition_of(problem)
    if part is None:
        if n < s:
            raise ModelError(f"model: {spec.name} has {n} layers, fewer than the schedule's "
                             f"{s} stages")
        bounds = [math.floor(k * n / s) for k in range(s + 1)]
        part = list(itertools.pairwise(bounds))
    elif part[-1][1] != n:
        raise ModelError(f"problem.meta.partition: covers {part[-1][1]} layers, model "
                         f"{spec.name} has {n}")
    return [nn.Sequential(*spec.layers[a:b]) for a, b in part]


def model_stages(cfg: RunConfig, problem: Problem) -> tuple[ModelSpec, list[nn.Module]]:
    """The model ``cfg`` names, built with its options and seed, cut into ``problem``'s
    stages (:func:`build_model`, :func:`split_stages`)."""
    spec = build_model(cfg.model, problem, seed=cfg.seed, **dict(cfg.model_options))
    return spec, split_stages(spec, problem)


#: Recompute modes of the model form (``model.recompute``; per stage in ``meta.stage_costs``).
RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_modes(problem: Problem) -> tuple[str, ...]:
    """Each stage's recompute mode as the model form recorded it (``meta.stage_costs[k]
    .recompute``: the model's mode, or the stage's own under ``recompute: per_stage``), else
    ``none``."""
    rows = dict(problem.meta).get("stage_costs") or []
    modes = []
    for k in range(problem.stages):
        row = rows[k] if k < len(rows) and isinstance(rows[k], dict) else {}
        mode = row.get("recompute", "none")
        if mode not in RECOMPUTE_MODES:
            raise ModelError(f"problem.meta.stage_costs[{k}].recompute: must be one of "
                             f"{', '.join(RECOMPUTE_MODES)}, got {mode!r}")
        modes.append(mode)
    return tuple(modes)


def recompute_plan(problem: Problem, override: str | None = None
                   ) -> tuple[tuple[bool, ...], list[str]]:
    """Per stage whether every layer is an activation checkpoint, and notes for the user. The
    problem decides (:func:`recompute_modes`: ``full`` checkpoints, ``selective`` cannot be
    reproduced on arbitrary layers and runs without); ``override`` (``none`` or ``full``, the
    ``--recompute`` flag) applies to every stage, with a note where it contradicts the
    problem, whose times then do not describe the run."""
    modes = recompute_modes(problem)
    if override is not None:
        if override not in ("none", "full"):
            raise ModelError(f"--recompute: must be none or full, got {override!r}")
        differ = [f"stage {k}: {m}" for k, m in enumerate(modes) if m != override]
        notes = [f"--recompute {override}: overrides the problem's recompute "
                 f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}); its op "
                 "times assume the problem's, so the measured ones will differ"] if differ else []
        return (override == "full",) * problem.stages, notes
    sel = [str(k) for k, m in enumerate(modes) if m == "selective"]
    notes = [f"stage(s) {', '.join(sel)}: selective recompute (the attention core only) is "
             "not reproduced, since the executor checkpoints whole layers; they run without "
             "recompute"] if sel else []
    return tuple(m == "full" for m in modes), notes
