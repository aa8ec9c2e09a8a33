"""A forward-only profile as the serving cost model's FLOP rates (issue 15 item 4):
``workload.costs.profile`` of an inference config, :func:`profiled_stage_models`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeopt.cli import main
from pipeopt.costs import inference as ci
from pipeopt.costs.profile import FORMAT, ProfileError, load_forward_profile
from pipeopt.costs.transformer import TransformerShape
from pipeopt.errors import ConfigError
from pipeopt.inference_config import parse_inference
from pipeopt.workloads.inference import Chunk, Decode, Iteration

ROOT = Path(__file__).resolve().parents[1]

#: pipeopt.models.tiny_gpt(4, 64, 4, 128, 16) as a model: section.
TINY = {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "seq_len": 16, "vocab": 128,
        "activation": "gelu", "norm": "layernorm", "bias": True,
        "position_embedding": "learned", "tie_embeddings": False, "dtype": "fp32"}
#: A tiny GPT block: qkv 3h² + 3h, proj h² + h, fc1 4h² + 4h, fc2 4h² + h, two layernorms 4h.
BLOCK_PARAMS = 12 * 64 * 64 + 13 * 64


def tiny_shape() -> TransformerShape:
    return TransformerShape(layers=4, hidden=64, heads=4, ffn_hidden=256, seq_len=16,
                            vocab=128, activation="gelu", norm="layernorm", bias=True,
                            position_embedding="learned", tie_embeddings=False, dtype="fp32",
                            causal=True)


def layer(name: str, forward_s: float, params: float) -> dict:
    return {"name": name, "forward_s": forward_s, "backward_input_s": 0.0,
            "backward_weight_s": 0.0, "backward_s": 0.0, "input_grad": False,
            "params": params, "activation_bytes": 0.0, "output_bytes": 0.0}


def write(path: Path, times: tuple[float, ...] = (0.001, 0.002, 0.002, 0.002, 0.002, 0.003),
          **top) -> Path:
    """A hand-written forward-only profile of the tiny GPT: embedding, 4 blocks, head, timed
    on 2 sequences of 16 tokens."""
    params = (9216, *[BLOCK_PARAMS] * 4, 8320)
    names = ("0:Embedding", "1:Block", "2:Block", "3:Block", "4:Block", "5:Head")
    doc = {"format": FORMAT, "model": "tiny-gpt", "device": "cpu", "micro_batch_size": 2,
           "input_shape": [2, 16], "forward_only": True,
           "layers": [layer(n, t, p) for n, t, p in zip(names, times, params, strict=True)]}
    doc.update(top)
    path.write_text(json.dumps(doc))
    return path


def config(tmp_path: Path, profile: str = "fwd.json", **workload) -> dict:
    return {"workload": {"kind": "inference", "gpu": "H100", "stages": 2,
                         "requests": [{"prompt": 100, "output": 3}], "method": "round-robin",
                         "costs": {"profile": profile}, **workload},
            "model": dict(TINY)}


def test_hand_computed_stage_costs(tmp_path):
    """Per layer and token (h = 64, f = 256, gelu: 2 MLP matrices, kv_dim = h):
    lin = 2 (2h² + 2h·h + 2hf) = 98,304 FLOPs; attention 4h = 256 per (query, key) pair;
    head 2hV = 16,384 per logit. The profiled forward: B = 2 sequences of S = 16 tokens.
    Stage 0 (embedding + blocks 1, 2): F0 = 2 (98,304·32 + 256·2·16²/2) = 6,422,528 FLOPs in
    0.001 + 2·0.002 = 0.005 s. Stage 1 (blocks 3, 4 + head): F1 = 6,422,528 + 16,384·32
    = 6,946,816 FLOPs in 2·0.002 + 0.003 = 0.007 s."""
    write(tmp_path / "fwd.json")
    cfg = parse_inference(config(tmp_path), str(tmp_path / "c.yaml"))
    s0, s1 = cfg.stages
    assert s0.peak_flops == pytest.approx(6_422_528 / 0.005)
    assert s1.peak_flops == pytest.approx(6_946_816 / 0.007)
    # A whole prompt of 100 tokens yielding its first token, on stage 1:
    # 2·98,304·100 + 2·256·100²/2 + 16,384 = 22,237,184 FLOPs at the measured rate.
    prefill = Iteration(0, chunks=(Chunk(0, 0, 100),), first_tokens=(0,))
    assert s1.time(prefill) == pytest.approx(22_237_184 * 0.007 / 6_946_816)
    # Stage 0 has no head: 2·98,304·100 + 2·256·100²/2 = 22,220,800 FLOPs.
    assert s0.time(prefill) == pytest.approx(22_220_800 * 0.005 / 6_422_528)
    # A decode with context 101 on stage 1: 2·98,304 + 2·256·101 + 16,384 = 264,704 FLOPs;
    # its HBM roof (fp32 weights of two blocks and the head, 1.4 MB at 3.35 TB/s) is ~0.4 us.
    decode = Iteration(0, decodes=(Decode(0, 101),))
    assert s1.time(decode) == pytest.approx(264_704 * 0.007 / 6_946_816)
    # The rest of the model is the analytic one: weights, KV bytes, memory, the HBM roof.
    analytic = ci.stage_models(tiny_shape(), "H100", 2)
    for got, want in zip(cfg.stages, analytic, strict=True):
        assert (got.weight_bytes, got.kv_bytes_per_token, got.hbm_bandwidth, got.memory_limit
                ) == (want.weight_bytes, want.kv_bytes_per_token, want.hbm_bandwidth,
                      want.memory_limit)
        assert got.kv_bytes_per_token == 2 * 2 * 64 * 4  # K and V, 2 layers, h = 64, fp32


def test_fast_profile_leaves_the_hbm_roof(tmp_path):
    """Layers timed at 1 ns: the measured rate is huge, so a decode costs its bytes over the
    H100's 3.35 TB/s (weights + the 101 KV entries it reads)."""
    write(tmp_path / "fwd.json", times=(1e-9,) * 6)
    s0, s1 = parse_inference(config(tmp_path), str(tmp_path / "c.yaml")).stages
    decode = Iteration(0, decodes=(Decode(0, 101),))
    for m in (s0, s1):
        assert m.time(decode) == pytest.approx((m.weight_bytes + 101 * 1024) / 3.35e12)


