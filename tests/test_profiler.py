"""Profiler on CPU with tiny models: FLOPs against FlopCounterMode and the formulas."""

import json
import os

import pytest

torch = pytest.importorskip("torch")

from memory_probe import recomputed_alive_bytes as _recomputed_alive_bytes  # noqa: E402
from memory_probe import saved_bytes as _saved_bytes  # noqa: E402

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
    assert gpt_profile["backward_split"].startswith("pipeopt.executor")
    for rec in gpt_profile["layers"][1:]:  # every layer records its own F, B, W and fused time
        assert rec["forward_s"] > 0 and rec["backward_input_s"] > 0
        assert rec["backward_weight_s"] > 0 and rec["backward_s"] > 0
    emb = gpt_profile["layers"][0]  # token ids take no gradient: W is the whole backward
    assert emb["backward_input_s"] == 0 and emb["backward_weight_s"] > 0 and emb["backward_s"] > 0


def test_split_backward_runs_the_executors_code(monkeypatch):
    """B and W are timed through the executor's own per-layer split
    (``pipeopt.executor.runtime.backward_input`` / ``backward_weight``), once per warm-up and
    timed repeat and layer; a layer whose input takes no gradient has no B, and its W is the
    whole backward (as PyTorch's runtime runs stage 0); the model's gradients are left as they
    were."""
    from pipeopt.executor import runtime

    calls = {"B": 0, "W": 0}
    real_b, real_w = runtime.backward_input, runtime.backward_weight

    def b(*args):
        calls["B"] += 1
        return real_b(*args)

    def w(*args):
        calls["W"] += 1
        return real_w(*args)

    monkeypatch.setattr(runtime, "backward_input", b)
    monkeypatch.setattr(runtime, "backward_weight", w)
    model = tiny_gpt(layers=1, hidden=32, heads=2, vocab=64, seq_len=8)
    x, _ = sample_batch("tiny-gpt", 2, seq_len=8, vocab=64)
    doc = profile_model(model, x, device="cpu", warmup=1, repeats=2)
    assert len(doc["layers"]) == 3  # embedding, block, head
    assert calls == {"B": 2 * 3, "W": 2 * 3}  # not on the embedding (integer input)
    assert all(p.grad is None for p in model.parameters())
    assert all(r["backward_weight_s"] > 0 for r in doc["layers"])


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
    doc = json.loads(json.dumps(gpt_profile))
    doc["layers"][2]["backward_s"] = -1.0
    bad.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"layers\[2\]\.backward_s"):
        load_profile(bad)
    doc["layers"][2]["backward_s"] = 1.0
    doc["layers"][2]["input_grad"] = "yes"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"layers\[2\]\.input_grad: expected true or false"):
        load_profile(bad)
    assert [r["input_grad"] for r in gpt_profile["layers"]] == [False, True, True, True]
    assert not layers[0].input_grad and layers[1].backward_time == gpt_profile["layers"][1][
        "backward_s"]
    del doc["layers"][2]["backward_s"]  # optional: older profiles lack it
    del doc["layers"][2]["input_grad"]
    bad.write_text(json.dumps(doc))
    assert len(load_profile(bad)) == 4


