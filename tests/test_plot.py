"""Gantt plots: valid PNGs of the expected pixel size, sensible content, CLI and compare."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import to_hex
from matplotlib.image import imread
from matplotlib.text import Text

import pipeopt
import pipeopt.plot as plot_mod
from pipeopt.cli import main
from pipeopt.io import dump_schedule
from pipeopt.plot import (
    compare_figure_size,
    figure_size,
    plot_compare,
    plot_schedule,
    render_compare,
    render_schedule,
)
from pipeopt.problem import chain_links, uniform_problem
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
    # The memory limit is drawn dashed, one line per device (one collection for them all).
    dashed = [seg for c in memory.collections if isinstance(c, LineCollection)
              and c.get_linestyle()[0][1] for seg in c.get_segments()]
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


# ----- compare: fits, ratios, legend ---------------------------------------------------------
def _titles(fig) -> list[str]:
    return [ax.get_title(loc="left") for ax in fig.axes]


def test_compare_ratio_against_best_fitting() -> None:
    prob = uniform_problem(4, 8)
    fast, slow = run_classic(prob, "zb-h1"), run_classic(prob, "1f1b")
    assert fast.makespan < slow.makespan
    # The faster schedule does not fit: "of best" is relative to the slower one, which fits.
    fig = render_compare([slow, fast], fits=[True, False])
    t_slow, t_fast = _titles(fig)
    assert "x1.000 of best" in t_slow and "OVER MEMORY LIMIT" not in t_slow
    assert f"x{fast.makespan / slow.makespan:.3f} of best" in t_fast
    assert "OVER MEMORY LIMIT" in t_fast
    colors = [next(to_hex(t.get_color()) for t in ax.get_children()
                   if isinstance(t, Text) and t.get_text() == ax.get_title(loc="left"))
              for ax in fig.axes]
    assert colors == [to_hex("black"), to_hex(plot_mod.LIMIT_COLOR)]
    # Without fits every schedule fits: the best of all is the reference.
    t_slow, t_fast = _titles(render_compare([slow, fast]))
    assert f"x{slow.makespan / fast.makespan:.3f} of best" in t_slow
    assert "x1.000 of best" in t_fast and "OVER" not in t_fast + t_slow
    # Nothing fits: no ratio at all.
    assert not any("of best" in t for t in _titles(render_compare([slow, fast],
                                                                  fits=[False, False])))
    with pytest.raises(ValueError, match="fits"):
        render_compare([slow, fast], fits=[True])


def test_compare_over_limit_names_device() -> None:
    prob = uniform_problem(4, 8, memory_limit=5.0)
    gpipe = run_classic(prob, "gpipe")  # all 8 micro-batches in flight on device 0
    fig = render_compare([gpipe], fits=[False])
    assert "OVER MEMORY LIMIT: dev 0 peaks at 8 > 5" in _titles(fig)[0]


def test_compare_shared_legend(tmp_path: Path) -> None:
    scheds = [SCHEDULES[n]() for n in ("zb-h2", "zb-v", "latency")]
    fig = render_compare(scheds)
    assert len(fig.legends) == 1  # once, at the top: not one per schedule
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:4] == ["F: forward", "B: backward (input)", "W: backward (weight)",
                          "idle (bubble)"]
    assert "message delay" in labels  # "latency" has delay lines
    assert not any(ax.get_legend() for ax in fig.axes)


def _b_label(fig) -> str:
    return next(t.get_text() for t in fig.legends[0].get_texts()
                if t.get_text().startswith("B:"))


def test_compare_legend_names_fused_backward() -> None:
    split, fused = SCHEDULES["zb-h2"](), SCHEDULES["1f1b"]()  # 1f1b runs fused
    assert split.problem.split_backward and not fused.problem.split_backward
    # Mixed: orange is the input gradient in split rows, the whole backward in fused ones.
    assert _b_label(render_compare([split, fused])) == (
        "B: backward (input; the whole backward where fused)")
    assert _b_label(render_compare([split, SCHEDULES["zb-v"]()])) == "B: backward (input)"
    assert _b_label(render_compare([fused, SCHEDULES["gpipe-fused"]()])) == "B: backward"


def test_compare_rows_keep_a_minimum_height() -> None:
    sched = run_classic(uniform_problem(32, 16), "1f1b")
    rows = plot_mod._compare_rows_heights([sched] * 15)
    assert all(r >= 0.08 * 32 - 1e-9 for r in rows)  # 8 px per device row at 100 dpi
    # A page of many tall pipelines squeezes them to stay drawable at 100 dpi.
    big = run_classic(uniform_problem(128, 4), "1f1b")
    _, h = compare_figure_size([big] * 15)
    assert h <= 151 and h * 100 <= plot_mod.MAX_SIDE_PX


# ----- dense schedules: no stripes -----------------------------------------------------------
def test_dense_rows_drawn_as_averaged_images() -> None:
    sched = run_classic(uniform_problem(16, 512), "1f1b")
    gantt = render_schedule(sched).axes[0]
    # Boxes of a pixel or two: one image per device row instead of a polygon per op.
    assert len(gantt.images) == 16
    polys = [c for c in gantt.collections if isinstance(c, PolyCollection)]
    assert all(len(c.get_paths()) != len(sched.ops) for c in polys)
    img = gantt.images[0].get_array()
    assert img.shape[0] == 1 and img.shape[2] == 4
    assert float(img[..., :3].min()) >= 0.0 and float(img[..., :3].max()) <= 1.0
    # Pixels average what is under them: a stretch of the row has the time-weighted mean
    # colour of the ops in it (polygons would let the last-drawn op win each pixel).
    n = img.shape[1]
    xmax = sched.makespan * 1.005
    i0, i1 = n // 2 - 100, n // 2 + 100
    t0, t1 = i0 * xmax / n, i1 * xmax / n
    want = [0.0, 0.0, 0.0]
    for o in sched.ops:
        if o.device == 0:
            part = max(0.0, min(o.end, t1) - max(o.start, t0))
            for c in range(3):
                want[c] += plot_mod._shade(o.kind, o.microbatch, 512)[c] * part / (t1 - t0)
    got = img[0, i0:i1, :3].mean(axis=0)
    assert [float(x) for x in got] == pytest.approx(want, abs=0.01)


def test_narrow_boxes_have_no_edges() -> None:
    assert plot_mod._box_edges([10.0, 2.0, 0.0], 20.0) == ["white", "none", "none"]
    assert plot_mod._box_edges([10.0], 4.0) == ["none"]  # rows too thin for edges
    sched = SCHEDULES["contended"]()
    gantt = render_schedule(sched).axes[0]
    boxes = next(c for c in gantt.collections
                 if isinstance(c, PolyCollection) and len(c.get_paths()) == len(sched.ops))
    assert len(boxes.get_edgecolors()) == len(sched.ops)


# ----- labels and datacenters ----------------------------------------------------------------
def _op_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.texts if t.get_text().isdigit()]


def test_labels_follow_one_rule() -> None:
    from pipeopt.config import load_config

    root = Path(__file__).resolve().parents[1]
    prob = load_config(root / "examples" / "cross_dc.yaml").problem
    sched = run_classic(prob, "zb-h1")
    fig = render_schedule(sched)
    gantt = fig.axes[0]
    by_pos = {(round(t.get_position()[0], 9), round(t.get_position()[1]))
              for t in gantt.texts if t.get_text().isdigit()}
    # Boxes of one duration are all labelled or none, whatever their micro-batch's digits.
    groups: dict[float, set[bool]] = {}
    for o in sched.ops:
        key = round(o.end - o.start, 9)
        groups.setdefault(key, set()).add(
            (round((o.start + o.end) / 2, 9), o.device) in by_pos)
    assert all(len(v) == 1 for v in groups.values())
    labels = _op_labels(gantt)
    assert "9" in labels and "15" in labels  # one and two digits alike


def test_datacenter_boundary() -> None:
    devices = [{"device": d, "datacenter": d // 2, "gpu": f"dc{d // 2}/g{d}"} for d in range(4)]
    prob = uniform_problem(4, 4).replace(meta=(("devices", devices),))
    fig = render_schedule(run_classic(prob, "1f1b"))
    gantt, memory = fig.axes
    hlines = [ln for ln in gantt.get_lines() if list(ln.get_ydata()) == [1.5, 1.5]]
    assert len(hlines) == 1  # between devices 1 and 2
    assert {"dc0", "dc1"} <= {t.get_text() for t in gantt.texts}
    assert any(list(ln.get_ydata()) == [-1.5, -1.5] for ln in memory.get_lines())
    labels = [t.get_text() for t in gantt.get_legend().get_texts()]
    assert "datacenter boundary" in labels
    # Without datacenter info (or a single datacenter): no boundary, no legend entry.
    for p in (uniform_problem(4, 4),
              uniform_problem(4, 4).replace(meta=(("devices", [{"datacenter": 0}] * 4),))):
        ax = render_schedule(run_classic(p, "1f1b")).axes[0]
        assert "datacenter boundary" not in [t.get_text() for t in ax.get_legend().get_texts()]
        assert not [t for t in ax.texts if t.get_text().startswith("dc")]


# ----- delay lines ---------------------------------------------------------------------------
def _legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_delay_legend_absent_when_no_line_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = SCHEDULES["latency"]()  # every link has the same latency: no slowest subset
    fig = render_schedule(sched)
    assert "message delay" in _legend_labels(fig)
    monkeypatch.setattr(plot_mod, "_MAX_DELAY_LINES", 5)
    fig = render_schedule(sched)
    assert not any(isinstance(c, LineCollection) for c in fig.axes[0].collections)
    assert not any(lab.startswith("message delay") for lab in _legend_labels(fig))
    assert any("message delay lines not drawn" in t.get_text() for t in fig.texts)
    # No latency at all: no entry and no note.
    fig = render_schedule(SCHEDULES["1f1b"]())
    assert not any(lab.startswith("message delay") for lab in _legend_labels(fig))
    assert not fig.texts


def test_delay_lines_keep_the_slowest_links(monkeypatch: pytest.MonkeyPatch) -> None:
    lat, bw = chain_links(4, [0.1, 0.5, 0.1], [math.inf] * 3)
    sched = run_classic(uniform_problem(4, 8).replace(latency=lat, bandwidth=bw), "1f1b")
    monkeypatch.setattr(plot_mod, "_MAX_DELAY_LINES", 20)  # of 3 links x 2 ways x 8 = 48
    fig = render_schedule(sched)
    (lines,) = [c for c in fig.axes[0].collections if isinstance(c, LineCollection)]
    segs = lines.get_segments()
    assert len(segs) == 16  # both ways of the slow link between devices 1 and 2
    assert all({round(seg[0][1]), round(seg[-1][1])} == {1, 2} for seg in segs)
    assert "message delay (slowest links only; 32 more not drawn)" in _legend_labels(fig)
    assert not fig.texts


# ----- dpi and formats -----------------------------------------------------------------------
def test_dpi_cap() -> None:
    from pipeopt.config import ConfigError

    sched = SCHEDULES["1f1b"]()
    size = figure_size(sched)
    top = plot_mod.max_dpi(size)
    assert max(size) * top <= plot_mod.MAX_SIDE_PX < max(size) * (top + 1)
    plot_mod.check_dpi(size, top)
    with pytest.raises(ConfigError, match=rf"^--dpi: .*largest dpi for this .* is {top} "):
        render_schedule(sched, dpi=1e6)
    with pytest.raises(ConfigError, match="--dpi"):
        plot_mod.check_dpi(size, top + 1)
    with pytest.raises(ConfigError, match="dpi"):
        render_compare([sched], dpi=10000)
    with pytest.raises(ValueError, match="--dpi"):  # a ConfigError is a ValueError
        plot_schedule(sched, "never.png", dpi=0)


def test_cli_plot_dpi_too_large(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "s.json"
    dump_schedule(SCHEDULES["1f1b"](), src)
    out = tmp_path / "o.png"
    assert main(["plot", str(src), "-o", str(out), "--dpi", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "--dpi" in err and "largest dpi" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF-"),
                                               (".PNG", PNG_MAGIC)])
def test_format_from_suffix(tmp_path: Path, suffix: str, magic: bytes) -> None:
    sched = SCHEDULES["zb-v"]()
    out = tmp_path / f"s{suffix}"
    plot_schedule(sched, out, dpi=40)
    data = out.read_bytes()
    assert data.startswith(magic)
    if suffix == ".svg":
        assert b"<svg" in data[:2000]
    cmp = tmp_path / f"c{suffix}"
    plot_compare([sched, SCHEDULES["1f1b"]()], cmp, dpi=40)
    assert cmp.read_bytes().startswith(magic)


def test_unknown_suffix_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeopt.config import ConfigError

    sched = SCHEDULES["1f1b"]()
    for name in ("x.jpg", "x"):
        with pytest.raises(ConfigError, match=r"\.png, \*\.svg or \*\.pdf"):
            plot_schedule(sched, tmp_path / name)
        assert not (tmp_path / name).exists()
    with pytest.raises(ConfigError, match="png"):
        plot_compare([sched], tmp_path / "c.gif")
    src = tmp_path / "s.json"
    dump_schedule(sched, src)
    assert main(["plot", str(src), "-o", str(tmp_path / "o.jpg")]) == 2
    assert "--output" in capsys.readouterr().err
    assert not (tmp_path / "o.jpg").exists()


# ----- compare titles fit the figure ---------------------------------------------------------
def _left_title(ax) -> Text:
    return next(t for t in ax.get_children()
                if isinstance(t, Text) and t.get_text() == ax.get_title(loc="left"))


def _long_title_schedules() -> tuple[list, list[bool]]:
    """The longest titles of the reported compare plot (examples/uniform.yaml): long method
    names, v=2 shapes and the red over-limit note, plus one name no line can hold."""
    from dataclasses import replace

    prob = uniform_problem(4, 8, memory_limit=4.0)
    chunked = uniform_problem(4, 8, virtual_stages=2, memory_limit=4.0)
    scheds = [
        run_classic(prob, "zb-h1"),
        replace(run_classic(chunked, "interleaved-1f1b"), method="torch:Interleaved1F1B"),
        replace(run_classic(chunked, "interleaved-1f1b"), method="torch:InterleavedZeroBubble"),
        run_classic(prob, "gpipe"),
        replace(run_classic(prob, "zb-h2"), method="a-search-method-with-a-long-name:" * 3),
    ]
    return scheds, [True, False, True, False, False]


@pytest.mark.parametrize("dpi", [50, 100, 200])
def test_compare_titles_fit_the_figure(dpi: int) -> None:
    scheds, fits = _long_title_schedules()
    fig = render_compare(scheds, fits=fits, dpi=dpi)
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width
    titles = [_left_title(ax) for ax in fig.axes]
    for t in titles:
        assert t.get_window_extent(renderer).x1 <= width, t.get_text()
    # One font for all, never under 7 points.
    assert len({t.get_fontsize() for t in titles}) == 1 and titles[0].get_fontsize() >= 7
    # Over the limit: the note is the title's own line, and the title does not reach up into
    # the chart above (its room was reserved).
    lines = [t.get_text().split("\n") for t in titles]
    assert len(lines[0]) == 1 and len(lines[2]) == 1
    assert lines[1][-1].startswith("OVER MEMORY LIMIT: dev 0 peaks at")
    assert lines[3][-1] == "OVER MEMORY LIMIT: dev 0 peaks at 8 > 4"
    assert len(lines[4]) >= 3  # the long name is wrapped at its parts, then the note
    fig.canvas.draw()
    for above, ax, t in zip(fig.axes, fig.axes[1:], titles[1:], strict=False):
        top = t.get_window_extent(renderer).y1
        ticks = above.get_tightbbox(renderer)  # the chart above and its tick labels
        assert top < ticks.y0, _left_title(ax).get_text()
    w, h = compare_figure_size(scheds, fits)
    assert (fig.get_figwidth(), fig.get_figheight()) == (w, h)
    assert h > compare_figure_size(scheds)[1]  # the notes' lines take room


def test_single_plot_title_fits() -> None:
    from dataclasses import replace

    sched = replace(SCHEDULES["zb-v"](), method="a-search-method-with-a-long-name:" * 2)
    fig = render_schedule(sched, dpi=80)
    t = _left_title(fig.axes[0])
    assert t.get_window_extent(fig.canvas.get_renderer()).x1 <= fig.bbox.width


# ----- gradient reduction --------------------------------------------------------------------
def _reduce_problem(split_backward: bool = True):
    # pipeline {devices: 4, microbatches: 4}, stages {forward: 1, backward_input: 1,
    # backward_weight: 1, grad_reduce: [6, 1, 1, 1]}
    return uniform_problem(4, 4, split_backward=split_backward).replace(
        grad_reduce=(6.0, 1.0, 1.0, 1.0))


def _hatched(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection) and c.get_hatch()]


def test_grad_reduce_drawn_after_last_w(tmp_path: Path) -> None:
    from pipeopt.config import load_config

    cfg = tmp_path / "gr.yaml"
    cfg.write_text("pipeline: {devices: 4, microbatches: 4}\n"
                   "stages: {forward: 1, backward_input: 1, backward_weight: 1, "
                   "grad_reduce: [6, 1, 1, 1]}\n")
    prob = load_config(cfg).problem
    assert prob.grad_reduce == (6.0, 1.0, 1.0, 1.0)
    sched = run_classic(prob, "zb-h1")
    assert sched.iteration_time > sched.makespan
    fig = render_schedule(sched)
    gantt, memory = fig.axes
    (bars,) = _hatched(gantt)
    boxes = sorted((float(pth.vertices[:, 0].min()), float(pth.vertices[:, 0].max()),
                    round(float(pth.vertices[:, 1].mean())))
                   for pth in bars.get_paths())
    want = []
    for k, red in enumerate(prob.grad_reduce):
        last = max((o for o in sched.ops if o.kind == "W" and o.stage == k), key=lambda o: o.end)
        want.append((last.end, last.end + red, last.device))
    assert len(boxes) == len(want)
    for got, exp in zip(boxes, sorted(want), strict=True):  # approx takes flat sequences only
        assert got == pytest.approx(exp)
    # The axis reaches the iteration time, which the title gives.
    assert gantt.get_xlim()[1] >= sched.iteration_time
    assert memory.get_xlim()[1] >= sched.iteration_time
    title = gantt.get_title(loc="left")
    assert f"makespan {sched.makespan:.4g} s   iteration {sched.iteration_time:.4g} s" in title
    assert "gradient all-reduce" in _legend_labels(fig)
    # Fused backward: the reduction follows the last B.
    fused = run_classic(_reduce_problem(False), "1f1b")
    (bars,) = _hatched(render_schedule(fused).axes[0])
    ends = sorted(float(pth.vertices[:, 0].min()) for pth in bars.get_paths())
    assert ends == pytest.approx(sorted(
        max(o.end for o in fused.ops if o.kind == "B" and o.stage == k) for k in range(4)))
    # Without a reduction: no bar, no entry, no iteration time in the title.
    plain = render_schedule(SCHEDULES["zb-h2"]())
    assert not _hatched(plain.axes[0])
    assert "gradient all-reduce" not in _legend_labels(plain)
    assert "iteration" not in plain.axes[0].get_title(loc="left")


def test_grad_reduce_in_compare() -> None:
    prob = _reduce_problem()
    scheds = [run_classic(prob, "zb-h1"), run_classic(prob, "1f1b")]
    fig = render_compare(scheds)
    assert fig.axes[0].get_xlim()[1] >= max(s.iteration_time for s in scheds)
    assert all(_hatched(ax) for ax in fig.axes)
    assert "gradient all-reduce" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert all("iteration " in ax.get_title(loc="left") for ax in fig.axes)
    # A dense schedule (rows drawn as images) shows its reductions too, over the image.
    dense = uniform_problem(16, 512).replace(grad_reduce=(50.0,) * 16)
    gantt = render_schedule(run_classic(dense, "1f1b")).axes[0]
    assert gantt.images and _hatched(gantt)


# ----- zero-length ops -----------------------------------------------------------------------
def test_zero_length_ops_are_ticks() -> None:
    prob = uniform_problem(4, 8).replace(backward_input=(0.0, 1.0, 1.0, 1.0))
    sched = run_classic(prob, "zb-h1")
    zero = [o for o in sched.ops if o.end <= o.start]
    assert len(zero) == 8 and {o.kind for o in zero} == {"B"}
    fig = render_schedule(sched)
    gantt = fig.axes[0]
    ticks = [c for c in gantt.collections if isinstance(c, LineCollection)
             and len(c.get_segments()) == len(zero)
             and all(seg[0][0] == seg[-1][0] for seg in c.get_segments())]
    assert len(ticks) == 1
    segs = ticks[0].get_segments()
    assert sorted((seg[0][0], round(seg[0][1] + plot_mod._HALF)) for seg in segs) == sorted(
        (o.start, o.device) for o in zero)
    assert all(abs(seg[1][1] - seg[0][1]) == pytest.approx(2 * plot_mod._HALF) for seg in segs)
    # In B's colours (orange: more red than blue), at least 1.5 px wide.
    assert all(r > b for r, _, b, _ in ticks[0].get_colors())
    assert ticks[0].get_linewidths()[0] * fig.dpi / 72 >= 1.5
    assert "zero-length B (tick)" in _legend_labels(fig)
    # Zero-length ops do not make the labels smaller: the same font as without them.
    nonzero = render_schedule(run_classic(uniform_problem(4, 8), "zb-h1")).axes[0]
    assert {t.get_fontsize() for t in gantt.texts} == {t.get_fontsize() for t in nonzero.texts}
    assert "zero-length B (tick)" not in _legend_labels(render_schedule(SCHEDULES["zb-h2"]()))


# ----- low dpi: no blobs ---------------------------------------------------------------------
def _px(t: Text, dpi: float) -> float:
    return t.get_fontsize() * dpi / 72


@pytest.mark.parametrize("dpi", [20, 30, 50, 72, 100])
def test_low_dpi_drops_or_grows_small_text(dpi: int) -> None:
    sched = SCHEDULES["zb-h2"]()
    fig = render_schedule(sched, dpi=dpi)
    gantt, memory = fig.axes
    labels = _op_labels(gantt)
    font = max((t.get_fontsize() for t in gantt.texts if t.get_text().isdigit()), default=0)
    if labels:
        assert font * dpi / 72 >= 6
    for ax in (gantt, memory):
        ticks = [t for t in ax.get_yticklabels() if t.get_text()]
        assert all(_px(t, dpi) >= 6 - 1e-9 for t in ticks)
        assert all(_px(t, dpi) >= 6 - 1e-9 for t in ax.texts)  # peaks, datacenters
    peaks = [t for t in memory.texts if "peak" in t.get_text()]
    if dpi >= 72:
        assert len(labels) == len(sched.ops)  # labelled as before
        assert len(peaks) == sched.problem.devices
        assert all(t.get_text() for t in gantt.get_yticklabels())
    if dpi == 50:
        assert not labels  # 5 to 7 points are 3.5 to 4.9 pixels: no numbers
        assert all(t.get_text() for t in gantt.get_yticklabels())  # "dev d" still fits
    # Labels that are drawn stay inside the margins.
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for t in [*peaks, *(t for t in gantt.get_yticklabels() if t.get_text())]:
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width


# ----- delay-line geometry -------------------------------------------------------------------
def test_delay_lines_leave_towards_the_receiver_and_wrap_around() -> None:
    prob = uniform_problem(4, 8, virtual_stages=2, latency=0.3)
    sched = run_classic(prob, "interleaved-1f1b")
    p, half = prob.devices, plot_mod._HALF
    (lines,) = [c for c in render_schedule(sched).axes[0].collections
                if isinstance(c, LineCollection)]
    segs = [[tuple(pt) for pt in seg] for seg in lines.get_segments()]
    # No line crosses a row: wrap-around lines (device 3 <-> 0) leave past the chart's edge.
    assert all(abs(seg[-1][1] - seg[0][1]) <= 1.0 for seg in segs)
    wraps = [seg for seg in segs if seg[-1][1] in (-0.5, p - 0.5) or seg[0][1] in (-0.5, p - 0.5)]
    assert wraps
    for src, dst in ((p - 1, 0), (0, p - 1)):
        pieces = plot_mod._delay_line(p, src, 1.0, dst, 2.0)
        assert len(pieces) == 2
        (out_a, out_b), (in_a, in_b) = pieces
        assert out_a == (1.0, src + (half if src == p - 1 else -half))
        assert out_b[1] == (p - 0.5 if src == p - 1 else -0.5)
        assert in_a[1] == (-0.5 if src == p - 1 else p - 0.5) and in_b == (2.0, dst)
    # Upward lines leave from the top edge of the sender's row, downward ones from the bottom.
    assert plot_mod._delay_line(p, 2, 1.0, 1, 2.0) == [[(1.0, 2 - half), (2.0, 1)]]
    assert plot_mod._delay_line(p, 1, 1.0, 2, 2.0) == [[(1.0, 1 + half), (2.0, 2)]]
    assert plot_mod._delay_line(2, 1, 1.0, 0, 2.0) == [[(1.0, 1 - half), (2.0, 0)]]


# ----- the documented maximum of devices (issue 18 item 8) --------------------------------------
def _pipeline_1024() -> pipeopt.Schedule:
    return run_classic(uniform_problem(1024, 1), "gpipe")


def test_1024_devices_fit_the_default_dpi() -> None:
    """Before: 0.3 inch per device row plus a memory band made a 434-inch figure, 43,400
    pixels at the default 100 dpi, which check_dpi refused."""
    from pipeopt.core.greedy import solve_greedy
    from pipeopt.plot import DEFAULT_DPI, MAX_FIGURE_IN, check_dpi, graph_figure_size
    from pipeopt.views_cli import DEFAULT_DPI as CLI_DPI
    from pipeopt.workloads import training

    assert CLI_DPI == DEFAULT_DPI
    sched = _pipeline_1024()
    size = figure_size(sched)
    assert size[1] == MAX_FIGURE_IN == plot_mod.MAX_SIDE_PX / DEFAULT_DPI
    check_dpi(size, DEFAULT_DPI)
    graph = solve_greedy(training.build(sched.problem))
    assert graph_figure_size(graph)[1] == MAX_FIGURE_IN
    check_dpi(graph_figure_size(graph), DEFAULT_DPI)
    assert figure_size(run_classic(uniform_problem(64, 4), "gpipe"))[1] < MAX_FIGURE_IN


@pytest.mark.slow
def test_1024_device_plot_at_the_default_dpi(tmp_path: Path) -> None:
    path = tmp_path / "p1024.json"
    dump_schedule(_pipeline_1024(), path)
    assert main(["plot", str(path)]) == 0  # about 30 s on two cores
    w, h = figure_size(_pipeline_1024())
    assert imread(tmp_path / "p1024.png").shape[:2] == (int(h * 100), int(w * 100)) == (
        20000, 2400)
