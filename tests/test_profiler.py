"""Profiler on CPU with tiny models: FLOPs against FlopCounterMode and the formulas."""

import json

import pytest

torch = pytest.importorskip("torch")

from pipeopt.costs.profiler import ProfileError, load_profile, profile_model  # noqa: E402
from pipeopt.costs.transformer import TransformerShape, block_flops, head_flops  # noqa: E402
from pipeopt.models import loss_fn, mlp, sample_batch, tiny_gpt  # noqa: E402

pytestmark = pytest.mark.torch

B, S, H, HEADS, V = 2, 16, 64, 4, 128


@pytest.fixture(scope="module")
def gpt_profile():
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=H, heads=HEADS, vocab=V, seq_len=S)
    x, _ = sample_batch("tiny-gpt", B, seq_len=S, vocab=V)
    return profile_model(model, x, device="cpu", warmup=1, repeats=3, name="tiny-gpt")


def test_flops_match_formulas(gpt_profile):
    shape = TransformerShape(layers=2, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B, dtype="fp32")
    lin, att = block_flops(shape)
    layers = gpt_profile["layers"]
    assert [r["name"] for r in layers] == ["0:Embedding", "1:Block", "2:Block", "3:Head"]
    assert layers[1]["forward_flops"] == lin + att == 24 * B * S * H * H + 4 * B * S * S * H
    assert layers[1]["backward_flops"] == 2 * (lin + att)  # B + W = 2 x forward
    assert layers[3]["forward_flops"] == head_flops(shape)
    assert layers[0]["forward_flops"] == 0


def test_whole_model_flops_with_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_gpt(layers=3, hidden=H, heads=HEADS, vocab=V, seq_len=S)
    x, y = sample_batch("tiny-gpt", B, seq_len=S, vocab=V)
    with FlopCounterMode(display=False) as fc:
        out = model(x)
    shape = TransformerShape(layers=3, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B)
    lin, att = block_flops(shape)
    assert fc.get_total_flops() == 3 * (lin + att) + head_flops(shape)
    loss_fn("tiny-gpt")(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bytes_and_times(gpt_profile):
    blk = gpt_profile["layers"][1]
    assert blk["params"] == 12 * H * H + 13 * H
    assert blk["param_bytes"] == 4 * blk["params"]
    assert blk["output_bytes"] == B * S * H * 4
    # Saved tensors: at least the 34-sbh-style inputs, far less than a full copy of params.
    assert B * S * H * 4 * 4 < blk["activation_bytes"] < 40 * B * S * H * 4 + 8 * B * S * S * 4
    assert blk["forward_s"] > 0 and blk["backward_input_s"] >= 0
    assert gpt_profile["layers"][0]["backward_input_s"] == 0  # token ids take no gradient


def test_profile_round_trip_and_solve(gpt_profile, tmp_path):
    from pipeopt.config import parse_config
    from pipeopt.solvers import solve

    path = tmp_path / "p.json"
    path.write_text(json.dumps(gpt_profile))
    layers = load_profile(path)
    assert len(layers) == 4 and layers[1].forward_time == gpt_profile["layers"][1]["forward_s"]
    cfg = parse_config({"pipeline": {"devices": 2, "microbatches": 4},
                        "model": {"profile": str(path)}, "cluster": {"gpu": "L4"}})
    sched = solve(cfg.problem, "1f1b")
    meta = dict(sched.problem.meta)
    assert meta["cost_model"]["source"] == "profile"
    assert sum(b - a for a, b in meta["partition"]) == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ProfileError, match="format"):
        load_profile(bad)


def test_mlp_and_cli(tmp_path):
    from pipeopt.cli import main

    m = mlp(layers=3, width=16)
    assert len(m) == 3
    out = tmp_path / "mlp.json"
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "16",
                 "--repeats", "1", "--warmup", "0", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["layers"]) == 2
    assert doc["layers"][0]["forward_flops"] == 2 * 2 * 16 * 16


def test_factory_model_needs_an_input_shape(tmp_path):
    from pipeopt.cli import main

    out = tmp_path / "f.json"
    assert main(["profile", "--model", "pipeopt.models:mlp", "-o", str(out)]) == 2
    assert main(["profile", "--model", "pipeopt.models:mlp", "--input-shape", "2,64",
                 "--repeats", "1", "--warmup", "0", "-o", str(out)]) == 0
    assert len(json.loads(out.read_text())["layers"]) == 4
