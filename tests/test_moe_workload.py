"""The MoE pipeline as a task graph (pipeopt.workloads.moe) and its schedules
(pipeopt.solvers.moe): structure, memory, an optimum by hand, hand-made orders."""

from __future__ import annotations

import dataclasses

import pytest

from pipeopt.core.bounds import lower_bound
from pipeopt.core.cpsat import solve_cpsat
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import check_orders, simulate
from pipeopt.core.validate import check
from pipeopt.schedules import GENERATORS
from pipeopt.solvers import moe as sm
from pipeopt.workloads import moe as wl


def one_stage(split: bool = False) -> wl.MoEPipeline:
    """One device, two micro-batches, one MoE block: attention F = B = 1 s, experts F = B = 1 s
    (no weight gradient), every all-to-all 1 s; 3 bytes of attention activations, 5 of
    experts."""
    blk = wl.MoEBlock(wl.Work(1.0, 1.0, 0.0, 3.0, 1.0 if split else 0.0),
                      wl.Work(1.0, 1.0, 0.0, 5.0, 2.0 if split else 0.0), 1.0, 1.0)
    return wl.MoEPipeline(stages=((blk,),), microbatches=2, split_backward=split)


def test_graph_of_one_microbatch() -> None:
    pipe = dataclasses.replace(one_stage(split=True), microbatches=1)
    g = wl.build(pipe)
    assert list(g.label) == ["0F0.attn0", "0F0.dispatch0", "0F0.experts0", "0F0.combine0",
                             "0F0.out", "0B0.out", "0B0.combine0", "0B0.experts0",
                             "0B0.dispatch0", "0B0.attn0", "0W0.all"]
    assert g.networks == ("a2a 0",) and g.num_links == 0
    assert g.comm_tasks == (1, 3, 6, 8)
    assert all(g.holds[i] == (0,) for i in g.comm_tasks)
    chain = list(zip(g.src, g.dst, strict=True))
    assert chain == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9),
                     (9, 10)]
    # memory: F allocates, B frees all but the weight-gradient part, W the rest
    assert g.mem_start[0] == 3.0 and g.mem_start[2] == 5.0
    assert g.mem_end[9] == -2.0 and g.mem_end[7] == -3.0 and g.mem_end[10] == -3.0
    assert sum(g.mem_start) + sum(g.mem_end) == 0.0
    assert dict(g.meta)["task_group"][1] == "all-to-all"


def test_overlap_optimum_by_hand() -> None:
    """One device, two micro-batches (fused backward), everything 1 s. Back to back (1F1B:
    F0 B0 F1 B1) each micro-batch is a chain of 4 compute + 4 all-to-all seconds: 16 s. The
    a2a resource carries 8 s of all-to-all, none before the first attention ends (1 s) and the
    last attention backward follows the last one (1 s): >= 10 s. By hand 10 s is reached:
    A0 0-1, A1 1-2, E0 2-3, E1 3-4, gradient experts 6-7, 7-8, attention 8-9, 9-10, with the
    resource busy 1-9 (D0 D1 C0 C1 dC0 dC1 dD0 dD1)."""
    pipe = one_stage()
    g = wl.build(pipe)
    assert lower_bound(g) == pytest.approx(10.0)
    orders = GENERATORS["1f1b"](pipe.problem())
    serial = simulate(g, wl.task_orders(pipe, orders))
    assert serial.objective == pytest.approx(16.0) and check(serial) == []
    best = solve_cpsat(g, time_limit=20, workers=1)
    assert best.objective == pytest.approx(10.0) and best.status == "optimal"
    assert check(best) == []
    found = sm.search(pipe, time_limit=20, workers=1)
    assert found.objective == pytest.approx(10.0) and found.status == "optimal"


def test_a_device_waits_for_its_own_all_to_all_without_overlap() -> None:
    pipe = one_stage()
    g = wl.build(pipe)
    s = sm.hand_made(pipe, "1f1b")
    lab = {x: i for i, x in enumerate(g.label)}
    # experts start when the dispatch ends: the device idles during it
    assert s.start[lab["0F0.experts0"]] == s.end[lab["0F0.dispatch0"]] == 2.0
    assert s.start[lab["0F1.attn0"]] == 8.0
    over = sm.hand_made(pipe, "1f1b", overlap=True)
    assert check(over) == [] and over.objective < s.objective
    # window 2 (ops F0 B0 F1 B1): F1 may start once F0 ended (4 s), during B0's all-to-all
    assert over.start[lab["0F1.attn0"]] == 4.0


