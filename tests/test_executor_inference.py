"""Replaying a served inference plan (issue 15 item 7): capped plans (pure), the KV-cached
forward against the uncached model in one process, and spawned gloo ranks whose tokens equal a
one-process greedy decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeopt.core.simulate import simulate  # noqa: E402
from pipeopt.core.validate import check  # noqa: E402
from pipeopt.executor.inference import (  # noqa: E402
    Message,
    Replay,
    build_layers,
    cap_plan,
    model_kwargs,
    prompt_tokens,
    reference_decode,
    replay_of,
    run_serving,
    segments,
    stage_forward,
)
from pipeopt.executor.procs import ExecutorError, RunConfig  # noqa: E402
from pipeopt.graphio import dump_any  # noqa: E402
from pipeopt.solvers import inference as si  # noqa: E402
from pipeopt.workloads import inference as wi  # noqa: E402
from pipeopt.workloads.inference import Chunk, Decode, Request, StageModel, Timing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: An iteration takes (1 + KV entries read) s on a stage; 1 byte per KV entry, weights 1 byte.
UNIT = StageModel(linear_flops_per_token=0.0, attention_flops_per_key=0.0, weight_bytes=1.0,
                  kv_bytes_per_token=1.0, peak_flops=1.0, hbm_bandwidth=1.0)

#: Different lengths, arrivals over time (irrelevant to the tokens), two groups, chunked
#: prefill under a budget of 4 tokens: continuous batching with prefill beside decodes.
REQUESTS = (Request(7, 3, 0.0), Request(2, 5, 0.0), Request(5, 1, 1.0), Request(3, 4, 2.0),
            Request(9, 2, 6.0))


def _plan(stages: int) -> wi.Plan:
    return wi.continuous_plan(REQUESTS, 2, 4, chunked=True, timing=Timing((UNIT,) * stages))


def test_cap_plan_keeps_iterations_and_the_first_token_in_place() -> None:
    """Prompt 10 in chunks 4 + 4 + 2, output 5; capped to prompt 5 and output 3: the chunks
    become [0, 4), nothing, [4, 5) (the last chunk still ends the prompt, so the first token
    comes out of iteration 2), decodes 1 and 2 stay (contexts 6, 7), 3 and 4 go; the request
    ends in iteration 4 and iterations 5, 6 are left empty."""
    its = [wi.Iteration(0, (Chunk(0, 0, 4),)), wi.Iteration(0, (Chunk(0, 4, 4),)),
           wi.Iteration(0, (Chunk(0, 8, 2),), (), (0,))]
    its += [wi.Iteration(0, (), (Decode(0, 10 + j),)) for j in range(1, 5)]
    its[-1] = wi.Iteration(0, (), (Decode(0, 14),), (), (0,))
    plan = wi.Plan((Request(10, 5),), tuple(its))
    capped = cap_plan(plan, max_prompt=5, max_output=3)
    assert capped.requests == (Request(5, 3),)
    assert [it.chunks for it in capped.iterations[:3]] == [(Chunk(0, 0, 4),), (),
                                                          (Chunk(0, 4, 1),)]
    assert capped.iterations[2].first_tokens == (0,)
    assert [it.decodes for it in capped.iterations[3:]] == [(Decode(0, 6),), (Decode(0, 7),),
                                                           (), ()]
    assert capped.iterations[4].finished == (0,)
    assert cap_plan(plan) is plan
    assert cap_plan(plan, max_prompt=1).iterations[2].chunks == (Chunk(0, 0, 1),)
    with pytest.raises(ValueError, match=r"--max-output: must be an integer >= 1, got 0"):
        cap_plan(plan, max_output=0)


def test_messages_in_one_global_order_by_send_time() -> None:
    """Two stages, one request (prompt 2, output 3): prefill i0 (reads 2 KV entries: 3 s per
    stage, 0-3 and 3-6), decodes i1 (4 s: 6-10, 10-14) and i2 (5 s: 14-19, 19-24). Messages by
    the end of the task that sends them: hidden i0 at 3, tokens i0 at 6, hidden i1 at 10,
    tokens i1 at 14, hidden i2 at 19; i2's tokens end the request and go nowhere."""
    plan = wi.continuous_plan([Request(2, 3)], 1, 8)
    sched = simulate(wi.build(plan, (UNIT, UNIT)), wi.plan_orders(plan, 2), check=False)
    assert list(sched.end) == [3.0, 6.0, 10.0, 14.0, 19.0, 24.0]
    replay = replay_of(sched)
    assert replay.messages == (Message("hidden", 0, 0, 1), Message("tokens", 0, 1, 0),
                               Message("hidden", 1, 0, 1), Message("tokens", 1, 1, 0),
                               Message("hidden", 2, 0, 1))


