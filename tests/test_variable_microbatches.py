"""Micro-batches of different cost, the front end: config keys, the sequence-length cost model
(against hand-computed values), schedule JSON, compare's given and longest-first rows."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeopt.cli import main
from pipeopt.config import ConfigError, parse_config
from pipeopt.costs.config import parse_training
from pipeopt.costs.lengths import (
    MicrobatchTokens,
    draw_lengths,
    microbatch_ratios,
    microbatch_tokens,
    split_layers,
)
from pipeopt.costs.transformer import TransformerShape
from pipeopt.io import dump_schedule, schedule_from_dict, schedule_to_dict
from pipeopt.problem import uniform_problem
from pipeopt.simulate import ScheduleError, validate
from pipeopt.solvers import compare, longest_first, run_classic

ROOT = Path(__file__).resolve().parents[1]

EXPLICIT: dict[str, Any] = {
    "pipeline": {"devices": 4, "microbatches": 8},
    "stages": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0,
               "activation_memory": 1.0},
}

# A two-block model small enough to price by hand: h = 64, a = 4, s = 128, b = 1, V = 1000.
TINY_MODEL: dict[str, Any] = {
    "pipeline": {"devices": 2, "microbatches": 4},
    "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 128, "vocab": 1000},
    "cluster": {"gpu": "H100-SXM", "gpus_per_node": 2},
    "memory": {"limit": 1.0e12},
}


def explicit(**pipeline: Any) -> dict[str, Any]:
    doc = copy.deepcopy(EXPLICIT)
    doc["pipeline"].update(pipeline)
    return doc


# ----- explicit config -------------------------------------------------------------------
def test_explicit_scale_list_and_scalar() -> None:
    p = parse_config(explicit(microbatch_scale=[1, 2, 3, 4, 1, 2, 3, 4])).problem
    assert p.time_scale == (1, 2, 3, 4, 1, 2, 3, 4)
    assert p.memory_scale == p.time_scale and p.message_scale == p.time_scale
    assert p.device_work(0) == pytest.approx(3.0 * 20)
    q = parse_config(explicit(microbatch_scale=2.0, microbatch_memory_scale=[1] * 8)).problem
    assert q.time_scale == (2.0,) * 8 and q.memory_scale == (1.0,) * 8


@pytest.mark.parametrize(("pipeline", "message"), [
    ({"microbatch_scale": [1, 1, 1, 0, 1, 1, 1, 1]},
     "pipeline.microbatch_scale[3]: must be > 0, got 0"),
    ({"microbatch_scale": [1] * 7},
     "pipeline.microbatch_scale: expected 8 values (pipeline.microbatches), got 7"),
    ({"microbatch_scale": [1, 1, float("inf"), 1, 1, 1, 1, 1]},
     "pipeline.microbatch_scale[2]: must be a finite number > 0, got inf"),
    ({"microbatch_memory_scale": -1}, "pipeline.microbatch_memory_scale: must be > 0, got -1"),
    ({"microbatch_message_scale": "big"},
     "pipeline.microbatch_message_scale: expected a number, got 'big'"),
    ({"microbatch_scal": 1}, "did you mean 'microbatch_scale'?"),
])
def test_explicit_scale_errors(pipeline: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(explicit(**pipeline))
    assert message in str(err.value)


def test_factors_that_overflow_are_named() -> None:
    doc = explicit(microbatch_scale=[1e300] * 8)
    doc["stages"]["forward"] = 1e10
    with pytest.raises(ConfigError, match=r"^pipeline\.microbatch_scale: the times of one "):
        parse_config(doc)
    doc = explicit(microbatch_memory_scale=1e300)
    doc["stages"]["activation_memory"] = 1e10
    with pytest.raises(ConfigError, match=r"^pipeline\.microbatch_memory_scale: the memory "):
        parse_config(doc)


# ----- sequence lengths -> costs -----------------------------------------------------------
def test_split_layers_by_hand() -> None:
    shape = TransformerShape(layers=1, hidden=64, heads=4, seq_len=128, vocab=1000)
    split = split_layers(shape)
    block = 1  # embedding, block0, head
    lin = 24 * 128 * 64 * 64  # 24 b s h^2
    att = 4 * 128 * 128 * 64  # 4 b s^2 h
    # F, B (= linear + 2 attention), W (= linear) FLOPs.
    assert split.linear[block, :3] == pytest.approx([lin, lin, lin])
    assert split.quadratic[block, :3] == pytest.approx([att, 2 * att, 0])
    # Activations: s b h (34 + 5 a s / h) with 16-bit values and dropout.
    assert split.linear[block, 3] == pytest.approx(34 * 128 * 64)
    assert split.quadratic[block, 3] == pytest.approx(5 * 4 * 128 * 128)
    assert split.linear[block, 5] == pytest.approx(2 * 128 * 64)  # message: b s h x 2 bytes
    assert not split.quadratic[[0, 2]].any()  # embedding and head grow with tokens only
    # Twice the length: F ratio (2 lin + 4 att) / (lin + att) = 2.5 for these sizes.
    ratios = microbatch_ratios(split, [MicrobatchTokens.padded(256, 1)],
                               MicrobatchTokens.padded(128, 1))
    assert ratios.flops[0, block, 0] == pytest.approx((2 * lin + 4 * att) / (lin + att))
    assert ratios.flops[0, block, 0] == pytest.approx(2.5)
    assert ratios.message[0] == 2.0


def test_model_form_scales_by_hand() -> None:
    doc = copy.deepcopy(TINY_MODEL)
    doc["training"] = {"sequence_lengths": [128, 256, 64, [64, 64]]}
    p = parse_config(doc).problem
    lin, att = 24 * 128 * 64**2, 2 * 128**2 * 64  # causal (the model form's default): 2 b s^2 h
    head = 2 * 128 * 64 * 1000  # 2 b s h V

    def flops(r_lin: float, r_att: float) -> float:  # F + B + W = 3 x forward, two blocks
        return 3 * (2 * (lin * r_lin + att * r_att) + head * r_lin)

    act_lin, act_att = 34 * 128 * 64, 5 * 4 * 128**2
    emb_act = 8 * 128 + 128 * 64  # token ids (int64) and the dropout mask
    head_act = 2 * 2 * 128 * 64 + 4 * 128 * 1000  # norm and head inputs, fp32 logits

    def act(r_lin: float, r_att: float) -> float:
        return 2 * (act_lin * r_lin + act_att * r_att) + (emb_act + head_act) * r_lin

    # (tokens, attention) ratios: 128 -> (1, 1); 256 -> (2, 4); 64 -> (1/2, 1/4); two packed
    # documents of 64 -> (1, 1/2).
    cases = [(1, 1), (2, 4), (0.5, 0.25), (1, 0.5)]
    assert p.time_scale == pytest.approx([flops(a, b) / flops(1, 1) for a, b in cases])
    assert p.time_scale[1] == pytest.approx(99_876_864 / 45_744_128)
    assert p.memory_scale == pytest.approx([act(a, b) / act(1, 1) for a, b in cases])
    assert p.message_scale == pytest.approx([1, 2, 0.5, 1])
    assert dict(p.meta)["microbatch_costs"]["tokens"] == [128, 256, 64, 128]
    from pipeopt.costs import describe_partition

    assert "micro-batches: 4 of 64..256 tokens" in describe_partition(parse_config(doc))


def test_model_form_equal_lengths_are_uniform() -> None:
    doc = copy.deepcopy(TINY_MODEL)
    doc["training"] = {"sequence_lengths": [128] * 4}
    assert parse_config(doc).problem.uniform_microbatches


def test_distributions_are_seeded_and_bounded() -> None:
    spec = parse_training({"sequence_lengths": {"distribution": "zipf", "min": 64,
                                                "max": 4096, "exponent": 1.1, "seed": 3}})
    a = draw_lengths(spec.sequence_lengths, 200)
    assert a == draw_lengths(spec.sequence_lengths, 200)
    assert min(a) >= 64 and max(a) <= 4096 and len(set(a)) > 20
    logn = parse_training({"sequence_lengths": {"distribution": "lognormal", "mean": 1000,
                                                "sigma": 0.5, "seed": 0}}).sequence_lengths
    assert np.mean(draw_lengths(logn, 20000)) == pytest.approx(1000, rel=0.03)
    uni = parse_training({"sequence_lengths": {"distribution": "uniform", "min": 10,
                                               "max": 12}}).sequence_lengths
    assert set(draw_lengths(uni, 100)) == {10, 11, 12}


def test_packing_respects_the_budget() -> None:
    spec = parse_training({"sequence_lengths": {
        "distribution": "zipf", "min": 32, "max": 8192, "seed": 1,
        "tokens_per_microbatch": 2048}}).sequence_lengths
    mbs = microbatch_tokens(spec, 16, 2048, 1)
    assert len(mbs) == 16
    assert all(0 < mb.tokens <= 2048 for mb in mbs)
    assert all(mb.tokens**2 >= mb.attention >= mb.tokens * 32 for mb in mbs)


@pytest.mark.parametrize(("training", "message"), [
    ({"sequence_lengths": [128, 128, 128]},
     "training.sequence_lengths: expected 4 values (pipeline.microbatches), got 3"),
    ({"sequence_lengths": [128, 0, 128, 128]},
     "training.sequence_lengths[1]: must be >= 1, got 0"),
    ({"sequence_lengths": [128, [], 128, 128]}, "training.sequence_lengths[1]: an empty"),
    ({"sequence_lengths": {"distribution": "uniform", "min": 8}},
     "training.sequence_lengths.max: missing"),
    ({"sequence_lengths": {"distribution": "lognormal"}},
     "training.sequence_lengths.mean: missing"),
    ({"sequence_lengths": {"distribution": "zipf", "mean": 3}},
     "training.sequence_lengths.mean: not used by the zipf distribution"),
    ({"sequence_lengths": {"distribution": "zipf", "min": 9, "max": 3}},
     "training.sequence_lengths.max: must be >= min (9), got 3"),
    ({"sequence_lengths": {"distribution": "normal"}},
     "training.sequence_lengths.distribution: must be 'uniform', 'lognormal' or 'zipf'"),
])
def test_sequence_length_errors(training: dict[str, Any], message: str) -> None:
    doc = copy.deepcopy(TINY_MODEL)
    doc["training"] = training
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert message in str(err.value)


def test_lengths_and_factors_not_both() -> None:
    doc = copy.deepcopy(TINY_MODEL)
    doc["training"] = {"sequence_lengths": [128] * 4}
    doc["pipeline"]["microbatch_scale"] = [1, 2, 1, 1]
    with pytest.raises(ConfigError, match=r"^pipeline\.microbatch_scale: cannot be combined"):
        parse_config(doc)
    del doc["training"]
    assert parse_config(doc).problem.time_scale == (1, 2, 1, 1)  # factors alone: as given


# ----- schedule JSON -----------------------------------------------------------------------
def skewed(p: int = 4, m: int = 8) -> Any:
    scale = tuple(1.0 + 3.0 * ((j * 5) % m) / (m - 1) for j in range(m))
    return uniform_problem(p, m, 1.0, 1.0, 1.0).replace(microbatch_scale=scale)


def test_json_round_trip_and_order() -> None:
    prob = skewed()
    sched = run_classic(prob, "zb-h1", order=longest_first(prob))
    doc = json.loads(json.dumps(schedule_to_dict(sched)))
    assert doc["problem"]["microbatch_scale"] == list(prob.time_scale)
    assert doc["microbatch_order"] == list(longest_first(prob))
    again = schedule_from_dict(doc)
    assert again.problem == prob and again.makespan == sched.makespan
    uniform = schedule_to_dict(run_classic(uniform_problem(4, 8), "1f1b"))
    assert "microbatch_order" not in uniform and "microbatch_scale" not in uniform["problem"]
    assert schedule_from_dict(uniform).problem.uniform_microbatches  # v1 files load as before


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["problem"].update(microbatch_scale=[1, 2, 0, 1, 1, 1, 1, 1]),
     "problem.microbatch_scale[2]: must be > 0"),
    (lambda d: d["problem"].update(microbatch_scale=[1, 2]),
     "problem.microbatch_scale: expected 8 values"),
    (lambda d: d["problem"].update(microbatch_scale="x"),
     "problem.microbatch_scale: expected a list of numbers"),
    (lambda d: d.update(microbatch_order=[0, 1]),
     "microbatch_order: expected a permutation of 0..7"),
    (lambda d: d.update(microbatch_order=list(range(8))),
     "microbatch_order: the file says [0, 1, 2, 3, 4, 5, 6, 7], its ops give"),
])
def test_loader_refuses_bad_scales(edit: Any, message: str) -> None:
    prob = skewed()
    doc = schedule_to_dict(run_classic(prob, "1f1b", order=longest_first(prob)))
    edit(doc)
    with pytest.raises(ScheduleError) as err:
        schedule_from_dict(doc)
    assert message in str(err.value)


# ----- compare, auto, solve ----------------------------------------------------------------
def test_longest_first_schedule_is_of_the_original_problem() -> None:
    prob = skewed()
    order = longest_first(prob)
    assert [prob.time_scale[j] for j in order] == sorted(prob.time_scale, reverse=True)
    sched = validate(run_classic(prob, "1f1b", order=order))
    assert sched.problem == prob.replace(split_backward=False)
    assert sched.microbatch_order == order and sched.method == "1f1b+longest-first"
    # Running the permuted problem in FIFO order takes the same time.
    assert sched.makespan == run_classic(prob.permute_microbatches(order), "1f1b").makespan


def test_compare_shows_both_orders() -> None:
    rows = compare(skewed(), ["1f1b", "zb-h1", "greedy"], time_limit=5, workers=1)
    names = {r.method for r in rows}
    assert names == {"1f1b", "1f1b (longest first)", "zb-h1", "zb-h1 (longest first)",
                     "greedy"}
    for r in rows:
        assert r.schedule is not None
        validate(r.schedule)
    same = compare(uniform_problem(4, 8), ["1f1b"])  # equal costs: one row
    assert [r.method for r in same] == ["1f1b"]


def test_summary_prints_the_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prob = skewed()
    path = tmp_path / "s.json"
    dump_schedule(run_classic(prob, "zb-h1", order=longest_first(prob)), path)
    assert main(["simulate", str(path)]) == 0
    line = "micro-batches " + ", ".join(map(str, longest_first(prob))) + " (the order run)"
    assert line in capsys.readouterr().out
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(explicit(microbatch_scale=[1, 1, 1, 1, 4, 4, 4, 4])))
    assert main(["solve", str(cfg), "--method", "greedy", "--json", "-q"]) == 0
    order = json.loads(capsys.readouterr().out)["microbatch_order"]
    assert sorted(order) == list(range(8))
    assert main(["compare", str(cfg), "--methods", "1f1b,zb-h1", "-q"]) == 0
    assert "1f1b (longest first)" in capsys.readouterr().out


def test_multimodal_example_solves_and_validates(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pipeopt.config import load_config
    from pipeopt.io import load_schedule

    example = str(ROOT / "examples" / "multimodal.yaml")
    prob = load_config(example).problem
    assert (prob.devices, prob.microbatches) == (8, 32)
    assert (min(prob.time_scale), max(prob.time_scale)) == (1.0, 4.0)
    # The limit is 1F1B's peak when every micro-batch is the longest: p x 4 x 1.
    assert prob.memory_limit == (32.0,) * 8
    out = tmp_path / "s.json"
    assert main(["solve", example, "--method", "greedy", "-q", "-o", str(out)]) == 0
    sched = load_schedule(out)  # validated again, memory limit included
    assert max(sched.peak_memory) <= 32.0
    capsys.readouterr()
    assert main(["compare", example, "--methods", "1f1b,zb-h1,greedy", "--json", "-q"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"1f1b", "1f1b (longest first)", "zb-h1", "zb-h1 (longest first)",
                         "greedy"}
    assert all(r["fits"] for r in rows.values())
    hand = min(rows[k]["makespan"] for k in rows if k != "greedy")
    assert rows["greedy"]["makespan"] <= hand * 1.05


def test_memory_floor_counts_the_largest_microbatch() -> None:
    from pipeopt.schedules import NotApplicable
    from pipeopt.solvers import memory_floor, require_memory

    prob = uniform_problem(2, 2, activation=1.0).replace(microbatch_scale=(0.25, 0.5))
    assert memory_floor(prob) == (0.5, 0.5)
    require_memory(prob.replace(memory_limit=(0.5, 0.5)), "greedy")  # one at a time fits
    with pytest.raises(NotApplicable, match=r"0\.5 of activations that the largest micro-batch"):
        require_memory(prob.replace(memory_limit=(0.4, 0.4)), "greedy")


def test_model_form_gives_a_row_per_stage() -> None:
    """The partition puts embedding and both blocks on stage 0 and the head on stage 1: the
    head grows with the tokens only, so its row is the token ratio; stage 0's is its blocks'
    FLOP ratio (the embedding has no FLOPs) and its activations' (embedding included)."""
    doc = copy.deepcopy(TINY_MODEL)
    doc["training"] = {"sequence_lengths": [128, 256, 64, [64, 64]]}
    p = parse_config(doc).problem
    assert dict(p.meta)["partition"] == [[0, 3], [3, 4]]
    lin, att = 24 * 128 * 64**2, 2 * 128**2 * 64
    act_lin, act_att = 34 * 128 * 64, 5 * 4 * 128**2
    emb_act = 8 * 128 + 128 * 64
    cases = [(1, 1), (2, 4), (0.5, 0.25), (1, 0.5)]
    assert p.stage_scales
    assert p.time_table[0] == pytest.approx([(lin * a + att * b) / (lin + att) for a, b in cases])
    assert p.time_table[1] == pytest.approx([a for a, _ in cases])
    blocks = 2 * (act_lin + act_att) + emb_act
    assert p.memory_table[0] == pytest.approx(
        [(2 * (act_lin * a + act_att * b) + emb_act * a) / blocks for a, b in cases])
    assert p.memory_table[1] == pytest.approx([a for a, _ in cases])
    # Each stage's busy time is its layers' own: the sum of the rows' work is the model's.
    for k in range(2):
        unit = p.forward[k] + p.backward_input[k] + p.backward_weight[k]
        assert p.device_work(k) == pytest.approx(unit * sum(p.time_table[k]))


