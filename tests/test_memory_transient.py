"""Issue 18 item 1: the transient memory of a recomputing backward.

A block's backward under ``recompute: full`` (or ``selective``) first rebuilds what its forward
dropped; while it runs, the block holds its no-recomputation activations. The model adds that
transient to each device's static memory (exact for one stage per device, a fused backward and
equal micro-batches; an upper bound otherwise). Figures below are computed by hand from
Korthikanti et al. 2022's per-block count, sbh(34 + 5as/h) bytes with 16-bit values and dropout.
"""

from __future__ import annotations

import pytest

import pipeopt
from pipeopt.config import parse_config
from pipeopt.costs.build import backward_transient
from pipeopt.costs.transformer import (
    TransformerShape,
    block_activation_bytes,
    block_backward_transient_bytes,
    transformer_layers,
)

S, B, H, A = 512, 1, 256, 4
SBH = S * B * H  # 131,072
SHAPE = TransformerShape(layers=8, hidden=H, heads=A, seq_len=S, vocab=1000, micro_batch_size=B)
#: sbh(32 + 5as/h): everything a GPT block keeps without recomputation, 34 sbh + 5as^2b,
#: less the block input (2 sbh) that full recomputation keeps.
FULL = SBH * (32 + 5 * A * S / H)  # 9,437,184
#: 5as^2b: the attention core (softmax output, its dropout mask and output).
SELECTIVE = 5 * A * S * S * B  # 5,242,880


def test_transient_by_hand():
    assert FULL == 9_437_184 and SELECTIVE == 5_242_880
    assert block_backward_transient_bytes(SHAPE, "full") == FULL
    assert block_backward_transient_bytes(SHAPE, "selective") == SELECTIVE
    assert block_backward_transient_bytes(SHAPE, "none") == 0
    # Kept + transient = what the block holds without recomputation, in every mode.
    for mode in ("none", "selective", "full"):
        assert (block_activation_bytes(SHAPE, mode) + block_backward_transient_bytes(SHAPE, mode)
                == block_activation_bytes(SHAPE, "none") == SBH * (34 + 5 * A * S / H))


def test_layers_carry_it_blocks_only():
    from dataclasses import replace

    layers = transformer_layers(replace(SHAPE, recompute="full"))
    assert [lc.backward_transient_bytes for lc in layers] == [0.0, *[FULL] * 8, 0.0]
    # Tensor parallelism without sequence parallelism: the replicated part is not divided.
    tp = replace(SHAPE, recompute="full", tensor_parallel=2, sequence_parallel=False)
    none = SBH * (10 + 24 / 2 + 5 * A * S / (H * 2))  # Korthikanti et al., table 2
    assert block_backward_transient_bytes(tp) == pytest.approx(none - 2 * SBH)


def cfg(recompute: str, limit: float | None = None) -> dict:
    return {"pipeline": {"devices": 4, "microbatches": 8, "split_backward": False},
            "model": {"layers": 8, "hidden": H, "heads": A, "seq_len": S, "vocab": 1000,
                      "recompute": recompute, "causal": False},
            "cluster": {"gpu": "A100-80GB", "gpus_per_node": 4},
            "memory": {"limit": limit}}


@pytest.mark.parametrize(("mode", "transient"), [("full", FULL), ("selective", SELECTIVE),
                                                 ("none", 0.0)])
def test_problem_counts_it_as_static(mode, transient):
    c = parse_config(cfg(mode))
    meta = dict(c.problem.meta)
    rows = meta["stage_costs"]
    assert [r["backward_transient_bytes"] for r in rows] == [transient] * 4
    for d, r in enumerate(rows):  # one stage per device, every one with blocks
        assert c.problem.static_memory[d] == pytest.approx(r["static_bytes"] + transient)
    if transient:
        assert meta["backward_transient_bytes"] == [transient] * 4
        assert any("recomputed activations" in n for n in meta["notes"])
    else:
        assert "backward_transient_bytes" not in meta


