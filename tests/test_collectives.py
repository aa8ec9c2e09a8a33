"""Alpha-beta collective times (pipeopt.costs.collectives) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from pipeopt.costs.collectives import (
    LinkCost,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    reduce_scatter_time,
    slowest,
    tree_all_reduce_time,
)


def test_ring_all_reduce() -> None:
    # 4 ranks, 8 GB, 10 us, 10 GB/s: 2 * 3 * 1e-5 + 2 * 3 / 4 * 8e9 / 1e10 = 6e-5 + 1.2.
    assert all_reduce_time(4, 8e9, 1e-5, 1e10) == pytest.approx(1.20006, rel=1e-12)


def test_reduce_scatter_and_all_gather_are_half_an_all_reduce() -> None:
    # 3 * 1e-5 + 3 / 4 * 8e9 / 1e10 = 3e-5 + 0.6.
    assert reduce_scatter_time(4, 8e9, 1e-5, 1e10) == pytest.approx(0.60003, rel=1e-12)
    assert all_gather_time(4, 8e9, 1e-5, 1e10) == pytest.approx(0.60003, rel=1e-12)
    for n in (2, 3, 8, 64):
        assert (reduce_scatter_time(n, 1e9, 2e-6, 5e10) + all_gather_time(n, 1e9, 2e-6, 5e10)
                == pytest.approx(all_reduce_time(n, 1e9, 2e-6, 5e10), rel=1e-12))


def test_all_to_all() -> None:
    # 8 ranks, 16 GB each (2 GB to every rank), 2 us, 50 GB/s: 7 * 2e-6 + 7 / 8 * 16e9 / 5e10.
    assert all_to_all_time(8, 1.6e10, 2e-6, 5e10) == pytest.approx(0.280014, rel=1e-12)


def test_the_slowest_link_bounds_the_group() -> None:
    nvlink = LinkCost(1e-5, 1e11)
    wan = LinkCost(0.03, 1.25e9)
    assert slowest([nvlink, wan, nvlink]) == wan
    # Two replicas across a 10 Gbit/s WAN with 30 ms: 2 * 0.03 + 2 * 1 / 2 * 1e9 / 1.25e9.
    assert collective_time("all_reduce", 2, 1e9, [nvlink, wan]) == pytest.approx(0.86)
    # The slowest latency and the slowest bandwidth may come from different links.
    assert slowest([LinkCost(0.1, 1e12), LinkCost(0.0, 1e9)]) == LinkCost(0.1, 1e9)


def test_tree_all_reduce() -> None:
    # 8 ranks: 3 rounds up (reduce), 3 down (broadcast), each 1e-5 + 1e6 / 1e10 s.
    assert tree_all_reduce_time(8, 1e6, 1e-5, 1e10) == pytest.approx(6 * 1.1e-4, rel=1e-12)
    # ceil(log2 n) rounds each way: 5 ranks take 3, 2 ranks 1 (the ring's 2 steps, but each
    # moves the whole buffer instead of half)
    assert tree_all_reduce_time(5, 0.0, 1.0, 1.0) == pytest.approx(6.0)
    assert tree_all_reduce_time(2, 0.0, 1.0, 1.0) == pytest.approx(all_reduce_time(2, 0.0, 1.0,
                                                                                  1.0))
    assert tree_all_reduce_time(1, 1e9, 1.0, 1.0) == 0.0
    # small buffer, many ranks: the tree's 2 * 6 latency terms beat the ring's 2 * 63
    wan = [LinkCost(0.03, 1.25e9)]
    tree = collective_time("all_reduce", 64, 1e6, wan, "tree")
    ring = collective_time("all_reduce", 64, 1e6, wan)
    assert tree == pytest.approx(12 * (0.03 + 1e6 / 1.25e9)) and tree < ring
    # a large buffer: the ring's bandwidth term wins
    assert (collective_time("all_reduce", 64, 1e10, wan, "tree")
            > collective_time("all_reduce", 64, 1e10, wan))


def test_one_rank_costs_nothing() -> None:
    assert collective_time("all_reduce", 1, 1e9, []) == 0.0
    assert all_reduce_time(1, 1e9, 0.5, 1.0) == 0.0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: all_reduce_time(0, 1.0, 0.0, 1.0), "ranks: must be an integer >= 1, got 0"),
    (lambda: all_reduce_time(2, -1.0, 0.0, 1.0), "bytes: must be a finite number >= 0"),
    (lambda: all_reduce_time(2, 1.0, math.nan, 1.0), "latency: must be a finite number"),
    (lambda: all_reduce_time(2, 1.0, 0.0, 0.0), "bandwidth: must be > 0 bytes/s, got 0.0"),
    (lambda: collective_time("broadcast", 2, 1.0, [LinkCost(0, 1)]),  # type: ignore[arg-type]
     "kind: must be one of all_reduce, reduce_scatter, all_gather, all_to_all"),
    (lambda: collective_time("all_reduce", 2, 1.0, []), "links: a group of two or more"),
    (lambda: collective_time("all_reduce", 2, 1.0, [LinkCost(0, 1)], "star"),
     "algorithm: must be one of ring, tree, got 'star'"),
    (lambda: collective_time("reduce_scatter", 2, 1.0, [LinkCost(0, 1)], "tree"),
     "algorithm: tree is modelled for all_reduce only, got reduce_scatter"),
    (lambda: tree_all_reduce_time(2, 1.0, 0.0, -1.0), "bandwidth: must be > 0 bytes/s"),
])
def test_bad_input_is_named(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
