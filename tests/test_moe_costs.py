"""MoE cost formulas (pipeopt.costs.moe) against values computed by hand for a Mixtral-8x7B-like
and a DeepSeek-V3-like layer, and the published parameter counts of Mixtral 8x7B."""

from __future__ import annotations

import pytest

from pipeopt.costs import moe
from pipeopt.costs.collectives import all_to_all_time
from pipeopt.costs.transformer import TransformerShape

T = 4096  # tokens per micro-batch: b = 1, s = 4096


def mixtral(layers: int = 32) -> TransformerShape:
    """Mixtral 8x7B's shape (Jiang et al. 2024, table 1): h 4096, 32 heads, 8 KV heads,
    SwiGLU experts of width 14336, vocab 32000, RMSNorm, no biases, rotary positions."""
    return TransformerShape(layers=layers, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                            seq_len=4096, vocab=32000, activation="swiglu", norm="rmsnorm",
                            bias=False, position_embedding="rotary", dropout=False,
                            causal=True)


MIXTRAL = moe.MoESpec(experts=8, top_k=2, expert_ffn=14336, expert_parallel=8)


def deepseek() -> TransformerShape:
    """A DeepSeek-V3-like shape (technical report, section 4.2: h 7168, 61 layers, the first 3
    dense with width 18432; 128 heads: MLA is not modelled, plain multi-head attention stands
    in)."""
    return TransformerShape(layers=61, hidden=7168, heads=128, ffn_hidden=18432, seq_len=4096,
                            vocab=129280, activation="swiglu", norm="rmsnorm", bias=False,
                            position_embedding="rotary", dropout=False, causal=True)


DEEPSEEK = moe.MoESpec(experts=256, top_k=8, expert_ffn=2048, expert_parallel=64,
                       shared_experts=1, first_dense=3, dispatch_dtype="fp8")


def test_mixtral_flops_by_hand() -> None:
    sh = mixtral()
    # attention linear: 2T(2h^2 + 2 h kv_dim), kv_dim = 8 * 128 = 1024
    lin = 2 * T * (2 * 4096**2 + 2 * 4096 * 1024)
    assert lin == 343_597_383_680
    core = 2 * 4096**2 * 4096  # causal: 2 b s^2 h
    assert moe.attention_flops(sh) == (lin, core)
    assert moe.gate_flops(sh, MIXTRAL) == 2 * T * 4096 * 8 == 268_435_456
    # dropless: k T routed copies, each 2 * 3 * h * f
    assert moe.routed_tokens(sh, MIXTRAL) == 2 * T
    assert moe.expert_flops(sh, MIXTRAL) == 2 * T * 6 * 4096 * 14336 == 2_886_218_022_912
    cost = moe.block_cost(sh, MIXTRAL)
    gate = 268_435_456
    assert cost.attention.forward_flops == lin + core + gate == 481_304_772_608
    assert cost.attention.backward_input_flops == lin + 2 * core + gate
    assert cost.attention.backward_weight_flops == lin + gate
    assert cost.experts.backward_input_flops == cost.experts.backward_weight_flops == (
        2_886_218_022_912)
    assert cost.shared is None


def test_capacity_factor_pads_every_expert() -> None:
    """GShard / Switch: capacity c k T / E per expert; padded, a rank processes c k T copies."""
    sh = mixtral()
    spec = moe.MoESpec(experts=8, top_k=2, expert_ffn=14336, expert_parallel=8,
                       capacity_factor=1.25)
    assert moe.routed_tokens(sh, spec) == 1.25 * 2 * T
    assert moe.expert_flops(sh, spec) == pytest.approx(1.25 * 2_886_218_022_912)
    assert moe.dispatch_bytes(sh, spec) == 1.25 * 2 * T * 4096 * 2


