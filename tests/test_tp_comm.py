"""Tensor-parallel communication in the cost model: Megatron-LM's all-reduces per layer
(Narayanan et al., SC'21, section 3.3; Korthikanti et al. 2022, section 4.2.2 with sequence
parallelism) timed as ring all-reduces on the tensor-parallel group's links, checked by hand."""

import pytest

from pipeopt.config import parse_config
from pipeopt.costs.config import PRESETS
from pipeopt.costs.transformer import (
    TransformerShape,
    block_tp_collectives,
    tp_comm_times,
    transformer_layers,
)


def shape(name: str, **kw) -> TransformerShape:
    return TransformerShape(**{**PRESETS[name], **kw})


def test_gpt3_block_runs_two_all_reduces_each_way():
    b, s, h = 1, 2048, 12288
    nbytes = 2 * b * s * h  # bf16 b·s·h activations: 50,331,648 bytes
    assert block_tp_collectives(shape("gpt3-175b", tensor_parallel=8)) == (
        (0, 2.0, nbytes), (1, 2.0, nbytes))
    # Full recomputation replays the forward (and its two all-reduces) inside B.
    assert block_tp_collectives(shape("gpt3-175b", tensor_parallel=8, recompute="full")) == (
        (0, 2.0, nbytes), (1, 4.0, nbytes))
    # Selective recomputation replays the attention core only: no communication.
    assert block_tp_collectives(shape("gpt3-175b", tensor_parallel=8,
                                      recompute="selective"))[1] == (1, 2.0, nbytes)
    assert block_tp_collectives(shape("gpt3-175b")) == ()
    assert all(lc.tp_collectives == () for lc in transformer_layers(shape("gpt3-175b")))


def test_gpt3_block_on_eight_a100s_by_hand():
    # One ring all-reduce over t = 8 GPUs of a 50,331,648-byte buffer at NVLink's 300e9 B/s
    # per direction and 2e-6 s per hop: 2·7·2e-6 + 2·7/8 · 50331648 / 300e9
    #   = 2.8e-5 + 2.9360128e-4 = 3.2160128e-4 s; a block has two in F and two in B.
    lc = transformer_layers(shape("gpt3-175b", tensor_parallel=8))[1]
    f, b, w = tp_comm_times(lc, 8, 2e-6, 300e9)
    assert f == pytest.approx(2 * 3.2160128e-4, rel=1e-12)
    assert b == pytest.approx(2 * 3.2160128e-4, rel=1e-12)
    assert w == 0.0
    # Against the block's forward compute at half of the A100's 312 TFLOP/s (the model
    # form's default efficiency): (24bsh² + 4bs²h) / 8 / 156e12 = 6.115 ms, so the two
    # all-reduces add about 10.5% to it.
    compute = lc.times(312e12, 0.5)[0]
    assert compute == pytest.approx((24 * 2048 * 12288**2 + 4 * 2048**2 * 12288) / 8 / 156e12)
    assert f / compute == pytest.approx(0.1052, abs=1e-4)
    # One rank: nothing to reduce.
    assert tp_comm_times(lc, 1, 2e-6, 300e9) == (0.0, 0.0, 0.0)


def test_embedding_and_head_collectives():
    sp = transformer_layers(shape("gpt3-175b", tensor_parallel=4))
    nb, tokens = 2 * 2048 * 12288, 2048
    assert sp[0].tp_collectives == ((0, 0.5, nb),)  # a reduce-scatter of its output
    assert sp[-1].tp_collectives == ((0, 0.5, nb), (0, 3.0, 4.0 * tokens), (1, 0.5, nb))
    no_sp = transformer_layers(shape("gpt3-175b", tensor_parallel=4, sequence_parallel=False))
    assert no_sp[0].tp_collectives == ((0, 1.0, nb),)
    assert no_sp[-1].tp_collectives == ((0, 3.0, 4.0 * tokens), (1, 1.0, nb))
    # Sequence parallelism changes how, not how much: the blocks' all-reduce volume is equal.
    assert sp[1].tp_collectives == no_sp[1].tp_collectives


