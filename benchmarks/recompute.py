"""Recomputation per stage (AdaPipe-style, issue 16 item 2) against the best uniform recompute.

    python benchmarks/recompute.py [--time-limit 5]

For GPT-3 175B and Llama-2 70B settings whose memory is tight, every uniform
``model.recompute`` (none, selective, full) and ``per_stage`` are built with the exact DP
partition search, then each problem is scheduled by the same method (greedy, the time limit
per problem); it prints per mode whether the 1F1B in-flight counts fit (``lean``: only with
one micro-batch in flight per stage), the analytic pipeline objective, the iteration time,
the peak memory, the partition search's wall time and the whole build's (with per stage it
includes scheduling both backward worlds when they compete), and per setting the ratio best
uniform / per stage (> 1: per stage is faster). All figures are measured in this run;
nothing is asserted about wall time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import pipeopt
from pipeopt.config import ConfigError, parse_config

MODES = ("none", "selective", "full", "per_stage")

#: (label, config without model.recompute). GPT-3 175B on 8-GPU A100-80GB nodes as in
#: Narayanan et al. (SC'21): tensor parallel 8 within a node, sequences of 2048 tokens;
#: Llama-2 70B on H100s with long sequences, where selective recomputation alone is tight.
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("gpt3-175b t8 p8 m32 s2048 b1 A100-80GB", {
        "pipeline": {"devices": 8, "microbatches": 32},
        "model": {"preset": "gpt3-175b", "tensor_parallel": 8},
        "cluster": {"gpu": "A100-80GB", "gpus_per_node": 8, "nodes_per_datacenter": 8}}),
    ("gpt3-175b t8 p8 m32 s2048 b4 A100-80GB", {
        "pipeline": {"devices": 8, "microbatches": 32},
        "model": {"preset": "gpt3-175b", "tensor_parallel": 8, "micro_batch_size": 4},
        "cluster": {"gpu": "A100-80GB", "gpus_per_node": 8, "nodes_per_datacenter": 8}}),
    ("llama2-70b t4 p8 m32 s16384 H100", {
        "pipeline": {"devices": 8, "microbatches": 32},
        "model": {"preset": "llama2-70b", "tensor_parallel": 4, "seq_len": 16384},
        "cluster": {"gpu": "H100-SXM", "gpus_per_node": 8, "nodes_per_datacenter": 4}}),
    ("llama2-70b t8 p8 m32 s32768 H100", {
        "pipeline": {"devices": 8, "microbatches": 32},
        "model": {"preset": "llama2-70b", "tensor_parallel": 8, "seq_len": 32768},
        "cluster": {"gpu": "H100-SXM", "gpus_per_node": 8, "nodes_per_datacenter": 8}}),
    ("llama2-70b t8 p4 m16 s32768 H100", {
        "pipeline": {"devices": 4, "microbatches": 16},
        "model": {"preset": "llama2-70b", "tensor_parallel": 8, "seq_len": 32768},
        "cluster": {"gpu": "H100-SXM", "gpus_per_node": 8, "nodes_per_datacenter": 4}}),
]


def run_mode(doc: dict[str, Any], mode: str, time_limit: float) -> dict[str, Any]:
    """Build and schedule ``doc`` with ``model.recompute: mode``."""
    doc = {**doc, "model": {**doc["model"], "recompute": mode},
           "solver": {"method": "greedy", "time_limit": time_limit}}
    t0 = time.perf_counter()
    try:
        config = parse_config(doc)
    except ConfigError as exc:
        return {"error": str(exc)[:70]}
    built = time.perf_counter() - t0
    meta = dict(config.problem.meta)
    rep = meta["partition_search"]
    sched = pipeopt.solve(config.problem, "greedy", time_limit=time_limit)
    return {"lean": "inflight_fallback" in rep, "analytic": rep["analytic_objective_s"],
            "iteration": sched.iteration_time, "peak": max(sched.peak_memory),
            "limit": min(config.problem.memory_limit), "build": built,
            "search": rep["wall_time_s"],
            "split": config.problem.split_backward,
            "modes": [r["recompute"] for r in meta["stage_costs"]]}


def short(modes: list[str]) -> str:
    """Modes per stage as letters: n(one), s(elective), f(ull)."""
    return "".join(m[0] for m in modes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=5.0, help="greedy seconds per problem")
    args = ap.parse_args()
    for label, doc in SETTINGS:
        print(f"{label}")
        rows = {mode: run_mode(doc, mode, args.time_limit) for mode in MODES}
        for mode, r in rows.items():
            if "error" in r:
                print(f"  {mode:<10} does not fit: {r['error']}...")
                continue
            print(f"  {mode:<10} {'lean' if r['lean'] else 'fits':<4} "
                  f"{'split' if r['split'] else 'fused':<5} modes {short(r['modes']):<9} "
                  f"analytic {r['analytic']:8.3f} s  iteration {r['iteration']:8.3f} s  "
                  f"peak {r['peak'] / 2**30:5.1f} / {r['limit'] / 2**30:5.1f} GiB  "
                  f"(search {r['search']:.2f} s, build {r['build']:.1f} s)")
        per = rows["per_stage"]
        uniform = {m: r for m, r in rows.items() if m != "per_stage" and "error" not in r}
        if "error" in per or not uniform:
            continue
        best = min(uniform, key=lambda m: uniform[m]["iteration"])
        fits = {m: r for m, r in uniform.items() if not r["lean"]}
        ratio = uniform[best]["iteration"] / per["iteration"]
        line = f"  best uniform {best}: iteration {ratio:.3f}x per stage's"
        if fits:
            fit_best = min(fits, key=lambda m: fits[m]["analytic"])
            line += (f"; best uniform that fits the 1F1B counts ({fit_best}): analytic "
                     f"{fits[fit_best]['analytic'] / per['analytic']:.3f}x, iteration "
                     f"{fits[fit_best]['iteration'] / per['iteration']:.3f}x")
        print(line)


if __name__ == "__main__":
    main()
