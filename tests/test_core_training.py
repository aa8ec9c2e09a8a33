"""The core on today's chain: training.build(problem) timed by the core simulator gives exactly
what the chain simulator gives, for every hand-made schedule, and the core validator agrees."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import DeadlockError, simulate
from pipeopt.core.validate import check
from pipeopt.problem import Op, Problem, chain_links, uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.schedules import NotApplicable
from pipeopt.simulate import DeadlockError as ChainDeadlock
from pipeopt.simulate import _time as chain_time
from pipeopt.simulate import simulate as chain_simulate
from pipeopt.solvers import classic_methods, run_classic
from pipeopt.workloads import training
from tests.strategies import problems, random_orders

TOL = 1e-9


def _hetero() -> Problem:
    lat, bw = chain_links(4, [0.1, 0.3, 0.2], [math.inf] * 3)
    return Problem(devices=4, microbatches=6, forward=(1.0, 1.5, 0.7, 1.2),
                   backward_input=(1.1, 2.0, 0.9, 1.3), backward_weight=(0.6, 0.4, 1.0, 0.5),
                   activation_memory=(3.0, 2.0, 2.5, 1.0), weight_grad_memory=(1.0, 0.5, 2.5, 0.0),
                   static_memory=(1.0, 2.0, 0.0, 0.5), latency=lat, bandwidth=bw)


def _serialized(m: int = 6, v: int = 1, placement: str = "loop",
                memory_limit: float | None = None) -> Problem:
    """4 devices whose links carry one 0.5-byte message at a time at 1 byte/s."""
    lat, bw = chain_links(4, [0.1] * 3, [1.0] * 3)
    prob = uniform_problem(4, m, virtual_stages=v, placement=placement,  # type: ignore[arg-type]
                           memory_limit=memory_limit)
    return prob.replace(latency=lat, bandwidth=bw, message_size=(0.5,) * (4 * v - 1))


PROBLEMS: dict[str, Problem] = {
    "uniform": uniform_problem(4, 8),
    "fused": uniform_problem(4, 8, split_backward=False),
    "hetero": _hetero(),
    "loop-v2": uniform_problem(4, 8, virtual_stages=2),
    "vshape-v2": uniform_problem(4, 8, virtual_stages=2, placement="vshape"),
    "latency": uniform_problem(4, 8, f=1.0, b=1.5, w=0.5, latency=0.3),
    "serialized": _serialized(memory_limit=4.0),
    "serialized-vshape": _serialized(8, 2, "vshape"),
    "serialized-fused-hetero": replace(
        _hetero(), split_backward=False, message_size=(2.0, 1.0, 3.0),
        bandwidth=chain_links(4, [0.0] * 3, [2.0, 4.0, 1.0])[1]),
    "grad-reduce": uniform_problem(4, 8).replace(grad_reduce=(3.0, 0.5, 2.0, 9.0)),
    "grad-reduce-fused-v2": uniform_problem(2, 4, virtual_stages=2, split_backward=False).replace(
        grad_reduce=(1.0, 2.0, 3.0, 0.25)),
    "single-device": uniform_problem(1, 3),
    # Micro-batches of different cost: times, memory and message bytes per micro-batch.
    "scaled-serialized": _serialized(memory_limit=9.0).replace(
        microbatch_scale=(1.0, 3.0, 0.5, 2.0, 1.0, 4.0),
        microbatch_memory_scale=(1.0, 2.0, 0.5, 2.0, 1.0, 2.0),
        microbatch_message_scale=(1.0, 2.5, 1.0, 0.5, 3.0, 1.0)),
    "scaled-hetero": _hetero().replace(microbatch_scale=(2.0, 1.0, 1.0, 0.25, 3.0, 1.5)),
}


def _core(sched: Schedule) -> GraphSchedule:
    prob = sched.problem
    graph = training.build(prob)
    return simulate(graph, training.task_orders(prob, sched.device_orders()), sched.method)


def _assert_same(sched: Schedule, core: GraphSchedule) -> None:
    prob = sched.problem
    for o in sched.ops:
        i = training.task_id(prob, o.op)
        assert core.start[i] == pytest.approx(o.start, abs=TOL), o.op
        assert core.end[i] == pytest.approx(o.end, abs=TOL), o.op
    assert core.makespan == pytest.approx(sched.makespan, abs=TOL)
    assert core.objective == pytest.approx(sched.iteration_time, abs=TOL)
    assert core.peak_memory == pytest.approx(sched.peak_memory, abs=TOL)
    # The same messages on the same links at the same times.
    g = core.graph
    chain = {(m.src_stage, m.dst_stage, m.microbatch): (m.start, m.end, m.arrival)
             for m in sched.messages}
    mine = {}
    for mm in core.messages:
        src, dst = training.task_op(prob, g.src[mm.edge]), training.task_op(prob, g.dst[mm.edge])
        mine[(src.stage, dst.stage, src.microbatch)] = (mm.start, mm.end, mm.arrival)
    assert mine.keys() == chain.keys()
    for key, times in chain.items():
        assert mine[key] == pytest.approx(times, abs=TOL), key


@pytest.mark.parametrize("pname", sorted(PROBLEMS))
def test_core_times_every_classic_schedule_as_the_chain_does(pname: str) -> None:
    applied = []
    for method in classic_methods():
        try:
            sched = run_classic(PROBLEMS[pname], method)
        except NotApplicable:
            continue
        applied.append(method)
        core = _core(sched)
        _assert_same(sched, core)
        limits = sched.problem.memory_limit
        fits = all(lim is None or pk <= lim + 1e-9
                   for pk, lim in zip(sched.peak_memory, limits, strict=True))
        assert (check(core) == []) == fits, (method, check(core)[:3])
    assert applied, pname


@pytest.mark.parametrize("pname", sorted(PROBLEMS))
def test_graph_mirrors_the_problem(pname: str) -> None:
    """Edges are Problem.inputs of every op; durations, memory, messages and tails match."""
    prob = PROBLEMS[pname]
    g = training.build(prob)
    assert g.num_tasks == prob.num_ops
    dev, _, _, _ = prob.op_table
    assert g.device == dev
    for i, op in enumerate(prob.ops()):
        assert training.task_id(prob, op) == i and training.task_op(prob, i) == op
        assert g.label[i] == str(op)
        assert g.duration[i] == prob.duration(op)
        alloc, free = prob.memory_delta(op)
        assert (g.mem_start[i], -g.mem_end[i]) == (alloc, free)
        preds = [training.task_op(prob, g.src[e]) for e in g.preds(i)]
        assert preds == prob.inputs(op)
        for e in g.preds(i):
            x = training.task_op(prob, g.src[e])
            tx, lat = prob.transfer(x.stage, op.stage, op.microbatch)
            assert (g.edge_transmission[e], g.edge_latency[e]) == (tx, lat)
        last = op.kind == prob.kinds[-1]
        assert g.tail[i] == (prob.grad_reduce[op.stage] if last else 0.0)
    assert g.memory_limit == prob.memory_limit and g.static_memory == prob.static_memory
    assert g.serialized == prob.has_link_contention


#: Derived columns: build() hands some over whole (TaskGraph.trusted), the rest are derived.
DERIVED = ("edge_link", "edge_latency", "edge_transmission", "serialized", "in_degree",
           "succ_offsets", "succ_edges", "succ_tasks", "out_steps", "pred_offsets",
           "pred_edges", "pred_tasks", "topological_order", "device_tasks")


def _assert_as_validated(g: TaskGraph) -> None:
    """The validated constructor accepts build()'s columns unchanged (same values and types)
    and derives every column as build() gave it."""
    checked = TaskGraph(**{f.name: getattr(g, f.name) for f in fields(TaskGraph)})
    for f in fields(TaskGraph):
        mine, theirs = getattr(g, f.name), getattr(checked, f.name)
        assert list(mine) == list(theirs), f.name
        assert list(map(type, mine)) == list(map(type, theirs)), f.name
        assert type(mine) is tuple or f.name == "label", f.name
    for name in DERIVED:
        assert getattr(g, name) == getattr(checked, name), name
    assert g == checked


@pytest.mark.parametrize("pname", sorted(PROBLEMS))
def test_trusted_build_is_what_validation_gives(pname: str) -> None:
    _assert_as_validated(training.build(PROBLEMS[pname]))


@given(st.booleans().flatmap(lambda c: problems(contention=c)))
def test_trusted_build_is_what_validation_gives_on_random_problems(prob: Problem) -> None:
    _assert_as_validated(training.build(prob))


@pytest.mark.parametrize("pname", sorted(PROBLEMS))
def test_problem_columns_are_its_per_op_values(pname: str) -> None:
    """Problem.op_durations / op_memory_deltas, by op id, are duration / memory_delta of each op
    (uniform problems read them once per block, scaled ones once per op)."""
    prob = PROBLEMS[pname]
    ops = list(prob.ops())
    assert list(prob.op_durations()) == [prob.duration(op) for op in ops]
    alloc, free = prob.op_memory_deltas()
    assert list(zip(alloc, free, strict=True)) == [prob.memory_delta(op) for op in ops]


def test_labels_are_the_ops_names() -> None:
    prob = uniform_problem(2, 3)
    labels = training.build(prob).label
    assert list(labels) == [str(op) for op in prob.ops()]
    assert labels[-1] == "1W2" and labels[1:3] == ("0F1", "0F2") and len(labels) == 18
    with pytest.raises(IndexError):
        labels[18]


def _bad_orders(prob: Problem) -> list[list[Op]]:
    orders = [list(x) for x in run_classic(prob, "zb-h1").device_orders()]
    orders[0] = orders[0][::-1]
    return orders


@pytest.mark.parametrize("pname", ["uniform", "serialized"])
def test_deadlock_is_named_as_in_the_chain(pname: str) -> None:
    prob = PROBLEMS[pname]
    orders = _bad_orders(prob)
    with pytest.raises(ChainDeadlock):
        chain_simulate(prob, orders)
    with pytest.raises(DeadlockError, match="deadlock: device 0 waits at") as info:
        simulate(training.build(prob), training.task_orders(prob, orders))
    g = training.build(prob)
    for d, task, waited in info.value.cycle:
        assert g.device[task] == d and waited in [g.src[e] for e in g.preds(task)]


@pytest.mark.parametrize("pname", ["uniform", "serialized", "grad-reduce"])
def test_validator_rejects_perturbed_schedules(pname: str) -> None:
    prob = PROBLEMS[pname]
    core = _core(run_classic(prob, "zb-h1"))
    g = core.graph
    assert check(core) == []
    # An op moved earlier than its input (F of stage 1, micro-batch 0: nothing else on its
    # device runs before it).
    i = training.task_id(prob, Op("F", 1, 0))
    start, end = list(core.start), list(core.end)
    start[i] -= 0.5
    end[i] -= 0.5
    bad = check(replace(core, start=tuple(start), end=tuple(end)))
    assert any("1F0 starts at" in v and "before its input from 0F0" in v for v in bad), bad
    # Two overlapping ops on device 0: its second op starts with its first.
    first, second = core.device_orders()[0][:2]
    start, end = list(core.start), list(core.end)
    start[second] = core.start[first] + 0.25
    end[second] = start[second] + g.duration[second]
    bad = check(replace(core, start=tuple(start), end=tuple(end)))
    assert any(v.startswith(f"device 0: {g.label[second]} starts at") for v in bad), bad
    # Memory over a limit: the same times against a limit below the peak.
    tight = g.replace(memory_limit=tuple(pk - 0.5 for pk in core.peak_memory))
    bad = check(replace(core, graph=tight))
    assert len([v for v in bad if "exceeds the limit" in v]) == g.devices, bad
    # A duration changed.
    end = list(core.end)
    end[i] += 0.1
    assert any("1F0: lasts" in v for v in check(replace(core, end=tuple(end))))


def test_validator_checks_messages() -> None:
    prob = PROBLEMS["serialized"]
    core = _core(run_classic(prob, "1f1b"))
    assert core.messages and check(core) == []
    bad = check(replace(core, messages=core.messages[1:]))
    assert any("no message carries it" in v for v in bad), bad
    m0, m1 = core.messages[0], core.messages[1]
    same_link = [mm for mm in core.messages[1:]
                 if core.graph.edge_link[mm.edge] == core.graph.edge_link[m0.edge]]
    m1 = same_link[0]
    moved = m1._replace(start=m0.start, end=m0.end, arrival=m0.arrival)
    msgs = tuple(moved if mm is m1 else mm for mm in core.messages)
    bad = check(replace(core, messages=msgs))
    assert any(v.startswith("link ") for v in bad), bad
    assert any("message sent at" in v for v in bad), bad


@given(problems(contention=True), st.integers(0, 10**6))
def test_random_orders_time_as_in_the_chain(prob: Problem, seed: int) -> None:
    orders = random_orders(prob, seed)
    sched = chain_simulate(prob, orders)
    core = simulate(training.build(prob), training.task_orders(prob, orders))
    _assert_same(sched, core)
    assert check(core) == []


@pytest.mark.parametrize("pname", ["serialized", "serialized-vshape", "serialized-fused-hetero",
                                   "hetero", "scaled-hetero"])
def test_a_graph_built_once_times_as_a_graph_built_per_call(pname: str) -> None:
    """simulate(graph=chain_graph(problem)) and a call without a graph (which takes the
    problem's cached one) give the very times (and messages) of a graph freshly built, for
    every classic schedule, on the same graph value each time."""
    prob = PROBLEMS[pname]
    built = training.chain_graph(prob)
    fresh = training.ChainGraph(prob, training.build(prob))
    assert built.problem is prob and built.graph == fresh.graph
    assert built.graph is not fresh.graph
    applied = []
    for method in classic_methods():
        try:
            sched = run_classic(prob, method)
        except NotApplicable:
            continue
        if sched.problem != prob:  # a variant of the problem (e.g. the backward fused)
            continue
        applied.append(method)
        orders = sched.device_orders()
        ops, msgs = chain_time(prob, orders, check=True)
        assert chain_time(prob, orders, check=True, graph=built) == (ops, msgs), method
        assert chain_time(prob, orders, check=True, graph=fresh) == (ops, msgs), method
        assert chain_simulate(prob, orders, graph=built).ops == chain_simulate(prob, orders).ops
    assert len(applied) >= 3, applied


def test_a_graph_of_another_problem_is_refused() -> None:
    prob = PROBLEMS["serialized"]
    other = training.chain_graph(_serialized(m=8))
    orders = run_classic(prob, "zb-h1").device_orders()
    with pytest.raises(ValueError, match="graph: built for another problem"):
        chain_simulate(prob, orders, graph=other)
    equal = training.chain_graph(_serialized(memory_limit=4.0))  # equal, not the same object
    assert chain_simulate(prob, orders, graph=equal).ops == chain_simulate(prob, orders).ops


def test_graph_of_builds_once_per_problem_object() -> None:
    """graph_of keeps a problem's graph while the problem lives: the same object again hits,
    an equal problem that is another object gets a graph of its own (equal to it), the cache
    keeps at most GRAPH_CACHE_SIZE graphs, and a freed problem's graph leaves with it."""
    import gc
    import weakref

    cache = training._CACHE
    cache.clear()
    prob = _serialized(m=5)
    graph = training.graph_of(prob)
    assert training.graph_of(prob) is graph and training.chain_graph(prob).graph is graph
    twin = _serialized(m=5)
    assert twin == prob and twin is not prob
    assert training.graph_of(twin) is not graph and training.graph_of(twin) == graph
    assert len(cache) == 2
    gone = weakref.ref(graph)
    del prob, graph
    gc.collect()
    assert gone() is None and len(cache) == 1  # freed with its problem, not kept by the cache
    many = [uniform_problem(2, m) for m in range(1, training.GRAPH_CACHE_SIZE + 3)]
    graphs = [training.graph_of(p) for p in many]
    assert len(cache) == training.GRAPH_CACHE_SIZE
    assert training.graph_of(many[-1]) is graphs[-1]  # the newest kept
    assert training.graph_of(many[0]) is not graphs[0]  # the oldest pushed out, built again
    for p, g in zip(many, graphs, strict=True):
        assert training.graph_of(p) == g == training.build(p)
    cache.clear()
    assert len(cache) == 0


def test_simulate_again_on_one_problem_takes_its_cached_graph() -> None:
    """A second simulate of one problem object reuses the graph of the first and times as a
    fresh build does; errors still name the op (a missing op, a deadlock) with a cached graph."""
    prob = _serialized(m=6)
    orders = run_classic(prob, "zb-h1").device_orders()
    first = chain_simulate(prob, orders)
    graph = training.graph_of(prob)
    again = chain_simulate(prob, orders)
    assert training.graph_of(prob) is graph
    fresh = chain_simulate(prob, orders, graph=training.ChainGraph(prob, training.build(prob)))
    assert again.ops == first.ops == fresh.ops and again.messages == fresh.messages
    with pytest.raises(ChainDeadlock):
        chain_simulate(prob, [list(reversed(o)) for o in orders])
    from pipeopt.simulate import ScheduleError

    with pytest.raises(ScheduleError, match="missing"):
        chain_simulate(prob, [orders[0][1:], *orders[1:]])


@pytest.mark.parametrize("pname", ["scaled-hetero", "serialized"])
def test_a_search_builds_each_problems_graph_once(pname: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ChainGraphs builds one graph per distinct problem timed (the problem, its fused-backward
    variant, its micro-batches longest first, and that one fused), and every hand-made schedule
    timed with it is the one timed without it: same ops, messages and method."""
    from itertools import combinations

    import pipeopt.solvers.base as base

    prob = PROBLEMS[pname]
    built: list[Problem] = []
    real = training.chain_graph

    def counted(p: Problem) -> training.ChainGraph:
        built.append(p)
        return real(p)

    monkeypatch.setattr(base, "chain_graph", counted)
    graphs = base.ChainGraphs()
    timed = 0
    for method in classic_methods():
        for order in base.fifo_orders(prob):
            try:
                alone = run_classic(prob, method, order=order)
            except NotApplicable:
                continue
            pooled = run_classic(prob, method, order=order, graphs=graphs)
            assert (pooled.ops, pooled.messages, pooled.method) == (
                alone.ops, alone.messages, alone.method), method
            timed += 1
    assert timed >= 6
    assert len(base.fifo_orders(prob)) == (2 if pname == "scaled-hetero" else 1)
    assert 2 <= len(built) <= 2 * len(base.fifo_orders(prob))
    assert all(a != b for a, b in combinations(built, 2))  # never the same problem twice
