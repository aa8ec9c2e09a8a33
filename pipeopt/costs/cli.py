"""``pipeopt profile``: time a torch model per layer and write a profile JSON."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pipeopt.config import ConfigError
from pipeopt.io import check_writable, write_output


def _int_at_least(low: int) -> Any:
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if val < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {val}")
        return val
    return parse


def _device(text: str | None) -> str:
    """Check ``--device`` against what this torch build can use; returns the device name."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device: {text!r} asked for, but this torch "
                              f"({torch.__version__}) sees no CUDA device; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device: {text!r}: only {torch.cuda.device_count()} CUDA "
                              "device(s) here")
    elif dev.type != "cpu":
        raise ConfigError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    return str(dev)


def _build(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(model, example input, name) for ``--model``."""
    import pipeopt.models as models

    if args.model == "tiny-gpt":
        if args.hidden % args.heads:
            raise ConfigError(f"--heads: must divide --hidden ({args.hidden}), got "
                              f"{args.heads}")
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
    if not callable(factory):
        raise ConfigError(f"--model: {args.model!r} is not a function that builds a model")
    try:
        made = factory()
    except Exception as exc:  # the user's code: report it, do not crash with its traceback
        raise ConfigError(f"--model: {args.model}() failed: {type(exc).__name__}: {exc}") \
            from None
    if isinstance(made, tuple) and len(made) == 2:
        return made[0], made[1], args.model
    if args.input_shape is None:
        raise ConfigError("--input-shape: needed when the factory returns only a model "
                          "(or return (model, example_input) from it)")
    import torch

    try:
        shape = [int(s) for s in args.input_shape.split(",")]
    except ValueError:
        raise ConfigError(f"--input-shape: expected comma-separated integers such as 2,64, "
                          f"got {args.input_shape!r}") from None
    if not shape or any(n < 1 for n in shape):
        raise ConfigError(f"--input-shape: every size must be >= 1, got {args.input_shape!r}")
    return made, torch.randn(*shape), args.model


def _timing(args: argparse.Namespace, device: str) -> str:
    """``--timing`` resolved: ``auto`` is ``step`` for a training profile of a built-in model
    on the CPU (what the executor's CPU ranks run), else ``warm``; ``step`` where it cannot
    run is refused."""
    if args.timing == "auto":
        builtin = args.model in ("tiny-gpt", "mlp")
        return "step" if builtin and device == "cpu" and not args.forward_only else "warm"
    if args.timing == "step" and (args.forward_only or device != "cpu"):
        raise ConfigError("--timing step: times a training step on gloo ranks on the CPU; not "
                          "with " + ("--forward-only" if args.forward_only
                                     else f"--device {device}") + " (use --timing warm)")
    return str(args.timing)


def _step_timed(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    """The warm profile ``doc`` re-timed in real steps of the executor
    (:func:`pipeopt.costs.profiler.step_profile`)."""
    from pipeopt.costs.profiler import step_profile
    from pipeopt.executor.procs import ExecutorError, ModelError

    options: tuple[tuple[str, Any], ...] = ()
    if args.model == "tiny-gpt":
        options = (("layers", args.layers), ("hidden", args.hidden), ("heads", args.heads),
                   ("vocab", args.vocab), ("seq_len", args.seq_len))
    elif args.model == "mlp":
        options = (("layers", args.layers), ("width", args.hidden))
    try:
        return step_profile(doc, args.model, options, ranks=args.step_ranks,
                            microbatches=args.step_microbatches)
    except (ExecutorError, ModelError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"--timing step: running {args.model} on {args.step_ranks} gloo "
                          f"ranks failed: {first} (or use --timing warm)") from None


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile a model and write the JSON."""
    try:
        import torch
    except ImportError:
        raise ConfigError("profile: needs torch (pip install 'pipeopt[torch]')") from None
    from pipeopt.costs.profiler import profile_model, write_profile

    check_writable("--output", args.output)  # before minutes of timing, not after
    device = _device(args.device)
    timing = _timing(args, device)
    if timing == "step":  # before minutes of warm profiling, as `pipeopt run` refuses them
        import os

        from pipeopt.executor.procs import (
            ExecutorError,
            available_memory_bytes,
            check_rank_capacity,
        )
        try:
            check_rank_capacity(args.step_ranks, os.cpu_count(), available_memory_bytes())
        except ExecutorError as exc:
            raise ConfigError(f"--step-ranks: {exc}") from None
    if args.overheads and timing == "step":
        raise ConfigError("--overheads: --timing step measures the overheads in its own runs "
                          "of the model; --overheads is for --timing warm")
    if args.overheads and (args.forward_only or device != "cpu"):
        raise ConfigError("--overheads: measured with gloo ranks on the CPU, for the CPU "
                          "training replay; not with "
                          + ("--forward-only" if args.forward_only else f"--device {device}"))
    model, x, name = _build(args)
    if not isinstance(model, torch.nn.Sequential) or len(model) == 0:
        raise ConfigError(f"--model: {name} must give a non-empty torch.nn.Sequential (its "
                          f"layers are what is timed), got {type(model).__name__}")
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"--model: {name}'s example input must be a tensor, got "
                          f"{type(x).__name__}")
    try:
        doc = profile_model(model, x, device=device, warmup=args.warmup,
                            repeats=args.repeats, name=name, forward_only=args.forward_only,
                            overheads=args.overheads)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        # Shapes that do not fit the model, an input on the wrong device, ...: the model's own
        # error, on one line.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"--model: running {name} on its example input failed: "
                          f"{type(exc).__name__}: {first}") from None
    if timing == "step":
        doc = _step_timed(args, doc)
    write_output("--output", args.output, lambda path: write_profile(doc, path))
    if args.forward_only:
        print(f"{'layer':<18} {'F ms':>8} {'GFLOP':>9} {'params':>9}")
        for rec in doc["layers"]:
            print(f"{rec['name']:<18} {rec['forward_s'] * 1e3:>8.3f} "
                  f"{rec['forward_flops'] / 1e9:>9.4f} {rec['params']:>9.0f}")
        print(f"written {args.output} ({doc['device']}; forward only, in inference mode); use "
              f"it with workload: {{kind: inference, costs: {{profile: {args.output}}}}}")
        return 0
    print(f"{'layer':<18} {'F ms':>8} {'B ms':>8} {'W ms':>8} {'fused ms':>9} {'act KiB':>9} "
          f"{'params':>9}")
    for rec in doc["layers"]:
        print(f"{rec['name']:<18} {rec['forward_s'] * 1e3:>8.3f} "
              f"{rec['backward_input_s'] * 1e3:>8.3f} {rec['backward_weight_s'] * 1e3:>8.3f} "
              f"{rec['backward_s'] * 1e3:>9.3f} {rec['activation_bytes'] / 1024:>9.1f} "
              f"{rec['params']:>9.0f}")
    print("B and W: the split backward as pipeopt run computes it; fused: the whole backward "
          "in one pass (B is 0 where the input takes no gradient)")
    if doc.get("timing") == "step":
        st = doc["in_step"]
        print(f"timed in step: {st['ranks']} gloo ranks ran {' and '.join(st['methods'])} with "
              f"{st['microbatches']} micro-batches on partition {st['partition']} "
              f"({st['wall_s']:.0f} s); each layer scaled so that every stage's ops add up to "
              "what the runs measured; the runs' median step against this profile's "
              "prediction of the same orders: " + ", ".join(
                  f"{r['method']} {r['measured_ms']:.2f} / {r['predicted_ms']:.2f} ms"
                  for r in st["replayed"]) + f" (per step {st['step_measured_ms']:.3f} ms "
              f"measured beyond the ops, {st['step_fit_ms']:.3f} ms priced)")
    else:
        print("timed in a warm loop, one layer alone (--timing warm): ops inside a pipelined "
              "step run slower than this")
    if "overheads" in doc:
        o = doc["overheads"]
        print(f"overheads: {o['action_s'] * 1e3:.3f} ms per action, {o['message_s'] * 1e3:.3f} "
              f"ms per message, {o['step_s'] * 1e3:.3f} ms per step (+ the optimizer step of "
              f"each layer: {sum(r['step_s'] for r in doc['layers']) * 1e3:.3f} ms in all)")
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
    pos, nonneg = _int_at_least(1), _int_at_least(0)
    p.add_argument("--layers", type=pos, default=4, help="blocks of a built-in model")
    p.add_argument("--hidden", type=pos, default=64, help="hidden size / MLP width")
    p.add_argument("--heads", type=pos, default=4)
    p.add_argument("--vocab", type=pos, default=128)
    p.add_argument("--seq-len", type=pos, default=16)
    p.add_argument("--batch-size", type=pos, default=2, help="micro-batch size")
    p.add_argument("--input-shape", help="comma-separated input shape for a factory model")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--warmup", type=nonneg, default=2, help="untimed runs per op")
    p.add_argument("--repeats", type=pos, default=5, help="timed runs per op (the median)")
    p.add_argument("--forward-only", action="store_true",
                   help="time the inference forward alone (eval, torch.inference_mode): "
                        "backward fields 0, no saved activations")
    p.add_argument("--timing", choices=("auto", "step", "warm"), default="auto",
                   help="step: re-time the ops in real steps of the executor (gloo ranks on "
                        "the CPU run 1F1B and ZB-H1: each stage's F/B/W as a step runs them, the "
                        "runtime's gap per op, message delay and step tail as overheads; tens "
                        "of seconds); warm: each layer alone in a warm loop; auto (default): "
                        "step for tiny-gpt and mlp training on the CPU, else warm")
    p.add_argument("--step-ranks", type=_int_at_least(2), default=2,
                   help="--timing step: gloo ranks (stages) of the runs")
    p.add_argument("--step-microbatches", type=pos, default=8,
                   help="--timing step: micro-batches of --batch-size samples per step")
    p.add_argument("--overheads", action="store_true",
                   help="--timing warm: also measure the executor's fixed costs per action, "
                        "message and step (2 gloo ranks replaying a trivial model; CPU only, a "
                        "few seconds)")
    p.add_argument("-o", "--output", default="profile.json", help="profile JSON to write")
    p.set_defaults(func=cmd_profile)
