"""Hypothesis strategies for problems and valid device orders (shared by property tests)."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import strategies as st

from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.solvers import run_classic


@st.composite
def problems(draw, max_devices: int = 4, max_microbatches: int = 6, contention: bool = False):
    p = draw(st.integers(1, max_devices))
    m = draw(st.integers(1, max_microbatches))
    v = draw(st.integers(1, 2))
    placement = draw(st.sampled_from(["loop", "vshape"]))
    split = draw(st.booleans())
    s = p * v
    times = st.floats(0.1, 5.0, allow_nan=False)

    def per_stage():
        return tuple(draw(st.lists(times, min_size=s, max_size=s)))

    act = tuple(draw(st.lists(st.floats(0.0, 3.0), min_size=s, max_size=s)))
    frac = draw(st.floats(0.0, 1.0))
    lat = draw(st.lists(st.floats(0.0, 2.0), min_size=max(p - 1, 0), max_size=max(p - 1, 0)))
    if contention:
        bw = draw(st.lists(st.floats(0.5, 4.0), min_size=max(p - 1, 0),
                           max_size=max(p - 1, 0)))
        msg = tuple(draw(st.lists(st.floats(0.0, 2.0), min_size=s - 1, max_size=s - 1)))
    else:
        bw = [float("inf")] * (p - 1)
        msg = ()
    lat_m, bw_m = chain_links(p, lat, bw)
    return Problem(devices=p, microbatches=m, virtual_stages=v, placement=placement,
                   split_backward=split, forward=per_stage(), backward_input=per_stage(),
                   backward_weight=per_stage(), activation_memory=act,
                   weight_grad_memory=tuple(a * frac for a in act),
                   latency=lat_m, bandwidth=bw_m, message_size=msg)


def inputs(problem: Problem, op: Op) -> list[Op]:
    """Data inputs of an op (written here independently of the simulator)."""
    k, j = op.stage, op.microbatch
    if op.kind == "F":
        return [Op("F", k - 1, j)] if k > 0 else []
    if op.kind == "B":
        return [Op("F", k, j)] + ([Op("B", k + 1, j)] if k + 1 < problem.stages else [])
    return [Op("B", k, j)]


def random_orders(problem: Problem, seed: int) -> list[list[Op]]:
    """Device orders from a random topological order of the data dependencies (so they can
    never deadlock)."""
    rng = random.Random(seed)
    remaining = set(problem.ops())
    done: set[Op] = set()
    orders: list[list[Op]] = [[] for _ in range(problem.devices)]
    while remaining:
        ready = sorted(op for op in remaining if all(x in done for x in inputs(problem, op)))
        op = rng.choice(ready)
        remaining.remove(op)
        done.add(op)
        orders[problem.stage_device[op.stage]].append(op)
    return orders


def _contended_schedule() -> Schedule:
    """ZB-H1 on 4 devices whose links serialize messages, with a memory limit."""
    p = 4
    lat, bw = chain_links(p, [0.1] * (p - 1), [1.0] * (p - 1))
    prob = uniform_problem(p, 6, memory_limit=4.0).replace(
        latency=lat, bandwidth=bw, message_size=(0.5,) * 3)
    return run_classic(prob, "zb-h1")


# Small schedules of every shape the views must draw (fused / split backward, chunks, links).
SAMPLE_SCHEDULES: dict[str, Callable[[], Schedule]] = {
    "1f1b": lambda: run_classic(uniform_problem(4, 8), "1f1b"),
    "gpipe-fused": lambda: run_classic(uniform_problem(3, 5, split_backward=False), "gpipe"),
    "zb-h2": lambda: run_classic(uniform_problem(4, 8, f=1.0, b=1.5, w=0.5), "zb-h2"),
    "zb-v": lambda: run_classic(uniform_problem(4, 8, virtual_stages=2, placement="vshape"),
                                "zb-v"),
    "interleaved": lambda: run_classic(uniform_problem(2, 4, virtual_stages=2),
                                       "interleaved-1f1b"),
    "contended": _contended_schedule,
    "latency": lambda: run_classic(uniform_problem(4, 8, latency=0.3), "zb-h1"),
    "single-device": lambda: run_classic(uniform_problem(1, 3), "1f1b"),
}
