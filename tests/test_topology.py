"""Topology: tiered links, path delays, placement of pipeline ranks."""

import itertools

import networkx as nx
import pytest

from pipeopt.costs.gpus import lookup
from pipeopt.topology import (
    DEFAULT_TIERS,
    Datacenter,
    NodeGroup,
    Tier,
    TierOverride,
    Topology,
    TopologyError,
    uniform_cluster,
)

TIERS = {"nvlink": Tier(400e9, 1e-6), "pcie": Tier(60e9, 2e-6),
         "infiniband": Tier(50e9, 4e-6), "wan": Tier(10e9, 5e-3)}


def cluster():
    return uniform_cluster("H100-SXM", datacenters=2, nodes=2, gpus_per_node=4, tiers=TIERS)


def test_links_per_tier():
    topo = cluster()
    assert topo.num_gpus == 16
    assert topo.link(0, 1) == (pytest.approx(1e-6), 400e9)  # same node: NVLink
    # Other node, same datacenter: PCIe to the NIC, InfiniBand, PCIe; bottleneck InfiniBand.
    assert topo.link(0, 4) == (pytest.approx(2e-6 + 4e-6), 50e9)
    # Other datacenter: adds the WAN hop; bottleneck the WAN.
    assert topo.link(0, 8) == (pytest.approx(2e-6 + 4e-6 + 5e-3), 10e9)
    assert topo.link(3, 3) == (0.0, float("inf"))
    assert topo.p2p_time(0, 8, 1e9) == pytest.approx(6e-6 + 5e-3 + 0.1)


def test_placement_fills_nodes_and_counts_cuts():
    topo = cluster()
    ranks = topo.place(8, group=2)
    assert ranks == [0, 2, 4, 6, 8, 10, 12, 14]
    assert topo.cross_datacenter_cuts(ranks) == 1
    lat, bw = topo.matrices(ranks)
    assert lat[3][4] == pytest.approx(6e-6 + 5e-3)
    assert lat[0][1] == pytest.approx(1e-6) and bw[0][1] == 400e9
    assert lat[2][2] == 0
    with pytest.raises(TopologyError, match="need 34 GPUs"):
        topo.place(17, group=2)
    with pytest.raises(TopologyError, match="does not fit in any node"):
        topo.place(1, group=8)
    # A datacenter whose nodes are too small for a group is skipped, not an error.
    mixed = Topology([Datacenter(lookup("H100-SXM"), 2, 8), Datacenter(lookup("H100-SXM"), 2, 4)])
    assert mixed.place(2, group=8) == [0, 8]
    with pytest.raises(TopologyError, match="need 24 GPUs"):
        mixed.place(3, group=8)


def test_heterogeneous_datacenters_and_default_nvlink():
    topo = Topology([Datacenter(lookup("H100-SXM"), 1, 8), Datacenter(lookup("A100-80GB"), 1, 8)])
    assert topo.gpu_models[0].name == "H100-SXM" and topo.gpu_models[8].name == "A100-80GB"
    assert topo.link(0, 1)[1] == lookup("H100-SXM").nvlink_bandwidth
    assert topo.link(8, 9)[1] == lookup("A100-80GB").nvlink_bandwidth
    assert topo.link(0, 8)[1] == DEFAULT_TIERS["wan"].bandwidth


def test_path_chosen_for_the_message_size():
    # An intra-node fabric with less bandwidth than the detour through the node's NIC (two
    # PCIe hops of 0.5 us each): the detour is taken only when the message is large enough
    # for bandwidth to matter.
    gpu = lookup("H100-SXM")
    topo = Topology([Datacenter(gpu, 1, 2)],
                    tiers={"nvlink": Tier(1e9, 1e-7), "pcie": Tier(64e9, 1e-6)})
    assert topo.link(0, 1) == (pytest.approx(1e-7), 1e9)  # small: the lowest latency
    lat, bw = topo.link(0, 1, 64e6)  # 64 MB: 64 ms on NVLink here, 1 ms + 1 us via PCIe
    assert (lat, bw) == (pytest.approx(1e-6), 64e9)
    assert topo.p2p_time(0, 1, 64e6) == pytest.approx(1e-6 + 1e-3)
    assert topo.p2p_time(0, 1, 100) == pytest.approx(1e-7 + 1e-7)  # 100 B: NVLink still


def test_pcie_only_gpus_talk_over_pcie_of_their_generation():
    l4 = Topology([Datacenter(lookup("L4"), 1, 4)])
    assert not l4.graph.has_edge(l4.gpus[0], l4.gpus[1])  # no NVLink between L4s
    assert l4.link(0, 1) == (pytest.approx(DEFAULT_TIERS["pcie"].latency), 32e9)  # Gen4
    h100 = Topology([Datacenter(lookup("H100-SXM"), 1, 4)])
    assert h100.link(0, 1)[1] == 450e9  # NVLink
    assert h100.graph.edges[h100.gpus[0], "dc0/n0"]["bandwidth"] == 64e9  # PCIe Gen5
    given = Topology([Datacenter(lookup("L4"), 1, 4)], tiers={"pcie": Tier(25e9, 5e-6)})
    assert given.link(0, 1) == (pytest.approx(5e-6), 25e9)


