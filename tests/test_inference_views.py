"""Serving plans as schedule files, plots and traces (issue 15 item 6), and requests that
arrive over time (TTFT from the arrival, no iteration before its requests arrive)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipeopt.core.simulate import simulate
from pipeopt.core.validate import check
from pipeopt.graphio import dump_any, graph_schedule_from_dict, graph_schedule_to_dict, load_any
from pipeopt.simulate import ScheduleError
from pipeopt.solvers import inference as si
from pipeopt.workloads import inference as wi
from pipeopt.workloads.inference import Request, StageModel, Timing

ROOT = Path(__file__).resolve().parents[1]

#: A stage whose iteration takes (1 + KV tokens read) s: weights 1 byte, 1 byte per KV entry,
#: 1 byte/s, no FLOPs; memory unlimited.
UNIT = StageModel(linear_flops_per_token=0.0, attention_flops_per_key=0.0, weight_bytes=1.0,
                  kv_bytes_per_token=1.0, peak_flops=1.0, hbm_bandwidth=1.0)


def timed(plan: wi.Plan, stages: tuple[StageModel, ...]) -> object:
    graph = wi.build(plan, stages)
    sched = simulate(graph, wi.plan_orders(plan, len(stages)), check=False)
    assert check(sched) == []
    return sched


# ----- arrivals ------------------------------------------------------------------------------
def test_arrival_delays_the_first_iteration_and_ttft_counts_from_it() -> None:
    """One stage, one request (prompt 1, output 2) arriving at 3 s: its prefill reads 1 KV
    entry (2 s), from 3 to 5; its decode reads 2 (3 s), from 5 to 8. TTFT = 5 - 3 = 2 s,
    TPOT = 8 - 5 = 3 s, throughput 2 tokens / 8 s."""
    plan = wi.continuous_plan([Request(1, 2, 3.0)], 1, 8, timing=Timing((UNIT,)))
    sched = timed(plan, (UNIT,))
    m = wi.metrics(plan, sched)
    assert (m.ttft_p50_s, m.tpot_s, m.makespan_s) == (2.0, 3.0, 8.0)
    assert m.throughput_tokens_per_s == pytest.approx(2 / 8)
    assert sched.start[0] == 3.0  # not before the arrival
    assert sched.graph.label[-1] == "arrive r0" and sched.graph.device[-1] == -1


def test_a_late_request_joins_the_iteration_running_after_it_arrives() -> None:
    """Two stages, requests (1, 3) at 0 and (1, 2) at 2.5 s, continuous batching in one
    group: i0 prefills r0 (2 s per stage: 0-2, 2-4); at 4 (r0's token is back) r1 has
    arrived and joins i1 with r0's decode (reads 1 + 2 entries: 4 s: 4-8, 8-12); i2 decodes
    both (reads 3 + 2: 6 s: 12-18, 18-24). TTFT r0 = 4, r1 = 12 - 2.5 = 9.5; TPOT r0 =
    (24 - 4) / 2 = 10, r1 = (24 - 12) / 1 = 12."""
    reqs = (Request(1, 3, 0.0), Request(1, 2, 2.5))
    plan = wi.continuous_plan(reqs, 1, 8, timing=Timing((UNIT, UNIT)))
    assert [len(it.chunks) + len(it.decodes) for it in plan.iterations] == [1, 2, 2]
    sched = timed(plan, (UNIT, UNIT))
    m = wi.metrics(plan, sched)
    assert m.ttft_s == (4.0, 9.5)
    assert m.ttft_p50_s == pytest.approx(6.75)
    assert m.tpot_s == pytest.approx(11.0)
    assert m.makespan_s == 24.0


def test_nothing_arrived_waits_for_the_next_arrival() -> None:
    """One stage; r0 (1, 1) at 0 ends at 2 s; r1 (1, 1) arrives at 10: the policy waits, its
    prefill runs 10-12; TTFTs 2 and 2."""
    reqs = (Request(1, 1), Request(1, 1, 10.0))
    for plan in (wi.continuous_plan(reqs, 2, 8, timing=Timing((UNIT,))),
                 wi.static_plan(reqs, 2, 4, timing=Timing((UNIT,))),
                 wi.separated_plan(reqs, 2, 8, timing=Timing((UNIT,)))):
        sched = timed(plan, (UNIT,))
        m = wi.metrics(plan, sched)
        assert m.ttft_s == (2.0, 2.0), plan.policy
        assert m.makespan_s == 12.0


def test_policies_need_timing_when_requests_arrive_over_time() -> None:
    with pytest.raises(ValueError, match="timing: requests arrive over time"):
        wi.continuous_plan([Request(1, 1, 1.0)], 1, 8)
    with pytest.raises(ValueError, match=r"request\.arrival: must be a finite number >= 0"):
        Request(1, 1, -1.0)
    with pytest.raises(ValueError, match=r"request\.arrival"):
        Request(1, 1, math.inf)


def test_poisson_arrivals_are_seeded_and_keep_the_lengths() -> None:
    a = wi.sample_requests(50, 3, prompt_median=100, output_median=10, arrival_rate=4.0)
    b = wi.sample_requests(50, 3, prompt_median=100, output_median=10, arrival_rate=4.0)
    c = wi.sample_requests(50, 3, prompt_median=100, output_median=10)
    assert a == b
    assert [(r.prompt, r.output) for r in a] == [(r.prompt, r.output) for r in c]
    t = [r.arrival for r in a]
    assert t == sorted(t) and t[0] > 0
    assert t[-1] / 50 == pytest.approx(1 / 4.0, rel=0.5)  # mean gap 1 / rate
    with pytest.raises(ValueError, match=r"requests\.arrival_rate"):
        wi.sample_requests(5, 0, prompt_median=1, output_median=1, arrival_rate=0.0)


def _llama_stages(n: int = 2) -> tuple[StageModel, ...]:
    from pipeopt.costs import inference as ci
    from pipeopt.costs.config import PRESETS
    from pipeopt.costs.transformer import TransformerShape

    keys = TransformerShape.__dataclass_fields__
    shape = TransformerShape(**{k: v for k, v in PRESETS["llama2-70b"].items() if k in keys},
                             dtype="fp16", causal=True)
    return ci.stage_models(shape, "H100", n)


def test_every_method_respects_arrivals() -> None:
    """No task of an iteration starts before the requests it holds arrive, for the baselines
    and every candidate of the search (the plan's order and the greedy's)."""
    stages = _llama_stages()
    reqs = wi.sample_requests(24, 1, prompt_median=300, output_median=20, arrival_rate=20.0)
    link = si.Link(2e-6, 450e9)
    runs = [si.round_robin(reqs, stages, 2048, link), si.separated(reqs, stages, 2048, link),
            *si.search(reqs, stages, link=link, budgets=(512,)).candidates]
    assert any(c.method.endswith("/greedy") for c in runs)
    for served in runs:
        sched = served.schedule
        assert check(sched) == [], served.method
        s = len(stages)
        for b, it in enumerate(served.plan.iterations):
            members = [c.request for c in it.chunks] + [d.request for d in it.decodes]
            latest = max(reqs[r].arrival for r in members)
            assert sched.start[b * s] >= latest - 1e-12, served.method
        assert all(t >= 0 for t in served.metrics.ttft_s)
        bound = si.throughput_bound(reqs, stages)
        assert served.metrics.throughput_tokens_per_s <= bound * (1 + 1e-9)


# ----- schedule JSON v2, plot, trace ---------------------------------------------------------
def test_v2_carries_the_plan_and_the_serving_metrics(tmp_path: Path) -> None:
    reqs = (Request(1, 3, 0.0), Request(1, 2, 2.5))
    plan = wi.continuous_plan(reqs, 1, 8, timing=Timing((UNIT, UNIT)))
    sched = timed(plan, (UNIT, UNIT))
    path = tmp_path / "serve.json"
    dump_any(sched, path)
    doc = json.loads(path.read_text())
    assert doc["metrics"]["ttft_p50_s"] == pytest.approx(6.75)
    assert doc["metrics"]["tpot_s"] == pytest.approx(11.0)
    assert doc["metrics"]["throughput_tokens_per_s"] == pytest.approx(5 / 24)
    assert doc["graph"]["meta"]["task_group"][:2] == ["prefill", "prefill"]
    back = load_any(path)
    assert wi.serving_plan(back.graph) == plan
    assert wi.serving_metrics(back) == wi.metrics(plan, sched)
    # Recorded figures must be those of the plan and the times.
    bad = graph_schedule_to_dict(sched)
    bad["metrics"]["ttft_p99_s"] = 1.0
    with pytest.raises(ScheduleError, match=r"metrics\.ttft_p99_s: the file says 1"):
        graph_schedule_from_dict(json.loads(json.dumps(bad)))
    bad = json.loads(path.read_text())
    bad["graph"]["meta"]["plan"]["requests"]["output"] = [3]
    with pytest.raises(ScheduleError, match=r"graph\.meta\.plan\.requests\.output: expected "
                                            r"a list of 2 integers"):
        graph_schedule_from_dict(bad)
    bad = json.loads(path.read_text())
    bad["graph"]["meta"]["plan"]["iterations"]["decode"][1] = [[0, 7]]
    with pytest.raises(ScheduleError, match=r"graph\.meta\.plan\.iterations\[1\]: decode of "
                                            r"request 0 \(context 7\) out of turn"):
        graph_schedule_from_dict(bad)


def test_example_solves_plots_and_traces(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Done-when of issue 15: examples/inference.yaml solves, plots, traces (a smaller
    request count and time limit, the example's keys otherwise)."""
    from pipeopt.cli import main

    text = (ROOT / "examples" / "inference.yaml").read_text()
    assert "count: 60" in text
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text.replace("count: 60", "count: 12"))
    out = tmp_path / "serve.json"
    assert main(["solve", str(cfg), "-o", str(out), "--time-limit", "20"]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "pipeopt.schedule/v2" and doc["metrics"]["ttft_p99_s"] > 0
    png = tmp_path / "serve.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = tmp_path / "serve.trace.json"
    assert main(["trace", str(out), "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())
    other = events["otherData"]
    for key in ("throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_s"):
        assert other[key] == pytest.approx(doc["metrics"][key])
    assert other["requests"] == 12
    tracks = [e for e in events["traceEvents"] if e.get("pid") == 4 and e["ph"] == "X"]
    assert {e["tid"] for e in tracks} == set(range(12))
    tasks = [e for e in events["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"]
    assert all("prefill" in e["args"] and "decode" in e["args"] for e in tasks)
    assert any(e["name"].startswith("KV cache device") for e in events["traceEvents"])
    assert main(["simulate", str(out)]) == 0
    capsys.readouterr()


def test_plot_title_and_kv_panel() -> None:
    from pipeopt.plot import graph_title, render_graph_schedule

    reqs = (Request(1, 3, 0.0), Request(1, 2, 2.5))
    plan = wi.continuous_plan(reqs, 1, 8, timing=Timing((UNIT, UNIT)))
    sched = timed(plan, (UNIT, UNIT))
    title = graph_title(sched)
    assert "TTFT p50 6.75 s p99 9.445 s" in title and "TPOT 11 s" in title
    fig = render_graph_schedule(sched)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert any(t.startswith("KV cache per stage (weights left out) (each band: 0 to 5 B")
               for t in titles)
    limited = replace(UNIT, memory_limit=101.0)  # room for 100 KV entries beside the weights
    sched = timed(plan, (limited, limited))
    titles = [ax.get_title(loc="left") for ax in render_graph_schedule(sched).axes]
    assert any(t.startswith("KV cache per stage (weights left out; room for it: at least 100 "
                            "B) (each band: 0 to 5 B") for t in titles)


def test_config_arrivals_and_their_errors() -> None:
    import yaml

    from pipeopt.errors import ConfigError
    from pipeopt.inference_config import parse_inference, solve_inference

    base = yaml.safe_load("""\
workload:
  kind: inference
  gpu: H100
  stages: [40, 40]
  requests:
    - {prompt: 100, output: 4}
    - {prompt: 300, output: 2, arrival: 0.25}
  method: round-robin
  token_budget: 256
model: {preset: llama2-70b, dtype: fp16}
""")
    cfg = parse_inference(base)
    assert cfg.requests == (Request(100, 4), Request(300, 2, 0.25))
    served, _ = solve_inference(cfg)
    assert served.schedule.graph.label[-1] == "arrive r1"
    assert served.metrics.ttft_s[1] > 0
    dist = {**base, "workload": {**base["workload"], "requests": {
        "count": 5, "seed": 2, "prompt_median": 100, "output_median": 4, "arrival_rate": 3.0}}}
    assert parse_inference(dist).requests == wi.sample_requests(
        5, 2, prompt_median=100, output_median=4, arrival_rate=3.0)
    bad = {**base, "workload": {**base["workload"], "requests": [
        {"prompt": 1, "output": 1, "arrival": -1}]}}
    with pytest.raises(ConfigError, match=r"workload\.requests.*arrival"):
        parse_inference(bad)
    dist["workload"]["requests"]["arrival_rate"] = 0
    with pytest.raises(ConfigError, match=r"workload\.requests.*arrival_rate"):
        parse_inference(dist)


def test_cpsat_respects_arrivals_and_is_no_worse_than_the_plan_order() -> None:
    """CP-SAT chooses its own order on each device; the arrival clock still keeps every
    iteration after its requests' arrivals."""
    reqs = (Request(2, 3, 0.0), Request(1, 2, 1.5), Request(3, 2, 4.0))
    stages = (UNIT, UNIT)
    plan = wi.continuous_plan(reqs, 2, 4, timing=Timing(stages))
    own = si.time_plan(plan, stages)
    opt = si.time_plan(plan, stages, order="cpsat", time_limit=10.0)
    assert check(opt.schedule) == []
    assert opt.schedule.makespan <= own.schedule.makespan + 1e-9
    for b, it in enumerate(plan.iterations):
        members = [c.request for c in it.chunks] + [d.request for d in it.decodes]
        assert opt.schedule.start[b * 2] >= max(reqs[r].arrival for r in members) - 1e-9
    assert min(opt.metrics.ttft_s) > 0


PARTITION_CONFIG = """\
workload:
  kind: inference
  gpu: [L4, L40S, A100-80GB, L40S]
  stages: serving
  requests: {count: 8, seed: 0, prompt_median: 200, output_median: 8, output_sigma: 0.3}
  method: round-robin
  token_budget: 512
  link: {latency: 5.0e-5, bandwidth: 1.25e+9}
model: {preset: llama2-70b, dtype: fp16}
"""


def test_config_chooses_the_partition(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from pipeopt.cli import main
    from pipeopt.costs.transformer import TransformerShape
    from pipeopt.errors import ConfigError
    from pipeopt.inference_config import parse_inference
    from pipeopt.partition.pipeedge import EdgeCluster, pipeedge_partition, serving_partition

    data = yaml.safe_load(PARTITION_CONFIG)
    cfg = parse_inference(data)
    gpus = ("L4", "L40S", "A100-80GB", "L40S")
    keys = TransformerShape.__dataclass_fields__
    from pipeopt.costs.config import PRESETS

    shape = TransformerShape(**{k: v for k, v in PRESETS["llama2-70b"].items() if k in keys},
                             dtype="fp16", causal=True)
    cluster = EdgeCluster(gpus, tuple(tuple(1.25e9 for _ in gpus) for _ in gpus), 5e-5)
    reqs = cfg.requests
    want = serving_partition(shape, cluster, prompt=sum(r.prompt for r in reqs) / 8,
                             output=sum(r.output for r in reqs) / 8)
    assert cfg.partition == want
    assert cfg.gpus == tuple(gpus[d] for d in want.devices)
    assert len(cfg.stages) == len(want.devices)
    assert cfg.link.bandwidth == (1.25e9,) * len(want.devices)
    data["workload"]["stages"] = "pipeedge"
    context = sum(r.prompt for r in reqs) / 8 + sum(r.output for r in reqs) / 16
    assert parse_inference(data).partition == pipeedge_partition(shape, cluster, batch=1,
                                                                 context=context)
    # a matrix of bandwidths, also for stages given by hand (hop k -> k + 1, then back)
    data["workload"]["stages"] = [8, 24, 40, 8]
    data["workload"]["link"] = {"bandwidth": [[0, 1e9, 0, 3e9], [1e9, 0, 2e9, 0],
                                              [0, 2e9, 0, 3e9], [3e9, 0, 3e9, 0]]}
    assert parse_inference(data).link.bandwidth == (1e9, 2e9, 3e9, 3e9)
    for change, pattern in (
            ({"stages": "serving", "gpu": "H100", "link": {}}, r"workload\.stages: serving "
                                                                  r"chooses among "
                                                   r"the GPUs of workload\.gpu"),
            ({"link": {"bandwidth": [[0, 1.0]]}}, r"workload\.link\.bandwidth: expected 4 x 4"),
            ({"link": {"bandwidth": [[0.0] * 4] * 4}}, r"workload\.link\.bandwidth: the "
                                                       r"pipeline needs a link"),
            ({"stages": "fastest"}, r"workload\.stages")):
        bad = {**data, "workload": {**data["workload"], **change}}
        with pytest.raises(ConfigError, match=pattern):
            parse_inference(bad)
    path = tmp_path / "edge.yaml"
    path.write_text(PARTITION_CONFIG)
    assert main(["solve", str(path)]) == 0
    out = capsys.readouterr().out
    assert "partition     " in out and "layers" in out


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_every_policy(seed: int) -> None:
    """Random tiny workloads with arrivals: every policy serves every request, the plan's own
    order validates, and no iteration starts before the requests it holds arrive."""
    import random

    rng = random.Random(seed)
    reqs = tuple(Request(rng.randint(1, 6), rng.randint(1, 4),
                         rng.choice([0.0, 0.0, round(rng.uniform(0, 30), 2)]))
                 for _ in range(rng.randint(2, 7)))
    stages = (UNIT,) * rng.randint(1, 3)
    timing = Timing(stages, latency=0.5)
    plans = [wi.continuous_plan(reqs, len(stages), 6, timing=timing, chunked=bool(seed % 2)),
             wi.continuous_plan(reqs, 2, 6, 40, timing=timing, assignment=[
                 i % 2 for i in range(len(reqs))]),
             wi.static_plan(reqs, 2, 2, timing=timing),
             wi.separated_plan(reqs, 2, 6, timing=timing)]
    for plan in plans:
        graph = wi.build(plan, stages, latency=0.5)
        sched = simulate(graph, wi.plan_orders(plan, len(stages)), check=False)
        assert check(sched) == [], plan.policy
        s = len(stages)
        for b, it in enumerate(plan.iterations):
            members = [c.request for c in it.chunks] + [d.request for d in it.decodes]
            assert sched.start[b * s] >= max(reqs[r].arrival for r in members) - 1e-9
        m = wi.metrics(plan, sched)
        assert min(m.ttft_s) > 0
        assert wi.serving_metrics(sched) == m