def test_mlp_and_cli(tmp_path):
    """``pipeopt profile`` of the MLP on the CPU: timed in step by default (2 gloo ranks run
    1F1B and ZB-H1 of it). Its layers add up, stage by stage, to the op times the runs
    measured; the overheads are the runs' own; the config form prices exactly that."""
    from pipeopt.cli import main
    from pipeopt.config import parse_config

    m = mlp(layers=3, width=16)
    assert len(m) == 3
    out = tmp_path / "mlp.json"
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "16",
                 "--repeats", "1", "--warmup", "0", "--step-microbatches", "4",
                 "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["layers"]) == 2
    assert doc["layers"][0]["forward_flops"] == 2 * 2 * 16 * 16
    assert doc["timing"] == "step"
    st = doc["in_step"]
    assert st["partition"] == [[0, 1], [1, 2]] and st["methods"] == ["1f1b", "zb-h1"]
    assert st["microbatches"] == 4 and st["ranks"] == 2
    assert st["message_bytes"] == 2 * 16 * 4 and st["message_ping_pong_ms"] > 0
    assert [r["method"] for r in st["replayed"]] == ["1f1b", "zb-h1"]
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in st["replayed"])
    # stage 0 takes no input gradient in a pipeline: its whole backward is one op
    assert doc["layers"][0]["input_grad"] is False and doc["layers"][1]["input_grad"] is True
    for row, rec in zip(st["stages"], doc["layers"], strict=True):  # one layer per stage
        assert rec["forward_s"] == pytest.approx(row["forward_ms"] / 1e3)
        assert rec["backward_s"] == pytest.approx(row["backward_ms"] / 1e3)
    assert doc["layers"][1]["backward_input_s"] == pytest.approx(
        st["stages"][1]["backward_input_ms"] / 1e3)
    over = doc["overheads"]
    assert all(0 <= over[k] < 0.5 for k in ("action_s", "message_s", "step_s"))
    assert over["action_s"] > 0 and "1f1b and zb-h1" in over["how"]
    assert st["warmup_rounds"] == 1 and "1 round(s) not counted" in over["how"]
    prob = parse_config({"pipeline": {"devices": 2, "microbatches": 4},
                         "model": {"profile": str(out)}}).problem
    a = over["action_s"]
    assert prob.forward == pytest.approx(tuple(r["forward_s"] + a for r in doc["layers"]))
    assert prob.backward_input[0] == pytest.approx(a)  # B of stage 0: nothing to compute
    assert prob.backward_weight[0] == pytest.approx(doc["layers"][0]["backward_s"] + a)
    warm = tmp_path / "warm.json"
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "16",
                 "--repeats", "1", "--warmup", "0", "--timing", "warm", "-o", str(warm)]) == 0
    wdoc = json.loads(warm.read_text())
    assert wdoc["timing"] == "warm" and "in_step" not in wdoc and "overheads" not in wdoc


