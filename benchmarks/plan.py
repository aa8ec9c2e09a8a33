"""``pipeopt plan`` on GPT-3 175B over 1024 A100-80GB (Narayanan et al., SC'21): candidates
scheduled against enumerated, wall time, and the best step time against the best
configuration of the no-search baseline (Megatron-LM's defaults: 1F1B, interleaved 1F1B for
v = 2, on the even partition, uniform recompute), both measured in this run.

    python benchmarks/plan.py [CONFIG] [--time-limit S] [--jobs N] [--no-baseline]
    python benchmarks/plan.py [CONFIG] --zero-compare [--time-limit S] [--jobs N]

The predicted throughput is printed beside the paper's 138 TFLOP/s per GPU (its table 1, 175B
on 1024 GPUs), counted as the paper counts (:func:`pipeopt.plan.narayanan_flops`); the ratio
is shown, not asserted. Prints figures measured in this run; asserts nothing about wall time.

``--zero-compare`` runs the search twice in this run instead, with ``plan.zero`` [0, 1] and
[0, 1, 2, 3] (ZeRO-2/3: :mod:`pipeopt.costs.zero`), and prints both bests and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from pipeopt.plan import Plan, PlanSpec, load_plan, narayanan_flops, plan

ROOT = Path(__file__).resolve().parents[1]
#: Narayanan et al. 2021, table 1: GPT-3 175B on 1024 A100s, 138 TFLOP/s per GPU.
PAPER_TFLOPS_PER_GPU = 138.0


def _line(name: str, result: Plan) -> None:
    r, best = result, result.best
    print(f"{name}: {r.count('scheduled')} scheduled of {r.enumerated} enumerated "
          f"({r.count('pruned', 'memory')} pruned by memory, "
          f"{r.count('pruned', 'bound')} by bound, {r.count('failed')} refused, "
          f"{r.count('skipped')} skipped); wall {r.wall_time_s:.1f} s")
    if best is not None:
        print(f"  best {best.candidate.label}: {best.step_time_s:.4f} s per step "
              f"(bound {best.bound_s:.4f} s), MFU {best.mfu:.1%}, method {best.method}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "examples" / "plan_gpt3.yaml"))
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--zero-compare", action="store_true",
                    help="search with ZeRO [0, 1] and [0, 1, 2, 3] (no baseline)")
    args = ap.parse_args(argv)
    spec = load_plan(args.config)
    if args.zero_compare:
        return _zero_compare(spec, args.time_limit, args.jobs)
    t0 = time.perf_counter()
    searched = plan(spec, time_limit=args.time_limit, jobs=args.jobs)
    t_plan = time.perf_counter() - t0
    _line("plan (search)", searched)
    best = searched.best
    if best is None:
        print("no configuration scheduled")
        return 1
    shape = spec.shape()
    flops = narayanan_flops(shape.layers, shape.hidden, shape.seq_len, shape.vocab,
                            spec.global_batch_size)
    per_gpu = flops / (best.step_time_s * best.candidate.gpus) / 1e12
    print(f"  predicted {per_gpu:.1f} TFLOP/s per GPU as Narayanan et al. count it "
          f"(96Bslh^2(1 + s/6h + V/16lh)), paper {PAPER_TFLOPS_PER_GPU:.0f}: ratio "
          f"{per_gpu / PAPER_TFLOPS_PER_GPU:.3f}; model-FLOPs MFU {best.mfu:.1%} "
          f"({best.tflops_per_gpu:.1f} TFLOP/s per GPU)")
    print(f"  TP within a node: {best.candidate.tp <= spec.cluster_cfg.gpus_per_node}; "
          f"PP >= 8: {best.candidate.pp >= 8}; under 10 minutes: {t_plan < 600}")
    if not args.no_baseline:
        base = plan(spec, time_limit=args.time_limit, jobs=args.jobs, baseline=True)
        _line("baseline (Megatron defaults: 1F1B / interleaved, even partition)", base)
        if base.best is not None:
            print(f"  best step time: baseline / plan = "
                  f"{base.best.step_time_s / best.step_time_s:.4f}")
    return 0


def _zero_compare(spec: PlanSpec, time_limit: float | None, jobs: int | None) -> int:
    """The best with ZeRO [0, 1] against the best with ZeRO [0, 1, 2, 3], same run."""
    bests = []
    for stages in ([0, 1], [0, 1, 2, 3]):
        variant = replace(spec, plan=spec.plan.model_copy(update={"zero": stages}))
        result = plan(variant, time_limit=time_limit, jobs=jobs)
        _line(f"plan, ZeRO {stages}", result)
        by_zero = {z: sum(r.status == "scheduled" and r.candidate.zero == z
                          for r in result.results) for z in stages}
        print(f"  scheduled per ZeRO stage: {by_zero}")
        bests.append(result.best)
    if bests[0] is not None and bests[1] is not None:
        print(f"  best step time: ZeRO [0, 1] / ZeRO [0..3] = "
              f"{bests[0].step_time_s / bests[1].step_time_s:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
