"""TaskGraph: validation messages, derived columns, cycles, the builder; GraphSchedule metrics;
the core simulator on hand-checked graphs."""

from __future__ import annotations

import math

import pytest

from pipeopt.core.graph import GraphBuilder, GraphError, TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.core.simulate import DeadlockError, OrderError, simulate
from pipeopt.core.validate import check


def _two_devices() -> TaskGraph:
    """a (dev 0) -> b (dev 1) with a 2-byte message over a 1 byte/s, 0.5 s link; c on dev 0."""
    g = GraphBuilder()
    d0, d1 = g.device(memory_limit=10.0, static_memory=1.0), g.device()
    g.link(d0, d1, latency=0.5, bandwidth=1.0)
    g.task("a", d0, 1.0, mem_start=4.0, mem_end=-3.0)
    g.task("b", d1, 2.0, tail=0.25)
    g.task("c", d0, 1.5, mem_start=2.0, mem_end=-3.0)
    g.edge("a", "b", bytes=2.0)
    g.edge("a", "c")
    return g.build()


def test_builder_and_derived_columns() -> None:
    g = _two_devices()
    assert (g.devices, g.num_tasks, g.num_edges, g.num_links) == (2, 3, 2, 1)
    assert g.label == ("a", "b", "c")
    assert g.edge_link == (0, -1)
    assert g.edge_transmission == (2.0, 0.0) and g.edge_latency == (0.5, 0.0)
    assert g.edge_delay == (2.5, 0.0) and g.serialized
    assert g.succs(0) == (0, 1) and g.preds(1) == (0,) and g.preds(2) == (1,)
    assert g.pred_offsets == (0, 0, 1, 2) and g.succ_offsets == (0, 2, 2, 2)
    assert g.topological_order[0] == 0
    assert g.device_tasks == ((0, 2), (1,))
    assert g.memory_limit == (10.0, None) and g.static_memory == (1.0, 0.0)


def test_simulate_by_hand() -> None:
    s = simulate(_two_devices(), [[0, 2], [1]])
    assert s.start == (0.0, 3.5, 1.0) and s.end == (1.0, 5.5, 2.5)
    assert [tuple(m) for m in s.messages] == [(0, 1.0, 3.0, 3.5)]
    assert s.makespan == 5.5 and s.objective == 5.75
    # Device 0: 1 static, +4 at 0, -3 at 1 and +2 at 1 (decreases first: 2, then 4), -3 at 2.5.
    assert s.peak_memory == (5.0, 0.0)
    assert check(s) == []


def test_zero_bandwidth_and_infinite_bandwidth_links() -> None:
    g = _two_devices().replace(bandwidth=(math.inf,))
    assert not g.serialized and g.edge_delay == (0.5, 0.0)
    s = simulate(g, [[0, 2], [1]])
    assert s.start[1] == 1.5 and s.messages == () and check(s) == []
    with pytest.raises(GraphError, match=r"links.bandwidth\[0\]: must be > 0, got 0"):
        _two_devices().replace(bandwidth=(0.0,))


