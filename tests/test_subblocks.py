"""Sub-blocks (issue 12 item 3; CrossPipe): every stage cut into k pieces on its device.

A hand-worked instance where cutting strictly helps, the same instance by exhaustive search,
hand-made schedules that keep their makespan piece by piece, k = 1 as today, bad k refused
with the field named, the schedule file, ``compare``, the config key and the executor.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeopt.bounds import lower_bound
from pipeopt.config import parse_config
from pipeopt.errors import ConfigError
from pipeopt.io import dump_schedule, load_schedule, schedule_json
from pipeopt.problem import Op, Problem, ProblemError, rechunk, uniform_problem
from pipeopt.schedules import GENERATORS, NotApplicable, generate
from pipeopt.simulate import DeadlockError, simulate, validate
from pipeopt.solvers import compare, run_classic, solve
from pipeopt.subblocks import expand_orders, merge, piece_layers, split

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _tight() -> Problem:
    """Two devices, two micro-batches, fused backward: F = 1 s and B = 2 s per stage, a 1 s
    link, activation 1 per micro-batch and stage, memory 1.5 per device."""
    return uniform_problem(2, 2, 1.0, 2.0, 0.0, split_backward=False, latency=1.0,
                           memory_limit=1.5)


# ----- the problem ------------------------------------------------------------------------------
def test_split_divides_each_stage_into_pieces_on_its_device() -> None:
    base = Problem(devices=2, microbatches=3, forward=(2.0, 4.0), backward_input=(6.0, 8.0),
                   backward_weight=(2.0, 2.0), activation_memory=(4.0, 8.0),
                   weight_grad_memory=(2.0, 4.0), message_size=(10.0,),
                   latency=((0.0, 1.0), (1.0, 0.0)), bandwidth=((math.inf, 5.0),
                                                                 (5.0, math.inf)),
                   grad_reduce=(4.0, 2.0), memory_limit=(100.0, None))
    cut = split(base, 2)
    assert cut.sub_blocks == 2 and cut.stages == 4
    assert cut.stage_device == (0, 0, 1, 1)
    assert cut.forward == (1.0, 1.0, 2.0, 2.0)
    assert cut.backward_input == (3.0, 3.0, 4.0, 4.0)
    assert cut.activation_memory == (2.0, 2.0, 4.0, 4.0)
    assert cut.weight_grad_memory == (1.0, 1.0, 2.0, 2.0)
    assert cut.grad_reduce == (2.0, 2.0, 1.0, 1.0)
    # only the last piece of stage 0 sends, over the link; the pieces inside a stage do not
    assert cut.message_size == (0.0, 10.0, 0.0)
    assert cut.transfer(1, 2) == base.transfer(0, 1) == (2.0, 1.0)
    assert cut.transfer(0, 1) == (0.0, 0.0)
    assert merge(cut) == base
    assert split(base, 1) is base and merge(base) is base


def test_split_and_merge_keep_per_stage_microbatch_factors() -> None:
    base = uniform_problem(2, 2).replace(
        microbatch_scale=((1.0, 2.0), (3.0, 4.0)),
        microbatch_message_scale=((5.0, 6.0),), message_size=(1.0,))
    cut = split(base, 3)
    assert cut.time_table == ((1.0, 2.0),) * 3 + ((3.0, 4.0),) * 3
    assert cut.message_table[2] == (5.0, 6.0)  # the boundary that crosses the link
    assert merge(cut) == base


def test_partition_is_cut_into_contiguous_layer_ranges() -> None:
    base = uniform_problem(2, 2).replace(meta=(("partition", [[0, 3], [3, 5]]),))
    cut = split(base, 2)
    assert dict(cut.meta)["partition"] == [[0, 2], [2, 3], [3, 4], [4, 5]]
    assert dict(merge(cut).meta)["partition"] == [[0, 3], [3, 5]]
    assert piece_layers(0, 7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ProblemError, match=r"^sub_blocks: 3 pieces need at least 3 layers per "
                                           r"stage; stage 1 has 2 .*at most 2 here"):
        split(base, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_sub_blocks_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ProblemError, match=r"^sub_blocks: must be an integer >= 1"):
        uniform_problem(2, 2).replace(sub_blocks=bad)
    with pytest.raises(ProblemError, match=r"^sub_blocks: must be an integer >= 1"):
        split(uniform_problem(2, 2), bad)  # type: ignore[arg-type]


def test_one_sub_block_is_todays_problem() -> None:
    base = uniform_problem(3, 4, latency=0.5)
    assert base.sub_blocks == 1 and "sub_blocks" not in base.to_dict()
    assert Problem.from_dict(base.to_dict()) == base
    with pytest.raises(ProblemError, match=r"^sub_blocks: the problem is cut"):
        split(split(base, 2), 2)
    with pytest.raises(ProblemError, match=r"^sub_blocks: rechunking"):
        rechunk(split(base, 2), 2, "loop")


# ----- a hand-worked instance where cutting helps -------------------------------------------------
def test_two_sub_blocks_beat_one_by_hand() -> None:
    """k = 1: a device holds one micro-batch's activation (2 > 1.5), so micro-batch 1 starts
    on device 0 only when micro-batch 0's backward ends there: its round trip F 1 + L 1 + F 1 +
    B 2 + L 1 + B 2 = 8 s, twice: 16 s. k = 2 (pieces of F 0.5, B 1, activation 0.5): device 0
    runs both F pieces of micro-batch 0 and the first of micro-batch 1 (1.5) by t = 1.5; the
    gradient is back at 4 + 2L = 6, B's last piece (stage 1) runs 6..7 and frees 0.5, then
    micro-batch 1's second F piece runs 7..7.5, and micro-batch 1 takes L + 1 + 2 + L + 2 = 7 s
    more: 14.5 s. That is optimal: the second F piece cannot start before a B piece of
    micro-batch 0 ends on device 0 (7 at the earliest)."""
    whole = _tight()
    assert solve(whole, "cpsat", time_limit=20, workers=1).makespan == pytest.approx(16.0)
    cut = split(whole, 2)
    F, B = "F", "B"
    orders = [[Op(F, 0, 0), Op(F, 1, 0), Op(F, 0, 1), Op(B, 1, 0), Op(F, 1, 1), Op(B, 0, 0),
               Op(B, 1, 1), Op(B, 0, 1)],
              [Op(F, 2, 0), Op(F, 3, 0), Op(B, 3, 0), Op(B, 2, 0), Op(F, 2, 1), Op(F, 3, 1),
               Op(B, 3, 1), Op(B, 2, 1)]]
    hand = validate(simulate(cut, orders))
    assert hand.makespan == pytest.approx(14.5)
    assert hand.peak_memory == pytest.approx((1.5, 1.0))
    best = solve(cut, "cpsat", time_limit=20, workers=1)
    assert best.makespan == pytest.approx(14.5) and best.solver.status == "optimal"
    assert lower_bound(cut) <= 14.5 + 1e-9
    auto = solve(cut, "auto", time_limit=20, workers=1)
    assert auto.makespan == pytest.approx(14.5)
    greedy = solve(cut, "greedy", time_limit=10, workers=1)
    assert 14.5 - 1e-9 <= greedy.makespan < 16.0
    # the activation leaves device 0 after the last F piece (stage 1), not between pieces
    assert {(m.src_stage, m.dst_stage) for m in best.messages} <= {(1, 2), (2, 1)}


def _linear_extensions(ops: list[Op], before: dict[Op, set[Op]]) -> Iterator[tuple[Op, ...]]:
    """Every order of ``ops`` that keeps each op after the ones it needs among ``ops``."""
    mine = set(ops)
    need = {op: before[op] & mine for op in ops}

    def rec(done: tuple[Op, ...], left: frozenset[Op]) -> Iterator[tuple[Op, ...]]:
        if not left:
            yield done
        for op in sorted(left):
            if need[op] <= set(done):
                yield from rec((*done, op), left - {op})

    yield from rec((), frozenset(ops))


def _brute_force(problem: Problem) -> float:
    """The least makespan over every combination of device orders within the memory limits
    (earliest-start timing is optimal for fixed orders without link contention)."""
    before: dict[Op, set[Op]] = {}

    def ancestors(op: Op) -> set[Op]:
        if op not in before:
            before[op] = set()
            for src in problem.inputs(op):
                before[op] |= {src} | ancestors(src)
        return before[op]

    for op in problem.ops():
        ancestors(op)
    per_device = [[op for op in problem.ops() if problem.stage_device[op.stage] == d]
                  for d in range(problem.devices)]
    best = math.inf
    for orders in itertools.product(*(list(_linear_extensions(ops, before))
                                      for ops in per_device)):
        try:
            sched = simulate(problem, [list(o) for o in orders])
        except DeadlockError:
            continue
        if all(lim is None or peak <= lim + 1e-9
               for peak, lim in zip(sched.peak_memory, problem.memory_limit, strict=True)):
            best = min(best, sched.makespan)
    return best


def test_brute_force_agrees_on_the_tight_instance() -> None:
    whole = _tight()
    assert _brute_force(whole) == pytest.approx(16.0)
    assert _brute_force(split(whole, 2)) == pytest.approx(14.5)


@pytest.mark.parametrize(("latency", "limit", "b"), [(0.0, None, 2.0), (2.0, 1.5, 1.0),
                                                     (0.5, 1.0, 3.0)])
def test_cut_problems_bounds_and_cpsat_against_brute_force(latency: float, limit: float | None,
                                                          b: float) -> None:
    """On tiny cut problems the bound holds and CP-SAT proves the exhaustive optimum, which
    is never above the uncut one (the uncut orders, run piece by piece, are among the cut
    problem's)."""
    whole = uniform_problem(2, 2, 1.0, b, 0.0, split_backward=False, latency=latency,
                            memory_limit=limit)
    cut = split(whole, 2)
    best = _brute_force(cut)
    assert best <= _brute_force(whole) + 1e-9
    assert lower_bound(cut) <= best + 1e-9
    sched = solve(cut, "cpsat", time_limit=20, workers=1)
    assert sched.solver.status == "optimal"
    assert sched.makespan == pytest.approx(best)


# ----- every method honours the option ---------------------------------------------------------
_SHAPES = [dict(virtual_stages=1), dict(virtual_stages=2), dict(virtual_stages=2,
                                                                placement="vshape")]


@pytest.mark.parametrize("shape", _SHAPES, ids=["loop1", "loop2", "vshape2"])
@pytest.mark.parametrize("k", [2, 4])
def test_hand_made_schedules_keep_their_makespan_piece_by_piece(shape: dict, k: int) -> None:
    whole = uniform_problem(4, 8, 1.0, 2.0, 1.0, latency=0.5, **shape)  # type: ignore[arg-type]
    ran = 0
    for name in GENERATORS:
        try:
            ref = run_classic(whole, name)
        except NotApplicable:
            with pytest.raises(NotApplicable):
                run_classic(split(whole, k), name)
            continue
        cut = validate(run_classic(split(whole, k), name))
        assert cut.problem.sub_blocks == k
        assert cut.makespan == pytest.approx(ref.makespan), name
        # activations come and go piece by piece: never more than the whole ops hold
        assert all(a <= b + 1e-9 for a, b in zip(cut.peak_memory, ref.peak_memory,
                                                 strict=True)), name
        ran += 1
    assert ran >= 2


def test_expanded_orders_run_forward_pieces_in_order_and_backward_in_reverse() -> None:
    cut = split(uniform_problem(2, 1), 3)
    orders = expand_orders(cut, generate("zb-h1", merge(cut)))
    assert [str(op) for op in orders[0]] == ["0F0", "1F0", "2F0", "2B0", "1B0", "0B0", "2W0",
                                             "1W0", "0W0"]
    assert orders == generate("zb-h1", cut)


@pytest.mark.parametrize("method", ["greedy", "cpsat", "auto"])
def test_searches_return_valid_schedules_of_the_cut_problem(method: str) -> None:
    whole = uniform_problem(4, 6, 1.0, 1.0, 1.0, latency=1.0, memory_limit=4.0)
    cut = split(whole, 2)
    sched = solve(cut, method, time_limit=8, workers=1)
    validate(sched)
    assert sched.problem == cut
    assert all(x <= 4.0 + 1e-9 for x in sched.peak_memory)
    if method == "auto":  # the hand-made schedules, run piece by piece, are among its candidates
        assert sched.makespan <= run_classic(cut, "zb-h1").makespan + 1e-9


def test_torch_schedules_run_piece_by_piece() -> None:
    pytest.importorskip("torch")
    whole = uniform_problem(4, 8, 1.0, 1.0, 1.0, latency=0.5)
    ref = solve(whole, "torch:1F1B")
    cut = solve(split(whole, 2), "torch:1F1B")
    assert cut.makespan == pytest.approx(ref.makespan)


def test_schedule_file_records_sub_blocks(tmp_path: Path) -> None:
    cut = split(_tight(), 2)
    sched = solve(cut, "cpsat", time_limit=10, workers=1)
    path = tmp_path / "s.json"
    dump_schedule(sched, path)
    back = load_schedule(path)
    assert back.problem == cut and back.problem.sub_blocks == 2
    assert back.makespan == pytest.approx(sched.makespan)
    assert '"sub_blocks": 2' in schedule_json(sched)
    assert '"sub_blocks"' not in schedule_json(run_classic(_tight(), "1f1b"))


def test_compare_runs_chunked_schedules_on_cut_chunks() -> None:
    whole = uniform_problem(2, 4, 1.0, 1.0, 1.0, latency=0.5)
    rows = {r.method: r for r in compare(split(whole, 2), ["zb-h1", "zb-v", "greedy"],
                                         time_limit=5, workers=1)}
    zbv = rows["zb-v (v=2)"].schedule
    assert zbv is not None and zbv.problem.sub_blocks == 2
    assert zbv.problem.virtual_stages == 2 and zbv.problem.stages == 8
    plain = run_classic(rechunk(whole, 2, "vshape"), "zb-v")
    assert zbv.makespan == pytest.approx(plain.makespan)
    assert rows["greedy"].schedule is not None


# ----- the config -------------------------------------------------------------------------------
_EXPLICIT = {"pipeline": {"devices": 2, "microbatches": 2, "split_backward": False},
             "stages": {"forward": 1.0, "backward_input": 2.0, "backward_weight": 0.0,
                        "activation_memory": 1.0},
             "links": {"latency": 1.0}, "memory": {"limit": 1.5}}


def _with(k: object, **pipeline: object) -> dict:
    data = copy.deepcopy(_EXPLICIT)
    data["pipeline"].update(sub_blocks=k, **pipeline)
    return data


def test_config_key_cuts_the_problem() -> None:
    cfg = parse_config(_with(2))
    assert cfg.problem == split(_tight(), 2)
    assert parse_config(_EXPLICIT).problem == parse_config(_with(1)).problem == _tight()


@pytest.mark.parametrize(("bad", "why"), [(0, "must be >= 1"), (-2, "must be >= 1"),
                                          (1.5, "expected an integer"),
                                          ("2", "expected an integer"),
                                          (True, "expected an integer")])
def test_config_refuses_bad_sub_blocks(bad: object, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"^pipeline\.sub_blocks: {why}"):
        parse_config(_with(bad))


def test_config_refuses_more_ops_than_pipeopt_schedules() -> None:
    data = {"pipeline": {"devices": 64, "microbatches": 1024, "sub_blocks": 6},
            "stages": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}}
    # 3 kinds x 384 pieces x 1024 micro-batches = 1,179,648 ops > 1,000,000; 5 fit
    with pytest.raises(ConfigError, match=r"^pipeline\.sub_blocks: .*1,179,648 ops.*at most 5 "
                                          r"sub-blocks here"):
        parse_config(data)


