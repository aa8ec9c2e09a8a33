"""Command-line and API behaviours that scripts rely on: flags that override the file, JSON
output, method lists, and the Python API's entry points."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

import pipeopt
from pipeopt.cli import main
from pipeopt.io import schedule_from_dict

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = str(ROOT / "examples" / "uniform.yaml")


def test_flags_override_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # uniform.yaml says method: auto, time_limit: 20.
    out = tmp_path / "s.json"
    assert main(["solve", UNIFORM, "--method", "zb-h1", "-o", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["method"] == "zb-h1"
    capsys.readouterr()
    assert main(["solve", UNIFORM, "--method", "cpsat", "--time-limit", "7", "--json", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "cpsat"
    assert main(["solve", UNIFORM, "--time-limit", "0", "-q"]) == 2  # checked, not ignored
    assert "--time-limit" in capsys.readouterr().err


def test_simulate_json_reports_valid_and_invalid(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["solve", UNIFORM, "--method", "1f1b", "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out), "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["valid"] is True and good["makespan"] == pytest.approx(33.0)  # (8+3)·3
    doc = json.loads(out.read_text())
    doc["ops"][0]["start"] += 0.5
    out.write_text(json.dumps(doc))
    assert main(["simulate", str(out), "--json"]) == 2
    captured = capsys.readouterr()
    bad = json.loads(captured.out)
    assert bad["valid"] is False and "invalid schedule" in bad["error"]
    assert captured.err.startswith("pipeopt: error:")


@pytest.mark.parametrize(("methods", "phrase"), [
    ("bogus", "--methods: unknown method 'bogus'"),
    ("1f1b,gredy", "did you mean 'greedy'?"),
    (",", "--methods: an empty name"),
    ("1f1b,,zb-h1", "--methods: an empty name"),
])
def test_compare_refuses_bad_method_lists(capsys: pytest.CaptureFixture[str], methods: str,
                                          phrase: str) -> None:
    assert main(["compare", UNIFORM, "--methods", methods]) == 2
    err = capsys.readouterr().err
    assert phrase in err and len(err.strip().splitlines()) == 1


def test_compare_runs_each_method_once_and_plots_with_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "c.png"
    assert main(["compare", UNIFORM, "--methods", "1f1b, zb-h1,1f1b", "--json",
                 "--plot", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["zb-h1", "1f1b"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_ratio_divides_the_iteration_time_shown_and_says_na_where_undefined(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18 item 5: "vs best" divides the column shown (the iteration time, with the
    gradient reduction), the makespan beside it only when they differ; a ratio with a best of
    0 s is n/a (null in --json), and a method named twice runs once."""
    cfg = tmp_path / "gr.yaml"
    cfg.write_text("pipeline: {devices: 4, microbatches: 4}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1, "
                   "grad_reduce: [9, 0, 0, 0]}\n")
    assert main(["compare", str(cfg), "--methods", "1f1b,zb-h1", "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["method", "iteration", "time", "vs", "best", "makespan"]
    # 1F1B: iteration 30 (its stage 0 ends its last W at 21 s, then 9 s of reduction), makespan
    # 21; ZB-H1: 24 and 15.
    assert lines[2].split()[:4] == ["zb-h1", "24", "1.000", "15"]
    assert lines[3].split()[:4] == ["1f1b", "30", "1.250", "21"]
    assert "iteration time = makespan + the gradient reduction" in lines[-1]
    assert main(["compare", str(cfg), "--methods", "1f1b,zb-h1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["ratio_of"] == "iteration_time" for r in rows)
    assert [r["ratio"] for r in rows] == [pytest.approx(r["iteration_time"] / 24)
                                          for r in rows] and rows[1]["ratio"] == 1.25

    zero = tmp_path / "zero.yaml"
    zero.write_text("pipeline: {devices: 2, microbatches: 2}\n"
                    "stages: {forward: 0, backward_input: 0, backward_weight: 0}\n")
    assert main(["compare", str(zero), "--methods", "1f1b,zb-h1", "-q"]) == 0
    table = capsys.readouterr().out
    assert "inf" not in table and all(line.split()[2] == "n/a"
                                      for line in table.splitlines()[2:])
    assert main(["compare", str(zero), "--methods", "1f1b,zb-h1", "--json"]) == 0
    assert [r["ratio"] for r in json.loads(capsys.readouterr().out)] == [None, None]

    prob = pipeopt.uniform_problem(devices=4, microbatches=8, f=1.0, b=1.0, w=1.0)
    rows_api = pipeopt.compare(prob, ["1f1b", "zb-h1", "1f1b"])
    assert [r.method for r in rows_api] == ["zb-h1", "1f1b"]
    assert rows_api[0].ratio == 1.0 and rows_api[1].ratio == pytest.approx(33 / 27)


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux's /proc")
def test_output_on_proc_names_the_true_reason_before_any_work(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18 item 12: /proc/version exists; it said "No such file or directory", after the
    solve. /proc makes no new files, and the atomic write needs one beside the target."""
    assert main(["solve", UNIFORM, "--method", "1f1b", "-o", "/proc/version"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the solve
    assert err.strip() == ("pipeopt: error: --output: cannot write /proc/version (/proc takes "
                           "no new files: a special file system such as /proc or /sys, not "
                           "storage; write to a file on a disk)")


def test_dash_reads_a_config_or_a_schedule_from_standard_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def stdin(data: bytes) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))

    stdin(Path(UNIFORM).read_bytes())
    out = tmp_path / "s.json"
    assert main(["solve", "-", "--method", "zb-h1", "-q", "-o", str(out)]) == 0
    assert "makespan      27 s" in capsys.readouterr().out
    stdin(out.read_bytes())  # a schedule JSON on standard input: its problem, solved again
    assert main(["solve", "-", "--method", "1f1b", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == 33
    stdin(out.read_bytes())
    assert main(["simulate", "-"]) == 0
    assert capsys.readouterr().out.startswith("<stdin>: valid")
    stdin(b"pipeline: [")
    assert main(["solve", "-", "-q"]) == 2
    assert capsys.readouterr().err.startswith("pipeopt: error: <stdin>: not valid YAML")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipeopt {pipeopt.__version__}"


def test_to_json_round_trips() -> None:
    cfg = pipeopt.load_config(UNIFORM)
    sched = pipeopt.solve(cfg.problem, method="zb-h1")
    doc = json.loads(sched.to_json())
    again = schedule_from_dict(doc)
    assert again.makespan == sched.makespan and sorted(again.ops) == sorted(sched.ops)
    assert doc["format"].startswith("pipeopt.schedule/")


def test_solve_takes_a_config_with_its_solver_section() -> None:
    cfg = pipeopt.load_config(UNIFORM, method="1f1b")
    sched = pipeopt.solve(cfg)
    assert sched.method == "1f1b" and sched.makespan == pytest.approx(33.0)
    assert pipeopt.solve(cfg, "zb-h1").method == "zb-h1"  # an explicit method wins
    with pytest.raises(TypeError, match="expected a Problem or a Config"):
        pipeopt.solve({"pipeline": {}}, "1f1b")


def test_zero_length_ops_listed_in_any_order_resimulate(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Every op lasts 0 s, so all start together: the file's op order must not decide the
    # re-simulated device orders (reversed, it used to deadlock on a valid file).
    cfg, out = tmp_path / "zero.yaml", tmp_path / "s.json"
    for v, method in ((1, "1f1b"), (1, "zb-h1"), (2, "interleaved-1f1b"), (2, "zb-v")):
        place = "vshape" if method == "zb-v" else "loop"
        cfg.write_text(f"pipeline: {{devices: 3, microbatches: 6, virtual_stages: {v}, "
                       f"placement: {place}}}\n"
                       "stages: {forward: 0, backward_input: 0, backward_weight: 0}\n")
        capsys.readouterr()
        assert main(["solve", str(cfg), "--method", method, "-o", str(out), "-q"]) == 0, \
            capsys.readouterr().err
        doc = json.loads(out.read_text())
        doc["ops"].reverse()
        out.write_text(json.dumps(doc))
        assert main(["simulate", str(out)]) == 0, (method, capsys.readouterr().err)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("tty", "flags", "shown"), [
    (True, [], True), (True, ["-q"], False), (True, ["--json"], False), (False, [], False)])
def test_progress_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], tty: bool,
                                     flags: list[str], shown: bool) -> None:
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["solve", UNIFORM, "--method", "cpsat", *flags]) == 0
    text = err.getvalue()
    assert ("\r" in text) == shown
    if shown:
        assert "cpsat  best 27  bound 27  gap 0.00%" in text
        assert text.endswith("\r") and text.rstrip("\r").split("\r")[-1].strip() == ""  # erased


def test_progress_clock_moves_between_reports() -> None:
    from pipeopt.cli import ProgressLine
    from pipeopt.solvers import Progress

    out = _Terminal()
    with ProgressLine(True, tick=0.01, stream=out) as line:
        line.running("cpsat")
        line.report(Progress(0.0, 10.0, 8.0))
        time.sleep(0.3)
    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    clocks = {f.split()[0] for f in frames}
    assert len(clocks) >= 2  # redrawn with a later elapsed time, no new report needed
    assert all("best 10  bound 8  gap 20.00%" in f for f in frames[1:])


def test_many_devices_summarise_peak_memory(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline: {devices: 32, microbatches: 64}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1, "
                   "activation_memory: 1}\n")
    assert main(["solve", str(cfg), "--method", "1f1b", "-q"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("peak memory"))
    assert line == ("peak memory   max 32 (device 0), min 1 (device 31) over 32 devices; each "
                    "device's in the JSON (peak_memory)")


def test_auto_stops_trying_hand_made_schedules_when_time_runs_out() -> None:
    prob = pipeopt.uniform_problem(devices=8, microbatches=32, f=1.0, b=1.0, w=1.0)
    sched = pipeopt.solve(prob, "auto", time_limit=1e-4)
    skipped = [k for k, v in sched.solver.details if v == "skipped: time limit"]
    assert skipped and all(k.startswith("classic_") for k in skipped)
    # The first tried, ZB-H1 (split backward), is kept: it is optimal here.
    assert sched.makespan == pytest.approx(32 * 3 + 7 * 1)


def test_gradient_reduction_keeps_spec_gap_and_reports_the_objectives(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SPEC: lower_bound bounds the makespan and gap = (makespan - lower_bound) / makespan.
    With a gradient reduction the solver minimises the iteration time: its own bound and gap
    are objective_lower_bound / objective_gap."""
    cfg, out = tmp_path / "gr.yaml", tmp_path / "s.json"
    cfg.write_text("pipeline: {devices: 4, microbatches: 8}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1, "
                   "grad_reduce: 5}\n")
    assert main(["solve", str(cfg), "--method", "zb-h1", "-q", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    sol = doc["solver"]
    assert doc["makespan"] == pytest.approx(27) and doc["iteration_time"] == pytest.approx(32)
    assert sol["lower_bound"] <= doc["makespan"]
    assert sol["gap"] == pytest.approx((doc["makespan"] - sol["lower_bound"]) / doc["makespan"])
    # Device 3 cannot finish before 27, plus 5 s of reduction: ZB-H1 is optimal here.
    assert sol["objective_lower_bound"] == pytest.approx(32) and sol["objective_gap"] == 0
    assert "status        heuristic (lower bound 32, gap 0.00%)" in capsys.readouterr().out
    assert pipeopt.load_schedule(out).solver.lower_bound == pytest.approx(32)


RUN_BAD_FLAGS = [(["--steps", "0"], "--steps"), (["--lr", "nan"], "--lr"),
                 (["--threads", "0"], "--threads"), (["--batch-size", "3"], "--batch-size"),
                 (["--model", "nope"], "unknown model 'nope'"),
                 (["--model-arg", "hidden"], "--model-arg"),
                 (["--data-parallel", "0"], "--data-parallel"),
                 (["--max-ranks", "0"], "--max-ranks"),
                 # uniform.yaml has 4 devices: 4 x (cores + 1) ranks, over 4 per core (item 9)
                 (["--data-parallel", str((os.cpu_count() or 1) + 1)], "per core"),
                 (["--max-ranks", "3"], "more than --max-ranks 3")]


def test_run_checks_every_flag_before_importing_torch(tmp_path: Path) -> None:
    """A bad ``run`` flag (or schedule file) is refused without importing torch (seconds)."""
    import subprocess

    sched = tmp_path / "s.json"
    assert main(["solve", UNIFORM, "--method", "1f1b", "-o", str(sched), "-q"]) == 0
    cases = [[str(sched), *flags] for flags, _ in RUN_BAD_FLAGS] + [[str(tmp_path / "none")]]
    script = ("import sys, json\nfrom pipeopt.cli import main\nout = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    out.append(main(['run', *argv]))\n"
              "print(json.dumps([out, 'torch' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    codes, torch_loaded = json.loads(proc.stdout.splitlines()[-1])
    assert codes == [2] * len(cases), proc.stderr
    assert not torch_loaded
    for _, needle in RUN_BAD_FLAGS:
        assert needle in proc.stderr


def test_run_builtin_model_names_match_the_executor() -> None:
    pytest.importorskip("torch")
    from pipeopt.executor.cli import BUILTIN_MODELS
    from pipeopt.executor.models import BUILTIN

    assert BUILTIN_MODELS == BUILTIN


def test_run_refuses_more_ranks_than_the_machine_holds() -> None:
    """Issue 18, item 9: 64 or 1024 ranks of ~440 MiB each are refused with the numbers."""
    from pipeopt.executor.procs import ExecutorError, check_rank_capacity

    gib = 2**30
    with pytest.raises(ExecutorError, match=r"1024 ranks .* 4 per core .* 16 cores \(64\)"):
        check_rank_capacity(1024, 16, 1024 * gib)
    with pytest.raises(ExecutorError, match=r"64 ranks to start need about 27.5 GiB \(440 MiB "
                       r"each\), more than the 16.0 GiB available"):
        check_rank_capacity(64, 16, 16 * gib)
    check_rank_capacity(64, 16, 28 * gib)  # fits both
    check_rank_capacity(64, None, None)  # nothing known, nothing refused
    check_rank_capacity(1024, 16, gib, max_ranks=1024)  # the user knows better
    with pytest.raises(ExecutorError, match="more than --max-ranks 8"):
        check_rank_capacity(9, 1000, 1000 * gib, max_ranks=8)


TRADEOFF_YAML = """
pipeline: {devices: 2, microbatches: 32, split_backward: true}
stages: {forward: 1.0, backward_input: 2.0, backward_weight: 1.0, activation_memory: 1.0}
solver: {method: auto, time_limit: 5%s}
"""


def test_solve_prints_the_time_memory_tradeoff(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18, item 2: ZB-H1 (130 s, peak 2) over ZB-H2 (129 s, peak 3) within 1%."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TRADEOFF_YAML % "")
    assert main(["solve", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "method        auto:zb-h1" in out
    assert "trade-off     chose zb-h1: 0.8% slower, 1 less peak memory than the fastest" in out
    cfg.write_text(TRADEOFF_YAML % ", time_tolerance: 0")
    assert main(["solve", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "makespan      129 s" in out and "trade-off" not in out
    cfg.write_text(TRADEOFF_YAML % ", time_tolerance: 2")
    assert main(["solve", str(cfg)]) == 2
    assert "solver.time_tolerance" in capsys.readouterr().err


def test_solve_and_compare_show_the_pareto_set(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18 item 2: the time / peak memory trade-off in solve (text and --json) and in
    compare (a pareto column; "pareto" in --json). TRADEOFF: ZB-H2 (and CP-SAT) 129 s at 3
    activations, ZB-H1 / ZB-1P 130 s at 2, 1F1B 132 s at 2, GPipe 132 s at 32."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TRADEOFF_YAML % "")
    assert main(["solve", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("pareto"))
    rows = [re.split(r"\s{2,}", line.strip()) for line in out[at + 1:]]
    # Fastest first, equal figures on one line: ZB-H2 (CP-SAT too when it ran), then the
    # chosen line (marked >) with ZB-1P and ZB-H1; 1F1B and GPipe are dominated.
    assert [r[-4:-1] for r in rows] == [["129 s", "+0.0%", "3"], ["130 s", "+0.8%", "2"]]
    assert "zb-h2" in rows[0][-1] and rows[1] == [">", "130 s", "+0.8%", "2", "zb-1p, zb-h1"]
    assert "1f1b" not in "".join(out[at:]) and "gpipe" not in "".join(out[at:])
    assert main(["solve", str(cfg), "--json"]) == 0
    front = json.loads(capsys.readouterr().out)["pareto"]
    assert {(r["method"], r["iteration_time"], r["peak_memory"], r["chosen"])
            for r in front if not r["method"].startswith("cpsat")} == {
        ("zb-h2", 129.0, 3.0, False), ("zb-1p", 130.0, 2.0, False),
        ("zb-h1", 130.0, 2.0, True)}

    assert main(["compare", str(cfg), "--methods", "gpipe,1f1b,zb-h1,zb-h2", "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["fits", "pareto", "status"]
    table = {line.split()[0]: line.split()[-2] for line in lines[2:]}
    assert table == {"zb-h2": "yes", "zb-h1": "yes", "1f1b": "no", "gpipe": "no"}
    assert main(["compare", str(cfg), "--methods", "gpipe,1f1b,zb-h1,zb-h2", "--json"]) == 0
    assert {r["method"]: r["pareto"] for r in json.loads(capsys.readouterr().out)} == {
        "zb-h2": True, "zb-h1": True, "1f1b": False, "gpipe": False}
    # A row over the memory limits is no candidate: "-", never on the set.
    cfg.write_text(TRADEOFF_YAML.replace("activation_memory: 1.0}",
                                         "activation_memory: 1.0}\nmemory: {limit: 2.5}")
                   % "")
    assert main(["compare", str(cfg), "--methods", "gpipe,zb-h1,zb-h2", "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split()[-2] for line in lines[2:]}
    assert table == {"zb-h1": "yes", "zb-h2": "-", "gpipe": "-"}