def _tiny(tp: int, **model):
    # 2 blocks of h = 64 on 2 pipeline ranks of `tp` GPUs each, timed exactly from FLOPs
    # (1e12 FLOP/s at efficiency 1) and a slow NVLink: 1e9 B/s, 1e-4 s per hop (PCIe slower
    # still, so that the ring's fastest path between two GPUs stays the NVLink).
    return {"pipeline": {"devices": 2, "microbatches": 4},
            "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128,
                      "tensor_parallel": tp, **model},
            "cluster": {"gpu": "A100-80GB", "gpus_per_node": 4, "peak_flops": 1e12,
                        "compute_efficiency": 1.0,
                        "tiers": {"nvlink": {"bandwidth": 1e9, "latency": 1e-4},
                                  "pcie": {"bandwidth": 1e8, "latency": 1e-3}}},
            "training": {"stage_layers": [2, 2]}}


def test_model_form_stage_times_include_the_all_reduces_by_hand():
    with_tp = parse_config(_tiny(2)).problem
    meta = dict(with_tp.meta)
    # One ring all-reduce over 2 GPUs of b·s·h·2 = 4096 bytes: 2·1·1e-4 + 2·1/2·4096/1e9.
    ar = 2e-4 + 4096 / 1e9
    loss = 3 * (2e-4 + 128 / 1e9)  # three all-reduces of 32 fp32 values
    h, s, v = 64, 32, 128
    lin = 2 * s * (4 * h * h + 2 * h * 4 * h)  # Q, K, V, out + the two MLP matrices
    att = 2 * s * s * h  # causal: half of 4bs²h
    head = 2 * s * h * v
    flops_f = (lin + att) / 2
    stage0, stage1 = meta["stage_costs"]
    # Stage 1 = block1 + head: F = block F + head F + 2 AR + 1/2 AR (gather) + the loss's;
    # B = block B + head B + 2 AR + 1/2 AR (reduce-scatter); W = compute only.
    assert stage1["forward_s"] == pytest.approx(flops_f / 1e12 + head / 2 / 1e12
                                                + 2.5 * ar + loss, rel=1e-12)
    assert stage1["backward_input_s"] == pytest.approx(
        (lin + 2 * att) / 2 / 1e12 + head / 2 / 1e12 + 2.5 * ar, rel=1e-12)
    assert stage1["backward_weight_s"] == pytest.approx(lin / 2 / 1e12 + head / 2 / 1e12,
                                                        rel=1e-12)
    # Stage 0 = embedding + block0: F has the embedding's reduce-scatter and the block's two;
    # its input takes no gradient, so its W is the whole fused backward with the block's two.
    assert stage0["forward_s"] == pytest.approx(flops_f / 1e12 + 2.5 * ar, rel=1e-12)
    assert stage0["backward_input_s"] == 0.0
    assert stage0["backward_weight_s"] == pytest.approx(
        (lin + 2 * att + lin) / 2 / 1e12 + 2 * ar, rel=1e-12)
    assert with_tp.forward == (stage0["forward_s"], stage1["forward_s"])


def test_full_recompute_and_one_rank():
    full = dict(parse_config(_tiny(2, recompute="full")).problem.meta)["stage_costs"]
    none = dict(parse_config(_tiny(2)).problem.meta)["stage_costs"]
    ar = 2e-4 + 4096 / 1e9
    h, s = 64, 32
    fwd = (2 * s * (4 * h * h + 8 * h * h) + 2 * s * s * h) / 2 / 1e12
    # Full recomputation: B replays the block's forward compute and its two all-reduces.
    assert full[1]["backward_input_s"] - none[1]["backward_input_s"] == pytest.approx(
        fwd + 2 * ar, rel=1e-9)
    # Without tensor parallelism no time is added: forward = FLOPs / 1e12 exactly.
    one = dict(parse_config(_tiny(1)).problem.meta)["stage_costs"]
    assert one[0]["forward_s"] == pytest.approx(2 * fwd, rel=1e-12)


def test_tensor_parallel_ring_uses_the_node_links():
    # The tensor-parallel ring's hops are NVLink within the node: at the default A100 tier
    # (300e9 B/s, 2e-6 s) the block's forward grows by two all-reduces of that ring.
    data = _tiny(4)
    data["cluster"].pop("tiers")
    data["cluster"]["gpus_per_node"] = 8
    prob = parse_config(data).problem
    base = parse_config({**data, "model": {**data["model"], "tensor_parallel": 1}})
    ar = 2 * 3 * 2e-6 + 2 * 3 / 4 * 4096 / 300e9
    fwd4 = dict(prob.meta)["stage_costs"][0]["forward_s"]
    fwd1 = dict(base.problem.meta)["stage_costs"][0]["forward_s"]
    assert fwd4 == pytest.approx(fwd1 / 4 + 2.5 * ar, rel=1e-12)
