"""The README's claims stay true: its Python example runs, and the cross-datacenter table and
the quick-start output are what the code prints today."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipeopt.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block(after: str, lang: str = "") -> str:
    """The first fenced block of language ``lang`` after the text ``after``."""
    start = README.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, start)
    assert m is not None, f"no ``` block after {after!r}"
    return m.group(1)


def test_first_two_commands_are_install_and_test() -> None:
    lines = _block("# pipeopt", "bash").strip().splitlines()
    assert lines == ["pip install -e '.[dev,torch]' && pipeopt solve examples/uniform.yaml "
                     "-o schedule.json", "python -m pytest"]


def test_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    exec(compile(_block("## Python API", "python"), "README.md", "exec"), {"__name__": "_r"})
    assert (tmp_path / "zb-h1.json").exists()


def test_quick_start_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = README.index("$ pipeopt solve examples/uniform.yaml")
    shown = README[start:README.index("```", start)]
    assert main(["solve", str(ROOT / "examples/uniform.yaml"), "-o", str(tmp_path / "s.json"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    for key in ("status", "makespan", "bubble ratio", "peak memory"):
        want = next(line for line in shown.splitlines() if line.startswith(key))
        got = next(line for line in out.splitlines() if line.startswith(key))
        assert got == want
    assert "written" in out


def test_cross_datacenter_table(capsys: pytest.CaptureFixture[str]) -> None:
    table = _block("`pipeopt compare examples/cross_dc.yaml`")
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.strip().splitlines()[2:]]
    shown = {r[0]: (float(r[1]), r[5]) for r in rows}
    assert main(["compare", str(ROOT / "examples/cross_dc.yaml"), "--json"]) == 0
    got = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(shown) <= set(got)
    assert re.split(r"\s{2,}", table.strip().splitlines()[0])[1] == "iteration time"
    for method, (iteration, fits) in shown.items():
        assert got[method]["iteration_time"] == pytest.approx(iteration, abs=1e-3), method
        assert got[method]["fits"] == (fits == "yes"), method


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_bundled_example_solves(example: str, tmp_path: Path) -> None:
    """Each config in examples/ loads and gets a valid schedule (greedy: fast everywhere)."""
    from pipeopt.io import load_schedule

    out = tmp_path / "s.json"
    if example.startswith("plan_"):  # a plan config (pipeopt plan): tests/test_plan.py
        from pipeopt.plan import load_plan

        assert load_plan(ROOT / "examples" / example).global_batch_size > 0
        return
    if example.startswith("inference"):  # a serving config: its own method and result JSON
        assert main(["solve", str(ROOT / "examples" / example), "-q", "-o", str(out)]) == 0
        assert json.loads(out.read_text())["metrics"]["throughput_tokens_per_s"] > 0
        return
    if example == "moe.yaml":  # a task-graph workload: schedule JSON v2 (docs/moe.md)
        from pipeopt.graphio import load_any

        assert main(["solve", str(ROOT / "examples" / example), "--method", "zb-h1", "-q",
                     "-o", str(out)]) == 0
        assert load_any(out).objective > 0  # load_any validates it again
        return
    if "mode: async" in (ROOT / "examples" / example).read_text(encoding="utf-8"):
        # An asynchronous pipeline: its periodic search, and its own document checked again.
        from pipeopt.schedules.periodic import check_periodic
        from pipeopt.workloads.periodic import PeriodicSchedule

        assert main(["solve", str(ROOT / "examples" / example), "--method", "periodic", "-q",
                     "-o", str(out)]) == 0
        periodic = PeriodicSchedule.from_dict(json.loads(out.read_text()))
        assert periodic.period > 0 and check_periodic(periodic) == []
        return
    assert main(["solve", str(ROOT / "examples" / example), "--method", "greedy", "-q",
                 "-o", str(out)]) == 0
    from pipeopt.config import read_yaml
    from pipeopt.graph_config import graph_loader

    if graph_loader(read_yaml(ROOT / "examples" / example)) is not None:
        # A task-graph config (scheduled collectives): schedule JSON v2, validated on reading.
        from pipeopt.graphio import load_any

        assert load_any(out).makespan > 0
        return
    assert load_schedule(out).makespan > 0  # load_schedule validates it again


def test_data_parallel_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's data-parallel table and the synchronous figures under it."""
    from pipeopt.config import read_yaml
    from pipeopt.graph_config import load_graph_config
    from pipeopt.solvers.graph import compare_graph

    after = "`pipeopt compare examples/dp_cross_dc.yaml --methods"
    methods = README[README.index(after):].split("--methods ", 1)[1].split("`", 1)[0]
    table = _block(after)
    shown = {}
    for line in table.strip().splitlines()[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 6:
            shown[cells[0]] = float(cells[1])
    assert main(["compare", str(ROOT / "examples/dp_cross_dc.yaml"), "--methods", methods,
                 "--json", "-q"]) == 0
    got = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(shown) == set(got)
    for method, value in shown.items():
        assert got[method]["iteration_time"] == pytest.approx(value, abs=1e-4), method
    data = read_yaml(ROOT / "examples/dp_cross_dc.yaml")
    sync = load_graph_config({**data, "training": {**data["training"],
                                                    "delayed_reduction": False}})
    rows = {r.method: r.value for r in compare_graph(sync.work, ["1f1b", "zb-h1"])}
    text = README[README.index("With `delayed_reduction: false`"):]
    assert f"1F1B takes {rows['1f1b']:.3f} s and ZB-H1 {rows['zb-h1']:.3f} s" in text
