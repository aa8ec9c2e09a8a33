"""``pipeopt run`` (replay a schedule on torch.distributed) and ``pipeopt export``."""

from __future__ import annotations

import argparse
import json
import sys

from pipeopt.config import ConfigError
from pipeopt.executor.collectives import GraphRun, load_graph_run, plan_schedule, read_v2
from pipeopt.executor.procs import (
    ExecutorError,
    ModelError,
    RunConfig,
    check_nccl,
    check_run_flags,
    refuse,
)
from pipeopt.io import (
    check_writable,
    load_schedule,
    refuse_overwriting_input,
    write_atomic,
    write_output,
)
from pipeopt.schedule import Schedule

BUILTIN_MODELS = ("tiny-gpt", "mlp")  # pipeopt.executor.models.BUILTIN, named without torch

EXAMPLES = {
    "run": "pipeopt run schedule.json --model tiny-gpt --check",
    "export": "pipeopt export schedule.json --to torch -o schedule.csv",
}


def check_run_args(args: argparse.Namespace) -> Schedule:
    """Check every ``run`` flag and load the schedule, importing no torch; return the schedule.
    Raises :class:`ConfigError` naming the flag."""
    refuse_overwriting_input("--costs-out", args.costs_out, args.schedule)
    if args.costs_out:
        check_writable("--costs-out", args.costs_out)  # before the run, not after it
    sched = load_schedule(args.schedule)
    _check_model(args)
    check_run_flags(args, sched.problem.devices * args.data_parallel, sched.problem.microbatches)
    return sched


def _check_model(args: argparse.Namespace) -> None:
    if args.model not in BUILTIN_MODELS and ":" not in args.model:
        raise ConfigError(f"model: unknown model {args.model!r}; use "
                          f"{' or '.join(BUILTIN_MODELS)} or MODULE:FACTORY")


