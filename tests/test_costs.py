"""Analytic cost formulas against hand-computed values for published model shapes."""

import math
from dataclasses import replace

import pytest

from pipeopt.costs.config import PRESETS
from pipeopt.costs.gpus import CATALOG, lookup
from pipeopt.costs.transformer import (
    LayerCost,
    TransformerShape,
    attention_backward_flops,
    block_activation_bytes,
    block_flops,
    block_params,
    efficiency_at,
    model_flops_per_iteration,
    total_params,
    transformer_layers,
)


def shape(name: str, **kw) -> TransformerShape:
    return TransformerShape(**{**PRESETS[name], **kw})


def test_gpt3_175b_parameters():
    sh = shape("gpt3-175b")
    h = 12288
    # 12h² + 13h per block, token + position embeddings, final LayerNorm; head tied.
    hand = 96 * (12 * h * h + 13 * h) + 50257 * h + 2048 * h + 2 * h
    assert total_params(sh) == hand
    assert total_params(sh) == pytest.approx(174.6e9, rel=1e-3)
    assert block_params(sh) == 12 * h * h + 13 * h


def test_llama2_parameters():
    assert total_params(shape("llama2-7b")) == 6_738_415_616  # the released checkpoint's count
    assert total_params(shape("llama2-7b")) == pytest.approx(6.74e9, rel=1e-3)
    h, f, kvd = 8192, 28672, 8 * 128
    hand_block = 2 * h * h + 2 * h * kvd + 3 * h * f + 2 * h
    sh = shape("llama2-70b")
    assert block_params(sh) == hand_block
    assert total_params(sh) == 80 * hand_block + 2 * 32000 * h + h
    assert total_params(sh) == pytest.approx(68.98e9, rel=1e-3)


def test_gpt3_flops_match_narayanan():
    b, s, h, L, V = 1, 2048, 12288, 96, 50257
    sh = shape("gpt3-175b", micro_batch_size=b)
    lin, att = block_flops(sh)
    assert lin + att == 24 * b * s * h * h + 4 * b * s * s * h
    total = model_flops_per_iteration(sh)
    assert total == pytest.approx(72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)),
                                  rel=1e-12)


def test_llama70b_block_flops_gqa_swiglu():
    b, s, h = 2, 4096, 8192
    sh = shape("llama2-70b", micro_batch_size=b)
    lin, att = block_flops(sh)
    assert lin == 2 * b * s * (2 * h * h + 2 * h * 1024 + 3 * h * 28672)
    assert att == 4 * b * s * s * h


def test_llama2_7b_block_by_published_numbers():
    # Worked by hand for b=1, s=4096, h=4096, 32 heads (no GQA), SwiGLU f=11008, bf16:
    # linear 2bs(h(h + 2h) + h^2 + 3hf) = 1.657857e12 FLOPs, attention 4bs^2h = 2.748779e11;
    # activations without dropout: 4 norm/linear inputs 4·2sbh = 134,217,728 B, Q/K/V + the
    # projection input 2sb(3h + h) = 134,217,728 B, SwiGLU gate, up and product 3·2sbf =
    # 270,532,608 B, softmax output 2·a·s^2·b = 1,073,741,824 B.
    sh = shape("llama2-7b", micro_batch_size=1)
    lin, att = block_flops(sh)
    assert lin == 1_657_857_376_256
    assert att == 274_877_906_944
    assert block_activation_bytes(sh) == 1_612_709_888
    blk = transformer_layers(sh)[1]
    assert blk.forward_flops == 1_657_857_376_256 + 274_877_906_944
    assert blk.backward_weight_flops == 1_657_857_376_256  # dW: the linear layers only
    assert blk.backward_input_flops == 1_657_857_376_256 + 2 * 274_877_906_944
    assert blk.params == 202_383_360  # 4h^2 + 3hf + 2 RMSNorm weights of h


def test_llama2_13b_parameters():
    # The released checkpoint has 13,015,864,320 parameters.
    assert total_params(shape("llama2-13b")) == 13_015_864_320


def test_backward_split_is_twice_the_forward():
    sh = shape("llama2-7b")
    blk = transformer_layers(sh)[1]
    lin, att = block_flops(sh)
    assert blk.backward_input_flops == lin + 2 * att
    assert blk.backward_weight_flops == lin
    assert blk.backward_input_flops + blk.backward_weight_flops == pytest.approx(
        2 * blk.forward_flops)
    full = transformer_layers(shape("llama2-7b", recompute="full"))[1]
    assert full.backward_input_flops == blk.backward_input_flops + blk.forward_flops