def test_node_groups_of_different_gpus_share_one_fabric():
    # One datacenter: a node of 4 H100s, then two nodes of 2 A100s, all on one InfiniBand
    # switch. GPU numbering runs through the groups in order; no WAN hop between them.
    h100, a100 = lookup("H100-SXM"), lookup("A100-80GB")
    topo = Topology([Datacenter.of_groups([NodeGroup(h100, 1, 4), NodeGroup(a100, 2, 2)])],
                    tiers=TIERS)
    assert topo.num_gpus == 8
    assert [m.name for m in topo.gpu_models] == ["H100-SXM"] * 4 + ["A100-80GB"] * 4
    assert topo.gpus[4] == "dc0/n1/g0" and topo.gpus[7] == "dc0/n2/g1"
    assert topo.datacenter_of(7) == 0
    assert not any(e["tier"] == "wan" for *_, e in topo.graph.edges(data=True))
    # H100 to A100: PCIe half + InfiniBand + PCIe half, as between any two nodes.
    assert topo.link(0, 4) == (pytest.approx(2e-6 + 4e-6), 50e9)
    # Groups of 4 fit only the H100 node, groups of 2 every node.
    assert topo.place(2, group=2) == [0, 2]
    assert topo.place(4, group=2) == [0, 2, 4, 6]
    with pytest.raises(TopologyError, match="need 8 GPUs"):
        topo.place(2, group=4)
    # The same GPUs split over two datacenters get the WAN hop.
    apart = Topology([Datacenter(h100, 1, 4), Datacenter(a100, 2, 2)], tiers=TIERS)
    assert apart.link(0, 4)[0] == pytest.approx(2e-6 + 4e-6 + 5e-3)


def test_node_groups_take_their_own_gpus_links():
    l4, h100 = lookup("L4"), lookup("H100-SXM")
    topo = Topology([Datacenter.of_groups([NodeGroup(l4, 1, 2), NodeGroup(h100, 1, 2)])])
    assert not topo.graph.has_edge(topo.gpus[0], topo.gpus[1])  # L4: no NVLink
    assert topo.link(0, 1)[1] == 32e9  # PCIe Gen4
    assert topo.link(2, 3)[1] == 450e9  # H100 NVLink
    with pytest.raises(TopologyError, match="at least one node group"):
        Datacenter.of_groups([])


def test_partial_tier_overrides_keep_the_other_field():
    gpu = lookup("H100-SXM")
    topo = Topology([Datacenter(gpu, 2, 2), Datacenter(gpu, 1, 2)],
                    tiers={"wan": TierOverride(latency=1e-3),
                           "infiniband": TierOverride(bandwidth=25e9),
                           "nvlink": TierOverride(latency=7e-6)})
    assert topo.tiers["wan"] == Tier(DEFAULT_TIERS["wan"].bandwidth, 1e-3)
    assert topo.tiers["infiniband"] == Tier(25e9, DEFAULT_TIERS["infiniband"].latency)
    # 1 MB: NVLink (7 us + 2.2 us) beats the PCIe detour (2 us + 15.6 us); catalog bandwidth.
    assert topo.link(0, 1, 1e6) == (pytest.approx(7e-6), 450e9)
    pcie, ib = DEFAULT_TIERS["pcie"].latency, DEFAULT_TIERS["infiniband"].latency
    assert topo.link(0, 2) == (pytest.approx(pcie + ib), 25e9)
    assert topo.link(0, 4) == (pytest.approx(pcie + ib + 1e-3),
                               DEFAULT_TIERS["wan"].bandwidth)
    # A latency alone gives NVLink-less GPUs no NVLink; a bandwidth does.
    l4 = lookup("L4")
    assert not Topology([Datacenter(l4, 1, 2)], {"nvlink": TierOverride(latency=1e-6)}
                        ).graph.has_edge("dc0/n0/g0", "dc0/n0/g1")
    assert Topology([Datacenter(l4, 1, 2)], {"nvlink": TierOverride(bandwidth=20e9)}
                    ).link(0, 1) == (pytest.approx(DEFAULT_TIERS["nvlink"].latency), 20e9)
    with pytest.raises(TopologyError, match="unknown tier 'nvlnk'"):
        Topology([Datacenter(l4, 1, 2)], {"nvlnk": TierOverride(latency=1e-6)})


