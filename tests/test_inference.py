"""Inference: cost model (hand-computed), plans, the task graph, metrics (closed forms)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.costs import inference as ci
from pipeopt.costs.config import PRESETS
from pipeopt.costs.transformer import TransformerShape
from pipeopt.workloads import inference as wi
from pipeopt.workloads.inference import Request, StageModel


def llama2_70b() -> TransformerShape:
    keys = TransformerShape.__dataclass_fields__
    d = {k: v for k, v in PRESETS["llama2-70b"].items() if k in keys}
    return TransformerShape(**d, dtype="fp16", causal=True)


# ----- cost model ----------------------------------------------------------------------------
def test_kv_bytes_per_token_llama2_70b_by_hand() -> None:
    # 2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes (fp16)
    assert ci.kv_bytes_per_token(llama2_70b()) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert ci.kv_bytes_per_token(llama2_70b(), layers=20) == 327_680 / 4
    # Without GQA (64 KV heads) it would be 8x as much.
    full = TransformerShape(**{**llama2_70b().__dict__, "kv_heads": 64})
    assert ci.kv_bytes_per_token(full) == 8 * 327_680


def test_prefill_and_decode_flops_by_hand() -> None:
    sh = TransformerShape(layers=2, hidden=8, heads=2, kv_heads=1, ffn_hidden=16, seq_len=4,
                          vocab=10, activation="swiglu", causal=True)
    # kv_dim = 1 x 4 = 4; linear per token per layer 2 (2 64 + 2 8 4 + 3 8 16) = 2 (128+64+384)
    assert ci.linear_flops_per_token(sh) == 1152
    # prompt 4: 2 layers (1152 x 4 + 32 x 16 / 2) + 2 x 8 x 10 = 2 (4608 + 256) + 160
    assert ci.prefill_flops(sh, 4) == 9888
    # decode with context 5: 2 (1152 + 32 x 5) + 160
    assert ci.decode_flops(sh, 5) == 2784
    # The causal attention term equals block_flops' causal count for the whole prompt.
    from pipeopt.costs.transformer import block_flops
    lin, att = block_flops(sh)
    assert ci.prefill_flops(sh, 4) == 2 * (lin + att) + 160


def test_decode_is_memory_bound_on_h100() -> None:
    sh = llama2_70b()
    # One request of context 1000 on one H100 (ignoring that 70B does not fit one GPU):
    # FLOPs ~ 2 x 69e9 = 1.4e11 -> 0.14 ms; bytes ~ 138 GB -> 41 ms: memory bound.
    t = ci.decode_step_time(sh, "H100", [1000])
    bytes_ = ci.weight_bytes(sh) + 327_680 * 1000
    assert t == pytest.approx(bytes_ / 3.35e12)
    assert ci.decode_flops(sh, 1000) / 989.4e12 < t / 100
    # Batch 1 and batch 8 take almost the same time (the weights' read dominates).
    t8 = ci.decode_step_time(sh, "H100", [1000] * 8)
    assert t8 / t < 1.02
    # A huge batch turns compute bound: time grows with the batch.
    big = ci.decode_step_time(sh, "H100", [10] * 4096)
    assert big == pytest.approx(4096 * ci.decode_flops(sh, 10) / 989.4e12)


def test_stage_models_split_the_model() -> None:
    sh = llama2_70b()
    ms = ci.stage_models(sh, "H100", 4)
    assert sum(m.weight_bytes for m in ms) == pytest.approx(ci.weight_bytes(sh))
    assert all(m.kv_bytes_per_token == 327_680 / 4 for m in ms)
    assert [m.head_flops_per_logit > 0 for m in ms] == [False, False, False, True]
    # A whole-prompt iteration on all stages sums to the model's prefill FLOPs.
    it = wi.Iteration(0, chunks=(wi.Chunk(0, 0, 300),), first_tokens=(0,))
    assert sum(m.flops(it) for m in ms) == pytest.approx(ci.prefill_flops(sh, 300))
    with pytest.raises(ValueError, match="do not fit"):
        ci.stage_models(sh, "H100", 1)
    with pytest.raises(ValueError, match="stages"):
        ci.stage_models(sh, "H100", [40, 30])
    with pytest.raises(KeyError, match="did you mean"):
        ci.hbm_bandwidth("H10O")
    assert ci.split_layers(10, 4) == (3, 3, 2, 2)
    mixed = ci.stage_models(sh, ["H100", "H200"], [30, 50])
    assert [m.hbm_bandwidth for m in mixed] == [3.35e12, 4.8e12]
    assert mixed[1].memory_limit > mixed[0].memory_limit
    assert mixed[1].kv_bytes_per_token == 327_680 * 50 / 80
    with pytest.raises(ValueError, match="gpu: 1 GPUs for 2 stages"):
        ci.stage_models(sh, ["H100"], [30, 50])


# ----- plans ---------------------------------------------------------------------------------
def test_request_and_policy_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"request.output: must be an integer >= 1, got 0"):
        Request(5, 0)
    reqs = [Request(4, 2)] * 3
    with pytest.raises(ValueError, match=r"policy\.microbatches"):
        wi.continuous_plan(reqs, 0, 10)
    with pytest.raises(ValueError, match=r"policy\.order"):
        wi.continuous_plan(reqs, 2, 10, order=[0, 0, 1])
    with pytest.raises(ValueError, match=r"requests\[0\]: needs 5 KV tokens"):
        wi.continuous_plan(reqs, 2, 10, capacity_tokens=4)
    with pytest.raises(ValueError, match=r"requests\.prompt_median: must be > 0"):
        wi.sample_requests(1, 0, prompt_median=0, output_median=1)
    with pytest.raises(ValueError, match=r"requests\.max_output: must be an integer >= 1"):
        wi.sample_requests(1, 0, prompt_median=1, output_median=1, max_output=0)
    a = wi.sample_requests(50, 7, prompt_median=100, output_median=20, max_prompt=300)
    assert a == wi.sample_requests(50, 7, prompt_median=100, output_median=20, max_prompt=300)
    assert max(r.prompt for r in a) <= 300 and a != wi.sample_requests(
        50, 8, prompt_median=100, output_median=20, max_prompt=300)


def test_continuous_plan_by_hand() -> None:
    # Two groups, budget 5 tokens: group 0 admits r0 (3 tokens), r1 (4) does not fit beside it
    # and r2 waits behind it (first come, first served); group 1 admits r1 and r2 (4 + 1).
    reqs = [Request(3, 3), Request(4, 1), Request(1, 2)]
    plan = wi.continuous_plan(reqs, 2, 5)
    its = [(it.group, [(c.request, c.cached, c.tokens) for c in it.chunks],
            [(d.request, d.context) for d in it.decodes], it.first_tokens, it.finished)
           for it in plan.iterations]
    assert its == [
        (0, [(0, 0, 3)], [], (0,), ()),
        (1, [(1, 0, 4), (2, 0, 1)], [], (1, 2), (1,)),
        (0, [], [(0, 4)], (), ()),
        (1, [], [(2, 2)], (), (2,)),
        (0, [], [(0, 5)], (), (0,)),
    ]
    assert plan.request_iterations == ((0, 2, 4), (1,), (1, 3))


def test_chunked_prefill_splits_a_prompt() -> None:
    plan = wi.continuous_plan([Request(10, 2)], 1, 4, chunked=True)
    assert [[(c.cached, c.tokens) for c in it.chunks] for it in plan.iterations] == [
        [(0, 4)], [(4, 4)], [(8, 2)], []]
    # causal pairs of the chunk (4 after 4 cached): 4 x 4 + 16 / 2
    assert plan.iterations[1].attention_keys == 24
    assert plan.iterations[3].decodes == (wi.Decode(0, 11),)


def test_kv_capacity_holds_requests_back() -> None:
    reqs = [Request(4, 3)] * 3  # 6 KV tokens each
    plan = wi.continuous_plan(reqs, 3, 100, capacity_tokens=12)
    live = 0
    peak = 0
    for it in plan.iterations:
        live += len(it.first_tokens)
        peak = max(peak, live)
        live -= len(it.finished)
    assert peak == 2


def test_static_and_separated_plans() -> None:
    reqs = [Request(2, 1 + i) for i in range(6)]
    static = wi.static_plan(reqs, 2, 3)
    # Group 0 takes r0..r2 (3 tokens, 3 iterations), group 1 r3..r5 (6 iterations).
    assert [it.group for it in static.iterations].count(1) == 6
    assert static.iterations[0].first_tokens == (0, 1, 2)
    sep = wi.separated_plan(reqs, 2, 4)
    # Prefills first (two per iteration under 4 tokens), then decodes only.
    kinds = ["p" if it.chunks else "d" for it in sep.iterations]
    assert kinds == ["p"] * 3 + ["d"] * (len(kinds) - 3)
    assert sep.iterations[3].decodes and sep.iterations[3].group == 0


def test_plan_refuses_a_broken_iteration_list() -> None:
    reqs = (Request(2, 2),)
    ok = wi.continuous_plan(reqs, 1, 10)
    with pytest.raises(ValueError, match="yields 1 of its 2"):
        wi.Plan(reqs, ok.iterations[:1])
    bad = wi.Iteration(0, decodes=(wi.Decode(0, 2),))
    with pytest.raises(ValueError, match="out of turn"):
        wi.Plan(reqs, (bad, *ok.iterations))


# ----- the graph and metrics -----------------------------------------------------------------
def flat_stage(t: float = 0.01, kv: float = 0.0, limit: float | None = None) -> StageModel:
    """A stage whose every iteration takes ``t`` s: the weights' read dominates."""
    return StageModel(linear_flops_per_token=1.0, attention_flops_per_key=0.0,
                      weight_bytes=t * 1e12, kv_bytes_per_token=kv, peak_flops=1e15,
                      hbm_bandwidth=1e12, memory_limit=limit)