def test_config_refuses_sub_blocks_with_async() -> None:
    with pytest.raises(ConfigError, match=r"^pipeline\.sub_blocks: pipeline\.mode: async"):
        parse_config(_with(2, mode="async"))


def test_model_config_refuses_more_pieces_than_a_stage_has_layers() -> None:
    data = yaml.safe_load((EXAMPLES / "gpt_small.yaml").read_text())
    data["solver"] = {"method": "greedy", "time_limit": 5}
    fewest = min(b - a for a, b in parse_config(data).extra("partition"))
    data["pipeline"]["sub_blocks"] = fewest + 1
    with pytest.raises(ConfigError, match=rf"^pipeline\.sub_blocks: {fewest + 1} pieces need "
                                          rf"at least {fewest + 1} layers per stage; .*at most "
                                          rf"{fewest} here"):
        parse_config(data)


# ----- the executor -----------------------------------------------------------------------------
def test_export_to_other_trainers_refuses_sub_blocks() -> None:
    from pipeopt.executor.export import ExportError, megatron_args, to_torchtitan_toml

    sched = run_classic(split(_tight(), 2), "1f1b")
    with pytest.raises(ExportError, match=r"^torchtitan: the schedule cuts every stage into 2 "
                                          r"sub-blocks.*pipeline\.sub_blocks: 1"):
        to_torchtitan_toml(sched, "s.csv")
    with pytest.raises(ExportError, match=r"^megatron: the schedule cuts every stage into 2"):
        megatron_args(sched)