def test_concurrent_rings_divide_the_wan():
    # Two datacenters of one node of 4 GPUs: 4 rings (GPU j <-> GPU 4 + j) all cross the WAN
    # in both directions: 4 flows per direction share its 10e9 B/s, 2.5e9 each. The node
    # uplinks carry 4 flows on 4 NICs (one per GPU): not shared.
    topo = uniform_cluster("H100-SXM", datacenters=2, nodes=1, gpus_per_node=4, tiers=TIERS)
    links = topo.ring_links([([j, 4 + j], 1e6) for j in range(4)])
    for x in links:
        assert x.bandwidth == pytest.approx(10e9 / 4)
        assert x.latency == pytest.approx(2e-6 + 4e-6 + 5e-3)
        assert x.shared_by == 4 and x.link.startswith("wan ")
    # One ring alone gets the whole WAN, as before the sharing.
    (alone,) = topo.ring_links([([0, 4], 1e6)])
    assert alone.bandwidth == 10e9 and alone.shared_by == 1
    # A ring that crosses the WAN twice in each direction (dc0, dc1, dc0, dc1) shares it with
    # itself: 2 flows per direction.
    (zigzag,) = topo.ring_links([([0, 4, 1, 5], 1e6)])
    assert zigzag.bandwidth == pytest.approx(10e9 / 2)
    # A ring of one GPU has no link.
    assert topo.ring_links([([3], 1e6)])[0].bandwidth == float("inf")


def test_rings_share_a_node_uplink_with_fewer_nics_than_gpus():
    # Two nodes of 4 H100s with one NIC each (50e9 B/s): the 4 rings GPU j <-> GPU 4 + j put 4
    # flows on each uplink direction: 12.5e9 B/s each, below PCIe (64e9) and NVLink.
    h100 = lookup("H100-SXM")
    one_nic = Topology([Datacenter(h100, 2, 4, nics=1)])
    links = one_nic.ring_links([([j, 4 + j], 1e6) for j in range(4)])
    assert [x.bandwidth for x in links] == [pytest.approx(50e9 / 4)] * 4
    assert links[0].link.startswith("infiniband ")
    # Two NICs: 2 flows at full speed per NIC pair, 25e9 each.
    two = Topology([Datacenter(h100, 2, 4, nics=2)]).ring_links([([j, 4 + j], 1e6)
                                                                  for j in range(4)])
    assert two[0].bandwidth == pytest.approx(25e9)
    # Default: one NIC per GPU, nothing shared; the bottleneck is the NIC's 50e9.
    full = Topology([Datacenter(h100, 2, 4)]).ring_links([([j, 4 + j], 1e6) for j in range(4)])
    assert full[0].bandwidth == 50e9 and full[0].shared_by == 4


def _whole_graph_path(topo: Topology, a: int, b: int, nbytes: float) -> tuple[float, float]:
    """(latency, bandwidth) of the fastest path for ``nbytes`` by Dijkstra on the whole graph
    at every bandwidth floor (the search before paths were joined from pieces)."""
    best = None
    floors = sorted({e["bandwidth"] for *_, e in topo.graph.edges(data=True)})
    for floor in floors[:1] if nbytes == 0 else floors:
        view = nx.subgraph_view(
            topo.graph, filter_edge=lambda u, v, f=floor: topo.graph.edges[u, v]["bandwidth"] >= f)
        try:
            nodes = nx.dijkstra_path(view, topo.gpus[a], topo.gpus[b], weight="latency")
        except nx.NetworkXNoPath:
            continue
        lat = sum(topo.graph.edges[u, v]["latency"] for u, v in itertools.pairwise(nodes))
        bw = min(topo.graph.edges[u, v]["bandwidth"] for u, v in itertools.pairwise(nodes))
        t = lat + (0.0 if nbytes == 0 else nbytes / bw)
        if best is None or (t, lat) < best[0]:
            best = ((t, lat), (lat, bw))
    assert best is not None
    return best[1]


@pytest.mark.parametrize("topo", [
    uniform_cluster("A100-80GB", datacenters=1, nodes=3, gpus_per_node=4),
    uniform_cluster("H100-SXM", datacenters=3, nodes=2, gpus_per_node=2),
    # Slow NVLink and PCIe: some messages go around them.
    uniform_cluster("H100-SXM", datacenters=2, nodes=2, gpus_per_node=4,
                    tiers={"nvlink": TierOverride(1e9, 1e-4), "pcie": TierOverride(80e9, 1e-6),
                           "wan": TierOverride(200e9, 1e-3)}),
    Topology([Datacenter(lookup("L4"), 2, 4), Datacenter(lookup("A100-40GB"), 1, 8)]),
    Topology([Datacenter.of_groups([NodeGroup(lookup("L4"), 1, 2),
                                    NodeGroup(lookup("H100-SXM"), 2, 4, nics=1)])]),
], ids=["a100-1dc", "h100-3dc", "slow-nvlink", "pcie-only", "groups"])
def test_joined_paths_equal_whole_graph_dijkstra(topo: Topology) -> None:
    # Brute force: every pair of GPUs and several message sizes, against Dijkstra on the
    # whole graph at each bandwidth floor: the same latency and bottleneck bandwidth.
    n = topo.num_gpus
    for nbytes in (0.0, 1e3, 1e6, 1e9):
        for a in range(n):
            for b in range(n):
                if a != b:
                    assert topo.link(a, b, nbytes) == pytest.approx(
                        _whole_graph_path(topo, a, b, nbytes), rel=1e-12), (a, b, nbytes)