@pytest.mark.parametrize(("changes", "message"), [
    ({"duration": (1.0, -1.0, 1.0)}, r"tasks.duration\[1\]: must be >= 0, got -1"),
    ({"duration": (1.0, math.nan, 1.0)}, r"tasks.duration\[1\]: must be a finite number"),
    ({"duration": (1.0, 1.0)}, r"tasks.duration: expected 3 values, got 2"),
    ({"duration": (1.0, "x", 1.0)}, r"tasks.duration\[1\]: must be a number, got 'x'"),
    ({"device": (0, 2, 0)}, r"tasks.device\[1\]: must be in 0..1, got 2"),
    ({"device": (0, 1.5, 0)}, r"tasks.device\[1\]: must be an integer, got 1.5"),
    ({"tail": (0.0, 0.0, -2.0)}, r"tasks.tail\[2\]: must be >= 0, got -2"),
    ({"mem_start": (0.0, math.inf, 0.0)}, r"tasks.mem_start\[1\]: must be a finite number"),
    ({"label": ("a", "b")}, r"tasks.label: expected 3 values, got 2"),
    ({"label": ("a", 3, "c")}, r"tasks.label\[1\]: must be a string, got 3"),
    ({"dst": (1, 7)}, r"edges.dst\[1\]: must be in 0..2, got 7"),
    ({"bytes": (1.0, -1.0)}, r"edges.bytes\[1\]: must be >= 0, got -1"),
    ({"memory_limit": (-1.0, None)}, r"devices.memory_limit\[0\]: must be >= 0 or None"),
    ({"static_memory": (1.0, -4.0)}, r"devices.static_memory\[1\]: must be >= 0, got -4"),
    ({"memory_limit": ()}, r"devices: a graph needs at least one device"),
    ({"latency": (-0.5,)}, r"links.latency\[0\]: must be >= 0, got -0.5"),
    ({"link_dst": (0,)}, r"links\[0\]: a link joins two devices, got 0->0"),
    ({"link_src": (1,), "link_dst": (0,)},
     r"edges\[0\]: a \(device 0\) -> b \(device 1\) crosses devices without a link 0->1"),
    ({"src": (0, 2), "dst": (2, 0)}, r"edges: the graph has a cycle: (a -> c -> a|c -> a -> c)"),
    ({"src": (0, 1), "dst": (0, 1)}, r"edges: the graph has a cycle: a -> a"),
])
def test_graph_errors_name_field_and_index(changes: dict[str, object], message: str) -> None:
    with pytest.raises(GraphError, match=message):
        _two_devices().replace(**changes)


def test_longer_cycle_is_named_in_edge_direction() -> None:
    g = GraphBuilder()
    d = g.device()
    for name in "pqrs":
        g.task(name, d, 1.0)
    for a, b in ("pq", "qr", "rs", "sq"):
        g.edge(a, b)
    with pytest.raises(GraphError, match=r"cycle: (q -> r -> s -> q|r -> s -> q -> r|"
                                         r"s -> q -> r -> s)"):
        g.build()


def test_builder_errors() -> None:
    g = GraphBuilder()
    d = g.device()
    g.task("x", d, 1.0)
    with pytest.raises(GraphError, match="'x' is already task 0"):
        g.task("x", d, 1.0)
    with pytest.raises(GraphError, match="no task labelled 'y'"):
        g.edge("x", "y")
    both = GraphBuilder()
    a, b = both.device(), both.device()
    assert both.link(a, b, 0.1, 5.0, both_ways=True) == 0
    assert both.build().link_index == {(0, 1): 0, (1, 0): 1}
    with pytest.raises(GraphError, match=r"links\[2\]: 0->1 is already links\[0\]"):
        both.link(a, b)
        both.build()


def test_memory_limit_inf_means_none_and_defaults() -> None:
    g = TaskGraph(memory_limit=(math.inf,), device=(0, 0), duration=(1, 2), src=(0,), dst=(1,))
    assert g.memory_limit == (None,) and g.label == ("t0", "t1")
    assert g.mem_start == g.mem_end == g.tail == (0.0, 0.0) and g.bytes == (0.0,)
    s = simulate(g, [[0, 1]])
    assert s.end == (1.0, 3.0) and s.peak_memory == (0.0,)