def test_mixtral_parameters_match_the_published_counts() -> None:
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's release figures;
    the paper rounds them to 47B and 13B)."""
    sh = mixtral()
    expert = 3 * 4096 * 14336
    assert moe.expert_params(sh, 14336) == expert == 176_160_768
    attention = 2 * 4096**2 + 2 * 4096 * 1024 + 2 * 4096  # Q, O, K, V, two RMSNorms
    whole, rank = moe.block_params(sh, MIXTRAL)
    assert whole == attention + 4096 * 8 + 8 * expert == 1_451_270_144
    assert rank == attention + 4096 * 8 + 1 * expert  # E / ep = 1 expert per rank
    total, active = moe.model_params(sh, MIXTRAL)
    emb = 32000 * 4096
    assert total == 32 * whole + emb + (emb + 4096) == 46_702_792_704
    assert active == total - 32 * 6 * expert == 12_879_925_248
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


def test_mixtral_all_to_all_bytes_and_time() -> None:
    sh = mixtral()
    buf = 2 * T * 4096 * 2  # k T tokens of h bf16 values
    assert moe.dispatch_bytes(sh, MIXTRAL) == moe.combine_bytes(sh, MIXTRAL) == buf
    assert moe.bytes_leaving(buf, MIXTRAL) == buf * 7 / 8 == 58_720_256
    # 8 ranks over 50 GB/s links, 5 us each step: 7 alpha + 7/8 bytes / B
    t = all_to_all_time(8, buf, 5e-6, 50e9)
    assert t == pytest.approx(7 * 5e-6 + 58_720_256 / 50e9)


def test_mixtral_activation_bytes_by_hand() -> None:
    """No dropout, bf16: the dense block's activations (Korthikanti et al. term by term) less
    its MLP inner values, plus the router's fp32 probabilities; the experts keep each routed
    copy's input and its three SwiGLU inner values."""
    sh = mixtral()
    cost = moe.block_cost(sh, MIXTRAL)
    h, e = 4096, 2
    norms_and_inputs = 4 * e * T * h
    qkv = e * T * (h + 2 * 1024)
    proj = e * T * h
    softmax = e * 32 * 4096 * T
    router = 4 * T * 8
    assert cost.attention.activation_bytes == (norms_and_inputs + qkv + proj + softmax
                                               + router) == 1_291_976_704
    assert cost.experts.activation_bytes == e * 2 * T * (h + 3 * 14336) == 771_751_936
    assert cost.attention.weight_grad_bytes == e * T * (4 * h + 2 * 1024 + 8)
    assert cost.experts.weight_grad_bytes == cost.experts.activation_bytes  # capped


def test_deepseek_v3_layer_by_hand() -> None:
    sh, spec = deepseek(), DEEPSEEK
    assert [spec.is_moe(i) for i in range(5)] == [False, False, False, True, True]
    cost = moe.block_cost(sh, spec)
    routed = 8 * T
    assert moe.expert_flops(sh, spec) == routed * 6 * 7168 * 2048 == 2_886_218_022_912
    assert cost.shared is not None
    assert cost.shared.forward_flops == T * 1 * 6 * 7168 * 2048 == 360_777_252_864
    assert moe.gate_flops(sh, spec) == 2 * T * 7168 * 256 == 15_032_385_536
    # FP8 dispatch, BF16 combine (DeepSeek-V3 report, section 3.3.2)
    assert cost.dispatch_bytes == routed * 7168 * 1 == 234_881_024
    assert cost.combine_bytes == routed * 7168 * 2 == 469_762_048
    assert moe.bytes_leaving(cost.dispatch_bytes, spec) == 234_881_024 * 63 / 64
    expert = 3 * 7168 * 2048
    assert moe.expert_params(sh, 2048) == expert == 44_040_192
    assert cost.experts.params == 4 * expert  # 256 experts over 64 ranks
    assert cost.shared.params == expert
    whole, rank = moe.block_params(sh, spec)
    assert whole - rank == (256 - 4) * expert
    # 58 MoE blocks of 256 routed + 1 shared experts: 656.5B of the model's 671B
    assert 58 * 257 * expert == 656_463_101_952


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_k: must be <= experts"):
        moe.MoESpec(experts=8, top_k=9, expert_ffn=1)
    with pytest.raises(ValueError, match="expert_parallel: must divide experts"):
        moe.MoESpec(experts=8, top_k=2, expert_ffn=1, expert_parallel=3)
    with pytest.raises(ValueError, match="capacity_factor: must be a number > 0"):
        moe.MoESpec(experts=8, top_k=2, expert_ffn=1, capacity_factor=0)
    with pytest.raises(ValueError, match="dispatch_dtype: must be one of"):
        moe.MoESpec(experts=8, top_k=2, expert_ffn=1, dispatch_dtype="int4")
    from dataclasses import replace

    with pytest.raises(ValueError, match="tensor_parallel: the MoE pipeline workload"):
        moe.pipeline_of(replace(mixtral(), tensor_parallel=2), MIXTRAL, 2, 4,
                        moe.Cluster(flop_rate=1e15, ep_latency=0.0, ep_bandwidth=1e11))
    with pytest.raises(ValueError, match="recompute: MoE blocks support none, selective, full"):
        moe.block_cost(replace(mixtral(), recompute="per_stage"), MIXTRAL)
    with pytest.raises(ValueError, match="recompute: the MoE pipeline workload"):
        moe.pipeline_of(replace(mixtral(), recompute="full"), MIXTRAL, 2, 4,
                        moe.Cluster(flop_rate=1e15, ep_latency=0.0, ep_bandwidth=1e11))


