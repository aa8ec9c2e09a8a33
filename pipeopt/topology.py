"""Cluster topology: datacenters -> nodes -> GPUs, as a networkx graph with tiered links.

A datacenter is one fabric (one InfiniBand switch) holding node groups, each of its own GPU
type; a mixed cluster on one fabric is one datacenter of several groups.

Each edge carries a one-way ``latency`` (seconds) and a per-direction ``bandwidth`` (bytes/s).
GPUs of a node are fully connected by NVLink (through NVSwitch), except GPUs without NVLink
(L4, L40S), which reach each other over PCIe through the node's switch; each GPU reaches its
node's network interface over PCIe (the GPU's generation: Gen4 or Gen5); nodes reach their
datacenter's switch over InfiniBand / RoCE; the datacenter switches are connected pairwise by
WAN links. Edges through a hub (node NIC, switch) carry half the tier latency, so that two hops
through it add up to one tier latency.

The point-to-point delay of ``n`` bytes between two GPUs is the latency of the path plus ``n``
over its bottleneck bandwidth, on the path for which that sum is least.

Paths are searched piece by piece, as the graph allows: a GPU's node is left and entered only
through the node's NIC and a datacenter's only through its switch, so a path between GPUs of
two nodes is (GPU -> its NIC within its node) + (NIC -> switch -> ... -> switch -> NIC) + (NIC
-> GPU within the other node), each piece a shortest path of its own small graph (a node's
GPUs and NIC; the datacenter switches). Each piece is searched once per node (or
datacenter) and bandwidth floor, so the cost grows with the nodes, not with GPUs x GPUs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from pipeopt.costs.gpus import GPU, lookup


@dataclass(frozen=True)
class Tier:
    """A class of links: per-direction bandwidth (bytes/s) and one-way latency (seconds)."""

    bandwidth: float
    latency: float


#: Defaults (bytes/s, seconds). NVLink: from the GPU catalog (H100: 900 GB/s bidirectional,
#: 450 GB/s per direction); PCIe Gen5 x16: ~64 GB/s per direction; InfiniBand NDR 400 Gb/s per
#: GPU: 50 GB/s; WAN between datacenters: 100 Gb/s (12.5 GB/s) and 5 ms one way (~1000 km
#: of fibre at 2/3 c).
DEFAULT_TIERS: dict[str, Tier] = {
    "nvlink": Tier(450e9, 2e-6),
    "pcie": Tier(64e9, 2e-6),
    "infiniband": Tier(50e9, 5e-6),
    "wan": Tier(12.5e9, 5e-3),
}


@dataclass(frozen=True)
class TierOverride:
    """A user's change to a tier: the field given replaces the default, a None field keeps it
    (bytes/s per direction, seconds one way)."""

    bandwidth: float | None = None
    latency: float | None = None


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes of ``gpus_per_node`` GPUs of model ``gpu``, each node with ``nics``
    network interfaces of the infiniband tier's bandwidth (None: one per GPU)."""

    gpu: GPU
    nodes: int
    gpus_per_node: int
    nics: int | None = None


@dataclass(frozen=True)
class Datacenter:
    """One InfiniBand fabric: ``nodes`` nodes of ``gpus_per_node`` GPUs of model ``gpu``,
    then the node groups ``more`` (other GPU types on the same fabric, no WAN hop between
    them)."""

    gpu: GPU
    nodes: int
    gpus_per_node: int
    more: tuple[NodeGroup, ...] = ()
    #: NICs per node of the first group (None: one per GPU).
    nics: int | None = None

    @classmethod
    def of_groups(cls, groups: Sequence[NodeGroup]) -> Datacenter:
        """A datacenter of the node groups in order (at least one)."""
        if not groups:
            raise TopologyError("a datacenter needs at least one node group")
        first, *rest = groups
        return cls(first.gpu, first.nodes, first.gpus_per_node, tuple(rest), first.nics)

    @property
    def groups(self) -> tuple[NodeGroup, ...]:
        """Its node groups in GPU numbering order."""
        return (NodeGroup(self.gpu, self.nodes, self.gpus_per_node, self.nics), *self.more)


@dataclass(frozen=True)
class RingLink:
    """What paces one ring among concurrent rings: its hops' largest ``latency`` (seconds),
    its least ``bandwidth`` share (bytes/s), the ``shared_by`` flows on that link and the
    ``link`` itself (tier and direction; "" for a ring of one GPU)."""

    latency: float
    bandwidth: float
    shared_by: int
    link: str


class TopologyError(ValueError):
    """A placement that the cluster cannot hold."""


def _resolve(default: Tier, override: Tier | TierOverride | None) -> Tier:
    """``default`` with the fields that ``override`` gives."""
    if override is None:
        return default
    return Tier(default.bandwidth if override.bandwidth is None else override.bandwidth,
                default.latency if override.latency is None else override.latency)