def test_explicit_table() -> None:
    rows = [[1, 2, 3, 4, 1, 2, 3, 4], [1] * 8, [1] * 8, [2] * 8]
    p = parse_config(explicit(microbatch_scale=rows,
                              microbatch_message_scale=[[2] * 8, [1] * 8, [3] * 8])).problem
    assert p.time_table == tuple(tuple(map(float, r)) for r in rows)
    assert p.memory_table == p.time_table
    assert p.message_table == ((2.0,) * 8, (1.0,) * 8, (3.0,) * 8)


@pytest.mark.parametrize(("pipeline", "message"), [
    ({"microbatch_scale": [[1] * 8]},
     "pipeline.microbatch_scale: a table needs 4 rows (one per stage), got 1"),
    ({"microbatch_scale": [[1] * 8, [1] * 8, [1] * 8, [1] * 7]},
     "pipeline.microbatch_scale[3]: expected 8 values (pipeline.microbatches), got 7"),
    ({"microbatch_memory_scale": [[1] * 8, [1, 1, 0, 1, 1, 1, 1, 1], [1] * 8, [1] * 8]},
     "pipeline.microbatch_memory_scale[1][2]: must be > 0, got 0"),
    ({"microbatch_message_scale": [[1] * 8] * 4},
     "pipeline.microbatch_message_scale: a table needs 3 rows (one per stage boundary), got 4"),
    ({"microbatch_scale": [[1] * 8, 2, [1] * 8, [1] * 8]},
     "pipeline.microbatch_scale: a table's rows must all be lists, row 1 is 2"),
])
def test_explicit_table_errors(pipeline: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(explicit(**pipeline))
    assert message in str(err.value)
