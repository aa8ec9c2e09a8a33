"""The model/cluster form of config.yaml: validation messages, problem building, the CLI."""

import json
from pathlib import Path

import pytest

from pipeopt.config import ConfigError, load_config, parse_config
from pipeopt.costs import describe_partition

ROOT = Path(__file__).resolve().parents[1]


def cfg(**sections):
    base = {"pipeline": {"devices": 4, "microbatches": 8},
            "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1000},
            "cluster": {"gpu": "A100-80GB", "gpus_per_node": 4}}
    for key, val in sections.items():
        if val is None:
            base.pop(key, None)
        elif isinstance(val, dict) and key in base and key != "pipeline":
            base[key] = {**base[key], **val}
        else:
            base[key] = val
    return base


@pytest.mark.parametrize(("change", "message"), [
    ({"model": {"hidden": -1}}, r"^model\.hidden: must be > 0, got -1"),
    ({"cluster": {"gpu": "H300"}}, r"^cluster\.gpu: unknown GPU 'H300'; did you mean 'H200'\?"),
    ({"model": {"hiden": 3}}, r"^model\.hiden: unknown key; did you mean 'hidden'\?"),
    ({"model": {"recompute": "some"}}, r"^model\.recompute: must be 'none', 'selective'"),
    ({"model": {"heads": 3}}, r"^model\.heads: must divide model\.hidden"),
    ({"model": {"preset": "llama9"}}, r"^model\.preset: unknown preset"),
    ({"stages": {"forward": 1, "backward_input": 1, "backward_weight": 1}}, r"^stages: cannot"),
    ({"links": {"latency": 0.1}}, r"^links: not used with cluster"),
    ({"model": None}, r"^model: missing"),
    ({"training": {"stage_layers": [1, 2, 3, 3]}}, r"^training\.stage_layers: must add up"),
    ({"training": {"stage_layers": [0, 2, 3, 5]}}, r"^training\.stage_layers\[0\]: must be >= 1"),
    ({"pipeline": {"devices": 16, "microbatches": 8}}, r"^pipeline\.devices: .*at least 16"),
    ({"cluster": {"compute_efficiency": 1.5}}, r"^cluster\.compute_efficiency: must be in"),
    ({"model": {"layer_costs": [{"forward": 1}]}}, r"^model\.layer_costs: cannot be combined"),
])
def test_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg(**change))


def test_problem_carries_partition_and_costs():
    c = parse_config(cfg())
    p = c.problem
    meta = dict(p.meta)
    part = meta["partition"]
    assert len(part) == 4 and part[0][0] == 0 and part[-1][1] == 10  # 8 blocks + emb + head
    assert all(b > a for a, b in part)
    assert [r["forward_s"] for r in meta["stage_costs"]] == list(p.forward)
    assert meta["layer_names"][0] == "embedding" and meta["layer_names"][-1] == "head"
    # Default memory limit: HBM minus the 10% reserve; static = params x 16 bytes.
    assert p.memory_limit[0] == pytest.approx(80 * 2**30 * 0.9)
    assert p.static_memory[0] == pytest.approx(meta["stage_costs"][0]["params"] * 16)
    assert len(p.latency) == 4 and p.latency[0][1] > 0
    assert c.extra("partition") == part
    json.dumps(p.to_dict())  # JSON-able
    assert "embedding" in describe_partition(c)


def test_explicit_partition_and_memory_limit():
    c = parse_config(cfg(training={"stage_layers": [1, 4, 4, 1]}, memory={"limit": 1e12}))
    assert dict(c.problem.meta)["partition"] == [[0, 1], [1, 5], [5, 9], [9, 10]]
    assert c.problem.memory_limit == (1e12,) * 4


def test_infeasible_memory_explains():
    with pytest.raises(ConfigError, match=r"^memory: .*stage \d.*over its limit of"):
        parse_config(cfg(memory={"limit": 1e6}))