def test_peak_of_1f1b_by_hand():
    """1F1B with a fused backward: device d holds p - d micro-batches' activations at its
    peak, then runs a backward, which adds the transient on top."""
    c = parse_config(cfg("full"))
    rows = dict(c.problem.meta)["stage_costs"]
    sched = pipeopt.solve(c.problem, "1f1b")
    for d, r in enumerate(rows):
        want = r["static_bytes"] + FULL + (4 - d) * r["activation_bytes"]
        assert sched.peak_memory[d] == pytest.approx(want)


def test_memory_limit_honours_it():
    """A limit that holds 1F1B's resident peak but not the transient on top is refused."""
    c = parse_config(cfg("full"))
    rows = dict(c.problem.meta)["stage_costs"]
    without = max(r["static_bytes"] + (4 - d) * r["activation_bytes"]
                  for d, r in enumerate(rows))
    tight = c.problem.replace(memory_limit=(without + FULL / 2,) * 4)
    with pytest.raises(pipeopt.NotApplicable, match="memory"):
        pipeopt.solve(tight, "1f1b")


def test_search_keeps_room_for_it():
    """The partition search leaves the transient free on every device, so what it picks fits
    once the problem counts it: the per-stage estimate includes it and stays within the
    limit."""
    limit = 6e7
    c = parse_config(cfg("full", limit))
    for r in dict(c.problem.meta)["stage_costs"]:
        assert r["memory_estimate_bytes"] == pytest.approx(
            r["static_bytes"] + r["inflight_microbatches"] * r["activation_bytes"] + FULL)
        assert r["memory_estimate_bytes"] <= limit
    sched = pipeopt.solve(c.problem, "auto", time_limit=5)
    assert max(sched.peak_memory) <= limit


def test_backward_transient_scales():
    rows = [{"stage": 0, "device": 0, "backward_transient_bytes": 10.0},
            {"stage": 1, "device": 1, "backward_transient_bytes": 0.0},
            {"stage": 2, "device": 0, "backward_transient_bytes": 4.0}]
    assert backward_transient(rows, 2, ()) == [10.0, 0.0]
    # One factor per micro-batch: the largest micro-batch's transient.
    assert backward_transient(rows, 2, (0.5, 2.0)) == [20.0, 0.0]
    # A row per stage: stage 2's largest factor (3) makes its 4 bytes 12 > stage 0's 10 x 1.
    assert backward_transient(rows, 2, ((1.0, 1.0), (9.0, 9.0), (3.0, 1.0))) == [12.0, 0.0]


def test_flash_attention_keeps_softmax_statistics_only():
    """With ``flash_attention`` the attention core keeps one fp32 logsumexp per head and token
    (4·a·s·b) instead of 5as²b: GPT's block keeps sbh·34 + 4asb, and full recomputation's
    transient is sbh·32 + 4asb."""
    from dataclasses import replace

    flash = replace(SHAPE, flash_attention=True)
    assert block_activation_bytes(flash, "none") == SBH * 34 + 4 * A * S * B
    assert block_activation_bytes(flash, "selective") == SBH * 34
    assert block_backward_transient_bytes(flash, "full") == SBH * 32 + 4 * A * S * B == 4_202_496
    c = parse_config({**cfg("full"), "model": {**cfg("full")["model"], "flash_attention": True}})
    rows = dict(c.problem.meta)["stage_costs"]
    assert [r["backward_transient_bytes"] for r in rows] == [4_202_496] * 4


def test_a_transient_over_the_limit_is_refused_with_the_figures():
    """One block's recomputed activations over what a device has: refused before the
    partition search (which would report a negative limit), naming the remedies."""
    from pipeopt.config import ConfigError

    with pytest.raises(ConfigError, match=r"memory: with recompute: full a block's backward "
                       r"first rebuilds its activations, 0\.0 GiB .*flash_attention: true"):
        parse_config(cfg("full", FULL / 2))
    flash = cfg("full", FULL / 2)
    flash["model"]["flash_attention"] = True
    with pytest.raises(ConfigError, match="memory: no partition"):  # fits the transient only
        parse_config(flash)
