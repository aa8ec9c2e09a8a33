"""Collective communication times by the alpha-beta model (seconds).

A message of ``b`` bytes over a link costs ``alpha + b / B`` (``alpha``: the link's latency in
seconds, ``B``: its bandwidth in bytes/s; Hockney's model, as used by Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005,
section 2, and by NCCL's performance notes). Over ``n`` ranks, with ``bytes`` the size of the
whole buffer each rank holds:

* ring all-reduce: ``2 (n - 1) alpha + 2 (n - 1) / n * bytes / B`` (a reduce-scatter then an
  all-gather; Thakur et al., section 4.4; Patarasuk and Yuan, "Bandwidth optimal all-reduce
  algorithms for clusters of workstations", JPDC 69(2), 2009, prove the bandwidth term optimal);
* ring reduce-scatter and ring all-gather: ``(n - 1) alpha + (n - 1) / n * bytes / B`` each
  (Thakur et al., sections 4.1 and 4.3);
* all-to-all (pairwise exchange, each rank sends ``bytes / n`` to every other rank):
  ``(n - 1) alpha + (n - 1) / n * bytes / B`` (Thakur et al., section 4.6);
* tree all-reduce (``algorithm="tree"``): a binomial-tree reduce to one rank, then a
  binomial-tree broadcast, each ``ceil(log2 n)`` rounds of the whole buffer:
  ``2 ceil(log2 n) (alpha + bytes / B)`` (the binomial-tree broadcast and reduce costs of
  Thakur et al., without the reduction's arithmetic, as everywhere here). Fewer latency terms
  than the ring past 3 ranks, more bandwidth terms: the better choice for small buffers over
  many ranks.

Every step of a ring waits for its slowest hop, so ``alpha`` and ``B`` are those of the group's
slowest link (:func:`slowest`): a group that spans two datacenters pays the WAN. One rank
(``n = 1``) costs nothing. This module imports nothing from pipeopt, so workload builders
(:mod:`pipeopt.workloads`) below the cost model may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, NamedTuple

Collective = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]

#: The collectives :func:`collective_time` knows.
COLLECTIVES: tuple[Collective, ...] = ("all_reduce", "reduce_scatter", "all_gather",
                                       "all_to_all")


class LinkCost(NamedTuple):
    """One hop's alpha-beta parameters: ``latency`` (s), ``bandwidth`` (bytes/s)."""

    latency: float
    bandwidth: float


def _check(ranks: int, nbytes: float, latency: float, bandwidth: float) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: must be an integer >= 1, got {ranks!r}")
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"bytes: must be a finite number >= 0, got {nbytes!r}")
    if not (latency >= 0 and math.isfinite(latency)):
        raise ValueError(f"latency: must be a finite number of seconds >= 0, got {latency!r}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth: must be > 0 bytes/s, got {bandwidth!r}")


def _steps(ranks: int, nbytes: float, latency: float, bandwidth: float,
           rounds: int) -> float:
    """``rounds (n - 1)`` steps, each of ``alpha + bytes / (n B)``."""
    _check(ranks, nbytes, latency, bandwidth)
    steps = rounds * (ranks - 1)
    return steps * latency + steps * nbytes / ranks / bandwidth


def all_reduce_time(ranks: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2(n-1) alpha + 2(n-1)/n * bytes / B`` (s)."""
    return _steps(ranks, nbytes, latency, bandwidth, 2)


def reduce_scatter_time(ranks: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Ring reduce-scatter of ``nbytes`` per rank (each keeps ``bytes / n`` reduced):
    ``(n-1) alpha + (n-1)/n * bytes / B`` (s)."""
    return _steps(ranks, nbytes, latency, bandwidth, 1)


def all_gather_time(ranks: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Ring all-gather to ``nbytes`` per rank (each contributes ``bytes / n``):
    ``(n-1) alpha + (n-1)/n * bytes / B`` (s)."""
    return _steps(ranks, nbytes, latency, bandwidth, 1)


def all_to_all_time(ranks: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Pairwise all-to-all of ``nbytes`` per rank (``bytes / n`` to each rank):
    ``(n-1) alpha + (n-1)/n * bytes / B`` (s)."""
    return _steps(ranks, nbytes, latency, bandwidth, 1)


def tree_all_reduce_time(ranks: int, nbytes: float, latency: float, bandwidth: float
                         ) -> float:
    """Binomial-tree all-reduce of ``nbytes`` per rank (a reduce, then a broadcast):
    ``2 ceil(log2 n) (alpha + bytes / B)`` (s)."""
    _check(ranks, nbytes, latency, bandwidth)
    rounds = 2 * (ranks - 1).bit_length()  # ceil(log2 n) each way
    return rounds * (latency + nbytes / bandwidth)


_TIMES = {"all_reduce": all_reduce_time, "reduce_scatter": reduce_scatter_time,
          "all_gather": all_gather_time, "all_to_all": all_to_all_time}

#: The algorithms :func:`collective_time` knows: ``ring`` for every collective, ``tree`` for
#: the all-reduce only.
ALGORITHMS: tuple[str, ...] = ("ring", "tree")


def slowest(links: Iterable[LinkCost]) -> LinkCost:
    """The bottleneck of a group's links: the highest latency and the lowest bandwidth (each
    ring step waits for its slowest hop). Raises ValueError without any link."""
    items = list(links)
    if not items:
        raise ValueError("links: a group of two or more ranks needs at least one link")
    return LinkCost(max(x.latency for x in items), min(x.bandwidth for x in items))


def collective_time(kind: Collective, ranks: int, nbytes: float,
                    links: Iterable[LinkCost], algorithm: str = "ring") -> float:
    """Seconds of collective ``kind`` of ``nbytes`` per rank over ``ranks`` ranks whose ring
    (or tree) uses ``links`` (its slowest one bounds it; none needed for one rank);
    ``algorithm``: one of :data:`ALGORITHMS` (``tree``: all-reduce only)."""
    if kind not in _TIMES:
        raise ValueError(f"kind: must be one of {', '.join(COLLECTIVES)}, got {kind!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got "
                         f"{algorithm!r}")
    if algorithm == "tree" and kind != "all_reduce":
        raise ValueError(f"algorithm: tree is modelled for all_reduce only, got {kind}")
    if ranks == 1:
        _check(ranks, nbytes, 0.0, 1.0)
        return 0.0
    slow = slowest(links)
    time_of = tree_all_reduce_time if algorithm == "tree" else _TIMES[kind]
    return time_of(ranks, nbytes, slow.latency, slow.bandwidth)