def test_step_trace_costs_by_hand():
    """A 1F1B step of 2 stages and 2 micro-batches traced by hand (seconds): every op's
    duration, the runtime's gap before an op whose inputs are local (0.1), the delay of a
    message that held an op up (0.3) and the tail after the last op (0.7, on rank 0); the
    first step of a round is warm-up and not counted."""
    from pipeopt.costs.profiler import step_trace_costs, trimmed_mean
    from pipeopt.problem import uniform_problem
    from pipeopt.solvers import solve

    s = solve(uniform_problem(2, 2).replace(split_backward=False), "1f1b")
    assert [[str(o) for o in order] for order in s.device_orders()] == [
        ["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    r0 = [("0F0", 0.0, 1.0), ("0F1", 1.1, 2.1), ("0B0", 4.3, 5.3), ("0B1", 7.3, 8.3)]
    r1 = [("1F0", 1.3, 2.3), ("1B0", 2.4, 4.0), ("1F1", 4.1, 5.1), ("1B1", 5.2, 7.0)]
    junk = [("0F0", 0.0, 50.0)]  # a slow first step: never counted
    runs = [[{"step_traces": [junk, r0], "step_times": [60.0, 9.0]}],
            [{"step_traces": [junk, r1], "step_times": [60.0, 8.5]}]]
    got = step_trace_costs(s, runs)
    assert got["ops"]["F0"] == pytest.approx([1.0, 1.0])
    assert got["ops"]["B1"] == pytest.approx([1.6, 1.8])
    assert got["gaps"] == pytest.approx([0.1] * 4)
    assert got["delays"] == pytest.approx([0.3] * 3)
    # Where each was measured: (step, rank), the step an index into got["steps"].
    assert got["where"]["F0"] == [(0, 0), (0, 0)] and got["where"]["B1"] == [(0, 1), (0, 1)]
    assert sorted(got["gap_where"]) == [(0, 0), (0, 1), (0, 1), (0, 1)]
    assert len(got["tails"]) == 1 and got["tails"][0][1] == 0
    assert got["tails"][0][0] == pytest.approx(0.7) and got["leads"] == [0.0]
    assert trimmed_mean([float(x) for x in range(1, 11)] + [100.0]) == pytest.approx(6.0)
    assert trimmed_mean([]) == 0.0 and trimmed_mean([2.0]) == 2.0


def test_op_spread_splits_a_planted_factor_from_per_op_noise():
    """Traces of 3 steps of 1F1B (2 stages, 2 micro-batches) whose every op and gap ran at a
    planted factor per step and rank (rank 0: 0.9, 1.0, 1.1; rank 1: 1.2, 1.0, 0.8, each
    averaging 1, so the trimmed means priced are the base times F0 1, B0 2, F1 1.5, B1 3 s),
    and stage 0's forwards also 10 % over and under it (micro-batch 0 and 1). The spread
    gives back the six factors, F0's residuals of +-0.1 s and no residual elsewhere; pooled
    as before, B0's residuals would have been 2 x factor - 2 = -0.2..+0.2 s."""
    from pipeopt.costs.profiler import _op_spread

    action = 0.1
    planted = {0: (0.9, 1.0, 1.1), 1: (1.2, 1.0, 0.8)}
    base = {"F0": (1.1, 0.9), "B0": (2.0, 2.0), "F1": (1.5, 1.5), "B1": (3.0, 3.0)}
    ops: dict = {k: [] for k in base}
    where: dict = {k: [] for k in base}
    gaps, gap_where = [], []
    for step in range(3):
        for rank, keys in ((0, ("F0", "B0")), (1, ("F1", "B1"))):
            c = planted[rank][step]
            for key in keys:
                for t in base[key]:
                    ops[key].append(c * t)
                    where[key].append((step, rank))
            gaps += [c * action] * 3  # 4 ops a rank, the first after no gap
            gap_where += [(step, rank)] * 3
    fused = {"ops": ops, "where": where, "gaps": gaps, "gap_where": gap_where,
             "delays": [0.4, 0.5], "leads": [], "tails": [], "steps": [0.0] * 3}
    split = {"ops": {}, "where": {}, "gaps": [], "gap_where": [], "delays": []}
    spread = _op_spread(fused, split, 2, action)
    assert spread.shared == pytest.approx(sorted(planted[0] + planted[1]))
    assert spread.residuals("F0") == pytest.approx((-0.1,) * 3 + (0.1,) * 3)
    for key in ("B0 fused", "F1", "B1 fused"):
        assert spread.residuals(key) == pytest.approx((0.0,) * 6, abs=1e-12), key
    assert spread.residuals("B0") == () and spread.residuals("W1") == ()
    assert spread.gap == pytest.approx((0.0,) * len(spread.gap), abs=1e-12)
    assert spread.message == pytest.approx((-0.05, 0.05))


def test_step_rank_leaves_its_warm_up_rounds_out(monkeypatch):
    """``step_profile``'s ranks run every job ``warmup + rounds`` times, interleaved, and
    report only the rounds after the warm-up ones (a fresh rank's first round is not what a
    later run of the same schedule sees)."""
    import pipeopt.costs.profiler as profiler
    import pipeopt.executor.launch as launch

    calls: list[str] = []

    def fake_run(rank, world, device, sched, cfg, backend, status=None):
        calls.append(sched)
        return {"step_traces": [[(sched, 0.0, float(len(calls)))]],
                "step_times": [float(len(calls))]}

    monkeypatch.setattr(launch, "run_rank", fake_run)
    monkeypatch.setattr(profiler, "ping_pong_s", lambda rank, x, reps: 1e-4)
    got = profiler._step_rank(0, 2, "cpu", [("a", None), ("b", None)], 2, 8, warmup=1)
    assert calls == ["a", "b"] * 3
    assert [[r["step_times"] for r in job] for job in got["runs"]] == [
        [[3.0], [5.0]], [[4.0], [6.0]]]
    assert got["ping_pong_s"] == 1e-4
    calls.clear()
    got = profiler._step_rank(0, 2, "cpu", [("a", None)], 2, 8)  # no warm-up: all counted
    assert [r["step_times"] for r in got["runs"][0]] == [[1.0], [2.0]]


def test_step_profile_refuses_bad_rounds_and_scales_its_timeout(gpt_profile, monkeypatch):
    """A negative ``warmup`` or no counted round is refused up front (it silently counted
    fewer rounds); the ranks' spawn gets ``timeout`` scaled by ``(warmup + rounds) /
    rounds``, the rounds not counted taking as long as the others (found in review)."""
    import pipeopt.costs.profiler as profiler
    import pipeopt.executor.procs as procs

    for warmup, rounds in ((-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="warmup must be >= 0 and rounds >= 1"):
            profiler.step_profile({}, "mlp", warmup=warmup, rounds=rounds)
    seen: list[float] = []

    class Spawned(Exception):
        pass

    def spawn(fn, world, args, *, timeout, backend):
        seen.append(timeout)
        raise Spawned

    monkeypatch.setattr(procs, "spawn", spawn)
    with pytest.raises(Spawned):
        profiler.step_profile(gpt_profile, "tiny-gpt", rounds=2, warmup=1, timeout=100.0)
    assert seen == [pytest.approx(150.0)]


def test_factory_model_needs_an_input_shape(tmp_path):
    from pipeopt.cli import main

    out = tmp_path / "f.json"
    assert main(["profile", "--model", "pipeopt.models:mlp", "-o", str(out)]) == 2
    assert main(["profile", "--model", "pipeopt.models:mlp", "--input-shape", "2,64",
                 "--repeats", "1", "--warmup", "0", "-o", str(out)]) == 0
    assert len(json.loads(out.read_text())["layers"]) == 4


@pytest.mark.parametrize(("args", "phrase"), [
    (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["--hidden", "0"], "argument --hidden: must be >= 1, got 0"),
    (["--layers", "x"], "argument --layers: expected an integer, got 'x'"),
    (["--heads", "5"], "--heads: must divide --hidden (64), got 5"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--model", "pipeopt.models:mlp", "--input-shape", "a,b"],
     "--input-shape: expected comma-separated integers"),
    (["--model", "pipeopt.models:mlp", "--input-shape", "2,0"],
     "--input-shape: every size must be >= 1"),
    (["--model", "pipeopt.models:mlp", "--input-shape", "2,3"],
     "--model: running pipeopt.models:mlp on its example input failed: RuntimeError"),
    (["--model", "os:getcwd", "--input-shape", "2"],
     "must give a non-empty torch.nn.Sequential"),
    (["--model", "os:sep"], "is not a function that builds a model"),
    (["--model", "no_such_module_xyz:f"], "--model: cannot load 'no_such_module_xyz:f'"),
])
def test_profile_bad_arguments(tmp_path, capsys, args, phrase):
    from pipeopt.cli import main

    out = tmp_path / "p.json"
    assert main(["profile", "--repeats", "1", "--warmup", "0", *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert phrase in err, err
    assert not out.exists()


def test_layer_output_a_view_and_frozen_layer():
    """A Linear on a 3-d input returns a view, which PyTorch's split backward cannot detach in
    place: the profiler still times it; a frozen first layer costs no backward at all."""
    from torch import nn

    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)
    doc = profile_model(model, torch.randint(0, 16, (2, 5)), device="cpu", warmup=0, repeats=1)
    emb, *lins = doc["layers"]
    assert emb["backward_input_s"] == emb["backward_weight_s"] == emb["backward_s"] == 0
    assert all(r["backward_input_s"] > 0 and r["backward_weight_s"] > 0 for r in lins)


def test_recompute_memory_matches_autograd(capsys):
    """Issue 18 item 1: what a block keeps for its backward, measured as the bytes autograd
    saves (distinct storages, parameters left out) against the model's
    ``block_activation_bytes``: exact with ``recompute: full`` (only the block's input, the
    e*s*b*h bytes torch.utils.checkpoint keeps), within 1 % without recomputation; and what a
    W deferred past a full-recompute B would hold (``block_weight_grad_held_bytes``) is many
    times what the forward kept, which is why the model form fuses B and W there."""
    from torch.utils.checkpoint import checkpoint

    from pipeopt.costs.transformer import block_activation_bytes, block_weight_grad_held_bytes

    torch.manual_seed(0)
    block = tiny_gpt(layers=1, hidden=H, heads=HEADS, vocab=V, seq_len=S)[1]

    shape = TransformerShape(layers=1, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B, dtype="fp32", dropout=False,
                             sequence_parallel=False)
    x = torch.randn(B, S, H, requires_grad=True)
    full = _saved_bytes(block, x, lambda x: checkpoint(block, x, use_reentrant=False))
    none = _saved_bytes(block, x)
    full_ratio = full / block_activation_bytes(shape, "full")
    none_ratio = none / block_activation_bytes(shape, "none")
    held = block_weight_grad_held_bytes(shape)
    with capsys.disabled():
        print(f"\nrecompute full: profiled / modelled bytes = {full_ratio:.3f}; "
              f"none: {none_ratio:.3f}; a deferred W would hold {held / full:.0f}x what "
              "the full-recompute forward kept")
    assert full == B * S * H * 4  # fp32: the block's input only
    assert full_ratio == 1.0
    assert none_ratio == pytest.approx(1.0, rel=0.01)
    assert held > 10 * full


def test_recompute_transient_matches_autograd(capsys):
    """Issue 18 item 1: the peak a full-recompute backward reaches (what the recomputation
    leaves alive, :func:`_recomputed_alive_bytes`) against the model's kept bytes plus
    ``block_backward_transient_bytes``: within 1 %, the same margin as without recomputation
    above."""
    from pipeopt.costs.transformer import block_activation_bytes, block_backward_transient_bytes

    torch.manual_seed(0)
    block = tiny_gpt(layers=1, hidden=H, heads=HEADS, vocab=V, seq_len=S)[1]
    alive = _recomputed_alive_bytes(block, torch.randn(B, S, H, requires_grad=True))
    shape = TransformerShape(layers=1, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B, dtype="fp32", dropout=False,
                             sequence_parallel=False, recompute="full")
    modelled = block_activation_bytes(shape) + block_backward_transient_bytes(shape)
    ratio = alive / modelled
    with capsys.disabled():
        print(f"\nfull-recompute backward: profiled / modelled peak bytes = {ratio:.3f} "
              f"(transient {block_backward_transient_bytes(shape):.0f} B on "
              f"{block_activation_bytes(shape):.0f} B kept)")
    assert ratio == pytest.approx(1.0, rel=0.01)
    assert block_backward_transient_bytes(shape) > 10 * block_activation_bytes(shape)


def test_flash_attention_memory_matches_autograd(capsys):
    """``model.flash_attention``: the same block with torch's fused attention
    (``scaled_dot_product_attention``, whose backward keeps the fp32 logsumexp instead of the
    s x s scores): saved bytes and the full-recompute peak against the model's, within 1 %,
    and the standard-attention model would miss by more (the s^2 term it counts)."""
    import torch.nn.functional as F

    from pipeopt.costs.transformer import block_activation_bytes, block_backward_transient_bytes
    from pipeopt.executor.models import Block

    class FlashBlock(Block):
        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                       for z in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    block = FlashBlock(H, HEADS)
    x = torch.randn(B, S, H, requires_grad=True)
    shape = TransformerShape(layers=1, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B, dtype="fp32", dropout=False,
                             sequence_parallel=False, flash_attention=True)
    saved = _saved_bytes(block, x) / block_activation_bytes(shape, "none")
    from dataclasses import replace

    full = replace(shape, recompute="full")
    peak = _recomputed_alive_bytes(block, x) / (block_activation_bytes(full)
                                                + block_backward_transient_bytes(full))
    standard = _saved_bytes(block, x) / block_activation_bytes(
        replace(shape, flash_attention=False), "none")
    with capsys.disabled():
        print(f"\nflash attention: profiled / modelled bytes = {saved:.3f} kept, {peak:.3f} "
              f"full-recompute peak (standard-attention model: {standard:.3f})")
    assert saved == pytest.approx(1.0, rel=0.01) and peak == pytest.approx(1.0, rel=0.01)
    assert abs(standard - 1) > 0.03


def test_forward_only_profile(tmp_path):
    """Issue 15 item 4: the inference forward alone: the same forward FLOPs as training's,
    no backward, nothing saved; the file reads back and the CLI writes it."""
    from pipeopt.cli import main

    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=H, heads=HEADS, vocab=V, seq_len=S)
    x, _ = sample_batch("tiny-gpt", B, seq_len=S, vocab=V)
    doc = profile_model(model, x, device="cpu", warmup=0, repeats=1, forward_only=True)
    assert doc["forward_only"] is True
    shape = TransformerShape(layers=2, hidden=H, heads=HEADS, seq_len=S, vocab=V,
                             micro_batch_size=B, dtype="fp32")
    lin, att = block_flops(shape)
    blk = doc["layers"][1]
    assert blk["forward_flops"] == lin + att
    assert blk["backward_flops"] == blk["backward_s"] == blk["activation_bytes"] == 0
    assert blk["forward_s"] > 0 and blk["input_grad"] is False
    assert doc["layers"][3]["forward_flops"] == head_flops(shape)
    path = tmp_path / "fwd.json"
    path.write_text(json.dumps(doc))
    costs = load_profile(path)
    assert [c.backward_input_time + c.backward_weight_time for c in costs] == [0.0] * 4
    out = tmp_path / "cli.json"
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "16",
                 "--repeats", "1", "--warmup", "0", "--forward-only", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["forward_only"] is True


def test_optimizer_step_is_timed_per_layer_and_leaves_the_weights(gpt_profile):
    """Each layer records the SGD step of its own parameters (``step_s``, seconds): positive
    where there are parameters, 0 without; timing it moves no weight and keeps ``.grad``."""
    for rec in gpt_profile["layers"]:
        assert 0 < rec["step_s"] < 0.5
    from pipeopt.costs.profiler import optimizer_step_time

    lin = torch.nn.Linear(4, 4)
    before = lin.weight.detach().clone()
    lin.weight.grad = torch.ones_like(lin.weight)
    assert optimizer_step_time(list(lin.parameters()), 1, 3, lambda: None) > 0
    assert torch.equal(lin.weight, before) and torch.equal(lin.weight.grad,
                                                           torch.ones_like(lin.weight))
    assert lin.bias.grad is None
    assert optimizer_step_time([], 1, 3, lambda: None) == 0.0


def test_overheads_of_a_trivial_model_are_positive_and_small(tmp_path):
    """``pipeopt profile --overheads``: 2 gloo ranks replay a trivial model; the fixed costs
    per action, message and step are >= 0, some positive (a run is never free), and small
    (under 0.2 s each even on a loaded machine; a trivial op takes well under 1 ms alone);
    the profile file carries them and the config form reads them back."""
    from pipeopt.cli import main
    from pipeopt.costs.profile import load_overheads

    out = tmp_path / "p.json"
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "8", "--timing",
                 "warm", "--repeats", "1", "--warmup", "0", "--overheads", "-o", str(out)]) == 0
    over = json.loads(out.read_text())["overheads"]
    assert "ZB-H1 of a trivial model" in over["how"]
    got = load_overheads(out)
    assert (got.action_s, got.message_s, got.step_s) == (
        over["action_s"], over["message_s"], over["step_s"])
    assert all(0 <= x < 0.2 for x in (got.action_s, got.message_s, got.step_s)), got
    assert got.message_s > 0 and got.action_s + got.step_s > 0, got
    assert main(["profile", "--model", "mlp", "--forward-only", "--overheads",
                 "-o", str(out)]) == 2


def test_step_timing_refuses_more_ranks_than_the_machine_takes(tmp_path, capsys):
    """``--timing step --step-ranks N`` with N beyond what ``pipeopt run`` would start here: a
    one-line error naming the flag, before any timing, and no file written."""
    from pipeopt.cli import main
    from pipeopt.executor.procs import RANKS_PER_CORE

    out = tmp_path / "p.json"
    too_many = RANKS_PER_CORE * (os.cpu_count() or 1) + 1
    assert main(["profile", "--model", "mlp", "--layers", "2", "--hidden", "8", "--timing",
                 "step", "--step-ranks", str(too_many), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--step-ranks" in err and f"{too_many} ranks to start" in err
    assert not out.exists()


def test_kendall_tau_b_by_hand():
    """Kendall's tau-b on rankings worked by hand (scipy.stats.kendalltau gives the same):
    without ties it is tau-a; a tie in one ranking keeps it below 1, less than tau-a does."""
    from pipeopt.costs.profiler import kendall_tau_b

    assert kendall_tau_b([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert kendall_tau_b([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # 6 pairs: (1, 2) discordant, (2, 3) tied in a only, 4 concordant: 3 / sqrt(5 * 6).
    assert kendall_tau_b([1.0, 2.0, 3.0, 3.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(
        3 / 30 ** 0.5)
    # The prediction ties two cases, the measurement orders them: 5 / sqrt(5 * 6), not 5 / 6.
    assert kendall_tau_b([1.0, 2.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(
        (5 / 6) ** 0.5)
    # Ties on both sides of the same pair: the order of the rest decides alone.
    assert kendall_tau_b([1.0, 2.0, 2.0], [5.0, 7.0, 7.0]) == pytest.approx(1.0)
    # Values within rel_tol of each other are a tie (simulated times that differ by round-off).
    assert kendall_tau_b([1.0, 1.0 + 1e-12, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(
        2 / 6 ** 0.5)
    assert kendall_tau_b([1.0, 1.0], [1.0, 2.0]) != kendall_tau_b([1.0, 1.0], [1.0, 2.0])  # NaN
    with pytest.raises(ValueError, match="finite"):
        kendall_tau_b([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="3 and 2 items"):
        kendall_tau_b([1.0, 2.0, 3.0], [1.0, 2.0])


# A world priced exactly as the simulator prices a step (seconds): per stage F, B and W of
# the split backward, the fused backward, the runtime's gap before each op, the delay of an
# activation message beyond it and the step's tail after the last op.
_F, _B, _W, _FUSED = (2e-3, 3e-3), (0.0, 2.5e-3), (4e-3, 1.5e-3), (4e-3, 3.5e-3)
_GAP, _DELAY, _TAIL = 1e-4, 3e-4, 1e-3


def _world_runs(sched, steps=2):
    """``run_rank``-like reports (``step_traces``, ``step_times``: one round of ``steps``
    identical steps) of ``sched``'s orders on 2 ranks in the world above: the simulator's
    op times, each op's trace starting ``_GAP`` after the simulator's start (which pays the
    gap in the op, as ``with_overheads`` does), every rank's step ending ``_TAIL`` after the
    last op."""
    from pipeopt.problem import chain_links, uniform_problem
    from pipeopt.simulate import simulate

    split = sched.problem.split_backward
    lat, bw = chain_links(2, [_DELAY], [float("inf")])
    world = uniform_problem(2, sched.problem.microbatches, split_backward=split).replace(
        forward=tuple(x + _GAP for x in _F),
        backward_input=tuple(x + _GAP for x in (_B if split else _FUSED)),
        backward_weight=tuple(x + _GAP for x in _W) if split else (0.0, 0.0),
        latency=lat, bandwidth=bw)
    timed = simulate(world, sched.device_orders())
    step = timed.makespan + _TAIL
    traces = [sorted(((str(t.op), t.start + _GAP, t.end) for t in timed.ops if t.device == r),
                     key=lambda x: x[1]) for r in range(2)]
    return [[{"step_traces": [traces[r]] * steps, "step_times": [step] * steps}]
            for r in range(2)], step


def test_step_profile_from_runs_recovers_a_simulated_world(gpt_profile, tmp_path):
    """Runs whose op traces are the simulator's own step (known F, B, W, fused backward, gap,
    message delay and tail): ``step_profile_from_runs`` gives back every stage's times, the
    gap and the delay as the overheads, a step cost that predicts the runs exactly, and the
    config form's problem of the new document prices a third schedule's orders (ZB-H2, never
    run) at what that world takes: what ``benchmarks/executor.py --ranking`` relies on when
    it re-prices each case on every round's profile. The warm document is left as it was.
    Steps agree within 10 us (a tenth of one op's gap): the config form puts its default
    link (2 us, 450 GB/s) under the measured message delay."""
    import copy

    from pipeopt.config import parse_config
    from pipeopt.costs.profiler import (
        STEP_METHODS,
        sampled_step_fit,
        step_problem,
        step_profile_from_runs,
        step_schedules,
    )
    from pipeopt.schedules import fused_variant
    from pipeopt.simulate import simulate
    from pipeopt.solvers import solve

    # Every rank's step ends _TAIL after its last op: no layer's optimizer step on top.
    base = {**gpt_profile, "layers": [{**rec, "step_s": 0.0} for rec in gpt_profile["layers"]]}
    kept = copy.deepcopy(base)
    warm, part, scheds = step_schedules(base, 2, 4)
    assert [s.method for s in scheds] == list(STEP_METHODS)
    assert [s.problem.split_backward for s in scheds] == [False, True]
    assert part[0][0] == 0 and part[0][1] == part[1][0] and part[1][1] == len(warm["layers"])
    assert warm["layers"][0]["input_grad"] is False
    runs = [_world_runs(s) for s in scheds]
    per_rank = [[runs[i][0][r] for i in range(2)] for r in range(2)]  # [rank][method][round]
    doc = step_profile_from_runs(base, per_rank, microbatches=4, model="tiny-gpt")
    assert base == kept
    assert doc["timing"] == "step" and doc["in_step"]["partition"] == [list(x) for x in part]
    rows = doc["in_step"]["stages"]
    assert rows[0]["forward_ms"] == pytest.approx(2.0)
    assert rows[0]["backward_ms"] == pytest.approx(4.0)  # stage 0: the whole backward
    assert (rows[1]["forward_ms"], rows[1]["backward_input_ms"], rows[1]["backward_weight_ms"],
            rows[1]["backward_ms"]) == pytest.approx((3.0, 2.5, 1.5, 3.5))
    over = doc["overheads"]
    assert over["action_s"] == pytest.approx(_GAP) and over["message_s"] == pytest.approx(_DELAY)
    for row, (_, step) in zip(doc["in_step"]["replayed"], runs, strict=True):
        assert row["measured_ms"] == pytest.approx(step * 1e3)
        assert row["predicted_ms"] == pytest.approx(step * 1e3, abs=1e-2)
    path = tmp_path / "step.json"
    path.write_text(json.dumps(doc))
    prob = parse_config({"pipeline": {"devices": 2, "microbatches": 4},
                         "model": {"profile": str(path)},
                         "training": {"stage_layers": [b - a for a, b in part]}}).problem
    for method in ("zb-h2", "gpipe"):
        other = solve(prob, method)
        priced = simulate(prob if other.problem.split_backward else fused_variant(prob),
                          other.device_orders()).iteration_time
        assert priced == pytest.approx(_world_runs(other)[1], abs=1e-5), method
        # step_problem: the same problem without writing the document by hand.
        again_p = step_problem(doc)
        assert again_p.microbatches == 4 and again_p.stages == 2
        assert simulate(again_p if other.problem.split_backward else fused_variant(again_p),
                        other.device_orders()).iteration_time == pytest.approx(priced, abs=1e-12)
    assert step_problem(doc, 8).microbatches == 8
    with pytest.raises(ValueError, match=r"in_step\.partition: missing"):
        step_problem(base)
    # Identical steps: op times do not spread, so the sampled prediction differs from the
    # replay on mean parts only by the gaps this world's traces show beyond the priced
    # (trimmed-mean) one (some ops start 2 gaps after their input), which the fit against it
    # takes back out: it predicts both runs within one gap. The one step and rank with such
    # a double gap ran its ops and gaps 0.4 % over their priced sum (its shared factor), the
    # others at 1; its ops' residuals are what dividing by it leaves (under a fifth of a gap).
    spread = doc["in_step"]["op_spread"]
    assert len(spread["shared"]) == 4  # (1F1B, ZB-H1) x (rank 0, 1) x one counted step
    assert sorted(spread["shared"])[:3] == pytest.approx([1.0] * 3, abs=1e-12)
    assert 1.003 < max(spread["shared"]) < 1.005
    # The same four factors per step, both ranks' together: one step of each schedule.
    assert len(spread["joint"]) == 2 and all(len(v) == 2 for v in spread["joint"])
    assert sorted(x for v in spread["joint"] for x in v) == sorted(spread["shared"])
    assert spread["ops"]["F0"] and max(abs(x) for v in spread["ops"].values() for x in v) < _GAP / 5
    assert set(spread["ops"]) == {"F0", "F1", "B0", "B1", "W0", "W1", "B0 fused", "B1 fused"}
    assert all(abs(g) < 1e-6 or g == pytest.approx(_GAP, rel=0.01) for g in spread["gap"])
    again = sampled_step_fit(doc, samples=20)
    # Drawn apart from the residuals it was divided out of, that factor can also take a few
    # us off a draw (3.6 us here): the fit stays within a tenth of a gap above the mean one.
    assert (over["step_s"] - _GAP - 1e-12 <= again["overheads"]["step_s"]
            <= over["step_s"] + _GAP / 10)
    for row, (_, step) in zip(again["in_step"]["sampled"]["replayed"], runs, strict=True):
        assert row["predicted_ms"] == pytest.approx(step * 1e3, abs=_GAP * 1e3)
    no_spread = {**doc, "in_step": {k: v for k, v in doc["in_step"].items() if k != "op_spread"}}
    with pytest.raises(ValueError, match=r"in_step\.op_spread: missing"):
        sampled_step_fit(no_spread)
    with pytest.raises(ValueError, match="of the 2 schedules 1f1b, zb-h1 on every rank"):
        step_profile_from_runs(base, [per_rank[0][:1], per_rank[1][:1]],
                               microbatches=4)


def test_step_schedules_refuses_what_cannot_run():
    """A forward-only profile has no step to time; fewer layers than stages cannot be cut."""
    from pipeopt.costs.profiler import step_schedules

    layer = {"name": "0:Linear", "forward_s": 1e-3, "backward_input_s": 0.0,
             "backward_weight_s": 0.0, "backward_s": 0.0, "input_grad": False, "params": 1.0,
             "param_bytes": 4.0, "activation_bytes": 0.0, "output_bytes": 4.0}
    with pytest.raises(ValueError, match="forward-only profile"):
        step_schedules({"forward_only": True, "layers": [layer] * 4}, 2, 4)
    with pytest.raises(ValueError, match="1 layer\\(s\\) cannot fill 2 stages"):
        step_schedules({"layers": [layer]}, 2, 4)