@pytest.mark.parametrize(("stages", "groups"), [(4, 4), (4, 2), (3, 1), (2, 5)])
def test_uniform_pipeline_gives_the_textbook_throughput(stages: int, groups: int) -> None:
    """Identical requests, every iteration t on every stage: with m groups over s stages each
    round of m iterations takes max(m, s) t on the first stage, so I iterations per group end
    at ((I - 1) max(m, s) + m - 1 + s) t; each iteration yields B tokens."""
    t, b, steps = 0.01, 3, 5
    reqs = [Request(7, steps)] * (b * groups)
    plan = wi.static_plan(reqs, groups, b)
    assert len(plan.iterations) == groups * steps
    graph = wi.build(plan, [flat_stage(t)] * stages)
    sched = simulate(graph, wi.plan_orders(plan, stages))
    makespan = ((steps - 1) * max(groups, stages) + groups - 1 + stages) * t
    assert sched.makespan == pytest.approx(makespan)
    m = wi.metrics(plan, sched)
    assert m.throughput_tokens_per_s == pytest.approx(b * groups * steps / makespan)
    # Steady state: m B tokens per max(m, s) t, the textbook pipeline throughput.
    steady = b * groups / (max(groups, stages) * t)
    assert m.throughput_tokens_per_s <= steady * (1 + 1e-12)  # equal when m = 1
    # First tokens: group g's prefill leaves the last stage at (g + s) t.
    assert sorted(set(round(x, 9) for x in m.ttft_s)) == [
        round((g + stages) * t, 9) for g in range(groups)]
    assert m.tpot_s == pytest.approx(max(groups, stages) * t)


