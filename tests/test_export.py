"""Export to torch.distributed.pipelining's compute-only CSV, and PyTorch running it."""

from __future__ import annotations

import pytest

from pipeopt.executor.export import check_actions, export_torch, to_torch_csv, torch_actions
from pipeopt.problem import uniform_problem
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError
from pipeopt.solvers import solve


def test_split_backward_exports_i_and_w() -> None:
    sched = solve(uniform_problem(2, 2), "zb-h1")
    assert to_torch_csv(sched).splitlines() == ["0F0,0F1,0I0,0W0,0I1,0W1",
                                                "1F0,1I0,1F1,1I1,1W0,1W1"]


def test_fused_backward_exports_b() -> None:
    sched = solve(uniform_problem(2, 2, virtual_stages=2), "interleaved-1f1b")
    rows = torch_actions(sched)
    assert not sched.problem.split_backward
    assert all(cell[-2] in "FB" for row in rows for cell in row)
    assert sorted(c for row in rows for c in row if c.startswith("3")) == ["3B0", "3B1", "3F0",
                                                                          "3F1"]


def test_malformed_and_misplaced_cells_are_rejected() -> None:
    sched = solve(uniform_problem(2, 2), "zb-h1")
    rows = torch_actions(sched)
    bad = [list(r) for r in rows]
    bad[0][2] = "0BW0"  # PyTorch's parser would silently read this as 0B
    with pytest.raises(ScheduleError, match="malformed"):
        check_actions(bad, sched)
    bad = [list(r) for r in rows]
    bad[0][0] = "1F0"
    with pytest.raises(ScheduleError, match="not on rank 0"):
        check_actions(bad, sched)
    with pytest.raises(ScheduleError, match="missing"):
        check_actions([rows[0][:-1], rows[1]], sched)
    fused = [[c.replace("I", "B") for c in r] for r in rows]
    with pytest.raises(ScheduleError, match="split_backward"):
        check_actions(fused, sched)


def test_invalid_schedule_is_not_exported() -> None:
    sched = solve(uniform_problem(2, 2), "zb-h1")
    # every op moved to time 0: dependencies broken
    broken = Schedule(sched.problem, "x", tuple(o._replace(start=0.0, end=o.end - o.start)
                                                 for o in sched.ops))
    with pytest.raises(ScheduleError, match="invalid schedule"):
        to_torch_csv(broken)


def test_torch_parser_reads_every_cell_back() -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import _Action

    sched = solve(uniform_problem(4, 8, virtual_stages=2, placement="vshape"), "zb-v")
    for row in torch_actions(sched):
        assert [str(_Action.from_str(c)) for c in row] == row


def test_cli_export(tmp_path, capsys) -> None:
    from pipeopt.cli import main
    from pipeopt.io import dump_schedule

    src, out = tmp_path / "s.json", tmp_path / "s.csv"
    sched = solve(uniform_problem(2, 2), "1f1b")
    dump_schedule(sched, src)
    assert main(["export", str(src), "--to", "torch", "-o", str(out)]) == 0
    assert out.read_text() == to_torch_csv(sched)
    assert "written" in capsys.readouterr().out


@pytest.mark.torch
def test_pytorch_runtime_runs_exported_schedules(tmp_path) -> None:
    """The CSV, read by PyTorch's own parser, holds exactly the actions the executor hands to
    ``_PipelineScheduleRuntime``; those runs match one-process training (2 gloo ranks)."""
    pytest.importorskip("torch")
    from pipeopt.executor._torch import parse_action, rows_to_actions
    from pipeopt.executor.launch import RunConfig, run_pipelines
    from pipeopt.executor.runtime import schedule_rows

    scheds = [solve(uniform_problem(2, 4), "zb-h1"),
              solve(uniform_problem(2, 4, virtual_stages=2), "interleaved-1f1b"),
              solve(uniform_problem(2, 4, virtual_stages=2, placement="vshape"), "zb-v")]
    for i, s in enumerate(scheds):
        path = tmp_path / f"{i}.csv"
        export_torch(s, path)
        rows = [[parse_action(c) for c in line.split(",")]
                for line in path.read_text().splitlines()]
        assert rows == list(rows_to_actions(schedule_rows(s)[0]).values())
    jobs = [(s, RunConfig(model="tiny-gpt", check=True)) for s in scheds]
    for s, res in zip(scheds, run_pipelines(jobs), strict=True):
        assert res.grads_match, f"{s.method}: {res.max_abs_grad_diff}"
        assert res.losses == pytest.approx(res.reference_losses, rel=1e-5)
