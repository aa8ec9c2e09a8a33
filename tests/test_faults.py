"""Solver limits and failures: time limits, Ctrl-C, huge instances, memory that nothing fits,
and atomic outputs.

Documented behaviour (see :mod:`pipeopt.cli`): a time limit returns the best schedule found
with status ``feasible`` and its gap; Ctrl-C during a CP-SAT search writes the best schedule so
far and exits with status 130; ``--method cpsat`` on an instance too large for a CP-SAT model
returns the greedy's schedule with a note; a failed or interrupted run leaves the previous
output file untouched and no temporary files behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import pipeopt.io
from pipeopt.cli import main
from pipeopt.io import load_schedule
from pipeopt.problem import uniform_problem
from pipeopt.simulate import validate
from pipeopt.solvers import solve
from pipeopt.solvers.cpsat import MAX_MODEL_OPS

ROOT = Path(__file__).resolve().parents[1]

# Uneven stages, latencies and per-device memory caps: CP-SAT improves on the warm start but
# cannot prove optimality within seconds (216 ops; measured gap ~1.4 % after 3 s on 2 cores).
HARD: dict[str, Any] = {
    "pipeline": {"devices": 6, "microbatches": 12},
    "stages": {"forward": [1.3, 0.9, 1.1, 1.0, 0.8, 1.6],
               "backward_input": [1.5, 1.2, 1.0, 1.3, 1.1, 1.9],
               "backward_weight": [0.7, 0.9, 0.6, 0.8, 1.0, 1.2],
               "activation_memory": [1.0, 1.2, 0.9, 1.1, 1.0, 1.3],
               "weight_grad_memory": 0.4},
    "links": {"latency": [0.1, 0.3, 0.05, 0.2, 0.1]},
    "memory": {"limit": [3.5, 3.2, 3.0, 2.8, 2.5, 2.2]},
    "solver": {"workers": 2},
}


def _config(tmp_path: Path, doc: dict[str, Any], name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _leftovers(folder: Path) -> list[str]:
    """Temporary files of atomic writes (``.<name>.<random>.tmp``)."""
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ----- time limit ----------------------------------------------------------------------------

def test_time_limit_returns_best_so_far_as_feasible_with_gap(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    t0 = time.perf_counter()
    rc = main(["solve", str(cfg), "--method", "cpsat", "--time-limit", "1.5", "-o", str(out),
               "--json"])
    wall = time.perf_counter() - t0
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "feasible"
    assert 0 < summary["gap"] < 0.2
    assert summary["lower_bound"] < summary["makespan"]
    assert wall < 15  # the limit plus model building, not minutes
    sched = validate(load_schedule(out))
    assert sched.solver.status == "feasible" and sched.gap == pytest.approx(summary["gap"])
    assert sched.solver.detail("cpsat_status") in ("FEASIBLE", "UNKNOWN")


# ----- Ctrl-C ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_in_a_subprocess_writes_best_schedule_and_exits_130(
        tmp_path: Path, sig: signal.Signals) -> None:
    """Send SIGINT (Ctrl-C) or SIGTERM (a job scheduler's stop) once CP-SAT reports its first
    solution (the ``-v`` search log): the best schedule so far is written either way."""
    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    out.write_text("previous", encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeopt", "solve", str(cfg), "--method", "cpsat",
         "--time-limit", "60", "-o", str(out), "-v"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        seen: list[str] = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("#") and line[1:2].isdigit():  # "#1  0.04s best:..."
                proc.send_signal(sig)
                break
        t0 = time.perf_counter()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
    assert proc.returncode == 130, "".join(seen) + stderr
    assert time.perf_counter() - t0 < 20  # stopped, not run to the 60 s limit
    assert "Traceback" not in stderr
    assert "pipeopt: interrupted: wrote the best schedule so far" in stderr
    assert "status feasible" in stderr
    assert "written" in stdout
    sched = validate(load_schedule(out))
    assert sched.solver.status == "feasible"
    assert sched.solver.detail("interrupted") is True
    assert _leftovers(tmp_path) == []


def test_ctrl_c_in_process_keeps_the_best_cpsat_schedule() -> None:
    """The API: SIGINT during the search stops it; the result is valid and marked."""
    prob = uniform_problem(6, 12, 1.0, 1.3, 0.7, weight_grad=0.4, latency=0.2, memory_limit=3.0)
    sent = []

    def interrupt(progress: Any) -> None:
        if progress.objective is not None and not sent:
            sent.append(progress)
            os.kill(os.getpid(), signal.SIGINT)

    sched = solve(prob, "cpsat", time_limit=60, workers=2, on_progress=interrupt)
    assert sent
    assert sched.solver.status in ("feasible", "optimal")
    assert sched.solver.detail("interrupted") is True
    assert sched.solver.wall_time < 30
    validate(sched)


def test_ctrl_c_during_the_greedy_keeps_the_previous_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipeopt.solvers.greedy as greedy

    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    out.write_text("previous good output", encoding="utf-8")

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(greedy, "solve_greedy", interrupted)
    assert main(["solve", str(cfg), "--method", "greedy", "-o", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "pipeopt: interrupted"
    assert out.read_text(encoding="utf-8") == "previous good output"
    assert _leftovers(tmp_path) == []


def test_ctrl_c_during_auto_keeps_the_best_hand_made_schedule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipeopt.solvers.greedy as greedy

    doc = {**HARD, "memory": {"limit": None}}
    cfg, out = _config(tmp_path, doc), tmp_path / "s.json"

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(greedy, "solve_greedy", interrupted)
    assert main(["solve", str(cfg), "--method", "auto", "-o", str(out), "-q"]) == 130
    assert "pipeopt: interrupted: wrote the best schedule so far" in capsys.readouterr().err
    sched = validate(load_schedule(out))
    assert sched.method.startswith("auto:") and sched.solver.detail("interrupted") is True


@pytest.mark.parametrize("where", ["greedy", "model"])
def test_ctrl_c_before_the_cpsat_search_keeps_the_warm_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        where: str) -> None:
    """Ctrl-C while the warm start's greedy runs, or while the model is built, must stop the
    solve there (it used to run the whole search and exit 0)."""
    import pipeopt.solvers.cpsat as cpsat
    import pipeopt.solvers.greedy as greedy

    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    real_greedy = greedy.solve_greedy

    def greedy_stopped(*args: Any, **kwargs: Any) -> Any:
        # As when Ctrl-C comes after the greedy's first variant: it keeps that one.
        sched = real_greedy(*args, **kwargs)
        return dataclasses.replace(sched, solver=dataclasses.replace(
            sched.solver, details=(*sched.solver.details, ("interrupted", True))))

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    if where == "greedy":
        monkeypatch.setattr(greedy, "solve_greedy", greedy_stopped)
    else:
        monkeypatch.setattr(cpsat, "build_model", interrupted)
    t0 = time.perf_counter()
    assert main(["solve", str(cfg), "--method", "cpsat", "--time-limit", "60", "-o", str(out),
                 "-q"]) == 130
    assert time.perf_counter() - t0 < 30  # not the 60 s search
    assert "pipeopt: interrupted: wrote the best schedule so far" in capsys.readouterr().err
    sched = validate(load_schedule(out))
    assert sched.method == "cpsat" and sched.solver.status == "feasible"
    assert sched.solver.detail("interrupted") is True
    assert sched.solver.detail("cpsat_status") == "SKIPPED (interrupted)"


def test_ctrl_c_during_compare_stops_and_shows_the_rows_so_far(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipeopt.solvers.greedy as greedy

    cfg = _config(tmp_path, {**HARD, "memory": {"limit": None}})

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(greedy, "solve_greedy", interrupted)
    rc = main(["compare", str(cfg), "--methods", "1f1b,greedy,zb-h1,cpsat", "--json"])
    captured = capsys.readouterr()
    assert rc == 130
    rows = {r["method"]: r for r in json.loads(captured.out)}
    assert rows["1f1b"]["makespan"] > 0  # ran before the Ctrl-C
    for name in ("greedy", "zb-h1", "cpsat"):  # cut off: not run
        assert rows[name]["error"] == "not run: interrupted (Ctrl-C)"
    assert "pipeopt: interrupted:" in captured.err and "not run: greedy, zb-h1, cpsat" in \
        captured.err


@pytest.mark.parametrize("delay", [0.3, 0.6, 1.2])
def test_ctrl_c_at_any_moment_of_the_command_exits_130(tmp_path: Path, delay: float) -> None:
    """While pydantic, numpy and OR-Tools still load, or once the solve runs: exit 130 with
    one line, never a traceback."""
    cfg = _config(tmp_path, HARD)
    proc = subprocess.Popen([sys.executable, "-m", "pipeopt", "compare", str(cfg),
                             "--time-limit", "30"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().startswith("pipeopt: interrupted"), err


def test_package_exports_resolve() -> None:
    import pipeopt
    import pipeopt.simulate  # the submodule of the same name must not shadow the function

    assert callable(pipeopt.simulate) and pipeopt.simulate.__name__ == "simulate"
    assert sorted(pipeopt.__all__) == sorted(pipeopt._EXPORTS)
    for name in pipeopt.__all__:
        assert getattr(pipeopt, name) is not None
    with pytest.raises(AttributeError):
        _ = pipeopt.no_such_name


# ----- atomic outputs --------------------------------------------------------------------------

@pytest.fixture
def good_output(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """A config and the schedule a first, successful solve wrote from it."""
    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    assert main(["solve", str(cfg), "--method", "greedy", "-o", str(out), "-q", "--json"]) == 0
    return cfg, out, out.read_bytes()


def test_bad_config_leaves_previous_output(tmp_path: Path, good_output: tuple[Path, Path, bytes],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _, out, before = good_output
    bad = _config(tmp_path, {**HARD, "stages": {**HARD["stages"], "forward": -1}}, "bad.yaml")
    capsys.readouterr()
    assert main(["solve", str(bad), "--method", "greedy", "-o", str(out)]) == 2
    assert "stages.forward: must be a finite number >= 0" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_infeasible_problem_leaves_previous_output(tmp_path: Path,
                                                   good_output: tuple[Path, Path, bytes],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, out, before = good_output
    bad = _config(tmp_path, {**HARD, "memory": {"limit": 0.5}}, "tight.yaml")
    capsys.readouterr()
    assert main(["solve", str(bad), "--method", "auto", "-o", str(out)]) == 2
    assert "memory.limit[0] = 0.5 is too small" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(5, "Input/output error"), KeyboardInterrupt()],
                         ids=["io-error", "ctrl-c"])
def test_failure_in_the_middle_of_writing(tmp_path: Path, good_output: tuple[Path, Path, bytes],
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          failure: BaseException) -> None:
    """The new file is fully written to a temporary file, then the flush to disk fails."""
    cfg, out, before = good_output
    written = []

    def fail(fd: int) -> None:
        written.append(os.fstat(fd).st_size)
        raise failure

    monkeypatch.setattr(pipeopt.io.os, "fsync", fail)
    capsys.readouterr()
    rc = main(["solve", str(cfg), "--method", "greedy", "-o", str(out), "-q"])
    err = capsys.readouterr().err
    assert written and written[0] > 0  # the failure came mid-write, after data went out
    if isinstance(failure, OSError):
        assert rc == 2
        assert err.startswith("pipeopt: error: --output: cannot write") and "Input/output" in err
    else:
        assert rc == 130
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_atomic_write_keeps_permissions_and_follows_symlinks(tmp_path: Path) -> None:
    from pipeopt.io import write_atomic

    old_mask = os.umask(0o027)
    try:
        fresh = write_atomic(tmp_path / "new.json", "{}")
        assert fresh.stat().st_mode & 0o777 == 0o640  # what open() gives: 0666 less the umask
    finally:
        os.umask(old_mask)
    shared = tmp_path / "shared.json"
    shared.write_text("old")
    shared.chmod(0o664)
    write_atomic(shared, "new")
    assert shared.read_text() == "new" and shared.stat().st_mode & 0o777 == 0o664
    link = tmp_path / "link.json"
    link.symlink_to(shared)
    write_atomic(link, "via the link")
    assert link.is_symlink() and shared.read_text() == "via the link"
    assert _leftovers(tmp_path) == []


def test_output_into_a_fifo_or_device_is_written_not_replaced(tmp_path: Path) -> None:
    """-o /dev/null or a pipe: write into it. (A rename over it, as root, replaced the device.)"""
    import stat

    from pipeopt.io import write_atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert _leftovers(tmp_path) == []
    if os.path.exists("/dev/null") and stat.S_ISCHR(os.stat("/dev/null").st_mode):
        link = tmp_path / "null"
        link.symlink_to("/dev/null")
        write_atomic(link, "gone")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["solve", "examples/uniform.yaml", "--method", "1f1b", "--json"],
                                  ["compare", "examples/uniform.yaml", "--methods", "1f1b"]])
def test_full_standard_output_is_one_error_line(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "pipeopt", *args], cwd=ROOT, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "pipeopt: error: cannot write the output: No space left on device\n"


def test_cpsat_resolution_too_fine_is_named(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = {**HARD, "solver": {"workers": 2, "resolution": 1e-300, "time_limit": 5}}
    cfg = _config(tmp_path, doc)
    assert main(["solve", str(cfg), "--method", "cpsat", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeopt: error: solver.resolution: 1e-300 s per unit is too fine")
    assert "Traceback" not in err


def test_long_output_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, HARD)
    ok = tmp_path / ("b" * 240 + ".json")  # legal; its temporary name must stay legal too
    assert main(["solve", str(cfg), "--method", "greedy", "-q", "-o", str(ok)]) == 0
    assert load_schedule(ok).method == "greedy"
    capsys.readouterr()
    too_long = tmp_path / ("b" * 300 + ".json")
    assert main(["solve", str(cfg), "--method", "greedy", "-q", "-o", str(too_long)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeopt: error: --output: cannot write") and "too long" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plot_failure_keeps_previous_png(tmp_path: Path, good_output: tuple[Path, Path, bytes],
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib.figure import Figure

    _, out, _ = good_output
    png = tmp_path / "s.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0
    before = png.read_bytes()

    def half_then_fail(self: Figure, fh: Any, **kwargs: Any) -> None:
        fh.write(b"\x89PNG half a picture")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(png)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert png.read_bytes() == before
    assert _leftovers(tmp_path) == []


# ----- huge instances --------------------------------------------------------------------------

def test_cpsat_falls_back_to_the_greedy_on_huge_instances(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    doc = {"pipeline": {"devices": 16, "microbatches": 512},
           "stages": {"forward": 1.0, "backward_input": 1.1, "backward_weight": 0.7,
                      "activation_memory": 1.0},
           "memory": {"limit": 12.0}, "solver": {"workers": 1}}
    assert MAX_MODEL_OPS < 3 * 16 * 512
    cfg, out = _config(tmp_path, doc), tmp_path / "s.json"
    t0 = time.perf_counter()
    rc = main(["solve", str(cfg), "--method", "cpsat", "--time-limit", "30", "-o", str(out),
               "--json"])
    assert rc == 0
    assert time.perf_counter() - t0 < 20  # no giant model was built
    err = capsys.readouterr().err
    assert "pipeopt: note: cpsat: 24576 ops is more than a CP-SAT model handles" in err
    sched = validate(load_schedule(out))
    assert sched.method == "greedy"
    assert "greedy" in sched.solver.detail("fallback")
    assert sched.solver.detail("cpsat_status") == "SKIPPED"
    assert max(sched.peak_memory) <= 12.0


def test_auto_skips_cpsat_on_huge_instances_with_a_note() -> None:
    prob = uniform_problem(16, 512, 1.0, 1.1, 0.7, memory_limit=12.0)
    sched = solve(prob, "auto", time_limit=5, workers=1)
    assert "greedy covers it" in sched.solver.detail("skipped_cpsat")


# ----- memory that no schedule fits ------------------------------------------------------------

def test_infeasible_memory_names_device_and_least_limits(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Device 2 needs static 0.5 + one micro-batch's activation 0.9 = 1.4; with exactly the
    reported limits the cheapest schedule fits, so they are the least that work."""
    doc = {**HARD, "memory": {"limit": [3.5, 3.2, 1.0, 2.8, 2.5, 2.2], "static": 0.5}}
    cfg = _config(tmp_path, doc)
    for method in ("auto", "greedy", "cpsat"):
        assert main(["solve", str(cfg), "--method", method, "--time-limit", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("pipeopt: error: ")
        assert "memory.limit[2] = 1 is too small for any schedule: device 2 needs at least 1.4" \
            in err
        assert "fits with memory.limit >= [1.5, 1.7, 1.4, 1.6, 1.5, 1.8]" in err
        assert "INFEASIBLE" not in err
    least = {**HARD, "memory": {"limit": [1.5, 1.7, 1.4, 1.6, 1.5, 1.8], "static": 0.5}}
    out = tmp_path / "s.json"
    assert main(["solve", str(_config(tmp_path, least, "least.yaml")), "--method", "greedy",
                 "-o", str(out), "-q"]) == 0
    validate(load_schedule(out))


def test_ctrl_c_between_greedy_variants_keeps_the_best_variant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pipeopt.solvers.greedy as greedy

    cfg, out = _config(tmp_path, HARD), tmp_path / "s.json"
    real, calls = greedy._run, []

    def second_is_interrupted(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(greedy, "_run", second_is_interrupted)
    assert main(["solve", str(cfg), "--method", "greedy", "-o", str(out), "-q"]) == 130
    assert "pipeopt: interrupted: wrote the best schedule so far" in capsys.readouterr().err
    sched = validate(load_schedule(out))
    assert sched.solver.detail("interrupted") is True
    assert sched.solver.detail("variants_tried") == 1
    assert max(p - lim for p, lim in zip(sched.peak_memory, HARD["memory"]["limit"],
                                         strict=True)) <= 1e-9