@pytest.mark.torch
def test_executor_runs_the_pieces_and_matches_the_reference() -> None:
    """Each piece is a part of its stage's layers (a stage of the runtime on the same rank):
    the pipelined run's loss and gradients are those of the plain model."""
    pytest.importorskip("torch")
    from pipeopt.executor.launch import RunConfig, run_pipelines

    fused = solve(split(_tight().replace(microbatches=4, memory_limit=(2.5, 2.5)), 2),
                  "cpsat", time_limit=5, workers=1, seed=0)
    zb = run_classic(split(uniform_problem(2, 4, latency=1.0), 2), "zb-h1")
    jobs = [(fused, RunConfig(model="mlp", check=True)),
            (zb, RunConfig(model="tiny-gpt", check=True))]
    for (sched, _), res in zip(jobs, run_pipelines(jobs), strict=True):
        assert res.max_abs_grad_diff < 1e-5, sched.method
        assert res.losses == pytest.approx(res.reference_losses, rel=1e-5), sched.method


def test_plot_names_the_pieces_and_keeps_them_in_their_chunk() -> None:
    pytest.importorskip("matplotlib")
    from pipeopt.plot import _chunk_index, schedule_title

    sched = run_classic(split(rechunk(uniform_problem(2, 2), 2, "loop"), 2), "interleaved-1f1b")
    assert "v=2 (loop) sub-blocks=2" in schedule_title(sched)
    # stages 0, 1 (chunk 0 of device 0), 2, 3 (chunk 0 of device 1), 4, 5 (chunk 1 of 0), ...
    assert _chunk_index(sched) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_auto_on_a_cut_problem_starts_from_the_uncut_answer() -> None:
    from pipeopt.solvers import SolveOptions
    from pipeopt.solvers.auto import uncut_candidate

    whole = uniform_problem(4, 8, 1.0, 1.2, 0.8, latency=1.0, memory_limit=4.0)
    cut = split(whole, 2)
    opts = SolveOptions(time_limit=20, workers=1)
    plain = solve(whole, "auto", time_limit=10, workers=1)
    assert plain.solver.status == "optimal"  # so the uncut answer below is this one's value
    cand = uncut_candidate(cut, opts)
    assert cand is not None and cand.problem == cut
    validate(cand)
    assert cand.makespan == pytest.approx(plain.makespan)
    # the uncut bound does not hold for the cut problem: the candidate carries the cut one's
    assert cand.solver.status == "heuristic"
    assert cand.solver.lower_bound == pytest.approx(lower_bound(cut))
    best = solve(cut, "auto", time_limit=20, workers=1)
    assert best.makespan <= plain.makespan + 1e-9