def test_activation_bytes_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    sh = shape("gpt3-175b", micro_batch_size=b)
    assert block_activation_bytes(sh) == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 8):
        no_sp = shape("gpt3-175b", tensor_parallel=t, sequence_parallel=False)
        assert block_activation_bytes(no_sp) == pytest.approx(
            s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        sp = shape("gpt3-175b", tensor_parallel=t)
        assert block_activation_bytes(sp) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
        sel = shape("gpt3-175b", tensor_parallel=t, recompute="selective")
        assert block_activation_bytes(sel) == pytest.approx(s * b * h * 34 / t)
    assert block_activation_bytes(shape("gpt3-175b", recompute="full")) == 2 * s * b * h


def test_activation_bytes_llama70b_by_hand():
    s, b, h, a, f, kvd = 4096, 1, 8192, 64, 28672, 1024
    sh = shape("llama2-70b", micro_batch_size=b)
    # No dropout: 2 norms + QKV input + MLP input, Q/K/V, projection input, 3 SwiGLU tensors,
    # softmax output; 2 bytes each.
    hand = 2 * s * b * (4 * h + (h + 2 * kvd) + h + 3 * f) + 2 * a * s * s * b
    assert block_activation_bytes(sh) == hand


def test_embedding_and_head_are_layers():
    sh = shape("llama2-7b", micro_batch_size=1)
    layers = transformer_layers(sh)
    assert [lc.name for lc in (layers[0], layers[-1])] == ["embedding", "head"]
    assert len(layers) == 34
    head = layers[-1]
    assert head.forward_flops == 2 * 4096 * 4096 * 32000
    assert head.activation_bytes >= 4 * 4096 * 32000  # fp32 logits
    assert layers[0].forward_flops == 0
    assert all(lc.weight_grad_bytes <= lc.activation_bytes for lc in layers)
    assert layers[5].output_bytes == 4096 * 4096 * 2


def test_tensor_parallel_divides_compute_and_params():
    one = transformer_layers(shape("llama2-7b"))[1]
    four = transformer_layers(shape("llama2-7b", tensor_parallel=4))[1]
    assert four.forward_flops == pytest.approx(one.forward_flops / 4)
    assert four.params == pytest.approx((one.params - 2 * 4096) / 4 + 2 * 4096)


def test_time_from_flops_and_measured():
    lc = LayerCost("x", forward_flops=1e12, backward_input_flops=1e12, backward_weight_flops=5e11)
    assert lc.times(1e12, 0.5) == (2.0, 2.0, 1.0)
    measured = LayerCost("m", forward_flops=1e12, forward_time=0.1, backward_input_time=0.2,
                         backward_weight_time=0.3, time_scale=2.0)
    assert measured.times(1e15) == pytest.approx((0.2, 0.4, 0.6))


def test_efficiency_curve_interpolates_in_log_flops():
    curve = [(1e9, 0.2), (1e11, 0.6)]
    assert efficiency_at(1e8, curve) == 0.2
    assert efficiency_at(1e10, curve) == pytest.approx(0.4)
    assert efficiency_at(1e12, curve) == 0.6
    assert efficiency_at(1e10, 0.5) == 0.5


def test_gpu_catalog_uses_dense_figures():
    assert lookup("H100-SXM").bf16_flops == pytest.approx(989.4e12)
    assert lookup("h100").name == "H100-SXM"
    assert lookup("A100-80GB").bf16_flops == 312e12
    # Memory as the driver reports it (nvidia-smi MiB / rocm-smi bytes): one unit for all.
    assert lookup("MI300X").memory_bytes == 206_141_652_992  # 192 GiB
    assert lookup("H200").memory_bytes == 143_771 * 2**20
    assert lookup("H100-SXM").memory_bytes == 81_559 * 2**20
    for gpu in CATALOG.values():
        assert gpu.bf16_flops < 2.3e15  # no 2:4-sparse figure slipped in
        assert gpu.peak_flops("fp32") < gpu.peak_flops("bf16")
    with pytest.raises(KeyError, match="did you mean 'H200'"):
        lookup("H300")
    assert not math.isnan(lookup("B200").bf16_flops)


def test_causal_attention_halves_the_attention_flops():
    """Issue 18, item 4: FlashAttention-2's count of causal attention, 2·b·s²·h per block."""
    b, s, h = 1, 4096, 4096  # llama2-7b, worked by hand: 4bs^2h = 274,877,906,944
    lin, att = block_flops(shape("llama2-7b", micro_batch_size=b, causal=True))
    assert lin == 1_657_857_376_256  # the linear layers do not change
    assert att == 2 * b * s * s * h == 137_438_953_472
    blk = transformer_layers(shape("llama2-7b", causal=True))[1]
    assert blk.forward_flops == 1_657_857_376_256 + 137_438_953_472
    assert blk.backward_input_flops == 1_657_857_376_256 + 2 * 137_438_953_472
    assert blk.backward_weight_flops == 1_657_857_376_256
    sel = transformer_layers(shape("llama2-7b", causal=True, recompute="selective"))[1]
    assert sel.backward_input_flops == blk.backward_input_flops + 137_438_953_472


def test_model_form_is_causal_by_default():
    from pipeopt.costs.build import shape_of
    from pipeopt.costs.config import parse_model

    assert shape_of(parse_model({"preset": "gpt3-175b"})).causal
    assert not shape_of(parse_model({"preset": "gpt3-175b", "causal": False})).causal
    # GPT-3 175B, b = 1: attention 2·s²·h = 103,079,215,104 FLOPs per block, causal.
    assert block_flops(shape_of(parse_model({"preset": "gpt3-175b"})))[1] == 103_079_215_104


def test_flash_attention_backward_recomputes_the_scores():
    """Issue 18: with ``flash_attention`` the backward first recomputes S = QKᵀ (Dao et al.
    2022, algorithm 4), so the attention core's backward is 2.5x its forward, not 2x; the
    extra 2·b·s²·h (half that causal) is input-gradient work. Small GPT block by hand: b = 1,
    s = 512, h = 256: linear 24bsh² = 805,306,368; attention 4bs²h = 268,435,456."""
    small = TransformerShape(layers=2, hidden=256, heads=4, seq_len=512, vocab=1000)
    lin, att = block_flops(small)
    assert (lin, att) == (805_306_368, 268_435_456)
    std = transformer_layers(small)[1]
    flash = transformer_layers(replace(small, flash_attention=True))[1]
    assert std.backward_input_flops == 805_306_368 + 536_870_912  # + 2 x attention
    assert flash.backward_input_flops == 805_306_368 + 671_088_640  # + 2.5 x attention
    assert flash.backward_input_flops - std.backward_input_flops == 2 * 512**2 * 256
    assert flash.forward_flops == std.forward_flops == 805_306_368 + 268_435_456
    assert flash.backward_weight_flops == std.backward_weight_flops == 805_306_368
    # Causal: every attention term halves, the recomputed QKᵀ too.
    causal = transformer_layers(replace(small, flash_attention=True, causal=True))[1]
    assert causal.backward_input_flops == 805_306_368 + 671_088_640 // 2
    # Full recomputation adds the whole forward (its attention run by FlashAttention again).
    full = transformer_layers(replace(small, flash_attention=True, recompute="full"))[1]
    assert full.backward_input_flops == flash.backward_input_flops + 805_306_368 + 268_435_456
    # Tensor parallelism divides it like the rest.
    tp = transformer_layers(replace(small, flash_attention=True, tensor_parallel=2))[1]
    assert tp.backward_input_flops == flash.backward_input_flops / 2


def test_flash_attention_backward_matches_torchs_count():
    """The same 5 : 2 matmul ratio as torch's FlopCounterMode formulas for
    scaled_dot_product_attention (forward QKᵀ and P·V; backward the recomputed scores and four
    gradient matmuls), on a GQA shape (8 query heads, 2 K/V heads)."""
    pytest.importorskip("torch")
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    b, a, kv, s, d = 2, 8, 2, 64, 16
    q, k = (b, a, s, d), (b, kv, s, d)
    fwd, bwd = sdpa_flop_count(q, k, k), sdpa_backward_flop_count(q, q, k, k)
    small = TransformerShape(layers=1, hidden=a * d, heads=a, kv_heads=kv, seq_len=s,
                             vocab=10, micro_batch_size=b, flash_attention=True)
    att = block_flops(small)[1]
    assert fwd == att
    assert bwd == attention_backward_flops(small, att) == 2.5 * att


def test_moe_attention_backward_counts_flash_too():
    from pipeopt.costs.moe import MoESpec
    from pipeopt.costs.moe import block_cost as moe_block

    small = TransformerShape(layers=2, hidden=256, heads=4, seq_len=512, vocab=1000)
    spec = MoESpec(experts=4, top_k=2, expert_ffn=512)
    std = moe_block(small, spec).attention
    flash = moe_block(replace(small, flash_attention=True), spec).attention
    assert flash.backward_input_flops - std.backward_input_flops == 2 * 512**2 * 256