def test_the_validator_rejects_two_all_to_all_at_once() -> None:
    pipe = one_stage()
    g = wl.build(pipe)
    s = sm.hand_made(pipe, "1f1b", overlap=True)
    lab = {x: i for i, x in enumerate(g.label)}
    d0, d1 = lab["0F0.dispatch0"], lab["0F1.dispatch0"]
    start, end = list(s.start), list(s.end)
    start[d1], end[d1] = start[d0], end[d0]  # both dispatches on a2a 0 at once
    bad = GraphSchedule(g, tuple(start), tuple(end), s.messages)
    assert any("a2a 0" in x for x in check(bad))


def pipeline(p: int = 3, m: int = 4, split: bool = True, shared: bool = False,
             blocks: int = 1) -> wl.MoEPipeline:
    sh = wl.Work(0.5, 0.5, 0.5, 1.0, 0.5) if shared else None
    blk = wl.MoEBlock(wl.Work(1.0, 1.0, 1.0, 4.0, 2.0), wl.Work(2.0, 2.0, 2.0, 6.0, 3.0),
                      0.75, 0.5, sh)
    return wl.MoEPipeline(stages=((blk,) * blocks,) * p, microbatches=m, split_backward=split,
                          message_bytes=1e6, latency=1e-3, bandwidth=1e9,
                          post=(wl.Work(0.0),) * (p - 1) + (wl.Work(0.25, 0.25, 0.25),))


@pytest.mark.parametrize(("shared", "blocks"), [(False, 1), (True, 2)])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_hand_made_orders_cover_every_device_task(name: str, shared: bool, blocks: int) -> None:
    pipe = pipeline(split=name != "1f1b" or shared, shared=shared, blocks=blocks)
    g = wl.build(pipe)
    orders = wl.task_orders(pipe, GENERATORS[name](pipe.problem()))
    check_orders(g, orders)
    serial = simulate(g, orders)
    assert check(serial) == []
    over = sm.hand_made(pipe, name, overlap=True, graph=g)
    assert check(over) == []
    # every micro-batch's message crosses a link: one per stage boundary and direction
    assert sum(1 for b in g.bytes if b) == 2 * (pipe.devices - 1) * pipe.microbatches
    assert sum(g.mem_start) + sum(g.mem_end) == pytest.approx(0.0)


def test_windowed_graph_keeps_a_device_within_the_window() -> None:
    pipe = pipeline()
    g = wl.build(pipe)
    ops = GENERATORS["zb-h1"](pipe.problem())
    gw, prio = wl.windowed(g, pipe, ops, 1)
    # window 1: op k + 1 waits for op k, so the list schedule is the serial order
    assert simulate(g, wl.task_orders(pipe, ops)).objective == pytest.approx(
        sm.hand_made(pipe, "zb-h1", overlap=True, window=1).objective)
    assert gw.num_edges > g.num_edges and len(prio) == g.num_tasks
    with pytest.raises(ValueError, match="window: must be an integer >= 1"):
        wl.windowed(g, pipe, ops, 0)


def test_search_beats_or_matches_every_hand_made_schedule_in_memory() -> None:
    pipe = pipeline(p=3, m=4)
    peaks, times = [], []
    for name in ("1f1b", "zb-h1"):
        s = sm.hand_made(dataclasses.replace(pipe, split_backward=name != "1f1b"), name)
        peaks.append(max(s.peak_memory))
        times.append(s.objective)
    limited = dataclasses.replace(pipe, memory_limit=(max(peaks),) * 3)
    found = sm.search(limited, time_limit=10, workers=1)
    assert check(found) == []
    assert max(found.peak_memory) <= max(peaks) + 1e-9
    assert found.objective <= min(times) + 1e-9
    assert found.lower_bound is not None and found.lower_bound <= found.objective + 1e-9