def test_graph_memory_is_weights_plus_kv() -> None:
    reqs = [Request(4, 3), Request(2, 2)]
    plan = wi.continuous_plan(reqs, 1, 100)
    kv = 10.0
    st = flat_stage(kv=kv, limit=1e12)
    graph = wi.build(plan, [st, st], latency=1e-3, bandwidth=1e9)
    sched = simulate(graph, wi.plan_orders(plan, 2))
    assert check(sched) == []
    # All prompt tokens and both first decodes are in the KV at once: (4 + 2) + 2 = 8 entries.
    assert sched.peak_memory == (st.weight_bytes + 8 * kv,) * 2
    # Every byte allocated is freed: net change zero per device.
    for d in range(2):
        tasks = graph.device_tasks[d]
        assert sum(graph.mem_start[i] + graph.mem_end[i] for i in tasks) == 0
    # The token goes back: iteration 1's first stage waits for iteration 0's last stage.
    assert sched.start[2] == pytest.approx(sched.end[1] + 1e-3)


def test_percentile_linear() -> None:
    assert wi.percentile([1, 2, 3, 4], 50) == 2.5
    assert wi.percentile(range(101), 99) == 99
    assert math.isclose(wi.percentile([0, 10], 99), 9.9)


# ----- baselines, search, bound --------------------------------------------------------------
def small_stages(stages: int = 2, limit: float | None = None) -> list[StageModel]:
    """A stage whose ridge is 4 tokens: weights 8e3 bytes at 1e6 bytes/s (8 ms), 2e3 FLOPs
    per token at 1e6 FLOP/s (2 ms per token); KV 10 bytes per token."""
    return [StageModel(linear_flops_per_token=2e3, attention_flops_per_key=10.0,
                       weight_bytes=8e3, kv_bytes_per_token=10.0, peak_flops=1e6,
                       hbm_bandwidth=1e6, memory_limit=limit)] * stages