class Topology:
    """The cluster graph; GPUs are numbered 0..n-1 in datacenter, node, slot order (a
    datacenter's node groups in their order).

    ``tiers`` overrides the defaults per tier, wholly (:class:`Tier`) or field by field
    (:class:`TierOverride`). The nvlink and pcie bandwidths default to each GPU's own (from
    the catalog); a GPU without NVLink gets direct GPU-to-GPU links only when an nvlink
    bandwidth is given.
    """

    def __init__(self, datacenters: Sequence[Datacenter],
                 tiers: Mapping[str, Tier | TierOverride] | None = None) -> None:
        self.datacenters = list(datacenters)
        given = dict(tiers or {})
        unknown = sorted(set(given) - set(DEFAULT_TIERS))
        if unknown:
            raise TopologyError(f"unknown tier {unknown[0]!r}; known: {', '.join(DEFAULT_TIERS)}")
        self.tiers = {name: _resolve(t, given.get(name)) for name, t in DEFAULT_TIERS.items()}
        self.graph = nx.Graph()
        self.gpus: list[str] = []
        self.gpu_info: list[tuple[int, int, int]] = []  # (datacenter, node, slot)
        self.gpu_models: list[GPU] = []
        #: Per node: (datacenter, GPUs in it); nodes in GPU numbering order.
        self.nodes: list[tuple[int, int]] = []
        # Per node (in self.nodes' order): its NIC and its GPUs' names; per GPU, its node.
        self._members: list[tuple[str, list[str]]] = []
        self._node_of: list[int] = []
        # Shortest paths of the pieces (see the module docstring), per (source, bandwidth
        # floor): within a node from its NIC or one of its GPUs, between datacenter switches.
        self._local: dict[tuple[str, float], dict[str, list[str]]] = {}
        self._wan: dict[tuple[str, float], dict[str, list[str]]] = {}
        nv_given = given.get("nvlink")
        nv_bw_given = nv_given is not None and nv_given.bandwidth is not None
        for d, dc in enumerate(self.datacenters):
            switch = f"dc{d}"
            self.graph.add_node(switch, kind="switch")
            n = 0
            for group in dc.groups:
                gpu = group.gpu
                nv = _resolve(Tier(gpu.nvlink_bandwidth, DEFAULT_TIERS["nvlink"].latency),
                              nv_given)
                pcie = _resolve(Tier(gpu.pcie_bandwidth, DEFAULT_TIERS["pcie"].latency),
                                given.get("pcie"))
                # GPUs without NVLink (L4, L40S) reach each other over PCIe, through the
                # node's switch: no direct edge, unless an nvlink bandwidth is given for them.
                direct = gpu.nvlink or nv_bw_given
                for _ in range(group.nodes):
                    self._add_node(d, n, group, nv, pcie, direct)
                    n += 1
        for a in range(len(self.datacenters)):
            for b in range(a + 1, len(self.datacenters)):
                self._edge(f"dc{a}", f"dc{b}", self.tiers["wan"], "wan")
        self._bandwidths = sorted({e["bandwidth"] for *_, e in self.graph.edges(data=True)})

    def _add_node(self, d: int, n: int, group: NodeGroup, nv: Tier, pcie: Tier,
                  direct: bool) -> None:
        """Node ``n`` of datacenter ``d``: its NIC, its GPUs and their links."""
        nic = f"dc{d}/n{n}"
        self.graph.add_node(nic, kind="nic")
        # The node's uplink: its NICs, each at the tier's bandwidth, carry that many flows at
        # full speed (one NIC per GPU unless said otherwise, as in a DGX H100: eight 400 Gb/s
        # ConnectX-7 for eight GPUs).
        self._edge(nic, f"dc{d}", self.tiers["infiniband"], "infiniband", half=True,
                   lanes=group.nics or group.gpus_per_node)
        self.nodes.append((d, group.gpus_per_node))
        members: list[str] = []
        self._members.append((nic, members))
        for g in range(group.gpus_per_node):
            name = f"dc{d}/n{n}/g{g}"
            self.graph.add_node(name, kind="gpu", index=len(self.gpus))
            self._node_of.append(len(self.nodes) - 1)
            self.gpus.append(name)
            self.gpu_info.append((d, n, g))
            self.gpu_models.append(group.gpu)
            self._edge(name, nic, pcie, "pcie", half=True)
            members.append(name)
        for i, a in enumerate(members):
            for b in members[i + 1:] if direct else ():
                self._edge(a, b, nv, "nvlink")

    def _edge(self, a: str, b: str, tier: Tier, kind: str, half: bool = False,
              lanes: int = 1) -> None:
        """A link; ``lanes`` flows per direction get its full bandwidth at once (the node
        uplink's NICs), more share ``lanes`` x bandwidth."""
        self.graph.add_edge(a, b, latency=tier.latency / 2 if half else tier.latency,
                            bandwidth=tier.bandwidth, tier=kind, lanes=lanes)

    @property
    def num_gpus(self) -> int:
        """Number of GPUs in the cluster."""
        return len(self.gpus)

    def _dijkstra(self, nodes: Sequence[str], src: str, floor: float
                  ) -> dict[str, list[str]]:
        """Lowest-latency paths from ``src`` in the graph induced by ``nodes`` over the links
        of bandwidth >= ``floor`` (a small graph: one node's GPUs and NIC, or the switches)."""
        inside = set(nodes)
        sub = nx.Graph()
        sub.add_nodes_from(nodes)
        adj = self.graph.adj
        sub.add_weighted_edges_from(
            ((u, v, e["latency"]) for u in nodes for v, e in adj[u].items()
             if v in inside and e["bandwidth"] >= floor), weight="latency")
        return nx.single_source_dijkstra_path(sub, src, weight="latency")

    def _within(self, node: int, src: str, floor: float) -> dict[str, list[str]]:
        """Lowest-latency paths from ``src`` (the NIC or a GPU of ``node``) within the node."""
        key = (src, floor)
        if key not in self._local:
            nic, gpus = self._members[node]
            self._local[key] = self._dijkstra([nic, *gpus], src, floor)
        return self._local[key]

    def _between(self, a: int, b: int, floor: float) -> list[str] | None:
        """Lowest-latency path between datacenter switches ``a`` and ``b`` over the WAN links
        of bandwidth >= ``floor`` (None: none)."""
        src = f"dc{a}"
        key = (src, floor)
        if key not in self._wan:
            self._wan[key] = self._dijkstra([f"dc{d}" for d in range(len(self.datacenters))],
                                            src, floor)
        return self._wan[key].get(f"dc{b}")

    def _shortest(self, a: int, b: int, floor: float) -> list[str] | None:
        """The lowest-latency path between GPUs ``a`` and ``b`` over the links of bandwidth
        >= ``floor`` (None: none), joined from its pieces (module docstring)."""
        na, nb = self._node_of[a], self._node_of[b]
        src, dst = self.gpus[a], self.gpus[b]
        if na == nb:
            return self._within(na, src, floor).get(dst)
        nic_a, nic_b = self._members[na][0], self._members[nb][0]
        up = self._within(na, nic_a, floor).get(src)
        down = self._within(nb, nic_b, floor).get(dst)
        da, db = self.datacenter_of(a), self.datacenter_of(b)
        if up is None or down is None or any(
                self.graph.edges[nic, f"dc{d}"]["bandwidth"] < floor
                for nic, d in ((nic_a, da), (nic_b, db))):
            return None
        middle = [f"dc{da}"] if da == db else self._between(da, db, floor)
        if middle is None:
            return None
        return [*reversed(up), *middle, *down]

    def path(self, a: int, b: int, nbytes: float = 0.0) -> list[str]:
        """The path between GPUs ``a`` and ``b`` (graph node names) that delivers an
        ``nbytes`` message soonest: least latency + nbytes / bottleneck bandwidth.

        Exact by trying every bandwidth floor: the lowest-latency path over the links at least
        that fast (with ``nbytes = 0``, the lowest-latency path)."""
        floors = [min(self._bandwidths)] if nbytes == 0 else self._bandwidths
        best: tuple[float, float, list[str]] | None = None
        for floor in floors:
            nodes = self._shortest(a, b, floor)
            if nodes is None:
                continue
            lat, bw = self._measure(nodes)
            t = lat + (0.0 if nbytes == 0 or math.isinf(bw) else nbytes / bw)
            if best is None or (t, lat) < best[:2]:
                best = (t, lat, nodes)
        if best is None:  # cannot happen: the topology is connected
            raise TopologyError(f"no path between GPU {a} and GPU {b}")
        return best[2]

    def _measure(self, nodes: list[str]) -> tuple[float, float]:
        lat, bw = 0.0, math.inf
        for u, v in itertools.pairwise(nodes):
            e = self.graph.edges[u, v]
            lat += e["latency"]
            bw = min(bw, e["bandwidth"])
        return lat, bw

    def link(self, a: int, b: int, nbytes: float = 0.0) -> tuple[float, float]:
        """(latency seconds, bottleneck bandwidth bytes/s) between GPUs ``a`` and ``b`` on the
        path that delivers an ``nbytes`` message soonest (:meth:`path`); (0, inf) for a GPU
        with itself."""
        if a == b:
            return 0.0, math.inf
        return self._measure(self.path(a, b, nbytes))

    def p2p_time(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from GPU ``a`` to GPU ``b`` on idle links."""
        lat, bw = self.link(a, b, nbytes)
        return lat + (0.0 if nbytes == 0 or math.isinf(bw) else nbytes / bw)

    def ring_links(self, rings: Sequence[tuple[Sequence[int], float]]) -> list[RingLink]:
        """The links of rings that run at the same time (the data-parallel all-reduce rings of
        every pipeline rank and tensor-parallel slot), each given as (GPUs in ring order,
        chunk bytes that choose its paths, :meth:`path`).

        Every hop sends to the next GPU at once, so a link carries, per direction, one flow
        per hop whose path crosses it: ``n`` flows over a link of bandwidth ``B`` and ``L``
        lanes (a node uplink's NICs; 1 otherwise) get ``B * min(1, L / n)`` each, equal
        shares (a lower bound: max-min fairness gives more to flows slowed elsewhere). A
        ring's bandwidth is the least share on any of its hops, its latency its hops' largest.
        """
        hops: list[list[tuple[float, list[tuple[str, str]]]]] = []
        flows: dict[tuple[str, str], int] = {}
        for gpus, chunk in rings:
            mine = []
            for a, b in zip(gpus, [*gpus[1:], *gpus[:1]], strict=True):
                if a == b:
                    continue
                nodes = self.path(a, b, chunk)
                edges = list(itertools.pairwise(nodes))
                for e in edges:
                    flows[e] = flows.get(e, 0) + 1
                mine.append((self._measure(nodes)[0], edges))
            hops.append(mine)
        out = []
        for mine in hops:
            if not mine:
                out.append(RingLink(0.0, math.inf, 1, ""))
                continue
            best = (math.inf, 1, "")
            for _, edges in mine:
                for u, v in edges:
                    e = self.graph.edges[u, v]
                    n = flows[(u, v)]
                    share = e["bandwidth"] * min(1.0, e["lanes"] / n)
                    if share < best[0]:
                        best = (share, n, f"{e['tier']} {u} -> {v}")
            out.append(RingLink(max(lat for lat, _ in mine), *best))
        return out

    def datacenter_of(self, gpu: int) -> int:
        """Datacenter index of a GPU."""
        return self.gpu_info[gpu][0]

    def place(self, ranks: int, group: int = 1) -> list[int]:
        """First GPU of each pipeline rank, when every rank takes ``group`` GPUs of one node
        (its tensor-parallel group).

        Ranks fill nodes in order (datacenter, node, slot), so pipeline neighbours share a node
        or a datacenter whenever possible and the chain crosses each datacenter boundary once.
        """
        slots: list[int] = []
        g0 = 0
        for _, size in self.nodes:
            slots.extend(g0 + i * group for i in range(size // group))  # none: too small
            g0 += size
        if not slots:
            raise TopologyError(
                f"a tensor-parallel group of {group} GPUs does not fit in any node (at most "
                f"{max(size for _, size in self.nodes)} GPUs per node)")
        if ranks > len(slots):
            raise TopologyError(
                f"{ranks} pipeline ranks x {group} GPU(s) need {ranks * group} GPUs in groups "
                f"within nodes; the cluster holds {len(slots)} such group(s) "
                f"({self.num_gpus} GPUs)")
        return slots[:ranks]

    def matrices(self, gpus: list[int], nbytes: float = 0.0
                 ) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        """(latency, bandwidth) matrices between the given GPUs, in their order, on the paths
        fastest for an ``nbytes`` message."""
        links = [[self.link(a, b, nbytes) for b in gpus] for a in gpus]
        lat = tuple(tuple(x[0] for x in row) for row in links)
        bw = tuple(tuple(x[1] for x in row) for row in links)
        return lat, bw

    def cross_datacenter_cuts(self, gpus: list[int]) -> int:
        """Pipeline neighbours (rank r, r+1) that sit in different datacenters."""
        return sum(self.datacenter_of(a) != self.datacenter_of(b)
                   for a, b in itertools.pairwise(gpus))

    def describe(self, gpu: int) -> str:
        """A GPU's name, e.g. ``dc1/n0/g4 (H100-SXM)``."""
        return f"{self.gpus[gpu]} ({self.gpu_models[gpu].name})"


def uniform_cluster(gpu: str = "H100-SXM", datacenters: int = 1, nodes: int = 1,
                    gpus_per_node: int = 8,
                    tiers: Mapping[str, Tier | TierOverride] | None = None) -> Topology:
    """A cluster of identical datacenters."""
    model = lookup(gpu)
    return Topology([Datacenter(model, nodes, gpus_per_node)] * datacenters, tiers)