def test_pipeline_of_prices_every_stage() -> None:
    """4 Mixtral blocks on 2 stages at 500 TFLOP/s: each stage has 2 MoE blocks; dispatch and
    combine seconds are the alpha-beta all-to-all of their buffers; the LM head is stage 1's
    post work; static memory = stored parameters x 16 bytes."""
    sh = mixtral(layers=4)
    cl = moe.Cluster(flop_rate=5e14, ep_latency=1e-5, ep_bandwidth=4e10)
    pipe = moe.pipeline_of(sh, MIXTRAL, 2, 3, cl)
    assert [len(st) for st in pipe.stages] == [2, 2] and pipe.microbatches == 3
    blk = pipe.stages[1][0]
    assert blk.attention.forward == pytest.approx(481_304_772_608 / 5e14)
    assert blk.experts.forward == pytest.approx(2_886_218_022_912 / 5e14)
    buf = 2 * T * 4096 * 2
    assert blk.dispatch == blk.combine == pytest.approx(7 * 1e-5 + buf * 7 / 8 / 4e10)
    head = 2 * T * 4096 * 32000
    assert pipe.post[1].forward == pytest.approx(head / 5e14)
    assert pipe.post[0].forward == 0.0
    _, rank = moe.block_params(sh, MIXTRAL)
    assert pipe.static_memory[0] == pytest.approx((2 * rank + 32000 * 4096) * 16)
    assert pipe.message_bytes == T * 4096 * 2
    with pytest.raises(ValueError, match="stage_layers"):
        moe.pipeline_of(sh, MIXTRAL, 2, 3, cl, stage_layers=[1, 2])
    with pytest.raises(ValueError, match="stages: 5 stages need"):
        moe.pipeline_of(sh, MIXTRAL, 5, 3, cl)


def test_tensor_parallel_splits_attention_and_experts() -> None:
    """t = 2 (expert tensor-parallel size = TP): every FLOP count and weight of the block is
    halved but the replicated router's (2ThE FLOPs, hE weights) and the norms' (2h);
    the shared expert is a dense MLP split in two whose output is all-reduced; the
    collectives by hand (sequence parallelism: the attention's all-reduce of T·h·e, half an
    all-reduce each of the dispatched copies' all-gather and the outputs' reduce-scatter)."""
    from dataclasses import replace

    shape = replace(mixtral(layers=1), micro_batch_size=1)
    spec = moe.MoESpec(experts=8, top_k=2, expert_ffn=14336, expert_parallel=8,
                       shared_experts=1)
    one, two = moe.block_cost(shape, spec), moe.block_cost(replace(shape, tensor_parallel=2),
                                                           spec)
    gate = moe.gate_flops(shape, spec)
    assert two.attention.forward_flops == pytest.approx(
        (one.attention.forward_flops - gate) / 2 + gate, rel=1e-12)
    assert two.attention.params == (one.attention.params - 8 * 4096 - 2 * 4096) / 2 + (
        8 * 4096 + 2 * 4096)
    for part in ("experts", "shared"):
        a, b = getattr(one, part), getattr(two, part)
        assert (b.forward_flops, b.params) == (a.forward_flops / 2, a.params / 2)
    t, h = 4096, 4096
    assert two.shared.activation_bytes == one.shared.activation_bytes / 2 == 2 * t * 3 * 14336 / 2
    assert moe.tp_collectives(shape, spec) == ()
    msg, routed = 2.0 * t * h, 2.0 * 2 * t * h
    assert moe.tp_collectives(replace(shape, tensor_parallel=2), spec) == (
        (0, 2.0, msg), (0, 0.5, routed), (0, 0.5, routed), (1, 2.0, msg), (1, 1.0, routed))