def test_layer_costs_form_and_heterogeneous_cluster():
    data = cfg(
        cluster={"datacenters": [{"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 2},
                                 {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 2}]},
        training={"partition": "ilp"})
    data["model"] = {"layer_costs": [{"name": "in", "forward": 0.5, "params": 1e6},
                                     {"name": "mid", "count": 6, "forward_flops": 1e12,
                                      "activation_bytes": 1e8, "output_bytes": 1e7},
                                     {"name": "out", "forward": 0.7}]}
    c = parse_config(data)
    meta = dict(c.problem.meta)
    assert meta["cross_datacenter_cuts"] == 1
    assert [d["model"] for d in meta["devices"]] == ["H100-SXM"] * 2 + ["A100-80GB"] * 2
    assert meta["layer_names"] == ["in"] + [f"mid{i}" for i in range(6)] + ["out"]
    assert c.problem.message_size[1] in (1e7, 0.0)


def test_partition_for_one_in_flight_when_1f1b_counts_fit_nothing():
    # GPT-2 small on 4 L4s, 2.1 GB each: with 1F1B's in-flight counts (stage 1 holds 3
    # micro-batches, ~3.3 GiB) no partition fits, with one micro-batch in flight per stage one
    # does, and a memory-aware schedule then keeps the limit.
    import pipeopt

    doc = {"pipeline": {"devices": 4, "microbatches": 8},
           "model": {"preset": "gpt2-small", "seq_len": 1024, "micro_batch_size": 4},
           "cluster": {"gpu": "L4", "gpus_per_node": 4}, "memory": {"limit": 2.1e9}}
    c = parse_config(doc)
    rep = dict(c.problem.meta)["partition_search"]
    assert "1f1b in-flight counts fit no partition" in rep["inflight_fallback"]
    sched = pipeopt.solve(c.problem, "greedy")
    assert max(sched.peak_memory) <= 2.1e9
    with pytest.raises(ConfigError, match="even with one micro-batch in flight per stage"):
        parse_config({**doc, "memory": {"limit": 1.9e9}})


def test_too_many_layers_for_the_partition_tables_get_the_uniform_split():
    c = parse_config(cfg(pipeline={"devices": 16, "microbatches": 32},
                         model={"layers": 3000, "hidden": 256, "heads": 4, "seq_len": 128,
                                "vocab": 1000}, cluster={"gpus_per_node": 8,
                                                         "nodes_per_datacenter": 2}))
    rep = dict(c.problem.meta)["partition_search"]
    assert rep["method"] == "uniform" and "too large for the dp search" in rep["note"]
    assert describe_partition(c).count("note: 16 stages x 3002 layers is too large") == 1


def test_overrides_and_virtual_stages():
    c = parse_config(cfg(pipeline={"devices": 2, "microbatches": 4, "virtual_stages": 2},
                         model={"overrides": [{"layers": [0, 1], "time_scale": 3.0}]}))
    assert c.problem.stages == 4
    # Several stages per device: the ILP prices each device's summed stages (exact here).
    rep = dict(c.problem.meta)["partition_search"]
    assert rep["method"] == "ilp" and rep["exact"] is True
    ilp = parse_config(cfg(pipeline={"devices": 2, "microbatches": 4, "virtual_stages": 2},
                           model={"overrides": [{"layers": [0, 1], "time_scale": 3.0}]},
                           training={"partition": "ilp"}))
    ilp_rep = dict(ilp.problem.meta)["partition_search"]
    assert ilp_rep["method"] == "ilp"
    assert ilp_rep["analytic_objective_s"] == pytest.approx(rep["analytic_objective_s"])


def test_llama70b_example_solves_through_the_cli(tmp_path, capsys):
    from pipeopt.cli import main

    out = tmp_path / "s.json"
    rc = main(["solve", str(ROOT / "examples" / "llama70b_2dc.yaml"), "--method", "1f1b",
               "-q", "-o", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    meta = doc["problem"]["meta"]
    assert len(meta["partition"]) == 8 and meta["partition"][-1][1] == 82
    assert len(meta["stage_costs"]) == 8 and meta["cross_datacenter_cuts"] == 1
    assert doc["problem"]["forward"] == [r["forward_s"] for r in meta["stage_costs"]]


def test_gpt_small_example_loads():
    c = load_config(ROOT / "examples" / "gpt_small.yaml")
    sizes = [b - a for a, b in dict(c.problem.meta)["partition"]]
    assert sizes[-1] < sizes[1]  # the heavy LM head gets a short stage


def test_data_parallel_adds_gradient_reduction():
    # 4 nodes of 4 A100s: one pipeline replica per node, so each rank's ring of 4 replicas
    # crosses InfiniBand: latency PCIe + IB (2 + 5 us), bottleneck the A100's PCIe Gen4
    # (32e9 B/s, below IB's 50e9).
    cluster = {"gpus_per_node": 4, "nodes_per_datacenter": 4}
    one = parse_config(cfg(cluster=cluster)).problem
    four = parse_config(cfg(cluster=cluster, training={"data_parallel": 4})).problem
    assert sum(one.grad_reduce) == 0
    assert four.forward == one.forward
    rows = dict(four.meta)["stage_costs"]
    for k, r in enumerate(rows):
        chunk = r["params"] * 2 / 4  # grad_bytes_per_param 2, a quarter per ring step
        assert four.grad_reduce[k] == pytest.approx(2 * 3 * (7e-6 + chunk / 32e9))
    assert dict(four.meta)["cost_model"]["data_parallel"] == 4
    # The replicas must fit the cluster: 4 ranks x 4 replicas do not fit one node of 4.
    with pytest.raises(ConfigError, match=r"training\.data_parallel: .*4 pipeline ranks x 4 "
                                          r"data-parallel replicas"):
        parse_config(cfg(training={"data_parallel": 4}))


def test_explicit_config_has_no_partition_table():
    c = parse_config({"pipeline": {"devices": 2, "microbatches": 2},
                      "stages": {"forward": 1, "backward_input": 1, "backward_weight": 1}})
    assert describe_partition(c) == ""


def _profile(tmp_path):
    """A hand-written profile: embedding (token ids: no input gradient), two blocks, head."""
    layer = {"params": 10.0, "activation_bytes": 100.0, "output_bytes": 8.0}
    rows = [("embedding", 0.1, 0.0, 0.2, 0.15, False), ("block0", 1.0, 1.2, 0.9, 1.8, True),
            ("block1", 1.0, 1.2, 0.9, 1.8, True), ("head", 0.5, 0.6, 0.4, 0.8, True)]
    doc = {"format": "pipeopt.profile/v1", "layers": [
        {"name": n, "forward_s": f, "backward_input_s": b, "backward_weight_s": w,
         "backward_s": fused, "input_grad": ig, **layer}
        for n, f, b, w, fused, ig in rows]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return path


def test_fused_schedule_on_a_split_profile_pays_the_measured_fused_backward(tmp_path):
    """Issue 17: 1F1B (which fuses the backward) solved or compared on a split-backward problem
    from a profile is priced at the profile's fused backward, not at the split's B + W."""
    from pipeopt.solvers import compare, solve

    c = parse_config({"pipeline": {"devices": 2, "microbatches": 4, "split_backward": True},
                      "model": {"profile": str(_profile(tmp_path))}, "cluster": {"gpu": "L4"},
                      "training": {"stage_layers": [2, 2]}})
    p = c.problem
    assert dict(p.meta)["fused_backward"] == pytest.approx([0.15 + 1.8, 1.8 + 0.8])
    assert p.backward_input[1] + p.backward_weight[1] == pytest.approx(1.8 + 1.3)  # split
    (row,) = compare(p, ["1f1b"])
    for sched in (solve(p, "1f1b"), row.schedule):
        assert sched is not None
        assert sched.problem.durations["B"] == pytest.approx((0.15 + 1.8, 1.8 + 0.8))
    zb = solve(p, "zb-h1")  # a split schedule still pays the split
    assert zb.problem.durations["B"] == pytest.approx((0.0, 1.8))


def test_profile_typos_and_deep_nesting_are_named(tmp_path):
    path = _profile(tmp_path)
    doc = json.loads(path.read_text())
    doc["layers"][1]["backwrd_s"] = doc["layers"][1].pop("backward_s")
    path.write_text(json.dumps(doc))
    base = {"pipeline": {"devices": 2, "microbatches": 4}, "model": {"profile": str(path)},
            "cluster": {"gpu": "L4"}}
    with pytest.raises(ConfigError, match=r"layers\[1\]\.backwrd_s: unknown field; did you "
                                          r"mean 'backward_s'\?"):
        parse_config(base)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_config(base)


@pytest.mark.parametrize("split", [True, False])
def test_partition_search_costs_stages_as_the_problem_does(tmp_path, split):
    """For every partition, the search's stage time is the problem's F + B + W of that stage
    (stage 0's fused backward included): else the search optimises another problem."""
    from pipeopt.config import ConfigFile
    from pipeopt.costs.build import make_plan
    from pipeopt.partition import evaluate

    path = _profile(tmp_path)
    doc = {"pipeline": {"devices": 2, "microbatches": 4, "split_backward": split},
           "model": {"profile": str(path)}, "cluster": {"gpu": "L4"}}
    plan = make_plan(ConfigFile.model_validate(doc))
    costs = plan.chain_costs()
    for part in (((0, 1), (1, 4)), ((0, 2), (2, 4)), ((0, 3), (3, 4))):
        prob = plan.problem(part)
        want = [prob.forward[k] + prob.backward_input[k] + prob.backward_weight[k]
                for k in range(2)]
        assert evaluate(costs, part).stage_time == pytest.approx(want)


@pytest.mark.parametrize("split", [True, False])
def test_profile_times_follow_the_executor(tmp_path, split):
    """Split backward: stage 0 (token-id input) has no B, its W is the whole fused backward;
    other stages pay the split path's B and W. Fused backward: B + W is the measured fused
    time on every stage."""
    path = _profile(tmp_path)
    c = parse_config({"pipeline": {"devices": 2, "microbatches": 4, "split_backward": split},
                      "model": {"profile": str(path)}, "cluster": {"gpu": "L4"},
                      "training": {"stage_layers": [2, 2]}})
    p = c.problem
    assert p.forward == pytest.approx((1.1, 1.5))
    if split:
        assert p.backward_input == pytest.approx((0.0, 1.8))
        assert p.backward_weight == pytest.approx((0.15 + 1.8, 1.3))
        assert p.weight_grad_memory[0] == p.activation_memory[0]  # all kept until W
    else:
        fused = [b + w for b, w in zip(p.backward_input, p.backward_weight, strict=True)]
        assert fused == pytest.approx([0.15 + 1.8, 1.8 + 0.8])


def test_node_groups_of_different_gpus_in_one_datacenter():
    # Two H100s and two A100s on one fabric: no cross-datacenter cut, each rank on its GPU.
    data = cfg(cluster={"datacenters": [{"nodes": [
        {"gpu": "H100-SXM", "count": 1, "gpus_per_node": 2},
        {"gpu": "A100-80GB", "count": 1}]}], "gpus_per_node": 2})
    c = parse_config(data)
    meta = dict(c.problem.meta)
    assert [d["model"] for d in meta["devices"]] == ["H100-SXM"] * 2 + ["A100-80GB"] * 2
    assert [d["datacenter"] for d in meta["devices"]] == [0] * 4
    assert meta["cross_datacenter_cuts"] == 0
    # Rank 1 -> 2 crosses nodes over InfiniBand (default tiers): PCIe + IB latency, no WAN.
    ib = 5e-6
    assert c.problem.latency[1][2] == pytest.approx(2e-6 + ib)
    # The H100s run the same layers faster than the A100s (989.4 vs 312 TFLOP/s peak).
    rows = meta["stage_costs"]
    per_layer = [r["forward_s"] / (r["layers"][1] - r["layers"][0]) for r in rows[1:3]]
    assert per_layer[0] < per_layer[1]


def test_partial_tier_override_in_the_model_form():
    base = cfg(cluster={"gpus_per_node": 1, "nodes_per_datacenter": 2, "datacenters": 2})
    full = parse_config(base).problem
    only_latency = parse_config(cfg(cluster={
        **base["cluster"], "tiers": {"wan": {"latency": 0.02}}})).problem
    only_bw = parse_config(cfg(cluster={
        **base["cluster"], "tiers": {"wan": {"bandwidth": 1e9}}})).problem
    # Device 1 -> 2 crosses the WAN: the latency changes by 20 - 5 ms, the bandwidth kept.
    assert only_latency.latency[1][2] == pytest.approx(full.latency[1][2] + 0.015)
    assert only_latency.bandwidth[1][2] == full.bandwidth[1][2] == 12.5e9
    assert only_bw.latency[1][2] == pytest.approx(full.latency[1][2])
    assert only_bw.bandwidth[1][2] == 1e9


@pytest.mark.parametrize(("cluster", "message"), [
    ({"tiers": {"wan": {}}}, r"^cluster\.tiers\.wan: give bandwidth \(bytes/s\), latency"),
    ({"tiers": {"wan": {"latency": -1}}}, r"^cluster\.tiers\.wan\.latency: must be >= 0"),
    ({"datacenters": [{"nodes": []}]}, r"^cluster\.datacenters\[0\]\.nodes: an empty list"),
    ({"datacenters": [{"nodes": 0}]}, r"^cluster\.datacenters\[0\]\.nodes: must be >= 1"),
    ({"datacenters": [{"nodes": [{"gpu": "H100-SXM"}]}]},
     r"^cluster\.datacenters\[0\]\.nodes\[0\]\.count: "),
    ({"datacenters": [{"nodes": [{"count": 1, "gpu": "H300"}]}]},
     r"^cluster\.datacenters\[0\]\.nodes\[0\]\.gpu: unknown GPU 'H300'"),
    ({"datacenters": [{"nodes": [{"count": 1, "gpus": 4}]}]},
     r"^cluster\.datacenters\[0\]\.nodes\[0\]\.gpus: unknown key"),
    ({"datacenters": [{"nodes": [{"count": 0}]}]},
     r"^cluster\.datacenters\[0\]\.nodes\[0\]\.count: must be >= 1"),
])
def test_cluster_group_and_tier_errors_name_the_key(cluster, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg(cluster=cluster))


def test_data_parallel_rings_divide_the_wan_they_share():
    # Two datacenters of one node of 8 GPUs; 4 pipeline ranks x tensor_parallel 2 fill one
    # datacenter per replica. data_parallel 2: 8 rings (4 ranks x 2 tensor-parallel slots)
    # each cross the WAN both ways, so each gets 12.5e9 / 8 B/s (it got all 12.5e9 before).
    data = cfg(model={"tensor_parallel": 2}, training={"data_parallel": 2},
               cluster={"gpus_per_node": 8, "datacenters": 2})
    c = parse_config(data)
    lat = 2e-6 + 5e-6 + 5e-3  # PCIe + InfiniBand (halves at each end) + WAN
    bw = 12.5e9 / 8
    meta = dict(c.problem.meta)
    for k, r in enumerate(meta["stage_costs"]):
        chunk = r["params"] * 2 / 2  # grad_bytes_per_param 2, half per ring step
        assert c.problem.grad_reduce[k] == pytest.approx(2 * 1 * (lat + chunk / bw))
    rings = meta["grad_reduce_rings"]
    assert [x["shared_by"] for x in rings] == [8] * 4
    assert all(x["rings"] == 2 and x["link"] in ("wan dc0 -> dc1", "wan dc1 -> dc0")
               for x in rings)
    assert rings[0]["bandwidth"] == pytest.approx(bw)
    # One NIC per node instead of one per GPU: the uplink's 50e9 B/s over 8 flows is
    # 6.25e9, still above the WAN share; the WAN stays the bottleneck.
    one_nic = parse_config(cfg(model={"tensor_parallel": 2}, training={"data_parallel": 2},
                               cluster={"gpus_per_node": 8, "datacenters": 2,
                                        "nics_per_node": 1}))
    assert one_nic.problem.grad_reduce == pytest.approx(c.problem.grad_reduce)
    # With the WAN's bandwidth raised to 1e12 B/s, the single NIC (6.25e9 each) paces them.
    fast = parse_config(cfg(model={"tensor_parallel": 2}, training={"data_parallel": 2},
                            cluster={"gpus_per_node": 8, "datacenters": 2, "nics_per_node": 1,
                                     "tiers": {"wan": {"bandwidth": 1e12}}}))
    ring = dict(fast.problem.meta)["grad_reduce_rings"][0]
    assert ring["bandwidth"] == pytest.approx(50e9 / 8) and ring["link"].startswith("infiniband")


def _chunk_cfg(**pipeline):
    return cfg(pipeline={"devices": 2, "microbatches": 4, **pipeline},
               model={"layers": 8, "hidden": 1024, "heads": 8, "seq_len": 1024,
                      "vocab": 32000},
               solver={"method": "auto", "time_limit": 20, "time_tolerance": 0.0})


def test_auto_chooses_the_chunks_per_device_in_the_model_form():
    from pipeopt.costs.chunks import chunk_variants, solve_config
    from pipeopt.solvers import solve

    c = parse_config(_chunk_cfg())
    variants = chunk_variants(c)
    assert [v.label for v in variants] == ["v=1 loop", "v=2 vshape", "v=2 loop"]
    assert [v.problem.stages for v in variants] == [2, 4, 4]
    # Each variant partitions the same 10 layers (embedding, 8 blocks, head) on its own.
    for v in variants:
        part = dict(v.problem.meta)["partition"]
        assert part[0][0] == 0 and part[-1][1] == 10 and len(part) == v.problem.stages
    times = {v.label: solve(v.problem, "auto", time_limit=5, time_tolerance=0.0).iteration_time
             for v in variants}
    chosen = solve_config(c, "auto", time_limit=15, time_tolerance=0.0)
    # The fastest of the three, as auto run on each alone finds it (two chunks win here).
    assert chosen.iteration_time == pytest.approx(min(times.values()), rel=1e-6)
    assert chosen.problem.virtual_stages == 2
    assert chosen.solver.detail("chunks").startswith("chose v=2")
    # A pipeline that fixes the chunking keeps it; so does any method other than auto.
    fixed = parse_config(_chunk_cfg(virtual_stages=1))
    assert [v.label for v in chunk_variants(fixed)] == ["v=1 loop"]
    assert solve_config(fixed, "auto", time_limit=5).problem.virtual_stages == 1
    assert solve_config(c, "1f1b").problem.virtual_stages == 1


def test_chunk_variant_without_enough_layers_says_why():
    from pipeopt.costs.chunks import chunk_variants

    c = parse_config(cfg(pipeline={"devices": 4, "microbatches": 8},
                         model={"layers": 4}))  # 6 layers: 8 stages do not fit
    notes = {v.label: v.note for v in chunk_variants(c)}
    assert notes["v=2 vshape"] == "8 stages need as many layers, the model has 6"


def test_full_recompute_does_not_defer_w_it_cannot_count():
    # recompute: full keeps only each block's input, 2 B x 128 x 256 = 65,536 bytes; a deferred
    # W would hold the linear layers' inputs (h, h, h, f) and output gradients (h + 2 kv_dim,
    # h, f, h) that B recomputed: 2 x 128 x (1792 + 2304) = 1,048,576 bytes (GeLU, f = 4h).
    full = parse_config(cfg(model={"recompute": "full"}))
    assert not full.problem.split_backward
    notes = dict(full.problem.meta)["notes"]
    assert notes[0].startswith("backward fused (split_backward: false): with recompute: full")
    assert "1.049e+06 bytes" in notes[0] and "6.554e+04 bytes" in notes[0]
    assert "note: backward fused" in describe_partition(full)
    # Asked for explicitly, the split backward is refused with the reason and the ways out.
    with pytest.raises(ConfigError, match=r"^pipeline\.split_backward: with recompute: full a "
                                          r"deferred W holds .*1\.049e\+06 bytes.*; set "
                                          r"split_backward: false .* or model\.recompute: "
                                          "selective"):
        parse_config(cfg(pipeline={"devices": 4, "microbatches": 8, "split_backward": True},
                         model={"recompute": "full"}))
    # One block overridden to full recompute is enough; selective keeps the split backward
    # (its W memory is among the kept activations: exact).
    one = parse_config(cfg(model={"overrides": [{"layers": [3], "recompute": "full"}]}))
    assert not one.problem.split_backward and "block3" in dict(one.problem.meta)["notes"][0]
    assert parse_config(cfg(model={"recompute": "selective"})).problem.split_backward


def test_solve_prints_the_chosen_chunks_and_their_partition(tmp_path, capsys):
    import yaml

    from pipeopt.cli import main

    path, out = tmp_path / "c.yaml", tmp_path / "s.json"
    path.write_text(yaml.safe_dump(_chunk_cfg()))
    assert main(["solve", str(path), "--time-limit", "15", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chunks        chose v=2 vshape" in text
    # The configured table (2 stages) and the chosen one (4 stages, devices 0 1 1 0).
    assert text.count("partition: ") == 2
    saved = json.loads(out.read_text())["problem"]
    assert saved["virtual_stages"] == 2 and saved["placement"] == "vshape"


def test_partition_line_says_when_uniform_is_over_the_memory_limit():
    """The partition line compares the chosen partition's analytic estimate with the uniform
    one's; a uniform split that is faster but does not fit must say so, or the choice reads
    like a bug (seen on a 128k-token full-recompute Llama-70B: dp 431 s vs uniform 402.6 s)."""
    import dataclasses

    c = parse_config(cfg())
    rep = dict(dict(c.problem.meta)["partition_search"])
    assert rep["uniform_fits"] is True
    line = next(x for x in describe_partition(c).splitlines() if x.startswith("partition:"))
    assert "vs uniform" in line and "over the memory limit" not in line
    meta = {**dict(c.problem.meta), "partition_search": {**rep, "uniform_fits": False}}
    over = dataclasses.replace(c, problem=dataclasses.replace(c.problem,
                                                              meta=tuple(meta.items())))
    line = next(x for x in describe_partition(over).splitlines() if x.startswith("partition:"))
    assert "(over the memory limit)" in line


def _with_overheads(path, overheads=None, step=None):
    doc = json.loads(path.read_text())
    if overheads is not None:
        doc["overheads"] = overheads
    if step is not None:
        for rec in doc["layers"]:
            rec["step_s"] = step
    path.write_text(json.dumps(doc))
    return path


def test_profile_overheads_price_actions_messages_and_the_step_tail(tmp_path):
    """Issue 17 item 4: the runtime's fixed costs measured into a profile reach the problem:
    ``action_s`` on every F, B and W (once on a fused backward), ``message_s`` on the link,
    and each stage's step tail (``step_s`` + its layers' optimizer steps) after its last W.
    One micro-batch on 2 stages, so the step time is computed by hand."""
    from pipeopt.solvers import solve

    base = {"pipeline": {"devices": 2, "microbatches": 1}, "cluster": {"gpu": "L4"},
            "training": {"stage_layers": [2, 2]}}
    plain = parse_config({**base, "model": {"profile": str(_profile(tmp_path))}}).problem
    path = _with_overheads(_profile(tmp_path), {"action_s": 0.01, "message_s": 0.02,
                                                "step_s": 0.03, "how": "by hand"}, 0.001)
    p = parse_config({**base, "model": {"profile": str(path)}}).problem
    assert p.forward == pytest.approx((1.11, 1.51))
    assert p.backward_input == pytest.approx((0.01, 1.81))
    assert p.backward_weight == pytest.approx((1.96, 1.31))
    assert dict(p.meta)["fused_backward"] == pytest.approx([1.96, 2.61])  # one action each
    assert p.latency[0][1] == pytest.approx(plain.latency[0][1] + 0.02)
    assert p.latency[0][0] == 0.0
    assert p.grad_reduce == pytest.approx((0.032, 0.032))  # 0.03 + 2 layers x 0.001
    # F0, F1, B1, then B0 and W0 on device 0 (the critical path), W1 beside them.
    d = p.delay(0, 1)
    zb = solve(p, "zb-h1")
    assert zb.makespan == pytest.approx(1.11 + d + 1.51 + 1.81 + d + 0.01 + 1.96)
    assert zb.iteration_time == pytest.approx(zb.makespan + 0.032)
    assert solve(plain, "zb-h1").iteration_time == pytest.approx(
        1.1 + plain.delay(0, 1) + 1.5 + 1.8 + plain.delay(0, 1) + 0.0 + 1.95)
    fused = parse_config({**base, "pipeline": {"devices": 2, "microbatches": 1,
                                               "split_backward": False},
                          "model": {"profile": str(path)}}).problem
    assert fused.durations["B"] == pytest.approx((1.96, 2.61))
    # model.overheads replaces the profile's; the layers' optimizer steps stay
    given = parse_config({**base, "model": {"profile": str(path), "overheads": {
        "action_s": 0.0, "step_s": 0.5}}}).problem
    assert given.forward == pytest.approx(plain.forward)
    assert given.grad_reduce == pytest.approx((0.502, 0.502))


def test_absent_overheads_leave_the_problem_unchanged(tmp_path):
    """A profile without overheads, or zero overheads, gives exactly the problem it gave
    before they existed (every makespan unchanged)."""
    from pipeopt.costs.build import with_overheads
    from pipeopt.costs.profile import Overheads
    from pipeopt.solvers import solve

    base = {"pipeline": {"devices": 2, "microbatches": 4}, "cluster": {"gpu": "L4"},
            "training": {"stage_layers": [2, 2]}}
    plain = parse_config({**base, "model": {"profile": str(_profile(tmp_path))}}).problem
    assert "overheads" not in dict(plain.meta) and not any(plain.grad_reduce)
    assert with_overheads(plain, Overheads(), [0.0, 0.0]) is plain
    zero = parse_config({**base, "model": {"profile": str(_profile(tmp_path)), "overheads": {
        "action_s": 0, "message_s": 0, "step_s": 0}}}).problem
    assert zero == plain
    for method in ("1f1b", "zb-h1", "greedy"):
        assert solve(zero, method).makespan == solve(plain, method).makespan


@pytest.mark.parametrize(("overheads", "step", "phrase"), [
    ({"action_s": -1}, None, r"overheads\.action_s: expected a number >= 0 \(seconds\), "
                             r"got -1"),
    ({"message_s": "1ms"}, None, r"overheads\.message_s: expected a number >= 0"),
    ([0.1], None, r"overheads: expected a mapping of action_s, message_s, step_s"),
    ({"acton_s": 0.1}, None, r"overheads\.acton_s: unknown field; did you mean 'action_s'"),
    (None, -0.5, r"layers\[0\]\.step_s: expected a number >= 0, got -0\.5"),
])
def test_bad_profile_overheads_are_named(tmp_path, overheads, step, phrase):
    path = _with_overheads(_profile(tmp_path), overheads, step)
    with pytest.raises(ConfigError, match=r"^model\.profile: .*" + phrase):
        parse_config({"pipeline": {"devices": 2, "microbatches": 4},
                      "model": {"profile": str(path)}, "cluster": {"gpu": "L4"}})


@pytest.mark.parametrize(("overheads", "phrase"), [
    ({"action_s": -0.1}, "model.overheads.action_s"),
    ({"step": 1.0}, "model.overheads.step"),
    ({"message_s": True}, "model.overheads.message_s"),
])
def test_bad_config_overheads_are_named(tmp_path, overheads, phrase):
    with pytest.raises(ConfigError) as err:
        parse_config({"pipeline": {"devices": 2, "microbatches": 4}, "cluster": {"gpu": "L4"},
                      "model": {"profile": str(_profile(tmp_path)), "overheads": overheads}})
    assert str(err.value).startswith(phrase), str(err.value)
