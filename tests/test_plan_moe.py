"""Mixture-of-experts models in ``pipeopt plan`` (issue 16): the MoE keys of the plan's model
form, expert-parallel candidates, one candidate's costs by hand, refusals, the CLI's table
and JSON, and the example."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeopt.cli import main
from pipeopt.config import ConfigError, load_config
from pipeopt.config import parse_config as load_config_data
from pipeopt.plan import Candidate, enumerate_candidates, estimate, load_plan, parse_plan, plan
from pipeopt.plan.candidates import model_plan
from pipeopt.plan.search import _Context, _Task

ROOT = Path(__file__).resolve().parents[1]

# A tiny MoE transformer (4 blocks, 4 SwiGLU experts of width 128, top-2) on 2 nodes of 2
# GPUs, timed exactly from FLOPs at 1e12 FLOP/s. NVLink 1 GB/s and 1 us; PCIe so slow to
# start (1 ms) that NVLink carries every hop within a node; InfiniBand 0.1 GB/s and 10 us.
MOE = {"experts": 4, "top_k": 2, "expert_ffn": 128}
TINY_MOE_MODEL = {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128,
                  "ffn_hidden": 128, "activation": "swiglu", "norm": "rmsnorm", "bias": False,
                  "position_embedding": "rotary", "dropout": False, "moe": dict(MOE)}
TINY_CLUSTER = {"gpu": "A100-80GB", "nodes_per_datacenter": 2, "gpus_per_node": 2,
                "peak_flops": 1e12, "compute_efficiency": 1.0,
                "tiers": {"nvlink": {"bandwidth": 1e9, "latency": 1e-6},
                          "pcie": {"bandwidth": 1e12, "latency": 1e-3},
                          "infiniband": {"bandwidth": 1e8, "latency": 1e-5}}}


def tiny_moe(**plan_keys: Any) -> dict[str, Any]:
    model = {**TINY_MOE_MODEL, "moe": dict(MOE)}
    return {"model": model, "cluster": {**TINY_CLUSTER},
            "training": {"global_batch_size": 8},
            "plan": {"time_limit": 120, "screen_time_limit": 0.5, "micro_batch_size": [1, 2],
                     **plan_keys}}


def test_moe_candidates_carry_ep_dividing_experts_and_dp() -> None:
    spec = parse_plan(tiny_moe())
    assert spec.moe is not None and spec.moe.experts == 4
    cands = enumerate_candidates(spec)
    assert {c.ep for c in cands} == {1, 2, 4}
    assert {c.tp for c in cands} == {1, 2}  # TP within a 2-GPU node, experts split too
    for c in cands:
        assert c.tp * c.pp * c.dp == 4
        assert c.ep is not None and 4 % c.ep == 0 and c.dp % c.ep == 0
        assert c.label.endswith(f" ep{c.ep}") and c.as_dict()["ep"] == c.ep
    # Every combination: (tp, pp, dp) in {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2),
    # (2, 2, 1)}, EP dividing DP and 4, b, v (only with PP > 1, PP x v at most the 6 pipeline
    # layers), recompute, ZeRO (> 0 only with DP > 1).
    expected = set()
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1)]:
        for ep in (1, 2, 4):
            for b in (1, 2):
                for v in (1, 2):
                    for rc in ("none", "selective", "full", "per_stage"):
                        for z in (0, 1):
                            if (dp % ep or (v == 2 and pp == 1) or (z and dp == 1)
                                    or pp * v > 6):
                                continue
                            expected.add(Candidate(tp, pp, dp, b, 8 // (dp * b), v, rc, z,
                                                   ep))
    assert set(cands) == expected
    # A dense model's candidates carry no ep (its JSON is unchanged).
    dense = {**tiny_moe(), "model": {k: v for k, v in TINY_MOE_MODEL.items() if k != "moe"}}
    assert all(c.ep is None and "ep" not in c.as_dict()
               for c in enumerate_candidates(parse_plan(dense)))


def test_one_moe_candidate_by_hand() -> None:
    """PP 1, DP 4, EP 2, b 1, m 2, ZeRO-1. Per MoE block and micro-batch (T = 32 tokens,
    h = 64, 4 experts of 3 x 64 x 128 weights, 2 per token, 2 per rank):
    forward 2T(h^2 + 2h^2 + h^2) = 1,048,576 (linear) + 2T^2h = 131,072 (causal attention)
    + 2ThE = 16,384 (router) + 2T x 2 x 3 x h x 128 = 3,145,728 (experts) = 4,341,760 FLOPs;
    B = linear + 2 x attention + router + experts = 4,472,832; W = linear + router + experts
    = 4,210,688. Each all-to-all sends a rank's 2T copies x h x 2 bytes = 8192 bytes over 2
    ranks of one node (NVLink): 1 us + 1/2 x 8192 / 1e9 = 5.096 us; F holds the dispatch and
    the combine, B their gradients."""
    spec = parse_plan(tiny_moe())
    c = Candidate(1, 1, 4, 1, 2, 1, "none", 1, 2)
    mp = model_plan(spec, c)
    a2a = 2 * (1e-6 + 0.5 * 8192 / 1e9)
    times = mp.layer_times(0)
    for i in range(1, 5):
        assert mp.layers[i].forward_flops == 4_341_760
        assert times[i] == pytest.approx([4_341_760 / 1e12 + a2a, 4_472_832 / 1e12 + a2a,
                                          4_210_688 / 1e12], rel=1e-12)
    # Parameters on a rank per block: attention 4h^2 + 2 norms h = 16,512, router hE = 256,
    # 2 experts 2 x 3 x 64 x 128 = 49,152; embedding and head V x h (+ the final norm h).
    assert [lc.params for lc in mp.layers] == [8192, *[65_920] * 4, 8256]
    assert mp.expert_params == (0, *[49_152] * 4, 0)
    # ZeRO-1: 4 + 12 / 4 = 7 bytes per parameter, the experts' optimizer state over their
    # DP / EP = 2 replicas: 4 + 12 / 2 = 10.
    static = (8192 + 4 * 65_920 + 8256) * 7 + 4 * 49_152 * 3
    assert static == 2_550_720
    assert mp.static_bytes(0, 6) == static
    est = estimate(spec, c, mp)
    act = sum(lc.activation_bytes for lc in mp.layers)
    assert est.memory_floor_bytes == pytest.approx(static + act, rel=1e-12)
    head = 524_288 / 1e12  # 2 T h V, each of F, B, W
    per_mb = 4 * ((4_341_760 + 4_472_832 + 4_210_688) / 1e12 + 2 * a2a) + 3 * head
    assert est.bound_s == pytest.approx(2 * per_mb, rel=1e-12)
    # Model FLOPs for MFU: 3 x forward (top-2, no capacity padding) x m x DP.
    assert est.model_flops == pytest.approx(3 * (4 * 4_341_760 + 524_288) * 2 * 4, rel=1e-12)
    # EP 4 spans both nodes: the ring's cross-node hop (PCIe 1 ms, then InfiniBand 10 us, each
    # half a tier's latency per end, at 0.1 GB/s) paces it: 3 x 1.01 ms + 3/4 x 8192 / 1e8.
    mp4 = model_plan(spec, Candidate(1, 1, 4, 1, 2, 1, "none", 1, 4))
    cross = 2 * (3 * 1.01e-3 + 0.75 * 8192 / 1e8)
    assert mp4.a2a_times[0][1] == pytest.approx([cross, cross, 0.0], rel=1e-12)


def _one_node(**plan_keys: Any) -> dict[str, Any]:
    """tiny_moe on one node of 4 GPUs (every TP and EP ring on NVLink: 1 us, 1 GB/s)."""
    data = tiny_moe(**plan_keys)
    data["cluster"] = {**TINY_CLUSTER, "nodes_per_datacenter": 1, "gpus_per_node": 4}
    return data


def test_tensor_parallel_moe_candidate_by_hand() -> None:
    """TP 2, PP 1, DP 2, EP 2, b 1, m 4 on one node (expert tensor-parallel size = TP). Per
    GPU and MoE block (T = 32, h = 64, E = 4, top-2): the attention's 1,048,576 linear and
    131,072 causal-attention FLOPs / 2 + the replicated router's 16,384 + the experts'
    3,145,728 / 2 = 2,179,072 forward; B = (1,048,576 + 2 x 131,072) / 2 + 16,384 +
    1,572,864 = 2,244,608; W = 1,048,576 / 2 + 16,384 + 1,572,864 = 2,113,536. Tensor-parallel
    collectives (sequence parallelism, the default) on the NVLink pair, an all-reduce of n
    bytes over 2 GPUs = 2 us + n / 1 GB/s: the attention's b·s·h all-reduce (4096 bytes,
    6.096 us) and half an all-reduce each of the dispatched copies' all-gather and the
    outputs' reduce-scatter (2T·h·2 = 8192 bytes, 10.192 us for both), in F and again in B.
    All-to-all: each GPU sends half the rank's 8192-byte buffers, 1 us + 1/2 x 4096 / 1e9 =
    3.048 us each, dispatch + combine in F and in B."""
    spec = parse_plan(_one_node())
    c = Candidate(2, 1, 2, 1, 4, 1, "none", 0, 2)
    mp = model_plan(spec, c)
    tp = 6.096e-6 + 10.192e-6
    a2a = 2 * 3.048e-6
    times = mp.layer_times(0)
    for i in range(1, 5):
        assert (mp.layers[i].forward_flops, mp.layers[i].backward_input_flops,
                mp.layers[i].backward_weight_flops) == (2_179_072, 2_244_608, 2_113_536)
        assert times[i] == pytest.approx([2_179_072e-12 + tp + a2a, 2_244_608e-12 + tp + a2a,
                                          2_113_536e-12], rel=1e-12)
    # Parameters per GPU and block: attention (16,512 - 2 norms of h) / 2 + 128 + router
    # hE = 8576; 2 experts of 24,576 split in halves: 24,576; embedding and head halved
    # (the head's final norm whole).
    assert [lc.params for lc in mp.layers] == [4096, *[33_152] * 4, 4160]
    assert mp.expert_params == (0, *[24_576] * 4, 0)
    # Activations per GPU and block: the dense block's with t = 2 and sequence parallelism,
    # 4 x 2 x T h / 2 + (2T(h + 2 kv) + 2Th + 3 x 2 T f + 2 a T^2) / 2 = 32,768, less its MLP
    # inner values 3 x 2 x T f / 2 = 12,288, plus the router's fp32 probabilities 4TE = 512;
    # each of the 2T routed copies' input (whole) and inner values (halved): 2 x 64 x (64 +
    # 3 x 128 / 2) = 32,768.
    assert [lc.activation_bytes for lc in mp.layers][1:5] == [53_760] * 4
    # Without sequence parallelism the combined outputs' halves are all-gathered back: half
    # an all-reduce of 4096 bytes more in F and in B (3.048 us).
    data = _one_node()
    data["model"]["sequence_parallel"] = False
    no_sp = model_plan(parse_plan(data), c).layer_times(0)
    assert no_sp[1, :2] - times[1, :2] == pytest.approx([3.048e-6, 3.048e-6], rel=1e-9)
    # The model form builds the same problem from tensor_parallel: 2 (what --config-out
    # writes and pipeopt solve takes).
    form = {**_model_form(data_parallel=2, zero_stage=0),
            "cluster": {**TINY_CLUSTER, "nodes_per_datacenter": 1, "gpus_per_node": 4}}
    form["model"] = {**form["model"], "tensor_parallel": 2}
    form["pipeline"] = {"devices": 1, "microbatches": 4}
    problem = load_config_data(form).problem
    head_f, emb_f = times[5, 0], times[0, 0]
    assert problem.forward[0] == pytest.approx(emb_f + 4 * times[1, 0] + head_f, rel=1e-12)


def test_full_and_per_stage_recompute_of_moe_blocks_by_hand() -> None:
    """The TP-2 candidate of test_tensor_parallel_moe_candidate_by_hand with full
    recomputation: each MoE block keeps only its input (2 bytes x T h / 2 with sequence
    parallelism = 2048 bytes) and its B runs the forward again: 2,244,608 + 2,179,072 =
    4,423,680 FLOPs, the forward's tensor-parallel collectives (16.288 us) and all-to-all
    (6.096 us) again; the backward is fused (full recomputation) and the recomputing backward
    holds the block's other activations, 53,760 - 2048 bytes, while it runs. With per_stage
    every stage picks its mode among the three MoE worlds and the problem is built."""
    spec = parse_plan(_one_node())
    mp = model_plan(spec, Candidate(2, 1, 2, 1, 4, 1, "full", 0, 2))
    assert not mp.split_backward and "block0: 4.531e+04 bytes" in mp.notes[0]
    tp, a2a = 6.096e-6 + 10.192e-6, 2 * 3.048e-6
    for i in range(1, 5):
        lc = mp.layers[i]
        assert (lc.forward_flops, lc.backward_input_flops, lc.backward_weight_flops) == (
            2_179_072, 4_423_680, 2_113_536)
        assert (lc.activation_bytes, lc.backward_transient_bytes) == (2048, 53_760 - 2048)
        assert mp.layer_times(0)[i] == pytest.approx(
            [2_179_072e-12 + tp + a2a, 4_423_680e-12 + 2 * (tp + a2a), 2_113_536e-12],
            rel=1e-12)
    # TP 1 (the first by-hand candidate): the input 2 x T h = 4096 bytes, B + F FLOPs and
    # both all-to-all pairs (the whole 8192-byte buffers: 5.096 us each) in B.
    tp1 = model_plan(spec, Candidate(1, 1, 4, 1, 2, 1, "full", 1, 2))
    assert tp1.layers[1].activation_bytes == 4096
    assert tp1.layers[1].backward_input_flops == 4_472_832 + 4_341_760
    whole = 2 * (1e-6 + 0.5 * 8192 / 1e9)
    assert tp1.a2a_times[0][1] == pytest.approx([whole, 2 * whole, 0.0], rel=1e-12)
    ctx = _Context(spec)
    per = Candidate(2, 1, 2, 1, 4, 1, "per_stage", 0, 2)
    est = estimate(spec, per, model_plan(spec, per))
    lows = [estimate(spec, c, model_plan(spec, c))
            for c in (Candidate(2, 1, 2, 1, 4, 1, m, 0, 2) for m in ("none", "full"))]
    # Its bound takes each layer's least time over the modes, its floor the least bytes.
    assert est.bound_s == pytest.approx(lows[0].bound_s, rel=1e-12)
    assert est.memory_floor_bytes == pytest.approx(lows[1].memory_floor_bytes, rel=1e-12)
    res = ctx.evaluate(_Task(0, per, "screen", 2.0, (), None, 0))
    assert res.status == "scheduled", res.reason
    assert res.step_time_s >= res.bound_s * (1 - 1e-9)
    # Under a limit that only full recomputation meets, per_stage picks it.
    tight = _one_node()
    tight["memory"] = {"limit": lows[1].memory_floor_bytes + 60_000}
    spec2 = parse_plan(tight)
    res = _Context(spec2).evaluate(_Task(0, per, "screen", 2.0, (), None, 0))
    assert res.status == "scheduled", res.reason
    assert dict(res.schedule.problem.meta)["partition_search"]["recompute"] == ["full"]
    assert _Context(spec2).evaluate(_Task(0, Candidate(2, 1, 2, 1, 4, 1, "none", 0, 2),
                                          "screen", 2.0, (), None, 0)).status == "pruned"


def test_zero2_and_zero3_of_moe_blocks_by_hand() -> None:
    """PP 1, DP 4, EP 2, m 2 on one node (the data-parallel ring on NVLink: 1 us, 1 GB/s).
    Per MoE block a GPU stores 16,768 parameters sharded over the 4 replicas and 49,152
    routed-expert parameters over their DP / EP = 2 replicas. ZeRO-3 gathers both in F and
    in B and reduce-scatters their gradients in W: (3 us + 3/4 x 33,536 / 1e9) + (1 us +
    1/2 x 98,304 / 1e9) = 78.304 us each; ZeRO-2 only the W's. Bytes per parameter (16 in
    all): ZeRO-3 16/4 and 16/2; ZeRO-2 2 + 14/4 and 2 + 14/2. One block at a time holds
    its gathered weights and full gradients (ZeRO-3: 4 bytes x 65,920) or its gradients
    (ZeRO-2: 2 x 65,920). After the step ZeRO-2 all-gathers the updated weights: the rest
    83,520 parameters x 2 bytes over 4 (128.28 us), the experts' 196,608 x 2 over 2
    (197.608 us); ZeRO-3 nothing."""
    spec = parse_plan(_one_node(zero=[0, 1, 2, 3]))
    assert {c.zero for c in enumerate_candidates(spec) if c.ep == 2} == {0, 1, 2, 3}
    zero = 78.304e-6
    a2a = 2 * (1e-6 + 0.5 * 8192 / 1e9)
    flops = (4_341_760, 4_472_832, 4_210_688)
    rest, experts = 8192 + 4 * 16_768 + 8256, 4 * 49_152
    want = {2: (rest * 5.5 + experts * 9, 2 * 65_920, 128.28e-6 + 197.608e-6),
            3: (rest * 4 + experts * 8, 4 * 65_920, 0.0)}
    for z, (static, held, after) in want.items():
        c = Candidate(1, 1, 4, 1, 2, 1, "none", z, 2)
        mp = model_plan(spec, c)
        gathers = zero if z == 3 else 0.0
        assert mp.layer_times(0)[1] == pytest.approx(
            [flops[0] * 1e-12 + a2a + gathers, flops[1] * 1e-12 + a2a + gathers,
             flops[2] * 1e-12 + zero], rel=1e-12)
        assert mp.static_bytes(0, 6) == pytest.approx(static, rel=1e-12)
        assert mp.transient_reserve() == pytest.approx(held, rel=1e-12)
        res = _Context(spec).evaluate(_Task(0, c, "screen", 2.0, (), None, 0))
        assert res.status == "scheduled", res.reason
        problem = res.schedule.problem
        assert problem.static_memory[0] == pytest.approx(static + held, rel=1e-12)
        assert problem.grad_reduce[0] == pytest.approx(after, rel=1e-9)
        assert res.step_time_s >= res.bound_s * (1 - 1e-9)


def test_moe_schedule_and_gradient_reduction() -> None:
    """The scheduled candidate's problem: the routed experts' gradients are all-reduced over
    their DP / EP replicas, the rest over DP (PP 1, DP 4, EP 2, ZeRO-0, 2-byte gradients)."""
    spec = parse_plan(tiny_moe())
    c = Candidate(1, 1, 4, 1, 2, 1, "none", 0, 2)
    res = _Context(spec).evaluate(_Task(0, c, "screen", 5.0, (), None, 0))
    assert res.status == "scheduled", res.reason
    assert res.step_time_s is not None and res.bound_s is not None
    assert res.step_time_s >= res.bound_s * (1 - 1e-9)
    problem = res.schedule.problem
    rows = dict(problem.meta)["stage_costs"]
    assert rows[0]["expert_params"] == 4 * 49_152
    # The ring over the 4 replicas crosses the nodes (its slowest hop: 1.01 ms, 0.1 GB/s).
    lat, bw = 1.01e-3, 1e8
    dense = (8192 + 4 * 65_920 + 8256 - 4 * 49_152) * 2
    experts = 4 * 49_152 * 2
    want = (2 * 3 * (lat + dense / 4 / bw)) + (2 * 1 * (lat + experts / 2 / bw))
    assert problem.grad_reduce[0] == pytest.approx(want, rel=1e-9)


def test_ep_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^plan\.expert_parallel\[1\]: must divide "
                       r"model\.moe\.experts \(4\), got 3"):
        parse_plan(tiny_moe(expert_parallel=[2, 3]))
    # EP 4 divides the experts but not DP 2: no PP-2 candidate has it, and one built by hand
    # fails with the reason.
    spec = parse_plan(tiny_moe(expert_parallel=[4]))
    assert all(c.dp % 4 == 0 for c in enumerate_candidates(spec))
    res = _Context(spec).evaluate(_Task(0, Candidate(1, 2, 2, 1, 4, 1, "none", 0, 4),
                                        "screen", 1.0, (), None, 0))
    assert res.status == "failed"
    assert ("cost model: model.moe.expert_parallel: must divide training.data_parallel (2"
            in res.reason)


@pytest.mark.parametrize(("change", "message"), [
    ({"moe": {**MOE, "expert_parallel": 2}}, "model.moe.expert_parallel: chosen by the planner"),
    ({"moe": {**MOE, "top_k": 8}}, "model.moe.top_k: must be <= experts (4), got 8"),
    ({"moe": {**MOE, "experts": 0}}, "model.moe.experts:"),
    ({"moe": {**MOE, "capacity_factor": -1.0}}, "model.moe.capacity_factor:"),
    ({"moe": {**MOE, "dispatch_dtype": "int4"}}, "model.moe.dispatch_dtype: must be one of"),
    ({"moe": {**MOE, "routers": 2}}, "model.moe.routers:"),
    ({"moe": 8}, "model.moe: expected a mapping"),
    ({"moe": {**MOE, "first_dense": 4}}, "model.moe.first_dense: 4 leaves no MoE block"),
    ({"num_experts": 8}, "model.num_experts: mixture-of-experts keys go under model.moe"),
    ({"overrides": [{"layers": [0], "ffn_hidden": 64}]}, "model.overrides: not with model.moe"),
])
def test_bad_moe_model_keys_name_the_key(change: dict[str, Any], message: str) -> None:
    data = tiny_moe()
    data["model"].update(change)
    with pytest.raises(ConfigError) as err:
        parse_plan(data)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize(("keys", "message"), [
    ({"expert_parallel": [0]}, "plan.expert_parallel[0]: must be >= 1"),
])
def test_bad_moe_plan_keys_name_the_key(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_plan(tiny_moe(**keys))
    assert str(err.value).startswith(message), str(err.value)


def test_expert_parallel_needs_an_moe_model() -> None:
    data = tiny_moe(expert_parallel=[2])
    del data["model"]["moe"]
    with pytest.raises(ConfigError, match=r"^plan\.expert_parallel: only for a "
                       "mixture-of-experts model"):
        parse_plan(data)


def test_cli_table_has_ep_and_json_carries_it(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tiny_moe(virtual_stages=[1], recompute=["none"], micro_batch_size=[1],
                    finalists=2)
    cfg = tmp_path / "plan.yaml"
    cfg.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["plan", str(cfg), "-q", "--top", "50"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out[1].split()
    assert head[:6] == ["#", "gpus", "tp", "pp", "dp", "ep"]
    ranked = out[:next(i for i, line in enumerate(out) if line.startswith("pareto:"))]
    rows = [line.split() for line in ranked if line[:1].isdigit()]
    assert rows and {r[5] for r in rows} == {"1", "2", "4"}
    assert main(["plan", str(cfg), "-q", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == len(enumerate_candidates(parse_plan(data)))
    assert all(r["dp"] % r["ep"] == 0 for r in records)
    # --config-out: the best as a model-form config with model.moe (its EP in
    # expert_parallel) that solve takes; its problem is the one the plan scheduled.
    best_cfg, sched = tmp_path / "best.yaml", tmp_path / "best.json"
    assert main(["plan", str(cfg), "-q", "--json", "--config-out", str(best_cfg),
                 "--schedule-out", str(sched)]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    written = yaml.safe_load(best_cfg.read_text(encoding="utf-8"))
    assert written["model"]["moe"] == {**MOE, "expert_parallel": best["ep"],
                                       "capacity_factor": None, "shared_experts": 0,
                                       "shared_ffn": None, "first_dense": 0, "every": 1,
                                       "dispatch_dtype": None}
    assert written["training"]["data_parallel"] == best["dp"]
    from pipeopt.io import load_schedule

    planned = load_schedule(sched)
    assert planned.iteration_time == pytest.approx(best["step_time_s"])
    problem = load_config(best_cfg).problem
    assert problem.forward == planned.problem.forward
    assert problem.backward_input == planned.problem.backward_input
    assert problem.static_memory == planned.problem.static_memory
    assert problem.grad_reduce == planned.problem.grad_reduce
    assert main(["solve", str(best_cfg), "-q", "--method", "greedy"]) == 0


def _model_form(**training: Any) -> dict[str, Any]:
    moe = {**MOE, "expert_parallel": 2}
    return {"pipeline": {"devices": 1, "microbatches": 2},
            "model": {**TINY_MOE_MODEL, "moe": moe}, "cluster": {**TINY_CLUSTER},
            "training": {"data_parallel": 4, "zero_stage": 1, **training}}


def test_model_form_takes_model_moe() -> None:
    """``pipeopt solve``'s model form with ``model.moe``: the candidate of
    test_one_moe_candidate_by_hand (PP 1, DP 4, EP 2, ZeRO-1, m 2), the same figures."""
    problem = load_config_data(_model_form()).problem
    a2a = 2 * (1e-6 + 0.5 * 8192 / 1e9)
    head = 524_288 / 1e12
    assert problem.forward[0] == pytest.approx(4 * (4_341_760 / 1e12 + a2a) + head, rel=1e-12)
    cost = dict(problem.meta)["cost_model"]
    assert cost["model_params"] == 8192 + 4 * (16_512 + 256 + 4 * 24_576) + 8256
    rows = dict(problem.meta)["stage_costs"]
    assert rows[0]["static_bytes"] == 2_550_720


@pytest.mark.parametrize(("change", "message"), [
    ({"model": {"moe": {**MOE, "expert_parallel": 3}}}, "model.moe.expert_parallel: must "
     "divide experts (4), got 3"),
    ({"training": {"data_parallel": 2}, "model": {"moe": {**MOE, "expert_parallel": 4}}},
     "model.moe.expert_parallel: must divide training.data_parallel (2"),
    ({"model": {"moe": {**MOE, "top_k": 0}}}, "model.moe.top_k:"),
])
def test_model_form_moe_errors_name_the_key(change: dict[str, Any], message: str) -> None:
    data = _model_form()
    for section, keys in change.items():
        data[section] = {**data[section], **keys}
    with pytest.raises(ConfigError) as err:
        load_config_data(data)
    assert str(err.value).startswith(message), str(err.value)


def test_scheduled_collectives_refuse_model_moe() -> None:
    from pipeopt.graph_config import load_dataparallel

    data = _model_form(collectives="scheduled")
    with pytest.raises(ConfigError, match=r"^model\.moe: not with training\.collectives: "
                       "scheduled"):
        load_dataparallel(data)


@pytest.mark.slow
def test_example_plan_uses_expert_parallelism() -> None:
    """examples/plan_moe.yaml (Mixtral-8x7B-like on 64 H100s): the best plan shards the
    experts (EP > 1). Without EP every GPU stores all 8 experts of its blocks: 46.7B
    parameters' weights, gradients and optimizer state over PP ranks only."""
    spec = load_plan(ROOT / "examples" / "plan_moe.yaml")
    result = plan(spec, time_limit=300)
    best = result.best
    assert best is not None and best.candidate.ep is not None and best.candidate.ep > 1
    assert best.step_time_s is not None and best.bound_s is not None
    assert best.step_time_s >= best.bound_s * (1 - 1e-9)
    assert result.count("failed") == 0