def test_model_config_prices_each_piece_by_its_layers() -> None:
    data = yaml.safe_load((EXAMPLES / "gpt_small.yaml").read_text())
    data["pipeline"]["devices"] = 2
    data["solver"] = {"method": "greedy", "time_limit": 5}
    whole = parse_config(data).problem
    data["pipeline"]["sub_blocks"] = 3
    cfg = parse_config(data)
    cut = cfg.problem
    meta = dict(cut.meta)
    assert cut.sub_blocks == 3 and cut.stages == 6
    ranges = dict(whole.meta)["partition"]
    assert meta["partition"] == [list(r) for a, b in ranges for r in piece_layers(a, b, 3)]
    # the pieces add up to their stage; a piece holding the head costs what the head costs,
    # not a third of its stage
    assert merge(cut).forward == pytest.approx(whole.forward)
    assert merge(cut).backward_input == pytest.approx(whole.backward_input)
    assert merge(cut).activation_memory == pytest.approx(whole.activation_memory)
    assert cut.forward[5] != pytest.approx(cut.forward[4])
    rows = meta["stage_costs"]
    assert [r["layers"] for r in rows] == meta["partition"]
    assert [r["forward_s"] for r in rows] == pytest.approx(list(cut.forward))
    assert rows[5]["last"] == "head" and rows[5]["sub_block"] == 2
    # inside a stage nothing leaves the device; stage 0's last piece sends its activation
    assert [rows[q]["output_bytes"] for q in (0, 1, 3, 4)] == [0.0] * 4
    assert rows[2]["output_bytes"] == cut.message_size[2] > 0
    assert cfg.extra("chunks_open") is False


