"""Where the executor's measured step goes beyond the prediction (issue 17): per method of
``executor.py --ranking``, the step rebuilt from the runs' own traces, one part at a time.

For each model of ``RANK_MODELS`` (project profile, as ``--ranking`` builds it) and each method
given, the schedule runs ``--rounds`` x ``--steps`` steps (the first of each round not counted)
and every step's op trace is read back (``run_rank``'s ``step_traces``). The device orders are
then replayed (``executor._replay``, the dependencies of the chain) on, cumulatively:

1. the profile's op times without overheads (what the prediction starts from);
2. the median duration of each kind of op (F / B / W per stage) measured in the run;
3. plus the median gap before an op whose inputs are all local (the runtime's time between
   two ops of a rank: the per-action overhead);
4. plus, on every cross-rank dependency, the median delay from the producer's end to the
   consumer's start where that message held the consumer up;
5. plus the median step tail: from the last op's end to the step's end (optimizer step,
   zero-grad, closing barrier).

The last column is what these parts leave unexplained (waits that a median hides).

    python benchmarks/step_gap.py [--methods 1f1b zb-h1 greedy] [--rounds 3] [--steps 4]
    python benchmarks/step_gap.py --cold   # one stage's forward: warm loop against in a step
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from executor import (
    RANK_MODELS,
    _bench_rank,
    _replay,
    load_note,
    project_profile,
    timed_overheads,
)

from pipeopt.costs.profiler import step_trace_costs
from pipeopt.executor.launch import RunConfig
from pipeopt.executor.procs import spawn
from pipeopt.problem import Op, Problem
from pipeopt.schedule import Schedule
from pipeopt.solvers import solve


def _op(name: str) -> Op:
    """``"1F0"`` -> Op("F", 1, 0) (stage, kind, micro-batch)."""
    i = next(k for k, c in enumerate(name) if c.isalpha())
    return Op(name[i], int(name[:i]), int(name[i + 1:]))


def _profile_cost(raw: Problem, s: Schedule, op: Op) -> float:
    """Seconds of ``op`` in the profile without overheads, as the executor runs it: fused
    B = B + W; on stage 0 (no input gradient to send) B is free and W the whole backward."""
    whole = raw.backward_input[op.stage] + raw.backward_weight[op.stage]
    if op.kind == "B" and not s.problem.split_backward:
        return whole
    if op.stage == 0 and op.kind in "BW":
        return whole if op.kind == "W" else 0.0
    return raw.durations[op.kind][op.stage]


def decompose(s: Schedule, raw: Problem, runs: list[list[dict[str, Any]]]
              ) -> dict[str, float]:
    """The parts of the measured step (seconds); ``runs[rank][round]`` is ``run_rank``'s
    report, read by the profiler's :func:`pipeopt.costs.profiler.step_trace_costs` (the first
    step of every round left out)."""
    got = step_trace_costs(s, runs)
    durs, local, msg = got["ops"], got["gaps"], got["delays"]
    tails = [t for t, _ in got["tails"]]
    steps = got["steps"]
    med = {k: statistics.median(v) for k, v in durs.items()}
    ops = [o for order in s.device_orders() for o in order]
    gap = statistics.median(local) if local else 0.0
    delay = statistics.median(msg) if msg else 0.0
    measured_ops = {str(o): med[f"{o.kind}{o.stage}"] for o in ops}
    with_gap = {k: v + gap for k, v in measured_ops.items()}
    parts = {
        "profile": _replay(s, {str(o): _profile_cost(raw, s, o) for o in ops}, 0.0),
        "ops": _replay(s, measured_ops, 0.0),
        "gap": _replay(s, with_gap, 0.0),
        "messages": _replay(s, with_gap, delay),
    }
    tail = statistics.median(tails)
    return {**parts, "tail": parts["messages"] + tail, "measured": statistics.median(steps),
            "gap_s": gap, "delay_s": delay, "tail_s": tail,
            **{f"op:{k}": v for k, v in med.items()}}


def _median_ms(fn: Any, before: Any = None, n: int = 30) -> float:
    """Median milliseconds of ``fn()`` over ``n`` calls, each after ``before()`` (untimed)."""
    times = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cold() -> None:
    """One MLP stage of ``--ranking`` (4 x Linear(512, 512) + tanh, a micro-batch of 4 rows,
    Adam) on one process and one thread: its forward timed in a warm loop (as the profile
    times a layer), right after another forward and backward, and right after the backwards
    of 8 micro-batches and an optimizer step (as a step's first forward runs)."""
    import torch

    from pipeopt._malloc import steady_cpu_allocator

    steady_cpu_allocator()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*[m for _ in range(4)
                                  for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())])
    opt = torch.optim.Adam(stage.parameters(), 1e-3)
    x = torch.randn(4, 512)

    def fwd() -> Any:
        return stage(x)

    def backward() -> None:
        fwd().sum().backward()

    def step() -> None:
        for out in [fwd() for _ in range(8)]:
            out.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _median_ms(fwd, n=10)
    print(f"MLP stage forward, one process ({load_note()}): warm loop {_median_ms(fwd):.3f} ms; "
          f"after a forward + backward {_median_ms(fwd, backward):.3f} ms; after 8 backwards "
          f"and an optimizer step {_median_ms(fwd, step):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["1f1b", "zb-h1", "greedy"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cold", action="store_true",
                    help="instead: one stage's forward in a warm loop against in a step")
    args = ap.parse_args()
    if args.cold:
        cold()
        return
    p, m = args.ranks, args.microbatches
    over = timed_overheads(p)
    for name, (model, options) in RANK_MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            prob, _ = project_profile(p, m, args.batch, tmp, model, options, over)
        with tempfile.TemporaryDirectory() as tmp:
            raw, _ = project_profile(p, m, args.batch, tmp, model, options, None)
        scheds = [solve(prob, meth, time_limit=5, workers=1, seed=0) for meth in args.methods]
        cfg = RunConfig(model=model, model_options=options, steps=args.steps,
                        batch_size=args.batch)
        per_rank = spawn(_bench_rank, p, ([("ours", s, cfg) for s in scheds], args.rounds),
                         timeout=3600, backend="gloo")
        print(f"{name}: ms per step (cumulative replays; {load_note()})")
        for i, s in enumerate(scheds):
            d = decompose(s, raw, [per_rank[r][str(i)] for r in range(p)])
            print(f"  {s.method:<8} predicted {s.iteration_time * 1e3:6.1f}  measured "
                  f"{d['measured'] * 1e3:6.1f} | profile ops {d['profile'] * 1e3:6.1f}  run's ops "
                  f"{d['ops'] * 1e3:6.1f}  +gap {d['gap_s'] * 1e3:.2f}/op {d['gap'] * 1e3:6.1f}  "
                  f"+msg {d['delay_s'] * 1e3:.2f} {d['messages'] * 1e3:6.1f}  +tail "
                  f"{d['tail_s'] * 1e3:.2f} {d['tail'] * 1e3:6.1f}  unexplained "
                  f"{(d['measured'] - d['tail']) * 1e3:+5.1f}")
            print("           op ms, run / profile: " + "  ".join(
                f"{k[3:]} {v * 1e3:.2f}/{_profile_cost(raw, s, _op(f'{k[4:]}{k[3]}0')) * 1e3:.2f}"
                for k, v in sorted(d.items()) if k.startswith("op:")))


if __name__ == "__main__":
    main()
