"""Gantt plots: valid PNGs of the expected pixel size, sensible content, CLI and compare."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.image import imread

import pipeopt.plot as plot_mod
from pipeopt.cli import main
from pipeopt.io import dump_schedule
from pipeopt.plot import (
    compare_figure_size,
    figure_size,
    plot_compare,
    plot_schedule,
    render_schedule,
)
from pipeopt.problem import uniform_problem
from pipeopt.solvers import run_classic
from tests.strategies import SAMPLE_SCHEDULES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


SCHEDULES = SAMPLE_SCHEDULES


def _png_shape(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = imread(path)
    return img.shape[0], img.shape[1]


def _expected(size: tuple[float, float], dpi: float) -> tuple[int, int]:
    # Matplotlib's Agg canvas truncates inches * dpi to whole pixels.
    w, h = size
    return int(h * dpi), int(w * dpi)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("show_memory", [True, False])
def test_plot_schedule_png(tmp_path: Path, name: str, show_memory: bool) -> None:
    sched = SCHEDULES[name]()
    out = tmp_path / "sub" / f"{name}.png"
    written = plot_schedule(sched, out, show_memory=show_memory, dpi=60)
    assert written == out and out.exists()
    assert _png_shape(out) == _expected(figure_size(sched, show_memory), 60)
    assert not list(out.parent.glob(".*.tmp"))  # the temporary file was renamed away


def test_figure_content() -> None:
    sched = SCHEDULES["contended"]()
    fig = render_schedule(sched)
    gantt, memory = fig.axes
    assert gantt.get_title(loc="left").startswith("zb-h1")
    assert f"{sched.bubble_ratio:.1%}" in gantt.get_title(loc="left")
    # Every op is one box (plus one idle band per device and the link-busy bars).
    polys = [c for c in gantt.collections if isinstance(c, PolyCollection)]
    counts = sorted(len(c.get_paths()) for c in polys)
    assert len(sched.ops) in counts
    assert sched.problem.devices in counts
    assert len(sched.messages) in counts
    assert any(isinstance(c, LineCollection) for c in gantt.collections)
    # Micro-batch labels fit at this size: one per op.
    labels = [t.get_text() for t in gantt.texts]
    assert sorted(labels) == sorted(str(o.microbatch) for o in sched.ops)
    # The memory limit is drawn dashed, one line per device.
    dashed = [ln for ln in memory.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == sched.problem.devices
    assert gantt.get_xlim()[1] >= sched.makespan


def test_large_pipeline_drops_labels(tmp_path: Path) -> None:
    sched = run_classic(uniform_problem(32, 128), "1f1b")
    fig = render_schedule(sched)
    assert len(fig.axes[0].texts) == 0  # boxes are a few pixels wide: no labels
    w, h = figure_size(sched)
    assert w <= 24 and h <= 20  # still a page, not a poster
    out = tmp_path / "big.png"
    plot_schedule(sched, out, dpi=40)
    assert _png_shape(out) == _expected((w, h), 40)


def test_custom_size_and_title(tmp_path: Path) -> None:
    sched = SCHEDULES["1f1b"]()
    out = tmp_path / "c.png"
    plot_schedule(sched, out, figsize=(6.0, 4.0), dpi=50, title="my title")
    assert _png_shape(out) == (200, 300)
    assert render_schedule(sched, title="my title").axes[0].get_title(loc="left") == "my title"


def test_overwrite_is_atomic(tmp_path: Path) -> None:
    sched = SCHEDULES["1f1b"]()
    out = tmp_path / "a.png"
    out.write_bytes(b"old")
    plot_schedule(sched, out, dpi=30)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_no_pyplot() -> None:
    # Global pyplot state would leak figures between calls in a long-running process.
    src = Path(plot_mod.__file__).read_text()
    assert "import pyplot" not in src and "matplotlib.pyplot" not in src


def test_plot_compare(tmp_path: Path) -> None:
    scheds = [SCHEDULES[n]() for n in ("1f1b", "zb-v", "latency")]
    out = tmp_path / "cmp.png"
    plot_compare(scheds, out, dpi=50)
    assert _png_shape(out) == _expected(compare_figure_size(scheds), 50)


def test_plot_compare_empty(tmp_path: Path) -> None:
    from pipeopt.simulate import ScheduleError

    with pytest.raises(ScheduleError, match="no schedule"):
        plot_compare([], tmp_path / "x.png")


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sched = SCHEDULES["zb-v"]()
    src = tmp_path / "s.json"
    dump_schedule(sched, src)
    out = tmp_path / "s-plot.png"
    assert main(["plot", str(src), "-o", str(out), "--dpi", "40"]) == 0
    assert _png_shape(out) == _expected(figure_size(sched, True), 40)
    assert str(out) in capsys.readouterr().out
    assert main(["plot", str(src), "--no-memory", "--dpi", "40"]) == 0
    assert _png_shape(tmp_path / "s.png") == _expected(figure_size(sched, False), 40)


def test_cli_plot_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = tmp_path / "o.png"
    assert main(["plot", str(bad), "-o", str(out)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert not out.exists()


def test_cli_compare_plot(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline: {devices: 3, microbatches: 4}\n"
                   "stages: {forward: 1.0, backward_input: 1.0, backward_weight: 1.0}\n")
    out = tmp_path / "compare.png"
    assert main(["compare", str(cfg), "--methods", "1f1b,zb-h1,zb-v", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("plot", "trace"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert f"Example: pipeopt {cmd}" in capsys.readouterr().out
