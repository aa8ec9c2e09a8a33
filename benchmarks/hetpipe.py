"""PipeDream's planner on mixed GPU types (HetPipe): the type-aware plan against two baselines
measured in the same run, every plan judged by the same steady-state search.

Run: python benchmarks/hetpipe.py

Profiles (seconds per micro-batch on a V100, bytes in fp32):

* ``vgg``: the VGG-16-like profile of examples/pipedream_planner.py (16 layers);
* ``gpt``: a GPT-like chain: an embedding (50257 x 1024 parameters, little work), 24
  transformer blocks (12.6 M parameters and 4 ms of F + B + W each, activations 8 MB), and the
  output head (as large as the embedding, 2 ms).

Clusters (4 GPUs per node, 10 GB/s inside a node, 1.25 GB/s between nodes; speeds are the
ratio of dense FP16 tensor-core peaks to the V100's 125 TFLOP/s: A100 312, T4 65, from NVIDIA's
data sheets; memory 16 GB per V100 and T4, 40 GB per A100):

* ``1V+1A``: one V100 node and one A100 node; ``2V+2A``: two of each; ``2V+1A+1T``: two V100
  nodes, one A100 node, one T4 node.

Per case: the type-aware plan (``plan_cluster``) and two baselines, all turned into the chain
problem with each stage's speed and solved by the periodic search (``solve_periodic``, weight
stashing, replicas' all-reduce as its load), so one judge times them all:

* ``blind``: PipeDream's DP as if every GPU ran at the profile's speed (``plan`` over all the
  nodes), its top-level parts placed on the nodes in the cluster's order or the reverse (the
  better of the two kept); a stage spanning nodes of two types runs at the slower one's pace
  (round-robin replicas);
* ``fast only``: the plan on the fastest type's nodes alone (the slower GPUs left idle).

Beside them, ``idle ok``: the type-aware plan allowed to leave whole nodes idle
(``every_node=False``), whose estimate is never above theirs by construction.

Printed: each period (ms per micro-batch), the ratios baseline / type-aware (above 1: the
type-aware plan is faster), the planner's wall time (s; noisy on a shared machine).
"""

from __future__ import annotations

import math
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeopt.partition.pipedream import (
    DeviceType,
    Layer,
    Level,
    Plan,
    Stage,
    plan,
    plan_cluster,
    plan_problem,
    plan_sync_s,
)
from pipeopt.solvers.periodic import solve_periodic

NODE = Level(4, 10e9)  # 4 GPUs per node, 10 GB/s between two of them
BETWEEN_NODES = 1.25e9  # bytes/s, 10 Gb/s
V100 = DeviceType("v100", 1, (NODE,), 1.0, 16e9)
A100 = DeviceType("a100", 1, (NODE,), 312 / 125, 40e9)
T4 = DeviceType("t4", 1, (NODE,), 65 / 125, 16e9)
BYTES = 4.0  # fp32


def vgg() -> list[Layer]:
    path = Path(__file__).resolve().parent.parent / "examples" / "pipedream_planner.py"
    return runpy.run_path(str(path))["vgg_like"]()


def gpt() -> list[Layer]:
    """GPT-like (module docstring): 1024 hidden, 24 blocks of 12 h^2 parameters."""
    emb = 50257 * 1024 * BYTES
    block = 12 * 1024 ** 2 * BYTES
    act = 8e6
    out = [Layer("embed", 1e-4, 1e-4, 1e-4, act, emb, act)]
    out += [Layer(f"block{i}", 1e-3, 1.5e-3, 1.5e-3, act, block, act) for i in range(24)]
    out.append(Layer("head", 5e-4, 7.5e-4, 7.5e-4, 4.0, emb, act))
    return out


def judge(layers: list[Layer], result: Plan) -> float:
    """The periodic search's period (s per micro-batch) of a plan's stages."""
    prob, reps = plan_problem(layers, result, microbatches=16, static_bytes=0.0)
    weights = [math.fsum(x.weight_bytes for x in layers[s.first:s.last + 1])
               for s in result.stages]
    return solve_periodic(prob, weights, replicas=reps,
                          sync_s=plan_sync_s(layers, result)).period


def blind(layers: list[Layer], types: list[DeviceType]) -> Plan:
    """PipeDream's homogeneous plan over all nodes, placed on the nodes in the better of the
    cluster's order and its reverse; a stage on mixed nodes gets the slower type."""
    nodes = [t for t, ty in enumerate(types) for _ in range(ty.units)]
    homogeneous = plan(layers, [NODE, Level(len(nodes), BETWEEN_NODES)])
    best: tuple[float, Plan] | None = None
    for order in (nodes, nodes[::-1]):
        stages: list[Stage] = []
        part: list[Stage] = []
        used = 0
        for s in homogeneous.stages:
            part.append(s)
            if s.split_level == 2 or s is homogeneous.stages[-1]:  # a top-level part ends
                units = sum(x.replicas for x in part) // NODE.units
                slow = min(order[used:used + units], key=lambda t: types[t].speed)
                stages += [Stage(x.first, x.last, x.replicas, x.split_level, x.sync_bandwidth,
                                 slow, x.link_bandwidth) for x in part]
                used += units
                part = []
        placed = Plan(tuple(stages), homogeneous.period, tuple(types))
        period = judge(layers, placed)
        if best is None or period < best[0]:
            best = (period, placed)
    assert best is not None
    return best[1]


def main() -> None:
    clusters = {"1V+1A": [V100, A100],
                "2V+2A": [DeviceType("v100", 2, (NODE,), V100.speed, V100.memory),
                          DeviceType("a100", 2, (NODE,), A100.speed, A100.memory)],
                "2V+1A+1T": [DeviceType("v100", 2, (NODE,), V100.speed, V100.memory), A100, T4]}
    print(f"{'profile':8} {'cluster':9} {'plan':>14} {'aware':>8} {'blind':>8} "
          f"{'fast only':>9} {'blind/aware':>11} {'fast/aware':>10} {'plan s':>7} "
          f"{'idle ok':>8} {'its plan':>14}")
    for pname, layers in (("vgg", vgg()), ("gpt", gpt())):
        for cname, types in clusters.items():
            t0 = time.perf_counter()
            aware = plan_cluster(layers, types, BETWEEN_NODES)
            wall = time.perf_counter() - t0
            fastest = max(types, key=lambda ty: ty.speed)
            fast = plan_cluster(layers, [fastest], BETWEEN_NODES)
            idle = plan_cluster(layers, types, BETWEEN_NODES, every_node=False)
            a, b, f = judge(layers, aware), judge(layers, blind(layers, types)), judge(layers,
                                                                                      fast)
            i = judge(layers, idle)
            print(f"{pname:8} {cname:9} {aware.config():>14} {a * 1e3:8.3f} {b * 1e3:8.3f} "
                  f"{f * 1e3:9.3f} {b / a:11.2f} {f / a:10.2f} {wall:7.2f} {i * 1e3:8.3f} "
                  f"{idle.config():>14}")


if __name__ == "__main__":
    main()