def test_ridge_tokens_and_balanced_groups_by_hand() -> None:
    from pipeopt.solvers import inference as si

    assert si.ridge_tokens(small_stages()) == 4  # 8 ms of weights / 2 ms per token
    reqs = [Request(1, o) for o in (5, 9, 2, 7, 3)]
    # LPT: 9 -> g0, 7 -> g1, 5 -> g1 (7 < 9), 3 -> g0 (9 < 12), 2 -> g0 (both 12 tokens and
    # 2 prompt tokens: the lower group).
    assert si.longest_output_first(reqs) == [1, 3, 0, 4, 2]
    assert si.balanced_groups(reqs, 2) == [1, 0, 0, 1, 0]


def test_methods_are_valid_and_below_the_bound() -> None:
    from pipeopt.solvers import inference as si

    reqs = wi.sample_requests(12, 3, prompt_median=6, output_median=4, max_prompt=20,
                              max_output=12)
    stages = small_stages(3, limit=8e3 + 10 * 60)  # room for 60 KV tokens beside the weights
    link = si.Link(latency=1e-4, bandwidth=1e6)
    bound = si.throughput_bound(reqs, stages)
    runs = [si.round_robin(reqs, stages, 8, link), si.separated(reqs, stages, 8, link)]
    res = si.search(reqs, stages, link=link, budgets=(4, 16))
    runs += res.candidates
    for run in runs:
        assert check(run.schedule) == [], run.method
        assert max(run.schedule.peak_memory) <= 8e3 + 600
        assert run.metrics.throughput_tokens_per_s <= bound * (1 + 1e-9), run.method
    assert res.best.metrics.throughput_tokens_per_s == max(
        c.metrics.throughput_tokens_per_s for c in res.candidates)
    # The search holds the round-robin plan's policy among its candidates (fcfs, shared queue).
    assert res.best.metrics.throughput_tokens_per_s >= 0.999 * min(
        c.metrics.throughput_tokens_per_s for c in res.candidates
        if c.plan.policy.startswith("fcfs/shared"))