def test_pipeline_errors_name_the_field() -> None:
    blk = wl.MoEBlock(wl.Work(1.0), wl.Work(1.0), -1.0, 1.0)
    with pytest.raises(ValueError, match=r"stages\[0\]\[0\]\.dispatch: must be a finite"):
        wl.MoEPipeline(stages=((blk,),), microbatches=1)
    blk = wl.MoEBlock(wl.Work(1.0, 1.0, 1.0, 1.0, 2.0), wl.Work(1.0), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"attention\.weight_grad_bytes: must be <="):
        wl.MoEPipeline(stages=((blk,),), microbatches=1)
    with pytest.raises(ValueError, match="microbatches: must be an integer >= 1"):
        wl.MoEPipeline(stages=((),), microbatches=0)
    with pytest.raises(ValueError, match="memory_limit / static_memory: expected 1"):
        wl.MoEPipeline(stages=((),), microbatches=1, memory_limit=(1.0, 2.0))
    with pytest.raises(ValueError, match="schedule: unknown hand-made schedule"):
        sm.hand_made(pipeline(), "nope")


def test_brute_force_over_every_device_order_meets_the_optimum() -> None:
    """The one-device instance above: every interleaving of the two micro-batches' 6 device
    tasks (C(12, 6) = 924 orders), each timed by the core simulator (the all-to-all as early
    as allowed): the best is the 10 s that CP-SAT proves optimal, the worst the 16 s of
    running them one after the other."""
    from itertools import combinations

    pipe = one_stage()
    g = wl.build(pipe)
    chains = [[i for i in range(g.num_tasks) if g.device[i] == 0 and f"F{j}." in g.label[i]]
              + [i for i in range(g.num_tasks) if g.device[i] == 0 and f"B{j}." in g.label[i]]
              for j in range(2)]
    assert [len(c) for c in chains] == [6, 6]
    times = []
    for first in combinations(range(12), 6):
        a, b = iter(chains[0]), iter(chains[1])
        order = [next(a) if q in first else next(b) for q in range(12)]
        times.append(simulate(g, [order], check=False).objective)
    assert min(times) == pytest.approx(10.0) and max(times) == pytest.approx(16.0)


def test_deepseek_like_pipeline_with_a_dense_stage_and_shared_experts() -> None:
    """4 DeepSeek-V3-like blocks on 4 stages, the first dense (stage 0 has only its O task),
    one shared expert per MoE block (beside the dispatch): every schedule is valid and the
    search is no slower than any hand-made one."""
    from pipeopt.costs import moe as cm
    from pipeopt.costs.transformer import TransformerShape

    sh = TransformerShape(layers=4, hidden=7168, heads=128, ffn_hidden=18432, seq_len=4096,
                          vocab=129280, activation="swiglu", norm="rmsnorm", bias=False,
                          position_embedding="rotary", dropout=False, causal=True)
    spec = cm.MoESpec(experts=256, top_k=8, expert_ffn=2048, expert_parallel=64,
                      shared_experts=1, first_dense=1, dispatch_dtype="fp8")
    cl = cm.Cluster(flop_rate=4.9e14, ep_latency=5e-6, ep_bandwidth=4e10)
    pipe = cm.pipeline_of(sh, spec, 4, 4, cl)
    assert [len(st) for st in pipe.stages] == [0, 1, 1, 1]
    assert pipe.post[0].forward > 0 and pipe.stages[1][0].shared is not None
    g = wl.build(pipe)
    assert sum(1 for x in g.label if ".shared" in x) == 3 * 4 * 2  # F and B per MoE stage
    times = []
    for name in ("1f1b", "zb-h1"):
        variant = dataclasses.replace(pipe, split_backward=name != "1f1b")
        for overlap in (False, True):
            s = sm.hand_made(variant, name, overlap=overlap)
            assert check(s) == []
            times.append(s.objective)
    found = sm.search(pipe, time_limit=3, workers=1)
    assert check(found) == [] and found.objective <= min(times) + 1e-12


def test_search_is_reproducible_by_its_seed() -> None:
    """Above CPSAT_MAX_TASKS (CP-SAT's answer under a time limit depends on the machine) and
    with time for every perturbation, the same seed gives the same schedule."""
    pipe = pipeline(p=4, m=24)
    assert wl.build(pipe).num_tasks > sm.CPSAT_MAX_TASKS
    a = sm.search(pipe, time_limit=600, seed=7)
    b = sm.search(pipe, time_limit=600, seed=7)
    assert a.start == b.start and a.method == b.method
    assert check(a) == []