def cmd_run(args: argparse.Namespace) -> int:
    """Replay a schedule; exit 1 when the gradients differ from the reference or a rank fails,
    2 for bad input (a model that cannot be built or cut as the schedule needs, too).
    Every flag and the schedule are checked before torch is imported (which takes seconds).
    A periodic (async) document goes to :mod:`pipeopt.executor.periodic`, a schedule JSON v2
    of a served inference plan to :mod:`pipeopt.executor.inference`."""
    try:
        return _run(args)
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    except ExecutorError as exc:
        print(f"pipeopt: run failed: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from pipeopt.executor.inference import cmd_run_serving
    from pipeopt.views_cli import load_periodic

    periodic = load_periodic(args.schedule)  # pipeline.mode: async's own document
    if periodic is not None:
        from pipeopt.executor.periodic import cmd_run_async

        return cmd_run_async(args, periodic)
    doc = read_v2(args.schedule)  # schedule JSON v2: scheduled collectives or a served plan
    plan = load_graph_run(args.schedule, doc)
    if plan is None and doc is not None:
        return cmd_run_serving(args)
    if getattr(args, "max_prompt", None) is not None or getattr(args, "max_output",
                                                                 None) is not None:
        raise ConfigError("--max-prompt / --max-output: apply to served inference plans "
                          f"(schedule JSON v2), and {args.schedule} is not one")
    sched = check_run_args(args) if plan is None else check_graph_args(args, plan)
    check_nccl(args.backend)  # the one check that needs torch, so the last one
    from pipeopt.executor.launch import run_graph, run_pipeline
    from pipeopt.executor.models import recompute_plan

    cfg = RunConfig.from_args(args)
    for note in recompute_plan(sched.problem, args.recompute)[1]:
        print(f"pipeopt: note: {note}", file=sys.stderr)
    res = run_pipeline(sched, cfg) if plan is None else run_graph(plan, cfg)
    if res is None:  # a torchrun rank other than 0
        return 0
    bad = args.check and not res.grads_match
    if args.costs_out:
        from pipeopt.executor.launch import measured_schedule
        from pipeopt.io import dump_schedule

        measured = measured_schedule(sched, res)
        write_output("--costs-out", args.costs_out,
                     lambda path: dump_schedule(measured, path))
    if args.json:
        print(json.dumps({**res.to_dict(), "schedule": args.schedule, "model": args.model}))
        return 1 if bad else 0
    print(f"schedule      {args.schedule} ({res.method}, {res.world} ranks)")
    print(f"model         {args.model}, batch {cfg.batch(sched.problem.microbatches)}, "
          f"{sched.problem.microbatches} micro-batches, {args.steps} step(s)")
    print(f"loss          {res.loss:.6g}")
    n = len(res.step_times)
    how = f"median of {n - 1} after warm-up" if n > 1 else "1 step, includes warm-up"
    if res.dtype != "float32":
        how += f"; in {res.dtype}, as --check runs this replay"
    print(f"step time     {res.step_time:.6g} s measured ({how})")
    print(f"predicted     {res.predicted_step_time:.6g} s (the schedule's "
          + ("makespan" if plan is None else "makespan / iterations")
          + "; its problem's times are read as seconds)")
    if args.check:
        print(f"reference     {res.reference_step_time:.6g} s per step without pipelining, loss "
              f"{res.reference_losses[-1]:.6g}")
        verdict = "ok" if res.grads_match else "MISMATCH"
        what = "grad diff" if res.compared == "gradients" else "weight diff"
        scope = "" if res.world == sched.problem.devices else ", every replica"
        print(f"{what:<14}{res.max_abs_grad_diff:.3g} max abs ({verdict}: |a - b| <= "
              f"{res.atol:g} + {res.rtol:g} |b| elementwise{scope}, {res.dtype} on both sides;"
              f" worst {res.worst_param})")
    if plan is not None:
        launches = sum(x.startswith("launch ") for x in res.collectives[0])
        print(f"collectives   {launches} launches on rank 0 (op and launch "
              f"order: --json), in the schedule's order, "
              f"{'one step late' if plan.delay == 2 else 'applied before the next step'}")
    if res.peak_memory:
        print(f"peak memory   {', '.join(f'{x / 2**20:.4g}' for x in res.peak_memory)} MiB "
              "per rank (CUDA allocator peak; on CPU the process's peak resident set)")
    prob, label = sched.problem, "op times"
    for k in range(prob.stages):
        kinds = [kind for kind in prob.kinds if (kind, k) in res.op_costs]
        if kinds:
            got = ", ".join(f"{kind} {res.op_costs[(kind, k)] * 1e3:.3g} ms" for kind in kinds)
            want = ", ".join(f"{prob.durations[kind][k] * 1e3:.4g} ms" for kind in kinds)
            print(f"{label:<14}stage {k}: {got} measured (problem: {want})")
            label = ""
    if args.costs_out:
        print(f"measured      {args.costs_out}: the same orders on the op times of this run "
              f"(makespan {measured.makespan:.6g} s); re-plan with pipeopt solve "
              f"{args.costs_out}")
    return 1 if bad else 0


def check_graph_args(args: argparse.Namespace, plan: GraphRun) -> Schedule:
    """The ``run`` flags' checks for a data-parallel graph schedule (ConfigError naming the
    flag); returns replica 0's first iteration as a chain schedule."""
    refuse((flag, given, f"{why} with a data-parallel schedule of scheduled collectives "
            "(docs/executor.md)") for flag, given, why in (
        ("--clip-grad-norm", args.clip_grad_norm is not None, "is not supported"),
        ("--costs-out", args.costs_out is not None, "is for chain schedules (v1)"),
        ("--data-parallel", args.data_parallel not in (1, plan.replicas),
         f"the schedule has {plan.replicas} replicas")))
    if args.steps > plan.iterations:
        raise ConfigError(f"--steps: the schedule holds {plan.iterations} iteration(s), one per "
                          f"step, got {args.steps}")
    _check_model(args)
    check_run_flags(args, plan.problem.devices * plan.replicas, plan.problem.microbatches)
    return plan_schedule(plan, 0, 0)


def cmd_export(args: argparse.Namespace) -> int:
    """Write the schedule in another tool's format."""
    from pipeopt.executor.export import (
        export_torch,
        to_megatron_args,
        to_torch_csv,
        to_torchtitan_toml,
    )

    if args.to == "torchtitan" and not args.csv:
        raise ConfigError("--csv: needed with --to torchtitan (the TOML names the schedule CSV "
                          "that torchtitan reads; give its path)")
    if args.csv and args.to != "torchtitan":
        raise ConfigError(f"--csv: only used with --to torchtitan, not --to {args.to}")
    refuse_overwriting_input("--output", args.output, args.schedule)
    refuse_overwriting_input("--csv", args.csv, args.schedule)
    if args.csv and args.output:
        refuse_overwriting_input("--csv", args.csv, args.output)
    if args.to == "torchtitan":  # two files: both checked before either is written
        for flag, path in (("--output", args.output), ("--csv", args.csv)):
            if path:
                check_writable(flag, path)
    sched = load_schedule(args.schedule)
    if args.to == "torch":
        text, what = None, "compute-only"
    elif args.to == "torchtitan":
        text = to_torchtitan_toml(sched, args.csv)  # refusals before anything is written
        write_output("--csv", args.csv, lambda path: export_torch(sched, path))
        # With the TOML on standard output, the note goes to standard error.
        print(f"written {args.csv} ({sched.problem.devices} ranks, compute-only)",
              file=sys.stdout if args.output else sys.stderr)
        what = "torchtitan [parallelism] and [training]"
    else:
        text = to_megatron_args(sched)
        what = "Megatron-LM flags; Megatron runs its own 1F1B order on this split"
    if args.output:
        if text is None:
            write_output("--output", args.output, lambda path: export_torch(sched, path))
        else:
            write_output("--output", args.output, lambda path: write_atomic(path, text))
        print(f"written {args.output} ({sched.problem.devices} ranks, {what})")
    else:
        sys.stdout.write(to_torch_csv(sched) if text is None else text)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``run`` and ``export`` to the ``pipeopt`` command line."""
    help_ = ("Replay a schedule JSON on torch.distributed (one process per device) and "
             "optionally check its gradients.")
    p = sub.add_parser("run", help=help_, description=help_,
                       epilog="Example: " + EXAMPLES["run"] + ". Under torchrun, each process "
                       "is one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).")
    p.add_argument("schedule", help="schedule JSON (pipeopt.schedule/v1), or a served "
                   "inference plan (v2, from a file): replayed forward only with a KV cache")
    p.add_argument("--model", default="tiny-gpt",
                   help="tiny-gpt, mlp, or MODULE:FACTORY returning an nn.Sequential or a list "
                   "of stage modules (default: tiny-gpt)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword for the model factory, e.g. hidden=128 (repeatable)")
    p.add_argument("--check", action="store_true",
                   help="also run without pipelining and compare gradients, within 1e-5 + "
                   "1e-5 |b| (a data-parallel graph schedule: every replica's final weights, "
                   "both sides in float64, within 1e-8 + 1e-8 |b|); exit 1 if they differ")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--batch-size", type=int, help="batch size (default 4 per micro-batch)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                   help="optimizer (default sgd)")
    p.add_argument("--clip-grad-norm", type=float, metavar="NORM",
                   help="clip the gradients to this global norm (over every rank)")
    p.add_argument("--autocast", choices=["bf16", "fp16"],
                   help="run the stages' forward under torch.autocast to this dtype")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="replicas of the pipeline (devices x N ranks), each on its share of a "
                   "batch N times as large; gradients averaged (default 1)")
    p.add_argument("--recompute", nargs="?", const="full", choices=["none", "full"],
                   help="activation checkpointing on every stage (full: every layer's forward "
                   "runs again in its backward; none: never), whatever the schedule's problem "
                   "says (default: where its model form says recompute: full)")
    p.add_argument("--torch-split", action="store_true",
                   help="split backward as PyTorch's runtime does it (whole stage), not "
                   "pipeopt's per-layer refinement")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a run that does not finish is stopped (default 300)")
    p.add_argument("--op-timeout", type=float, default=120.0,
                   help="seconds one op or message may take before the run is stopped, "
                   "naming the rank and the op (default 120)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="process group backend (auto: nccl with CUDA, else gloo)")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores / "
                   "ranks)")
    p.add_argument("--max-ranks", type=int, metavar="N",
                   help="start at most N rank processes, in place of the default limit (4 per "
                   "core and about 440 MiB of available memory each)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--max-prompt", type=int, metavar="TOKENS",
                   help="served inference plan: cut every prompt to at most this many tokens "
                   "(the iterations keep their places; docs/executor.md)")
    p.add_argument("--max-output", type=int, metavar="TOKENS",
                   help="served inference plan: generate at most this many tokens per request")
    p.add_argument("--costs-out", metavar="FILE",
                   help="write the schedule re-timed on the op durations measured in this run "
                   "(median per stage and kind, steps after the first): a schedule JSON whose "
                   "problem carries the measured costs, which pipeopt solve accepts in place "
                   "of a config to re-plan on them")
    p.set_defaults(func=cmd_run)

    help_ = ("Write a schedule in torch.distributed.pipelining's compute-only CSV, as a "
             "torchtitan config fragment (with the CSV) or as Megatron-LM's pipeline layout "
             "flags.")
    p = sub.add_parser("export", help=help_, description=help_,
                       epilog="Example: " + EXAMPLES["export"] + "; pipeopt export "
                       "schedule.json --to torchtitan --csv schedule.csv -o pipeline.toml")
    p.add_argument("schedule", help="schedule JSON (pipeopt.schedule/v1)")
    p.add_argument("--to", default="torch", choices=["torch", "torchtitan", "megatron"],
                   help="target: torch (compute-only CSV), torchtitan (TOML [parallelism] "
                   "with the stage split; needs --csv), megatron (command-line flags of the "
                   "stage split) (default torch)")
    p.add_argument("--csv", metavar="FILE",
                   help="with --to torchtitan: the schedule CSV to write, named in the TOML")
    p.add_argument("-o", "--output", help="file to write (default: standard output)")
    p.set_defaults(func=cmd_export)
