"""``pipeopt profile``: time a torch model per layer and write a profile JSON."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pipeopt.config import ConfigError


def _build(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(model, example input, name) for ``--model``."""
    from pipeopt import models

    if args.model == "tiny-gpt":
        m = models.tiny_gpt(layers=args.layers, hidden=args.hidden, heads=args.heads,
                            vocab=args.vocab, seq_len=args.seq_len)
        x, _ = models.sample_batch("tiny-gpt", args.batch_size, seq_len=args.seq_len,
                                   vocab=args.vocab)
        return m, x, "tiny-gpt"
    if args.model == "mlp":
        m = models.mlp(layers=args.layers, width=args.hidden)
        x, _ = models.sample_batch("mlp", args.batch_size, width=args.hidden)
        return m, x, "mlp"
    if ":" not in args.model:
        raise ConfigError(f"--model: expected tiny-gpt, mlp or MODULE:FACTORY, got "
                          f"{args.model!r}")
    mod_name, func = args.model.split(":", 1)
    try:
        factory = getattr(importlib.import_module(mod_name), func)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model: cannot load {args.model!r}: {exc}") from None
    made = factory()
    if isinstance(made, tuple) and len(made) == 2:
        return made[0], made[1], args.model
    if args.input_shape is None:
        raise ConfigError("--input-shape: needed when the factory returns only a model "
                          "(or return (model, example_input) from it)")
    import torch

    shape = [int(s) for s in args.input_shape.split(",")]
    return made, torch.randn(*shape), args.model


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile a model and write the JSON."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError("profile: needs torch (pip install 'pipeopt[torch]')") from None
    from pipeopt.costs.profiler import profile_model, write_profile

    model, x, name = _build(args)
    doc = profile_model(model, x, device=args.device, warmup=args.warmup,
                        repeats=args.repeats, name=name)
    write_profile(doc, args.output)
    print(f"{'layer':<18} {'F ms':>8} {'B ms':>8} {'W ms':>8} {'fused ms':>9} {'act KiB':>9} "
          f"{'params':>9}")
    for rec in doc["layers"]:
        print(f"{rec['name']:<18} {rec['forward_s'] * 1e3:>8.3f} "
              f"{rec['backward_input_s'] * 1e3:>8.3f} {rec['backward_weight_s'] * 1e3:>8.3f} "
              f"{rec['backward_s'] * 1e3:>9.3f} {rec['activation_bytes'] / 1024:>9.1f} "
              f"{rec['params']:>9.0f}")
    print("B and W: the split backward as pipeopt run computes it; fused: the whole backward "
          "in one pass (B is 0 where the input takes no gradient)")
    print(f"written {args.output} ({doc['device']}); use it with model: {{profile: "
          f"{args.output}}}")
    return 0


def add_commands(subparsers: Any) -> None:
    """Add ``pipeopt profile`` to the command line."""
    p = subparsers.add_parser(
        "profile", help="Time a torch model per layer and write a profile JSON.",
        description="Time a torch model per layer (forward, backward-input, backward-weight; "
                    "median of repeats), measure activation and parameter bytes, and write a "
                    "profile that solve accepts as model: {profile: FILE}.",
        epilog="Example: pipeopt profile --model tiny-gpt --layers 4 -o profile.json")
    p.add_argument("--model", default="tiny-gpt", help="tiny-gpt, mlp or MODULE:FACTORY")
    p.add_argument("--layers", type=int, default=4, help="blocks of a built-in model")
    p.add_argument("--hidden", type=int, default=64, help="hidden size / MLP width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2, help="micro-batch size")
    p.add_argument("--input-shape", help="comma-separated input shape for a factory model")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-o", "--output", default="profile.json", help="profile JSON to write")
    p.set_defaults(func=cmd_profile)
