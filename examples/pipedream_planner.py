"""PipeDream's planner on a VGG-16-like profile, 2 nodes x 4 GPUs, then its steady state.

Run: python examples/pipedream_planner.py

The profile: 13 convolutions whose work is large and weights small, then 3 fully connected
layers holding most of the weights with little work (VGG-16 has 138 M parameters, 124 M of them
in its three FC layers; Simonyan and Zisserman, ICLR'15). Per-layer times are illustrative
(milliseconds per micro-batch, backward input and weight parts each as long as the forward);
weights in fp32 (4 bytes per parameter). The planner replicates the convolutions and keeps the
classifier on one GPU, the structure of PipeDream's VGG-16 configurations (SOSP'19, Table 2:
"15-1" on 16 GPUs); pure data parallelism would all-reduce the classifier's weights over the
slow link between the nodes. The plan's stages then run PipeDream's 1F1B-async with weight
stashing, and the periodic search (more micro-batches in flight where the round trip through
the later stages needs them), both with the replicas' gradient all-reduce as a load on their
network (``plan_sync_s``: here 0.69 ms every 4 micro-batches on the first stage, 3.5 ms every
3 on the second, well under the period).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeopt.partition.pipedream import Layer, Level, plan, plan_problem, plan_sync_s
from pipeopt.solvers import solve_async

CONV_MS = [1.7, 3.7, 1.8, 3.7, 1.8, 3.7, 3.7, 1.8, 3.7, 3.7, 0.9, 0.9, 0.9]
CONV_PARAMS = [1.7e3, 3.7e4, 7.4e4, 1.5e5, 3e5, 5.9e5, 5.9e5, 1.2e6, 2.4e6, 2.4e6, 2.4e6,
               2.4e6, 2.4e6]
FC = [(0.3, 1.03e8), (0.05, 1.7e7), (0.01, 4.1e6)]  # (ms, parameters)
BYTES_PER_PARAM = 4.0  # fp32 weights
ACTIVATION_BYTES = 2.56e7  # the first block's output; halved after every third convolution


def vgg_like() -> list[Layer]:
    """The layer profile (module docstring)."""
    layers = [Layer(f"conv{i + 1}", t / 1e3, t / 1e3, t / 1e3,
                    ACTIVATION_BYTES / 2 ** (i // 3), BYTES_PER_PARAM * w,
                    ACTIVATION_BYTES / 2 ** (i // 3))
              for i, (t, w) in enumerate(zip(CONV_MS, CONV_PARAMS, strict=True))]
    layers += [Layer(f"fc{i + 6}", t / 1e3, t / 1e3, t / 1e3, 1.0e6, BYTES_PER_PARAM * w, 1.0e6)
               for i, (t, w) in enumerate(FC)]
    return layers


def main() -> None:
    layers = vgg_like()
    levels = [Level(4, 10e9), Level(2, 1.25e9)]  # 10 GB/s in a node, 10 Gb/s between nodes
    result = plan(layers, levels)
    print(f"plan {result.config()}: estimated period {result.period * 1e3:.2f} ms per "
          f"micro-batch on {result.devices} GPUs")
    for s in result.stages:
        print(f"  layers {layers[s.first].name}..{layers[s.last].name} on {s.replicas} GPU(s)")
    prob, replicas = plan_problem(layers, result)
    weights = [sum(x.weight_bytes for x in layers[s.first:s.last + 1]) for s in result.stages]
    for method in ("pipedream", "periodic"):
        steady = solve_async(prob, method, weights, replicas=replicas,
                             sync_s=plan_sync_s(layers, result))
        print(f"{method:>9}: period {steady.period * 1e3:.2f} ms (bound "
              f"{steady.lower_bound * 1e3:.2f} ms), in flight per GPU "
              f"{list(steady.replica_in_flight)}, weight versions "
              f"{list(steady.weight_versions)}, staleness {list(steady.staleness)}")


if __name__ == "__main__":
    main()
