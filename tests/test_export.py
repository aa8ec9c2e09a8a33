"""Export to torch.distributed.pipelining's compute-only CSV, and PyTorch running it."""

from __future__ import annotations

import pytest

from pipeopt.executor.export import check_actions, to_torch_csv, torch_actions
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
    """_PipelineScheduleRuntime loads our CSV on 2 gloo ranks; gradients match one process."""
    pytest.importorskip("torch")
    from pipeopt.executor.check import compare_grads, reference_run
    from pipeopt.executor.export import export_torch, run_torch_jobs
    from pipeopt.executor.launch import RunConfig, spawn

    scheds = [solve(uniform_problem(2, 4), "zb-h1"),
              solve(uniform_problem(2, 4, virtual_stages=2), "interleaved-1f1b"),
              solve(uniform_problem(2, 4, virtual_stages=2, placement="vshape"), "zb-v")]
    jobs = []
    for i, s in enumerate(scheds):
        path = tmp_path / f"{i}.csv"
        export_torch(s, path)
        jobs.append((s.problem, RunConfig(model="tiny-gpt"), str(path)))
    per_rank = spawn(run_torch_jobs, 2, (jobs,), timeout=120)
    for i, (prob, cfg, _) in enumerate(jobs):
        grads = {k: g for r in per_rank for k, g in r[i]["grads"].items()}
        ref = reference_run(prob, cfg.model, steps=1, batch_size=cfg.batch(prob.microbatches),
                            lr=cfg.lr, seed=cfg.seed)
        cmp = compare_grads(grads, ref["grads"])
        assert cmp.ok and cmp.compared > 0, f"{scheds[i].method}: {cmp}"
        loss = sum(r[i]["losses"][0] for r in per_rank)
        assert loss == pytest.approx(ref["losses"][0], rel=1e-5)