def test_orders_are_checked() -> None:
    g = _two_devices()
    with pytest.raises(OrderError, match="expected 2 device lists"):
        simulate(g, [[0, 2]])
    with pytest.raises(OrderError, match=r"orders\[1\]\[1\]: a belongs on device 0"):
        simulate(g, [[2], [1, 0]])
    with pytest.raises(OrderError, match=r"orders\[0\]\[2\]: a appears twice"):
        simulate(g, [[0, 2, 0], [1]])
    with pytest.raises(OrderError, match=r"1 tasks missing, e\.g\. c"):
        simulate(g, [[0], [1]])
    with pytest.raises(OrderError, match=r"orders\[0\]\[1\]: 9 is not a task id"):
        simulate(g, [[0, 9], [1]])
    with pytest.raises(OrderError, match=r"orders\[0\]\[0\]: expected a task id, got 'a'"):
        simulate(g, [["a", 2], [1]])


@pytest.mark.parametrize("bandwidth", [1.0, math.inf])
def test_deadlock_names_the_cycle(bandwidth: float) -> None:
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    g.link(d0, d1, bandwidth=bandwidth, both_ways=True)
    for name, dev in (("a0", d0), ("a1", d0), ("b0", d1), ("b1", d1)):
        g.task(name, dev, 1.0)
    g.edge("a0", "b1", bytes=1.0)
    g.edge("b0", "a1", bytes=1.0)
    graph = g.build()
    assert check(simulate(graph, [[0, 1], [2, 3]])) == []
    with pytest.raises(DeadlockError) as info:
        simulate(graph, [[1, 0], [3, 2]])
    text = str(info.value)
    assert "device 0 waits at a1 for b0 (device 1)" in text
    assert "device 1 waits at b1 for a0 (device 0)" in text
    assert {c[0] for c in info.value.cycle} == {0, 1}


def test_messages_on_one_link_go_in_ready_order() -> None:
    """Two messages on one link: the one ready first goes first, the other waits."""
    g = GraphBuilder()
    d0, d1 = g.device(), g.device()
    g.link(d0, d1, latency=0.25, bandwidth=1.0)
    g.task("x", d0, 1.0)
    g.task("y", d0, 1.0)
    g.task("u", d1, 1.0)
    g.task("v", d1, 1.0)
    g.edge("x", "v", bytes=3.0)
    g.edge("y", "u", bytes=3.0)
    s = simulate(g.build(), [[0, 1], [2, 3]])
    assert [(m.edge, m.start, m.end) for m in s.messages] == [(0, 1.0, 4.0), (1, 4.0, 7.0)]
    assert s.start[2] == 7.25 and s.start[3] == 8.25
    assert check(s) == []


def test_schedule_metrics() -> None:
    g = _two_devices()
    s = GraphSchedule(g, (0.0, 3.5, 1.0), (1.0, 5.5, 2.5), method="by hand", lower_bound=5.0)
    assert s.gap == pytest.approx((5.75 - 5.0) / 5.75)
    assert s.device_orders() == [[0, 2], [1]]
    summary = s.summary()
    assert summary["objective"] == 5.75 and summary["method"] == "by hand"
    # No message: the validator says which edge lacks one.
    assert check(s) == ["a -> b: no message carries it across link 0"]


def test_wide_waves_are_ordered_and_a_cycle_behind_them_is_found() -> None:
    """Waves of >= 64 tasks go through numpy, narrow ones one by one: both keep every edge
    forward, and a cycle after a wide wave is still named."""
    n = 300
    src = [*range(100), *range(100, 199)]
    dst = [*range(100, 200), *range(101, 200)]  # 100 wide, then a 100-long chain
    g = TaskGraph(memory_limit=(None,), device=(0,) * n, duration=(1.0,) * n, src=src, dst=dst)
    pos = {t: k for k, t in enumerate(g.topological_order)}
    assert len(pos) == n and all(pos[a] < pos[b] for a, b in zip(src, dst, strict=True))
    with pytest.raises(GraphError, match=r"cycle: (t200 -> t201 -> t202 -> t200|"
                                         r"t201 -> t202 -> t200 -> t201|"
                                         r"t202 -> t200 -> t201 -> t202)"):
        g.replace(src=(*src, 200, 201, 202), dst=(*dst, 201, 202, 200), bytes=())