def test_layers_per_stage_follow_the_partition(tmp_path):
    """stages: [3, 1]: stage 0 = embedding + blocks 1-3 (0.001 + 3·0.002 s), stage 1 = block 4
    + head (0.002 + 0.003 s); FLOPs per block 3,211,264 (above)."""
    write(tmp_path / "fwd.json")
    s0, s1 = parse_inference(config(tmp_path, stages=[3, 1]), str(tmp_path / "c.yaml")).stages
    assert s0.peak_flops == pytest.approx(3 * 3_211_264 / 0.007)
    assert s1.peak_flops == pytest.approx((3_211_264 + 16_384 * 32) / 0.005)


def test_measured_profile_of_the_tiny_gpt(tmp_path):
    """A profile measured here (pipeopt profile --forward-only on the tiny GPT): each stage's
    rate times its layers' measured seconds gives back the profiled forward's FLOPs."""
    torch = pytest.importorskip("torch")
    from pipeopt.costs.profiler import profile_model, write_profile
    from pipeopt.models import tiny_gpt

    torch.manual_seed(0)
    doc = profile_model(tiny_gpt(4, 64, 4, 128, 16), torch.randint(0, 128, (2, 16)),
                        device="cpu", warmup=0, repeats=1, forward_only=True)
    assert doc["input_shape"] == [2, 16]
    write_profile(doc, tmp_path / "fwd.json")
    prof = load_forward_profile(tmp_path / "fwd.json")
    assert (prof.batch, prof.seq_len, len(prof.layers)) == (2, 16, 6)
    s0, s1 = parse_inference(config(tmp_path), str(tmp_path / "c.yaml")).stages
    t = [rec["forward_s"] for rec in doc["layers"]]
    assert s0.peak_flops * (t[0] + t[1] + t[2]) == pytest.approx(2 * 3_211_264)
    assert s1.peak_flops * (t[3] + t[4] + t[5]) == pytest.approx(2 * 3_211_264 + 16_384 * 32)