def test_model_defaults_are_tiny_gpts() -> None:
    import inspect

    from pipeopt.executor.inference import MODEL_DEFAULTS, MODEL_KEYS
    from pipeopt.executor.models import tiny_gpt

    params = inspect.signature(tiny_gpt).parameters
    assert set(MODEL_KEYS) == set(params)
    assert all(params[k].default == v for k, v in MODEL_DEFAULTS)


def _in_one_process(replay: Replay, opts: RunConfig) -> list[list[int]]:
    """The replay's iterations in the plan's order through every layer in this process, KV
    cached as the ranks keep it: the tokens per request."""
    plan = replay.plan
    layers = build_layers(replay, opts)
    caches = [{} for layer in layers if type(layer).__name__ == "Block"]
    prompts = prompt_tokens(plan, model_kwargs(opts, plan, replay.stages)["vocab"], opts.seed)
    out: list[list[int]] = [[] for _ in plan.requests]
    with torch.no_grad():
        for b in range(len(plan.iterations)):
            segs = segments(plan, b)
            if not segs:
                continue
            ids = [t for s in segs for t in (prompts[s.request][s.position:s.position + s.tokens]
                                             if s.position < plan.requests[s.request].prompt
                                             else (out[s.request][-1],))]
            pos = torch.tensor([s.position + i for s in segs for i in range(s.tokens)])
            logits = stage_forward(layers, torch.tensor(ids), pos, segs, caches)
            for r, tok in zip(replay.yielding(b), logits.argmax(dim=-1).tolist(), strict=True):
                out[r].append(tok)
            for r in plan.iterations[b].finished:
                for c in caches:
                    del c[r]
    assert all(not c for c in caches)  # every request's cache freed at its end
    return out


def test_cached_forward_equals_the_uncached_decode() -> None:
    """Chunked prefill beside decodes, KV cached per request: the same tokens as decoding each
    request alone with the whole sequence each step, in float64."""
    plan = _plan(2)
    served = si.time_plan(plan, (UNIT, UNIT), order="greedy")
    replay = replay_of(served.schedule)
    opts = RunConfig(model="tiny-gpt", model_options=(("layers", 2), ("vocab", 16)), seed=3,
                     check=True)
    ref, _ = reference_decode(replay, opts)
    assert [len(t) for t in ref] == [r.output for r in REQUESTS]
    assert _in_one_process(replay, opts) == ref
    # Out of order (a decode before its prefill) is caught, not silently wrong.
    layers = build_layers(replay, opts)
    seg = segments(plan, len(plan.iterations) - 1)
    with pytest.raises(ExecutorError, match=r"request 4: 0 keys cached, its tokens start at "
                                            r"position 9"):
        stage_forward(layers, torch.tensor([1]), torch.tensor([9]), seg,
                      [{} for _ in range(2)])


def _swapped_orders(plan: wi.Plan, stages: int) -> list[list[int]]:
    """Stage 0 in the plan's order, later stages with each pair of consecutive iterations of
    different groups swapped where that keeps the data flow: the devices' orders differ, so
    a rank receives messages in another order than it runs them."""
    orders = wi.plan_orders(plan, stages)
    n = len(plan.iterations)
    for k in range(1, stages):
        its = list(range(n))
        for b in range(1, n - 1, 2):
            its[b], its[b + 1] = its[b + 1], its[b]
        orders[k] = [wi.task_id(stages, b, k) for b in its]
    return orders


