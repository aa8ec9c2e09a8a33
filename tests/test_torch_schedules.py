"""PyTorch's built-in schedules imported as ``torch:NAME`` methods (pure: no processes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pipeopt.problem import uniform_problem
from pipeopt.schedules import NotApplicable
from pipeopt.schedules.pytorch import TORCH_SCHEDULES, solve_torch, torch_names
from pipeopt.simulate import check
from pipeopt.solvers import compare, methods, run_classic, solve

SHAPE = {
    "1F1B": {},
    "Interleaved1F1B": {"virtual_stages": 2},
    "InterleavedZeroBubble": {"virtual_stages": 2},
    "ZBVZeroBubble": {"virtual_stages": 2, "placement": "vshape"},
    "DualPipeV": {"virtual_stages": 2, "placement": "vshape"},
}


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_every_torch_schedule_is_valid(name: str, p: int, m: int) -> None:
    sched = solve(uniform_problem(p, m, **SHAPE[name]), f"torch:{name}")
    assert check(sched) == []
    assert sched.method == f"torch:{name}" and sched.solver.status == "heuristic"
    assert sched.makespan >= sched.solver.lower_bound - 1e-9


def test_torch_1f1b_and_zbv_equal_ours() -> None:
    prob = uniform_problem(4, 8)
    assert solve_torch(prob, "1F1B").makespan == run_classic(prob, "1f1b").makespan
    v = uniform_problem(4, 8, virtual_stages=2, placement="vshape")
    assert solve_torch(v, "ZBVZeroBubble").makespan == run_classic(v, "zb-v").makespan
    il = uniform_problem(4, 8, virtual_stages=2)
    assert solve_torch(il, "Interleaved1F1B").makespan == run_classic(il,
                                                                     "interleaved-1f1b").makespan


def test_1f1b_last_rank_off_by_one_is_fixed_and_recorded() -> None:
    sched = solve_torch(uniform_problem(3, 5), "1F1B")
    assert "off-by-one" in sched.solver.detail("torch_fixup")
    last = [o for o in sched.device_orders()[2] if o.kind == "F"]
    assert [o.microbatch for o in last] == list(range(5))


def test_full_backward_schedules_run_fused_and_zero_bubble_ones_split() -> None:
    assert not solve_torch(uniform_problem(2, 4), "1F1B").problem.split_backward
    dp = solve_torch(uniform_problem(4, 8, **SHAPE["DualPipeV"]), "DualPipeV")
    assert dp.problem.split_backward and any(o.kind == "W" for o in dp.ops)


@pytest.mark.parametrize("name,kw,reason", [
    ("1F1B", {"virtual_stages": 2}, "virtual_stages: 1"),
    ("Interleaved1F1B", {}, "virtual_stages >= 2"),
    ("ZBVZeroBubble", {"virtual_stages": 2}, "placement: vshape"),
    ("ZBVZeroBubble", {"virtual_stages": 2, "placement": "vshape", "split_backward": False},
     "split_backward"),
    ("DualPipeV", {"virtual_stages": 2, "placement": "vshape"}, "microbatches"),
    ("Nope", {}, "unknown PyTorch schedule"),
])
def test_not_applicable_says_why(name: str, kw: dict, reason: str) -> None:
    with pytest.raises(NotApplicable, match=reason):
        solve_torch(uniform_problem(4, 4, **kw), name)


def test_names_and_compare() -> None:
    assert "torch:ZBVZeroBubble" in torch_names()
    assert solve_torch(uniform_problem(2, 2), "schedule1f1b").method == "torch:1F1B"
    rows = compare(uniform_problem(4, 8), ["1f1b", "torch:1F1B", "torch:ZBVZeroBubble"])
    by = {r.method: r for r in rows}
    assert by["torch:1F1B"].ratio == pytest.approx(by["1f1b"].ratio)
    # Chunked schedules run on the same work cut into two V-shaped chunks, and say so.
    zbv = by["torch:ZBVZeroBubble (v=2)"]
    assert zbv.schedule is not None and zbv.schedule.problem.virtual_stages == 2
    assert zbv.schedule.makespan < by["torch:1F1B"].schedule.makespan
    assert "torch:ZBVZeroBubble" in methods()


def test_compare_reports_torch_schedules_over_memory_instead_of_failing() -> None:
    prob = uniform_problem(4, 8, memory_limit=4.0)
    by = {r.method: r for r in compare(prob, ["torch:1F1B", "torch:Interleaved1F1B", "1f1b"])}
    assert by["torch:1F1B"].fits and by["torch:1F1B"].schedule.problem.split_backward is False
    assert max(by["torch:1F1B"].schedule.peak_memory) == max(by["1f1b"].schedule.peak_memory)
    inter = by["torch:Interleaved1F1B (v=2)"]
    assert inter.schedule is not None and not inter.fits
    assert max(inter.schedule.peak_memory) > 4.0
