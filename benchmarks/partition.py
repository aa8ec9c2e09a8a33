"""Partition search benchmark: search time at 128 layers x 32 stages, and the joint search
against the uniform (Megatron-style) partition on a model with a heavy LM head.

    python benchmarks/partition.py

Prints figures measured in this run; asserts nothing about wall time (CI never gates on it).
"""

from __future__ import annotations

import time

import numpy as np

from pipeopt.config import parse_config
from pipeopt.costs.build import make_plan
from pipeopt.partition import chain_costs, evaluate, inflight_microbatches, uniform_partition
from pipeopt.partition.dp import min_max_partition, pipeline_partition
from pipeopt.partition.ilp import ilp_partition, per_device_partition
from pipeopt.partition.joint import default_method, joint_search


def _timed(fn, *args, repeats: int = 3, **kw):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        best = min(best, time.perf_counter() - t0)
    return best, out


def search_time() -> None:
    rng = np.random.default_rng(0)
    n, s, m = 128, 32, 64
    comp = rng.uniform(1e-3, 2e-3, n)
    comp[0], comp[-1] = 8e-3, 12e-3  # heavy embedding and head
    costs = chain_costs(comp, stages=s, microbatches=m, comm=rng.uniform(0, 5e-5, (s - 1, n)),
                        static=rng.uniform(1e9, 2e9, n), activation=rng.uniform(1e8, 2e8, n),
                        inflight=inflight_microbatches(s, 1, m), device_limit=80e9)
    t_mm, mm = _timed(min_max_partition, costs)
    t_pl, pl = _timed(pipeline_partition, costs)
    small = chain_costs(comp[:64], stages=16, microbatches=m, static=costs.static[:64],
                        activation=costs.activation[:64], inflight=inflight_microbatches(16, 1, m),
                        device_limit=80e9)
    t_ilp, ilp = _timed(ilp_partition, small, "minmax", repeats=1)
    small_dp = min_max_partition(small)
    uni = evaluate(costs, uniform_partition(n, s))
    print(f"128 layers x 32 stages: DP min-max {t_mm * 1e3:.1f} ms, DP pipeline objective "
          f"{t_pl * 1e3:.1f} ms (exact: {pl.exact}), ILP min-max at 64 x 16 {t_ilp:.2f} s")
    print(f"  64 x 16 max stage time: DP {small_dp.evaluation.max_time * 1e3:.3f} ms, ILP "
          f"{ilp.evaluation.max_time * 1e3:.3f} ms")
    print(f"  128 x 32 max stage time: DP {mm.evaluation.max_time * 1e3:.3f} ms, "
          f"uniform {uni.max_time * 1e3:.3f} ms "
          f"(uniform / DP = {uni.max_time / mm.evaluation.max_time:.3f})")
    print(f"  under one second: {'yes' if max(t_mm, t_pl) < 1.0 else 'NO'}")
    # 16 devices x 2 virtual stages: memory limits are per device (two stages share one).
    sd = [k % 16 for k in range(s)]
    virt = chain_costs(comp, stages=s, microbatches=m, comm=costs.comm, static=costs.static,
                       activation=costs.activation, inflight=inflight_microbatches(16, 2, m),
                       stage_device=sd, device_limit=160e9)
    t_dp, dp = _timed(pipeline_partition, virt, repeats=1)
    t_pd, (pd, how) = _timed(per_device_partition, virt, repeats=1)
    print(f"128 layers x 16 devices x 2 virtual stages (each device's summed stages, per-device "
          f"memory): DP alone {t_dp:.2f} s, objective {evaluate(virt, dp.partition).objective:.4f}"
          f" s; search {t_pd:.1f} s ({how}, exact: {pd.exact}), objective "
          f"{pd.evaluation.objective:.4f} s")


HEAVY_HEAD = {
    "pipeline": {"devices": 8, "microbatches": 16},
    # A 2k-wide model with a 256k vocabulary: the LM head costs about nine blocks.
    "model": {"layers": 30, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 256000,
              "micro_batch_size": 1, "activation": "swiglu", "ffn_hidden": 5632,
              "norm": "rmsnorm", "bias": False, "position_embedding": "rotary",
              "dropout": False, "recompute": "selective"},
    "cluster": {"gpu": "H100-SXM", "gpus_per_node": 8},
}


def joint_vs_uniform() -> None:
    cfg = parse_config({**HEAVY_HEAD, "training": {"partition": "uniform"}})
    plan = cfg.extra("plan") or make_plan(cfg)
    costs = plan.chain_costs()
    uniform = plan.uniform()
    for method in dict.fromkeys([default_method(), "1f1b"]):
        t0 = time.perf_counter()
        res = joint_search(costs, plan.problem, top_k=4, method=method, extra=[uniform])
        wall = time.perf_counter() - t0
        base = next(r for r in res.rows if r.partition == uniform)
        best = res.schedule.iteration_time
        print(f"heavy head, scheduler {method}: uniform {[b - a for a, b in uniform]} -> "
              f"{base.value:.4f} s; joint {[b - a for a, b in res.partition]} -> {best:.4f} s; "
              f"joint / uniform = {best / base.value:.3f} ({len(res.rows)} candidates, "
              f"{wall:.2f} s)")


if __name__ == "__main__":
    search_time()
    joint_vs_uniform()