@pytest.mark.torch
@pytest.mark.parametrize("stages", [2, 3])
def test_spawned_ranks_generate_the_reference_tokens(stages: int) -> None:
    """Two and three gloo ranks, each device in its own order (stage 0 in the plan's, the
    others with neighbouring iterations swapped): the tokens of every request equal the
    one-process greedy decode, every rank frees every KV entry, and each rank's most KV entries
    held at once is the schedule's peak KV memory (1 byte per entry here)."""
    plan = _plan(stages)
    graph = wi.build(plan, (UNIT,) * stages)
    sched = simulate(graph, _swapped_orders(plan, stages), check=False)
    assert check(sched) == []
    replay = replay_of(sched)
    assert replay.orders[0] != replay.orders[1]
    res = run_serving(replay, RunConfig(model="tiny-gpt", backend="gloo",
                                           model_options=(("vocab", 32),), check=True))
    assert res.tokens_match, res.mismatched
    assert res.tokens == res.reference_tokens
    assert [len(t) for t in res.tokens] == [r.output for r in REQUESTS]
    assert res.max_abs_logit_diff < 1e-12
    assert res.kv_left == [0] * stages
    static = graph.static_memory
    assert res.peak_kv_tokens == [round(sched.peak_memory[d] - static[d])
                                  for d in range(stages)]


@pytest.mark.torch
def test_example_runs_in_the_executor_check(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Done-when of issue 15: examples/inference.yaml (8 requests, a shorter time limit)
    solves, and its served plan (the search's, in the greedy's per-device order) replays on 4
    gloo ranks with capped lengths, tokens equal to the one-process decode."""
    from pipeopt.cli import main

    text = (ROOT / "examples" / "inference.yaml").read_text()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text.replace("count: 60", "count: 8"))
    out = tmp_path / "serve.json"
    assert main(["solve", str(cfg), "-o", str(out), "--time-limit", "3"]) == 0
    capsys.readouterr()
    rc = main(["run", str(out), "--check", "--max-prompt", "12", "--max-output", "4",
               "--backend", "gloo", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and got["tokens_match"] is True and got["ranks"] == 4
    assert got["requests"] == 8 and got["kv_left"] == [0, 0, 0, 0]
    assert all(1 <= len(t) <= 4 for t in got["tokens"])


def test_cli_refusals_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A served plan with training flags, another model or a too short position table, and
    the caps on a chain schedule: one line naming the flag, before any rank starts."""
    from pipeopt.cli import main
    from pipeopt.io import dump_schedule
    from pipeopt.problem import uniform_problem
    from pipeopt.schedules import GENERATORS
    from pipeopt.simulate import simulate as simulate_chain

    served = si.time_plan(_plan(2), (UNIT, UNIT))
    path = tmp_path / "serve.json"
    dump_any(served.schedule, path)
    cases = [
        (["--batch-size", "8"], "--batch-size: applies to training schedules"),
        (["--model", "mlp"], "--model: a served plan replays on tiny-gpt"),
        (["--model-arg", "seq_len=4"], "--model-arg seq_len: must hold the longest request's "
                                       "10 positions"),
        (["--model-arg", "width=4"], "--model-arg: tiny-gpt takes layers, hidden"),
        (["--max-output", "0"], "--max-output: must be an integer >= 1, got 0"),
    ]
    for flags, message in cases:
        assert main(["run", str(path), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    from pipeopt.core.greedy import solve_greedy
    from pipeopt.workloads import training

    prob = uniform_problem(2, 2)
    graph_file = tmp_path / "graph.json"  # v2, but a training graph's schedule
    dump_any(solve_greedy(training.build(prob)), graph_file)
    assert main(["run", str(graph_file)]) == 2
    assert "schedule: its graph records no serving plan" in capsys.readouterr().err
    chain = tmp_path / "chain.json"
    dump_schedule(simulate_chain(prob, GENERATORS["1f1b"](prob)), chain)
    assert main(["run", str(chain), "--max-prompt", "4"]) == 2
    assert "--max-prompt / --max-output: apply to served inference plans" in \
        capsys.readouterr().err