def test_bad_weights_are_refused() -> None:
    base = uniform_problem(2, 2)
    with pytest.raises(ProblemError, match=r"^sub_blocks: weights: expected 2 stages"):
        split(base, 2, [[(1.0,) * 6] * 2])
    with pytest.raises(ProblemError, match=r"^sub_blocks: weights\[1\]: expected 2 pieces"):
        split(base, 2, [[(1.0,) * 6] * 2, [(1.0,) * 5] * 2])
    with pytest.raises(ProblemError, match=r"^sub_blocks: weights\[0\]: must be finite"):
        split(base, 2, [[(-1.0,) * 6] * 2, [(1.0,) * 6] * 2])
    cut = split(base, 2, [[(3.0,) * 6, (1.0,) * 6], [(0.0,) * 6, (0.0,) * 6]])
    assert cut.forward == (0.75, 0.25, 0.5, 0.5)  # a stage of zero weights: even


def test_cpsat_warm_start_on_a_cut_problem_is_no_worse_than_the_uncut_greedy() -> None:
    pytest.importorskip("ortools")
    from pipeopt.solvers import SolveOptions
    from pipeopt.solvers.cpsat import warm_start

    whole = uniform_problem(4, 8, 1.0, 1.2, 0.8, latency=1.0, memory_limit=4.0)
    cut = split(whole, 2)
    opts = SolveOptions(time_limit=10, workers=1)
    start, _ = warm_start(cut, opts)
    assert start.problem == cut
    validate(start)
    assert start.makespan <= solve(whole, "greedy", time_limit=5, workers=1).makespan + 1e-9