def test_the_example_solves_with_its_profile(tmp_path, capsys):
    out = tmp_path / "served.json"
    assert main(["solve", str(ROOT / "examples/inference_profile.yaml"), "-o", str(out)]) == 0
    assert "throughput" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["metrics"]["throughput_tokens_per_s"] > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"forward_only": None}, "forward_only: expected true"),
    ({"input_shape": [32]}, "input_shape: expected [batch, seq_len"),
    ({"input_shape": None}, "input_shape: expected [batch, seq_len"),
])
def test_not_a_forward_profile(tmp_path, change, message):
    top = {k: v for k, v in change.items() if v is not None}
    path = write(tmp_path / "fwd.json", **top)
    doc = json.loads(path.read_text())
    for k, v in change.items():
        if v is None:
            del doc[k]
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message.replace("[", r"\[")):
        load_forward_profile(path)
    with pytest.raises(ConfigError, match=r"^workload\.costs\.profile: .*" + message[:12]):
        parse_inference(config(tmp_path), str(tmp_path / "c.yaml"))


def test_profile_of_another_model(tmp_path):
    write(tmp_path / "fwd.json")
    bigger = config(tmp_path)
    bigger["model"]["hidden"] = 128
    bigger["model"]["ffn_hidden"] = 512
    with pytest.raises(ConfigError, match=r"workload\.costs\.profile: layers\[1\] \(1:Block\) "
                                          r"has 49984 parameters, a block of the model has"):
        parse_inference(bigger, str(tmp_path / "c.yaml"))
    more = config(tmp_path)
    more["model"]["layers"] = 6
    with pytest.raises(ConfigError, match=r"workload\.costs\.profile: 6 layers, expected 8"):
        parse_inference(more, str(tmp_path / "c.yaml"))


def test_zero_time_stage(tmp_path):
    write(tmp_path / "fwd.json", times=(0.0, 0.0, 0.0, 0.002, 0.002, 0.003))
    with pytest.raises(ConfigError, match=r"layers 0\.\.2 \(stage 0\) measured 0 s"):
        parse_inference(config(tmp_path), str(tmp_path / "c.yaml"))


@pytest.mark.parametrize(("workload", "message"), [
    ({"efficiency": 0.5}, r"^workload\.efficiency: cannot be combined with "
                          r"workload\.costs\.profile"),
    ({"gpu": ["H100", "L40S"], "stages": "serving"}, r"^workload\.stages: serving"),
    ({"gpu": ["H100", "L40S"]}, r"^workload\.costs\.profile: one profile prices every stage"),
    ({"costs": {"profile": "missing.json"}}, r"^workload\.costs\.profile: .*missing\.json: "
                                             r"no such file"),
    ({"costs": {"profile": ""}}, r"^workload\.costs\.profile: "),
    ({"costs": {"profil": "fwd.json"}}, r"^workload\.costs\.profil"),
])
def test_config_errors(tmp_path, workload, message):
    write(tmp_path / "fwd.json")
    with pytest.raises(ConfigError, match=message):
        parse_inference(config(tmp_path, **workload), str(tmp_path / "c.yaml"))


def test_path_is_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "fwd.json")
    monkeypatch.chdir(tmp_path)
    cfg = parse_inference(config(tmp_path), str(tmp_path / "sub" / "c.yaml"))
    assert cfg.stages[0].peak_flops == pytest.approx(6_422_528 / 0.005)
    with pytest.raises(ConfigError, match="no such file"):  # not found beside the cwd
        parse_inference(config(tmp_path), "c.yaml")