def test_ttft_limit_is_a_constraint() -> None:
    from pipeopt.solvers import inference as si

    reqs = [Request(8, 1 + (i * 7) % 9) for i in range(10)]
    stages = small_stages(2)
    free = si.search(reqs, stages, budgets=(4, 32), greedy=False)
    ttfts = sorted(c.metrics.ttft_p99_s for c in free.candidates)
    limit = ttfts[len(ttfts) // 2]
    tight = si.search(reqs, stages, budgets=(4, 32), ttft_limit=limit, greedy=False)
    assert tight.met_limit and tight.best.metrics.ttft_p99_s <= limit
    best_ok = max(c.metrics.throughput_tokens_per_s for c in free.candidates
                  if c.metrics.ttft_p99_s <= limit)
    assert tight.best.metrics.throughput_tokens_per_s == best_ok
    never = si.search(reqs, stages, budgets=(4,), ttft_limit=1e-9, greedy=False)
    assert not never.met_limit
    assert never.best.metrics.ttft_p99_s == min(c.metrics.ttft_p99_s for c in never.candidates)
    with pytest.raises(ValueError, match=r"ttft_limit: must be > 0"):
        si.search(reqs, stages, ttft_limit=0)


def test_search_time_limit_stops_after_the_first_candidate() -> None:
    """A limit already spent still returns a plan (the first candidate), flagged incomplete;
    a roomy one tries every candidate."""
    from pipeopt.solvers import inference as si

    reqs = [Request(8, 1 + (i * 7) % 9) for i in range(10)]
    stages = small_stages(2)
    full = si.search(reqs, stages, budgets=(4, 32), greedy=True)
    assert full.complete
    roomy = si.search(reqs, stages, budgets=(4, 32), greedy=True, time_limit=3600)
    assert roomy.complete and len(roomy.candidates) == len(full.candidates)
    cut = si.search(reqs, stages, budgets=(4, 32), greedy=True, time_limit=1e-9)
    assert not cut.complete and len(cut.candidates) == 1
    assert cut.candidates[0].plan.policy == full.candidates[0].plan.policy
    with pytest.raises(ValueError, match=r"time_limit: must be > 0"):
        si.search(reqs, stages, time_limit=0)


def test_cpsat_on_a_tiny_plan_is_no_worse_than_its_order() -> None:
    from pipeopt.core.bounds import lower_bound
    from pipeopt.solvers import inference as si

    reqs = [Request(3, 2), Request(1, 3), Request(2, 1)]
    stages = small_stages(2, limit=8e3 + 10 * 8)
    plan = wi.continuous_plan(reqs, 2, 4, si.capacity_tokens(stages))
    by_plan = si.time_plan(plan, stages)
    exact = si.time_plan(plan, stages, order="cpsat", time_limit=20)
    assert check(exact.schedule) == []
    assert exact.schedule.makespan <= by_plan.schedule.makespan + 1e-9
    assert exact.schedule.makespan >= lower_bound(exact.schedule.graph) - 1e-9
    assert exact.schedule.status == "optimal"


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/inference.md's example runs and prints what its comments say."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "inference.md").read_text("utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    exec(compile(block.group(1), "docs/inference.md", "exec"), {"__name__": "_doc"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "327680.0"
    assert lines[1].endswith(" True")  # the search met its TTFT limit
    ratio, bound = lines[3].split()[:2]
    assert float(ratio) >= 1.0 and float(bound) > 0


# ----- the config and `pipeopt solve` --------------------------------------------------------
SMALL_CONFIG = """\
workload:
  kind: inference
  gpu: H100
  stages: [40, 40]
  requests:
    - {prompt: 100, output: 4}
    - {prompt: 300, output: 2}
  method: round-robin
  token_budget: 256
  ttft_limit: 10.0
model: {preset: llama2-70b, dtype: fp16}
"""


def test_inference_config_errors_name_the_key() -> None:
    import yaml

    from pipeopt.errors import ConfigError
    from pipeopt.inference_config import parse_inference

    base = yaml.safe_load(SMALL_CONFIG)
    cfg = parse_inference(base)
    assert cfg.requests == (Request(100, 4), Request(300, 2))
    assert cfg.cpsat_time == 0
    searched = parse_inference({**base, "workload": {**base["workload"], "method": "search",
                                                     "cpsat_time": 5}})
    assert searched.cpsat_time == 5
    assert [m.kv_bytes_per_token for m in cfg.stages] == [327_680 / 2] * 2
    cases = [
        ({"token_budget": 0}, r"workload\.token_budget: must be >= 1, got 0"),
        ({"gpu": "H10O"}, r"workload\.gpu: unknown GPU 'H10O'; did you mean"),
        ({"gpu": ["H100", "H10O"]}, r"workload\.gpu\[1\]: unknown GPU 'H10O'"),
        ({"gpu": ["H100"]}, r"workload\.gpu: 1 GPUs for 2 stages"),
        ({"stages": [40, 30]}, r"workload\.stages: layers per stage \[40, 30\]"),
        ({"stages": 1}, r"workload\.stages\[0\]: the weights of 80 layers"),
        ({"methd": "search"}, r"workload\.methd: unknown key; did you mean 'method'"),
        ({"requests": [{"prompt": 0, "output": 1}]}, r"workload\.requests"),
        ({"cpsat_time": -1}, r"workload\.cpsat_time: must be >= 0"),
        ({"cpsat_time": 5}, r"workload\.cpsat_time: reorders the search's plan; method "
                            r"round-robin takes none"),
    ]
    for change, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            parse_inference({**base, "workload": {**base["workload"], **change}})
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        parse_inference({**base, "model": {"preset": "llama2-70b", "dtype": "fp17"}})
    with pytest.raises(ConfigError, match=r"solver: unknown key"):
        parse_inference({**base, "solver": {}})


def test_pipeopt_solve_an_inference_config(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pipeopt.cli import main

    path = tmp_path / "serve.yaml"
    path.write_text(SMALL_CONFIG)
    out = tmp_path / "serve.json"
    assert main(["solve", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "round-robin" in text and "limit 10 s met" in text
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipeopt.schedule/v2"
    assert set(doc["metrics"]) >= {"throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                   "tpot_s"}
    assert doc["metrics"]["throughput_tokens_per_s"] == pytest.approx(
        6 / doc["metrics"]["makespan"])
    assert doc["graph"]["meta"]["plan"]["requests"]["output"] == [4, 2]
    assert doc["method"] == "round-robin"
    assert main(["solve", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ttft_limit_met"] is True
    # --time-limit is the search's wall-time budget here too; a spent one still answers
    search_cfg = SMALL_CONFIG.replace("method: round-robin", "method: search")
    assert search_cfg != SMALL_CONFIG
    path2 = tmp_path / "search.yaml"
    path2.write_text(search_cfg)
    assert main(["solve", str(path2), "--time-limit", "1e-9"]) == 0
    assert "(time limit)" in capsys.readouterr().out
    path2.write_text(search_cfg.replace("kind: inference", "kind: inference\n  time_limit: 0"))
    assert main(["solve", str(path2)]) != 0
    assert "workload.time_limit" in capsys.readouterr().err
    assert main(["solve", str(path), "--method", "greedy"]) != 0
    assert "--method: not used with an inference config" in capsys.readouterr().err
    # The output never replaces the config.
    assert main(["solve", str(path), "-o", str(path)]) != 0
    assert "--output" in capsys.readouterr().err
    assert path.read_text() == SMALL_CONFIG


def test_docs_config_block_is_valid() -> None:
    import re

    import yaml

    from pipeopt.inference_config import parse_inference

    text = (Path(__file__).resolve().parents[1] / "docs" / "inference.md").read_text("utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block is not None
    cfg = parse_inference(yaml.safe_load(block.group(1)))
    assert len(cfg.stages) == 4 and len(cfg.requests) == 60 and cfg.ttft_limit == 3.0


def test_prefill_chunks_pipeline_stage_by_stage() -> None:
    """Three chunks of one prompt on three stages of t each: chunk c leaves stage k at
    (c + k + 1) t, so the first token is out at 5 t (not 9 t, as if every chunk waited for the
    previous one's last stage); the decode that follows waits for it: 8 t."""
    t = 0.01
    plan = wi.continuous_plan([Request(12, 2)], 1, 4, chunked=True)
    assert len(plan.iterations) == 4
    graph = wi.build(plan, [flat_stage(t)] * 3)
    sched = simulate(graph, wi.plan_orders(plan, 3))
    m = wi.metrics(plan, sched)
    assert m.ttft_s[0] == pytest.approx(5 * t)
    assert sched.makespan == pytest.approx(8 * t)
    assert check(sched) == []


def test_bound_holds_for_cpsat_on_chunked_plans() -> None:
    """CP-SAT's best order of a chunked plan (chunks pipeline) stays under the bound."""
    from pipeopt.solvers import inference as si

    reqs = [Request(9, 2), Request(2, 3)]
    stages = small_stages(3)
    plan = wi.continuous_plan(reqs, 1, 3, chunked=True)
    assert any(len(it.chunks) and not it.first_tokens for it in plan.iterations)
    exact = si.time_plan(plan, stages, order="cpsat", time_limit=20)
    assert check(exact.schedule) == []
    assert exact.metrics.throughput_tokens_per_s <= si.throughput_bound(reqs, stages) * (1 + 1e-9)


def test_separated_plan_refills_when_half_the_phase_ended() -> None:
    # KV for two requests at most (capacity 10 tokens: r0 needs 3, r1 7, r2 3, r3 3).
    reqs = [Request(2, 2), Request(2, 6), Request(2, 2), Request(2, 2)]

    def prefill_of(plan: wi.Plan, r: int) -> int:
        return next(b for b, it in enumerate(plan.iterations) if r in it.first_tokens)

    def end_of(plan: wi.Plan, r: int) -> int:
        return next(b for b, it in enumerate(plan.iterations) if r in it.finished)

    refill = wi.separated_plan(reqs, 2, 100, 10, refill_fraction=0.5)
    # After one decode round r0 has ended (1 of 2 live <= 0.5 x 2) and r2 fits: prefill it.
    assert prefill_of(refill, 2) < end_of(refill, 1)
    assert refill.iterations[prefill_of(refill, 2)].group == 2
    drain = wi.separated_plan(reqs, 2, 100, 10, refill_fraction=0.0)
    assert prefill_of(drain, 2) > end_of(drain, 1)
    with pytest.raises(ValueError, match=r"policy\.refill_fraction"):
        wi.separated_plan(reqs, 2, 100, refill_fraction=2)


def test_search_hands_its_best_plan_to_cpsat() -> None:
    """With ``cpsat_time`` the core CP-SAT reorders the best plan, hinted by its schedule: a
    valid schedule of the same plan, never longer, under the bound, and picked when best."""
    from pipeopt.core.bounds import lower_bound
    from pipeopt.solvers import inference as si

    reqs = [Request(3, 2), Request(1, 3), Request(2, 1), Request(4, 2)]
    stages = small_stages(2, limit=8e3 + 10 * 12)
    link = si.Link(latency=1e-4)
    plain = si.search(reqs, stages, budgets=(4,), link=link)
    res = si.search(reqs, stages, budgets=(4,), link=link, cpsat_time=20)
    assert len(res.candidates) == len(plain.candidates) + 1
    exact = res.candidates[-1]
    assert exact.method.endswith("/cpsat") and check(exact.schedule) == []
    assert exact.plan == plain.best.plan
    assert exact.schedule.makespan <= plain.best.schedule.makespan + 1e-9
    assert exact.schedule.makespan >= lower_bound(exact.schedule.graph) - 1e-9
    assert exact.metrics.throughput_tokens_per_s <= si.throughput_bound(reqs, stages) * (
        1 + 1e-9)
    assert res.best.metrics.throughput_tokens_per_s >= plain.best.metrics.throughput_tokens_per_s
    with pytest.raises(ValueError, match=r"cpsat_time: must be a finite number >= 0"):
        si.search(reqs, stages, cpsat_time=-1)
