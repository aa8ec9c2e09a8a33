"""Gantt charts of schedules (matplotlib, Agg backend, no pyplot state).

:func:`plot_schedule` draws one schedule: a row per device with its F / B / W ops coloured by
kind and shaded by micro-batch, idle time (bubbles) as grey gaps, link traffic, datacenter
boundaries, and a memory strip per device underneath. :func:`plot_compare` stacks several
schedules one above the other on one common time axis. :func:`render_schedule` and
:func:`render_compare` build the same figures without saving them.

:func:`plot_graph_schedule` (:func:`render_graph_schedule`) draws a task-graph schedule
(schedule JSON v2) with the same pieces: a row per device and per directed link that carries
timed messages or communication tasks (collectives), a row per named network resource (a
WAN), tasks coloured by group (a collective on the row of every resource it holds), the
latest tail per row hatched, memory bands underneath; :func:`plot_any` takes either kind of
schedule.

Figure sizes are fixed by :func:`figure_size` and :func:`compare_figure_size` (inches,
multiples of 1/8), so a PNG is ``int(inches * dpi)`` pixels wide and high; the image format
(PNG, SVG or PDF) follows the file's suffix (:func:`image_format`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import Colormap, to_rgba
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.textpath import TextToPath

from pipeopt.config import ConfigError
from pipeopt.core.schedule import GraphSchedule, task_groups
from pipeopt.io import write_atomic
from pipeopt.problem import format_memory
from pipeopt.schedule import Schedule, TimedOp
from pipeopt.simulate import ScheduleError
from pipeopt.workloads.inference import ARRIVAL_GROUP, serving_metrics, serving_plan

#: Colour map of each op kind; the micro-batch picks the shade within it.
KIND_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}
KIND_NAMES = {"F": "forward", "B": "backward (input)", "W": "backward (weight)"}
#: Legend name of B in a compare plot mixing split and fused schedules.
B_MIXED_NAME = "backward (input; the whole backward where fused)"
IDLE_COLOR = "#e6e6e6"
LINK_COLOR = "#7b3294"
LIMIT_COLOR = "#d62728"
CHUNK_MARK_COLOR = "#333333"
DC_COLOR = "#111111"
NOTE_COLOR = "#555555"
REDUCE_COLOR = "#3a3a3a"  # hatching of the data-parallel gradient reduction
REDUCE_HATCH = "////"

#: Image formats by file suffix (all written by matplotlib's own backends).
IMAGE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
#: Largest image side, in pixels, that :func:`render_schedule` and :func:`render_compare`
#: accept: larger ones take minutes and gigabytes to render, or fail inside matplotlib.
MAX_SIDE_PX = 20000
#: The dpi of ``pipeopt plot`` and of :func:`plot_schedule` unless told otherwise.
DEFAULT_DPI = 100
#: Tallest single-schedule figure (inches): :data:`MAX_SIDE_PX` at :data:`DEFAULT_DPI`, so
#: a 1024-device schedule draws at the default dpi (its rows squeezed, 14 px each) instead of
#: needing a 43,400-pixel image.
MAX_FIGURE_IN = MAX_SIDE_PX / DEFAULT_DPI

# Layout, in inches: fixed margins make the axes size known before drawing, which is what
# lets labels be dropped when their box is too narrow.
_LEFT_IN, _RIGHT_IN, _TOP_IN, _BOTTOM_IN, _GAP_IN = 0.9, 0.75, 0.75, 0.55, 0.45
_COMPARE_HEAD_IN = 0.75  # figure title and the shared legend above the first schedule
_COMPARE_MAX_IN = 150.0  # a compare page taller than this squeezes its rows
_MIN_ROW_IN = 0.08  # in a compare plot a device row gets at least this (8 px at 100 dpi)
_MAX_LABELS = 3000  # text is slow to render; past this many boxes no label would be legible
_MAX_DELAY_LINES = 1500  # latency arrows beyond this count are noise, not information
_LABEL_FONT_PT = 7.0  # largest micro-batch label; shrinks to _MIN_LABEL_FONT_PT to fit
_MIN_LABEL_FONT_PT = 5.0
_LABEL_PAD_PX = 2.0  # room a label leaves inside its box
_EDGE_MIN_PX = 3.0  # boxes narrower than this get no white edge: it would cover them
_HALF = 0.38  # half the height of an op box, in row units
_RASTER_BELOW_PX = 3.0  # rows whose median box is narrower are drawn as averaged images
_RASTER_SAMPLES = 8  # samples per pixel of those images
_MIN_TEXT_PX = 6.0  # text smaller than this many pixels is a blob: enlarged, shrunk or dropped
_TITLE_PT = 9.0  # compare titles; shrink to _MIN_TITLE_PT when a line would pass the edge
_MIN_TITLE_PT = 7.0
_TITLE_LINE_IN = _TITLE_PT * 1.3 / 72  # height of each further line of a compare title
_EDGE_PAD_IN = 0.04  # titles and legends end at least this far left of the figure's edge


def _gantt_rows_height(devices: int) -> float:
    return max(1.2, 0.3 * devices)


def _memory_rows_height(devices: int) -> float:
    return max(1.0, 0.22 * devices if devices <= 16 else 3.5 + 0.12 * (devices - 16))


def _eighths(inches: float) -> float:
    """Round up to 1/8 inch: exact in binary, so the PNG is exactly int(inches * dpi) pixels
    for an integer dpi."""
    return math.ceil(inches * 8 - 1e-9) / 8


def _compare_rows_heights(schedules: Sequence[Schedule], extra_in: float = 0.0
                          ) -> list[float]:
    """Height in inches of each schedule's Gantt rows in :func:`plot_compare`.

    Many tall pipelines would make a poster: each is squeezed towards 24 inches over all,
    but never below 1.5 inch nor below :data:`_MIN_ROW_IN` per device row (thinner rows
    alias into stripes). Only a page over :data:`_COMPARE_MAX_IN` squeezes further.
    ``extra_in``: the further title lines' height, which the page must hold as well.
    """
    count = max(1, len(schedules))
    rows = [min(_gantt_rows_height(s.problem.devices),
                max(1.5, 24.0 / count, _MIN_ROW_IN * s.problem.devices)) for s in schedules]
    fixed = _COMPARE_HEAD_IN + _BOTTOM_IN + (_TOP_IN * 0.6 + 0.3) * len(schedules) + extra_in
    total = sum(rows)
    if total and fixed + total > _COMPARE_MAX_IN:
        scale = max(_COMPARE_MAX_IN - fixed, 0.5 * len(schedules)) / total
        rows = [r * scale for r in rows]
    return rows


def _median(values: Sequence[float]) -> float:
    vals = sorted(values)
    return vals[len(vals) // 2] if vals else 0.0


def _width(schedules: Sequence[Schedule]) -> float:
    """Figure width in inches: room for the busiest device's ops (about 0.07 inch per op)
    and for a median op about 0.15 inch wide on the common time axis, clamped to a page."""
    return _width_of(max((s.iteration_time for s in schedules), default=0.0),
                     [(len(s.ops) / max(1, s.problem.devices),
                       _median([o.end - o.start for o in s.ops])) for s in schedules])


def _width_of(xmax: float, rows: Sequence[tuple[float, float]]) -> float:
    """:func:`_width` from the time axis' end (s) and, per chart, (boxes per row, median box
    duration in s)."""
    need = 0.0
    for per_row, typical in rows:
        need = max(need, 4.0 + 0.07 * per_row)
        if typical > 0:
            need = max(need, _LEFT_IN + _RIGHT_IN + 0.15 * xmax / typical)
    return _eighths(min(24.0, max(10.0, need)))


def figure_size(schedule: Schedule, show_memory: bool = True) -> tuple[float, float]:
    """(width, height) in inches of :func:`plot_schedule`'s figure for ``schedule``."""
    return _width([schedule]), _height(schedule.problem.devices, schedule.problem.devices,
                                       show_memory)


def _height(rows: int, devices: int, show_memory: bool) -> float:
    """Figure height (inches) for ``rows`` Gantt rows and, ``show_memory``, a memory band per
    device, at most :data:`MAX_FIGURE_IN` (the renderers squeeze the rows to fit)."""
    h = _TOP_IN + _gantt_rows_height(rows) + _BOTTOM_IN
    if show_memory:
        h += _GAP_IN + _memory_rows_height(devices)
    return min(MAX_FIGURE_IN, _eighths(h))


def compare_figure_size(schedules: Sequence[Schedule], fits: Sequence[bool] | None = None
                        ) -> tuple[float, float]:
    """(width, height) in inches of :func:`plot_compare`'s figure (``fits`` as there: a
    schedule over its memory limit gets a second title line)."""
    return _compare_layout(list(schedules), _fits(schedules, fits))[:2]


def _fits(schedules: Sequence[Schedule], fits: Sequence[bool] | None) -> list[bool]:
    fit = [True] * len(schedules) if fits is None else [bool(f) for f in fits]
    if len(fit) != len(schedules):
        raise ValueError(f"fits: {len(fit)} values for {len(schedules)} schedules")
    return fit


def _compare_layout(schedules: list[Schedule], fit: list[bool]
                    ) -> tuple[float, float, list[list[str]], list[float]]:
    """Width and height (inches) of a compare figure, each schedule's title lines and the
    height of its Gantt rows (inches)."""
    w = _width(schedules)
    best = min((s.objective_value for s, f in zip(schedules, fit, strict=True) if f),
               default=None)
    room_pt = (w - _LEFT_IN - _EDGE_PAD_IN) * 72
    titles = [_wrap_title(_compare_title_lines(s, f, best), room_pt, bold=not f)
              for s, f in zip(schedules, fit, strict=True)]
    extra = sum(len(t) - 1 for t in titles) * _TITLE_LINE_IN
    rows = _compare_rows_heights(schedules, extra)
    h = (_COMPARE_HEAD_IN + _BOTTOM_IN + sum(rows) + (_TOP_IN * 0.6 + 0.3) * len(schedules)
         + extra)
    return w, _eighths(h), titles, rows


def max_dpi(size: tuple[float, float]) -> int:
    """The largest whole dpi at which a figure of ``size`` inches stays within
    :data:`MAX_SIDE_PX` pixels per side."""
    return max(1, math.floor(MAX_SIDE_PX / max(size[0], size[1], 1e-9)))


def check_dpi(size: tuple[float, float], dpi: float, flag: str = "--dpi") -> None:
    """Raise :class:`~pipeopt.config.ConfigError` naming ``flag`` when ``dpi`` is not a finite
    number > 0 or would make a figure of ``size`` inches more than :data:`MAX_SIDE_PX`
    pixels wide or high."""
    try:
        ok = float(dpi) > 0 and math.isfinite(dpi)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{flag}: must be a finite number > 0, got {dpi!r}")
    w, h = size
    if max(w, h) * dpi > MAX_SIDE_PX:
        raise ConfigError(
            f"{flag}: {dpi:g} would make a {w * dpi:.0f} x {h * dpi:.0f} pixel image; the "
            f"largest dpi for this {w:g} x {h:g} inch figure is {max_dpi(size)} (at most "
            f"{MAX_SIDE_PX} pixels per side)")


def image_format(path: str | os.PathLike[str], flag: str | None = None) -> str:
    """The image format (``png``, ``svg`` or ``pdf``) that ``path``'s suffix names; any other
    suffix raises :class:`~pipeopt.config.ConfigError` (naming ``flag`` when given)."""
    suffix = Path(path).suffix
    fmt = IMAGE_FORMATS.get(suffix.lower())
    if fmt is None:
        what = f"a {suffix!r} file" if suffix else "a file without a suffix"
        raise ConfigError(f"{flag + ': ' if flag else ''}cannot draw {what} ({path}); name it "
                          f"*.png, *.svg or *.pdf")
    return fmt


# ----- colours -------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _cmap(kind: str) -> Colormap:
    return colormaps[KIND_CMAPS.get(kind, "Greys")]  # a copy: fetch once per kind


def _shade(kind: str, microbatch: int, microbatches: int) -> tuple[float, float, float, float]:
    """Colour of an op: its kind's colour map, darker for later micro-batches."""
    frac = microbatch / (microbatches - 1) if microbatches > 1 else 0.5
    return _cmap(kind)(0.35 + 0.55 * frac)


def _text_color(rgba: tuple[float, float, float, float]) -> str:
    r, g, b, _ = rgba
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _fmt_mem(x: float, schedule: Schedule) -> str:
    """Memory to 3 significant digits (:func:`pipeopt.problem.format_memory`)."""
    return format_memory(x, schedule.problem, ".3g", ".3g")


def _fmt_time(x: float) -> str:
    return f"{x:.4g} s"


def schedule_title(schedule: Schedule) -> str:
    """One line naming the method, the shape, makespan (and the iteration time when a
    gradient reduction ends after the last op) and bubble ratio."""
    pr = schedule.problem
    shape = f"p={pr.devices} m={pr.microbatches}"
    if pr.virtual_stages > 1:
        shape += f" v={pr.virtual_stages} ({pr.placement})"
    if pr.sub_blocks > 1:
        shape += f" sub-blocks={pr.sub_blocks}"
    out = f"{schedule.method}   {shape}   makespan {_fmt_time(schedule.makespan)}   "
    if not math.isclose(schedule.iteration_time, schedule.makespan, rel_tol=1e-12):
        out += f"iteration {_fmt_time(schedule.iteration_time)}   "
    out += f"bubble ratio {schedule.bubble_ratio:.1%}"
    if schedule.solver.status != "heuristic":
        out += f"   [{schedule.solver.status}]"
    return out


# ----- text that fits ------------------------------------------------------------------------
_SEP = "   "  # between the parts of a title


def _text_width_pt(text: str, size: float, bold: bool = False) -> float:
    """Width of one line of text in points from the font's outlines (no hinting: the same
    at every dpi; rendered text is up to ~7% wider, hence the margins of the callers)."""
    prop = FontProperties(size=size, weight="bold" if bold else "normal")
    return TextToPath().get_text_width_height_descent(text, prop, ismath=False)[0]


def _text_width_px(text: str, size: float, dpi: float) -> float:
    """Width in pixels of one line of ``text`` at ``size`` points as Agg renders it."""
    renderer = RendererAgg(8, 8, dpi)  # measuring needs no canvas of the figure's size
    w, _, _ = renderer.get_text_width_height_descent(text, FontProperties(size=size), False)
    return w


def _wrap_title(lines: list[str], room_pt: float, *, bold: bool) -> list[str]:
    """``lines``, each broken at its ``_SEP`` separators into as few lines as keep within
    ``room_pt`` points at :data:`_MIN_TITLE_PT` (with a margin for hinting)."""
    out: list[str] = []
    for line in lines:
        cur = ""
        for part in line.split(_SEP):
            trial = cur + _SEP + part if cur else part
            if cur and _text_width_pt(trial, _MIN_TITLE_PT, bold) * 1.1 > room_pt:
                out.append(cur)
                cur = part
            else:
                cur = trial
        out.append(cur)
    return out


def _fit_texts(fig: Figure, texts: Sequence[Text], sizes: Sequence[float]) -> float:
    """Give ``texts`` the largest of ``sizes`` (points, largest first) at which each of them
    ends left of the figure's right edge as the Agg renderer draws them; the smallest when
    none does. Returns the size."""
    renderer = RendererAgg(8, 8, fig.dpi)
    right = fig.bbox.width - _EDGE_PAD_IN * fig.dpi
    for size in sizes:
        for t in texts:
            t.set_fontsize(size)
        if all(t.get_window_extent(renderer).x1 <= right for t in texts):
            break
    return size


def _fit_legend(fig: Figure, make: Callable[[int], Legend], handles: Sequence[object]
                ) -> tuple[Legend, int]:
    """The legend ``make(ncol)`` in as few rows as keep it within the figure's width (one
    when it fits), and its number of rows."""
    renderer = RendererAgg(8, 8, fig.dpi)
    right = fig.bbox.width - _EDGE_PAD_IN * fig.dpi
    n = max(1, len(handles))
    rows = 1
    while True:
        ncol = math.ceil(n / rows)  # rows of equal length: legends fill column by column
        legend = make(ncol)
        if ncol == 1 or legend.get_window_extent(renderer).x1 <= right:
            return legend, math.ceil(n / ncol)
        legend.remove()
        rows += 1


# ----- drawing -------------------------------------------------------------------------------
@dataclass
class _Drawn:
    """What :func:`_draw_gantt` put on a chart, for the legend and the caption."""

    chunk_marks: bool = False
    link_busy: bool = False
    delays_drawn: int = 0
    delays_left_out: int = 0
    dc_boundaries: int = 0
    grad_reduce: bool = False
    zero_kinds: tuple[str, ...] = ()  # kinds with zero-length ops drawn as ticks


def _datacenters(schedule: Schedule) -> list[int] | None:
    """Per device, its datacenter from ``problem.meta["devices"]`` (written by configs with a
    ``cluster``), or None when the problem does not say."""
    pr = schedule.problem
    devices = dict(pr.meta).get("devices")
    if not isinstance(devices, list | tuple) or len(devices) != pr.devices:
        return None
    out: dict[int, int] = {}
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            return None
        d, dc = dev.get("device", i), dev.get("datacenter")
        if not isinstance(d, int) or not 0 <= d < pr.devices or not isinstance(dc, int):
            return None
        out[d] = dc
    return [out[d] for d in range(pr.devices)] if len(out) == pr.devices else None


def _min_pt(pt: float, dpi: float) -> float:
    """``pt``, or more when that is under :data:`_MIN_TEXT_PX` pixels at ``dpi``."""
    return max(pt, _MIN_TEXT_PX * 72 / dpi)


def _draw_dc_boundaries(ax: Axes, schedule: Schedule, sign: float, label: bool) -> int:
    """A dashed line between device rows of different datacenters (rows at ``sign * d``);
    with ``label``, each datacenter's name right of the chart. Returns the lines drawn."""
    dcs = _datacenters(schedule)
    if dcs is None or len(set(dcs)) < 2:
        return 0
    dpi = ax.figure.dpi if ax.figure is not None else 100.0
    lines = 0
    first = 0
    for d in range(1, len(dcs) + 1):
        if d < len(dcs) and dcs[d] == dcs[d - 1]:
            continue
        if d < len(dcs):
            ax.axhline(sign * (d - 0.5), color=DC_COLOR, lw=1.0, ls=(0, (5, 3)), zorder=5)
            lines += 1
        if label:
            ax.text(1.005, sign * (first + d - 1) / 2, f"dc{dcs[first]}",
                    fontsize=_min_pt(8.0, dpi),
                    ha="left", va="center", color=DC_COLOR,
                    transform=ax.get_yaxis_transform(), clip_on=False)
        first = d
    return lines


def _box_edges(widths_px: Sequence[float], row_px: float) -> list[str]:
    """White edges where a box is wide enough to show them; none on narrow boxes, whose
    edges would cover them and alias into stripes."""
    if row_px < _EDGE_MIN_PX * 2:
        return ["none"] * len(widths_px)
    return ["white" if w >= _EDGE_MIN_PX else "none" for w in widths_px]


def _label_font(widths_px: Sequence[float], chars: int, dpi: float) -> float:
    """Font size (points) of the micro-batch labels: the widest label (``chars`` digits)
    fits most boxes (the narrowest tenth excepted), between 5 and 7 points."""
    widths_px = [w for w in widths_px if w > 0]  # zero-length ops are ticks, not boxes
    if not widths_px:
        return _LABEL_FONT_PT
    narrow = sorted(widths_px)[len(widths_px) // 10]
    # Half a pixel to spare: boxes of one duration differ by float round-off.
    pt = (narrow - _LABEL_PAD_PX - 0.5) / (0.62 * chars) * 72 / dpi
    return min(_LABEL_FONT_PT, max(_MIN_LABEL_FONT_PT, pt))


def _draw_gantt(ax: Axes, schedule: Schedule, axes_width_in: float, dpi: float,
                xmax: float, height_in: float, *, dc_labels: bool = True) -> _Drawn:
    """Ops, idle background, gradient reductions, link traffic, latency lines and datacenter
    boundaries of ``schedule`` on ``ax``; returns what was drawn."""
    pr = schedule.problem
    p, m = pr.devices, pr.microbatches
    half = _HALF
    drawn = _Drawn()

    # Idle time: a grey band per device from 0 to the makespan; ops cover the busy parts.
    idle = [[(0, d - half), (schedule.makespan, d - half), (schedule.makespan, d + half),
             (0, d + half)] for d in range(p)]
    ax.add_collection(PolyCollection(idle, facecolors=IDLE_COLOR, edgecolors="none", zorder=1))

    px_per_s = axes_width_in * dpi / xmax if xmax > 0 else 0.0
    row_px = height_in * dpi / max(1, p)
    shades = _shade_table(pr.kinds, m)
    widths_px = [(o.end - o.start) * px_per_s for o in schedule.ops]
    raster = _median(widths_px) < _RASTER_BELOW_PX
    if raster:
        # Boxes of a pixel or two: polygons would alias into stripes (each one painted over
        # its neighbours' edge pixels). Paint the rows as images whose pixels average the
        # colours of the ops under them instead.
        _draw_rows_raster(ax, schedule, shades, round(axes_width_in * dpi), xmax)
    else:
        _draw_boxes(ax, schedule, shades, widths_px, row_px, dpi, drawn)

    # Data-parallel gradient reductions: a hatched bar from each stage's last W (its last B
    # when the backward is fused) for the stage's grad_reduce seconds. It runs on the
    # network, so the device may compute other chunks' ops meanwhile: the bar lies under
    # the boxes (over the averaged image of dense rows, which paints idle time too).
    reductions = _reductions(schedule)
    if reductions:
        bars = [[(a, d - half), (b, d - half), (b, d + half), (a, d + half)]
                for d, a, b in reductions]
        hatched = PolyCollection(bars, facecolors="none", edgecolors=REDUCE_COLOR,
                                 hatch=REDUCE_HATCH, linewidths=0.6,
                                 zorder=2.6 if raster else 1.5)
        if hasattr(hatched, "set_hatchcolor"):  # matplotlib >= 3.10; before, rcParams'
            hatched.set_hatchcolor(REDUCE_COLOR)  # hatch.color (black by default)
        ax.add_collection(hatched)
        drawn.grad_reduce = True

    # Micro-batch numbers inside the boxes. One rule for every box: it gets its number when
    # the widest number of the schedule fits in it, so equal boxes are all labelled or none.
    # None at all when the font would be under _MIN_TEXT_PX pixels (a low dpi): a blob.
    if len(schedule.ops) <= _MAX_LABELS:
        ops = schedule.ops
        _box_labels(ax, [(o.device, o.start, o.end) for o in ops],
                    [str(o.microbatch) for o in ops],
                    [shades[o.kind, o.microbatch] for o in ops], widths_px, row_px, dpi,
                    len(str(max(0, m - 1))))

    # Link traffic: a thin bar under the sender's row while a message occupies its link,
    # then a line to the receiver's row at the arrival (the link latency).
    lane_top, lane_bot = half + 0.01, half + 0.11
    if schedule.messages:
        bars = [[(mm.start, mm.src_device + lane_top), (mm.end, mm.src_device + lane_top),
                 (mm.end, mm.src_device + lane_bot), (mm.start, mm.src_device + lane_bot)]
                for mm in schedule.messages]
        ax.add_collection(PolyCollection(bars, facecolors=LINK_COLOR, edgecolors="none",
                                         alpha=0.85, zorder=3))
        drawn.link_busy = True
    picked, left_out = _pick_delays(_delay_segments(schedule), _MAX_DELAY_LINES)
    if picked:
        ax.add_collection(LineCollection([seg for segs in picked for seg in segs],
                                         colors=LINK_COLOR, linewidths=0.6, alpha=0.45,
                                         zorder=3))
    drawn.delays_drawn, drawn.delays_left_out = len(picked), left_out

    ax.set_xlim(0, xmax)
    ax.set_ylim(p - 0.5, -0.5)  # device 0 on top
    drawn.dc_boundaries = _draw_dc_boundaries(ax, schedule, 1.0, dc_labels)
    _device_ticks(ax, [float(d) for d in range(p)], row_px, dpi)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return drawn


def _box_labels(ax: Axes, boxes: Sequence[tuple[int, float, float]], texts: Sequence[str],
                colors: Sequence[tuple[float, float, float, float]], widths_px: Sequence[float],
                row_px: float, dpi: float, chars: int) -> None:
    """``texts[i]`` centred in box ``i`` (row, start, end) when a text of ``chars`` characters
    fits in it, in white or black against ``colors[i]``; none when the font would be under
    :data:`_MIN_TEXT_PX` pixels or taller than the row."""
    font = _label_font(widths_px, chars, dpi)
    need_px = 0.62 * font * dpi / 72 * chars + _LABEL_PAD_PX
    if font * dpi / 72 < _MIN_TEXT_PX or 2 * _HALF * row_px < font * dpi / 72 * 1.1:
        return
    for (r, a, b), text, color, w in zip(boxes, texts, colors, widths_px, strict=True):
        if w >= need_px:
            ax.text((a + b) / 2, r, text, ha="center", va="center", fontsize=font,
                    color=_text_color(color), zorder=4, clip_on=True)


def _reductions(schedule: Schedule) -> list[tuple[int, float, float]]:
    """(device, start, end) of each stage's gradient reduction (``problem.grad_reduce``)
    that lasts > 0: from the end of the stage's last W, or its last B when the backward is
    fused, as :attr:`Schedule.iteration_time` counts it."""
    pr = schedule.problem
    red = pr.grad_reduce
    if not any(red):
        return []
    final = "W" if pr.split_backward else "B"
    last: dict[int, TimedOp] = {}
    for o in schedule.ops:
        if o.kind == final and (o.stage not in last or o.end > last[o.stage].end):
            last[o.stage] = o
    return [(o.device, o.end, o.end + red[k]) for k, o in sorted(last.items()) if red[k] > 0]


def _tick_color(kind: str, microbatch: int, microbatches: int
                ) -> tuple[float, float, float, float]:
    """Colour of a zero-length op's tick: its kind's colour, a shade darker than a box's so
    that a line one or two pixels wide stands out from the grey."""
    frac = microbatch / (microbatches - 1) if microbatches > 1 else 0.5
    return _cmap(kind)(0.6 + 0.35 * frac)


def _shade_table(kinds: Sequence[str], microbatches: int
                 ) -> dict[tuple[str, int], tuple[float, float, float, float]]:
    """:func:`_shade` of every (kind, micro-batch): one colour-map lookup each, not per op."""
    return {(k, j): _shade(k, j, microbatches) for k in kinds for j in range(microbatches)}


def _draw_boxes(ax: Axes, schedule: Schedule,
                shades: dict[tuple[str, int], tuple[float, float, float, float]],
                widths_px: Sequence[float], row_px: float, dpi: float, drawn: _Drawn) -> None:
    """One polygon per op (white edges where they show), the odd-chunk strips, and a thin
    vertical tick for each zero-length op (a box of no width would not show)."""
    p = schedule.problem.devices
    half = _HALF
    chunk_of = _chunk_index(schedule)
    marks: list[list[tuple[float, float]]] = []  # odd chunks: a dark strip along the bottom
    mark_widths = []
    show_marks = 0.14 * row_px >= 2.0  # thinner, the strips only make a stripe pattern
    for o, w in zip(schedule.ops, widths_px, strict=True):
        if show_marks and chunk_of[o.stage] % 2:
            top = o.device + half - 0.14
            marks.append([(o.start, top), (o.end, top), (o.end, o.device + half),
                          (o.start, o.device + half)])
            mark_widths.append(w)
    lw = _paint_boxes(ax, [(o.device, o.start, o.end) for o in schedule.ops],
                      [shades[o.kind, o.microbatch] for o in schedule.ops], widths_px, row_px,
                      p)
    if marks:
        ax.add_collection(PolyCollection(marks, facecolors=CHUNK_MARK_COLOR,
                                         edgecolors=_box_edges(mark_widths, 2 * half * row_px),
                                         linewidths=lw, zorder=2.5))
        drawn.chunk_marks = True
    zero = [o for o in schedule.ops if o.end <= o.start]
    if zero:
        m = schedule.problem.microbatches
        _paint_ticks(ax, [(o.device, o.start) for o in zero],
                     [_tick_color(o.kind, o.microbatch, m) for o in zero], dpi)
        drawn.zero_kinds = tuple(k for k in ("F", "B", "W") if any(o.kind == k for o in zero))


def _paint_boxes(ax: Axes, boxes: Sequence[tuple[int, float, float]], colors: Sequence[object],
                 widths_px: Sequence[float], row_px: float, rows: int) -> float:
    """A polygon per (row, start, end) in ``boxes`` with its colour, white edges where they
    show (:func:`_box_edges`); returns the edge width used (points)."""
    half = _HALF
    lw = 0.5 if len(boxes) / max(1, rows) < 150 else 0.25
    ax.add_collection(PolyCollection(
        [[(a, r - half), (b, r - half), (b, r + half), (a, r + half)] for r, a, b in boxes],
        facecolors=colors, edgecolors=_box_edges(widths_px, 2 * half * row_px),
        linewidths=lw, zorder=2))
    return lw


def _paint_ticks(ax: Axes, ticks: Sequence[tuple[int, float]], colors: Sequence[object],
                 dpi: float) -> None:
    """A thin vertical line per zero-length box (row, time): a box of no width would not
    show."""
    ax.add_collection(LineCollection(
        [[(t, r - _HALF), (t, r + _HALF)] for r, t in ticks], colors=colors,
        linewidths=max(1.0, 1.5 * 72 / dpi), zorder=3.5))  # at least 1.5 px wide


def _draw_rows_raster(ax: Axes, schedule: Schedule,
                      shades: dict[tuple[str, int], tuple[float, float, float, float]],
                      columns: int, xmax: float) -> None:
    """Each device row as a one-pixel-high image ``columns`` wide over [0, xmax]: every
    pixel is the average colour of what lies under it (ops, idle time, nothing after the
    makespan), from 8 samples per pixel. Drawn over the idle band (zorder 2)."""
    keys = list(shades)
    index = {k: i for i, k in enumerate(keys)}
    _paint_raster(ax, schedule.problem.devices,
                  [(o.device, o.start, o.end) for o in schedule.ops],
                  [index[o.kind, o.microbatch] for o in schedule.ops],
                  [shades[k] for k in keys], columns, xmax, schedule.makespan)


def _paint_raster(ax: Axes, p: int, boxes: Sequence[tuple[int, float, float]],
                  color_index: Sequence[int], palette_rgba: Sequence[object], columns: int,
                  xmax: float, busy_until: float) -> None:
    """Rows ``0 .. p-1`` as one-pixel-high images ``columns`` wide over [0, xmax]; box ``i``
    (row, start, end) has colour ``palette_rgba[color_index[i]]``, idle time up to
    ``busy_until`` is grey; each pixel averages :data:`_RASTER_SAMPLES` samples."""
    columns = max(1, columns)
    sub = _RASTER_SAMPLES
    n = columns * sub
    palette = np.array([(0.0, 0.0, 0.0, 0.0), to_rgba(IDLE_COLOR), *palette_rgba],
                       dtype=np.float32)
    scale = n / xmax if xmax > 0 else 0.0
    rows = np.zeros((p, n), dtype=np.int32)
    rows[:, :max(0, min(n, round(busy_until * scale)))] = 1
    for (r, start, end), c in zip(boxes, color_index, strict=True):
        a, b = round(start * scale), round(end * scale)
        if b <= a:  # shorter than a sample: still paint the sample it starts in
            b = a + 1 if end > start else a
        rows[r, max(0, a):min(n, b)] = c + 2
    for d in range(p):
        img = palette[rows[d]].reshape(columns, sub, 4).mean(axis=1)
        ax.imshow(img[np.newaxis], extent=(0, xmax, d + _HALF, d - _HALF), aspect="auto",
                  interpolation="nearest", origin="upper", zorder=2)


def _device_ticks(ax: Axes, positions: list[float], row_px: float, dpi: float,
                  names: Sequence[str] | None = None) -> None:
    """Label rows "dev d" (or ``names``), every row if the labels fit, else every 2nd, 4th,
    ... row.

    The font is 8 points (6 on thin rows), never under :data:`_MIN_TEXT_PX` pixels: larger
    at a low dpi, shrunk to fit the left margin, and no labels at all when even that size
    does not fit it."""
    font_pt = _min_pt(8.0 if row_px >= 14 else 6.0, dpi)
    room_px = _LEFT_IN * dpi - 3.5 * dpi / 72 - 2  # the margin less the tick label's pad
    names = names or [f"dev {d}" for d in range(len(positions))]
    widest = max(_text_width_px(t, font_pt, dpi) for t in {names[-1], max(names, key=len)})
    if widest > room_px:
        font_pt *= room_px / widest
    if font_pt * dpi / 72 < _MIN_TEXT_PX - 1e-9:
        ax.set_yticks([])
        return
    need_px = font_pt * dpi / 72 * 1.2
    step = 1
    while step * row_px < need_px:
        step *= 2
    # Ticks only where a label goes (they have no length): a thousand empty tick labels
    # take seconds to lay out.
    ax.set_yticks(positions[::step], list(names[::step]), fontsize=font_pt)


def _chunk_index(schedule: Schedule) -> list[int]:
    """Per global stage, which of its device's chunks it is (0 for the first); the
    sub-blocks of a stage are parts of its chunk."""
    pr = schedule.problem
    out = [0] * pr.stages
    for stages in pr.device_stages:
        for c, k in enumerate(stages):
            out[k] = c // pr.sub_blocks
    return out


_Segment = list[tuple[float, float]]
_Delay = tuple[tuple[int, int], float, list[_Segment]]


def _delay_line(devices: int, src: int, t0: float, dst: int, t1: float) -> list[_Segment]:
    """The polylines of one delay line from ``src``'s row at ``t0`` to ``dst``'s at ``t1``.

    It leaves the sender's row at the edge facing the receiver (a line leaving from the
    middle or the far edge would cross the sender's next box) and ends in the middle of the
    receiver's row. The wrap-around link of an interleaved pipeline (between the last device
    and device 0) would cross every row: it leaves past the chart's edge beyond the sender
    and comes back in from the opposite edge, halfway through the delay.
    """
    down = dst > src
    if devices >= 3 and {src, dst} == {0, devices - 1}:
        # Out of the bottom edge below the last device, in from the top to device 0 (or the
        # other way round).
        mid = (t0 + t1) / 2
        out_y, in_y = (-0.5, devices - 0.5) if down else (devices - 0.5, -0.5)
        start = (t0, src + (-_HALF if down else _HALF))
        return [[start, (mid, out_y)], [(mid, in_y), (t1, dst)]]
    return [[(t0, src + (_HALF if down else -_HALF)), (t1, dst)]]


def _delay_segments(schedule: Schedule) -> list[_Delay]:
    """The delay line (:func:`_delay_line`) of every message from a producer's end to the
    arrival on the consumer's row, each with its link (sender, receiver device) and its
    delay (seconds).

    For messages that occupy a link the line starts where the transmission ends; for
    latency-only links it starts at the producer's end. Links with no delay draw nothing.
    """
    pr = schedule.problem
    p = pr.devices
    segs: list[_Delay] = []
    for mm in schedule.messages:
        if mm.arrival > mm.end:
            segs.append(((mm.src_device, mm.dst_device), mm.arrival - mm.end,
                         _delay_line(p, mm.src_device, mm.end, mm.dst_device, mm.arrival)))
    sent = {(mm.src_stage, mm.dst_stage, mm.microbatch) for mm in schedule.messages}
    ends: dict[tuple[str, int, int], TimedOp] = {(o.kind, o.stage, o.microbatch): o
                                                  for o in schedule.ops}
    s = pr.stages
    for o in schedule.ops:
        if o.kind == "F" and o.stage + 1 < s:
            dst = o.stage + 1
        elif o.kind == "B" and o.stage > 0:
            dst = o.stage - 1
        else:
            continue
        if (o.stage, dst, o.microbatch) in sent:
            continue
        delay = pr.delay(o.stage, dst, o.microbatch)
        if delay <= 0:
            continue
        consumer = ends.get((o.kind, dst, o.microbatch))
        if consumer is None:
            continue
        segs.append(((o.device, consumer.device), delay,
                     _delay_line(p, o.device, o.end, consumer.device, o.end + delay)))
    return segs


def _pick_delays(segments: Sequence[_Delay], limit: int
                 ) -> tuple[list[list[_Segment]], int]:
    """The delay lines to draw (each one or two polylines), and how many are left out.

    All of them when there are at most ``limit``; else the lines of the slowest links (by
    their longest delay; links of equal delay all or none), as many links as stay within
    ``limit``: those are the links (a WAN hop between datacenters) that shape the schedule.
    """
    if len(segments) <= limit:
        return [seg for _, _, seg in segments], 0
    by_link: dict[tuple[int, int], list[list[_Segment]]] = {}
    slowest: dict[tuple[int, int], float] = {}
    for link, delay, seg in segments:
        by_link.setdefault(link, []).append(seg)
        slowest[link] = max(slowest.get(link, 0.0), delay)
    order = sorted(by_link, key=lambda k: -slowest[k])
    out: list[list[_Segment]] = []
    i = 0
    while i < len(order):
        tier_delay = slowest[order[i]]
        j = i
        while j < len(order) and math.isclose(slowest[order[j]], tier_delay, rel_tol=1e-9):
            j += 1
        tier = [seg for link in order[i:j] for seg in by_link[link]]
        if len(out) + len(tier) > limit:
            break
        out += tier
        i = j
    return out, len(segments) - len(out)


def _draw_memory(ax: Axes, schedule: Schedule, xmax: float, height_in: float,
                 dpi: float) -> None:
    """Memory in use per device as a step plot in its own band; limits dashed."""
    pr = schedule.problem
    _memory_bands(ax, schedule.memory_timeline, pr.memory_limit, schedule.peak_memory, xmax,
                  height_in, dpi, lambda x: _fmt_mem(x, schedule))
    _draw_dc_boundaries(ax, schedule, -1.0, False)


def _memory_bands(ax: Axes, timelines: Sequence[Sequence[tuple[float, float]]],
                  limits: Sequence[float | None], peaks: Sequence[float], xmax: float,
                  height_in: float, dpi: float, fmt: Callable[[float], str],
                  what: str = "memory in use") -> None:
    """Memory in use per device (``timelines``: (time s, bytes) steps) as a step plot in its
    own band, limits (bytes, None: unlimited) dashed, each peak (``fmt`` writes bytes) right
    of its band when the rows have room; ``what`` names it in the panel's title."""
    p = len(timelines)
    known = [lim for lim in limits if lim is not None]
    full = max([*peaks, *known, 0.0])
    full = full if full > 0 else 1.0
    band = 0.8
    rows_px = height_in * dpi
    peak_pt, peak_labels = _peak_labels(peaks, fmt, dpi)
    label_rows = bool(peak_labels) and rows_px / p >= max(10.0, 1.2 * peak_pt * dpi / 72)
    # One collection each for the fills, the steps and the limits: an artist per device
    # takes seconds to draw at a thousand devices.
    fills, lines, dashes = [], [], []
    for d, steps in enumerate(timelines):
        base = -d - band / 2
        xs = [t for t, _ in steps] + [max(xmax, steps[-1][0])]
        ys = [base + band * b / full for _, b in steps]
        ys.append(ys[-1])
        line = [(xs[0], ys[0])]  # a step after each change ("post")
        for k in range(1, len(xs)):
            line += [(xs[k], ys[k - 1]), (xs[k], ys[k])]
        lines.append(line)
        fills.append([(xs[0], base), *line, (xs[-1], base)])
        lim = limits[d]
        if lim is not None:
            y = base + band * lim / full
            dashes.append([(0, y), (xmax, y)])
    ax.add_collection(PolyCollection(fills, facecolors="#6a8caf", alpha=0.35, linewidths=0))
    ax.add_collection(LineCollection(lines, colors="#2c4f73", linewidths=0.8))
    if dashes:
        ax.add_collection(LineCollection(dashes, colors=LIMIT_COLOR, linewidths=0.8,
                                         linestyles="--"))
    for d in range(p) if label_rows else ():
        ax.text(xmax, -d, peak_labels[d], fontsize=peak_pt, va="center", ha="left",
                color="#2c4f73", clip_on=False)
    ax.set_xlim(0, xmax)
    ax.set_ylim(-p + 0.5, 0.5)
    _device_ticks(ax, [float(-d) for d in range(p)], rows_px / p, dpi)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    limit_txt = ", dashed: memory limit" if known else ""
    ax.set_title(f"{what} (each band: 0 to {fmt(full)}{limit_txt})",
                 fontsize=9, loc="left")
    ax.set_xlabel("time (s)")


def _peak_labels(peaks: Sequence[float], fmt: Callable[[float], str], dpi: float
                 ) -> tuple[float, list[str]]:
    """Font size (points) and text of the "peak" labels right of the memory bands: 6 points
    but never under :data:`_MIN_TEXT_PX` pixels, shrunk to fit the right margin, and none
    (an empty list) when even that smallest size does not fit it."""
    labels = [f" peak {fmt(pk)}" for pk in peaks]
    pt = _min_pt(6.0, dpi)
    room_px = _RIGHT_IN * dpi - 2
    widest = max((_text_width_px(t, pt, dpi) for t in set(labels)), default=0.0)
    if widest > room_px:
        pt *= room_px / widest
    if pt * dpi / 72 < _MIN_TEXT_PX - 1e-9:
        return pt, []
    return pt, labels


def _legend_handles(schedules: Sequence[Schedule], drawn: Sequence[_Drawn]
                    ) -> list[Patch | Line2D]:
    """Legend entries for what is on the charts (``drawn``, one per schedule)."""
    handles: list[Patch | Line2D] = []
    kinds = [k for k in ("F", "B", "W") if any(k in s.problem.kinds for s in schedules)]
    split = any(s.problem.split_backward for s in schedules)
    fused = any(not s.problem.split_backward for s in schedules)
    for kind in kinds:
        name = KIND_NAMES[kind]
        if kind == "B" and not split:
            name = "backward"  # every B is the whole backward
        elif kind == "B" and fused:
            name = B_MIXED_NAME  # orange boxes of the fused rows are the whole backward
        handles.append(Patch(facecolor=_shade(kind, 1, 3), label=f"{kind}: {name}"))
    zero = [k for k in ("F", "B", "W") if any(k in d.zero_kinds for d in drawn)]
    if zero:
        handles.append(Line2D([], [], color=_tick_color(zero[0], 1, 3), marker="|",
                              linestyle="none", markersize=8, markeredgewidth=1.5,
                              label=f"zero-length {'/'.join(zero)} (tick)"))
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle (bubble)"))
    if any(d.grad_reduce for d in drawn):
        handles.append(Patch(facecolor="none", edgecolor=REDUCE_COLOR, hatch=REDUCE_HATCH,
                             linewidth=0.6, label="gradient all-reduce"))
    if any(d.chunk_marks for d in drawn):
        handles.append(Patch(facecolor=CHUNK_MARK_COLOR, label="underlined: odd chunk"))
    if any(d.link_busy for d in drawn):
        handles.append(Patch(facecolor=LINK_COLOR, label="link busy (sender)"))
    shown = sum(d.delays_drawn for d in drawn)
    if shown:
        left = sum(d.delays_left_out for d in drawn)
        label = "message delay"
        if left:
            label += f" (slowest links only; {left:,} more not drawn)"
        handles.append(Line2D([], [], color=LINK_COLOR, alpha=0.6, lw=1, label=label))
    if any(d.dc_boundaries for d in drawn):
        handles.append(Line2D([], [], color=DC_COLOR, lw=1.0, ls=(0, (5, 3)),
                              label="datacenter boundary"))
    return handles


def _caption(fig: Figure, drawn: Sequence[_Drawn]) -> None:
    """Bottom-right note on what was left out of the charts (nothing when nothing was)."""
    hidden = sum(d.delays_left_out for d in drawn if not d.delays_drawn)
    if hidden:
        w = fig.get_figwidth()
        fig.text(1 - _RIGHT_IN / w, 0.06 / fig.get_figheight(),
                 f"message delay lines not drawn: {hidden:,} (more than "
                 f"{_MAX_DELAY_LINES:,} even on the slowest links)",
                 ha="right", va="bottom", fontsize=7, color=NOTE_COLOR)


def _axes_rect(fig_w: float, fig_h: float, top_in: float, height_in: float
               ) -> tuple[float, float, float, float]:
    """Figure-relative [left, bottom, width, height] of an axes ``top_in`` below the top."""
    return (_LEFT_IN / fig_w, 1 - (top_in + height_in) / fig_h,
            (fig_w - _LEFT_IN - _RIGHT_IN) / fig_w, height_in / fig_h)


def render_schedule(schedule: Schedule, *, title: str | None = None, show_memory: bool = True,
                    dpi: float = DEFAULT_DPI, figsize: tuple[float, float] | None = None
                    ) -> Figure:
    """The Gantt figure of ``schedule`` (not saved); ``figsize`` in inches overrides
    :func:`figure_size`. A ``dpi`` that would make a side over :data:`MAX_SIDE_PX` pixels
    raises :class:`~pipeopt.config.ConfigError` naming ``--dpi``."""
    w, h = figsize or figure_size(schedule, show_memory)
    check_dpi((w, h), dpi)
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    p = schedule.problem.devices
    xmax = schedule.iteration_time * 1.005 or 1.0  # gradient reductions after the last op
    gantt_h = _gantt_rows_height(p)
    mem_h = _memory_rows_height(p) if show_memory else 0.0
    # When the caller picks the size, scale the rows to fill it.
    avail = h - _TOP_IN - _BOTTOM_IN - (_GAP_IN if show_memory else 0.0)
    scale = avail / (gantt_h + mem_h) if avail > 0 else 1.0
    gantt_h, mem_h = gantt_h * scale, mem_h * scale
    ax = fig.add_axes(_axes_rect(w, h, _TOP_IN, gantt_h))
    axes_w = w - _LEFT_IN - _RIGHT_IN
    drawn = _draw_gantt(ax, schedule, axes_w, dpi, xmax, gantt_h)
    _legend_and_title(fig, ax, _legend_handles([schedule], [drawn]),
                      title or schedule_title(schedule))
    if show_memory:
        mem_ax = fig.add_axes(_axes_rect(w, h, _TOP_IN + gantt_h + _GAP_IN, mem_h),
                              sharex=ax)
        _draw_memory(mem_ax, schedule, xmax, mem_h, dpi)
        ax.tick_params(axis="x", labelbottom=True, labelsize=8)
    else:
        ax.set_xlabel("time (s)")
    _caption(fig, [drawn])
    return fig


def _legend_and_title(fig: Figure, ax: Axes, handles: Sequence[Patch | Line2D], title: str
                      ) -> None:
    """The legend above ``ax`` (7 points, 6 when 7 takes more rows than the top margin holds)
    and the title above it, in the largest of 11 to 8 points that fits the figure's width."""
    for legend_pt in (7.0, 6.0):
        legend, rows = _fit_legend(fig, lambda ncol, pt=legend_pt: ax.legend(
            handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=ncol,
            fontsize=pt, frameon=False, borderaxespad=0.1, handlelength=1.5), handles)
        pad = 22 + legend_pt * 1.25 * (rows - 1)  # the title sits above the legend's rows
        if pad + 14 <= _TOP_IN * 72 or legend_pt == 6.0:
            break
        legend.remove()
    text = ax.set_title(title, fontsize=11, loc="left", pad=pad)
    _fit_texts(fig, [text], (11.0, 10.0, 9.0, 8.0))


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Save ``fig`` atomically (a temporary file in the same folder and a rename), in the
    format its suffix names."""
    fmt = image_format(path)
    return write_atomic(path, lambda fh: fig.savefig(fh, format=fmt, dpi=fig.dpi))


def plot_schedule(schedule: Schedule, path: str | os.PathLike[str], *, title: str | None = None,
                  show_memory: bool = True, dpi: float = DEFAULT_DPI,
                  figsize: tuple[float, float] | None = None) -> Path:
    """Draw ``schedule`` as a Gantt chart into ``path`` (written atomically): PNG, SVG or PDF
    by its suffix, any other suffix raises :class:`~pipeopt.config.ConfigError`.

    The image is ``figure_size(schedule, show_memory)`` inches (or ``figsize``) times ``dpi``
    pixels, at most :data:`MAX_SIDE_PX` per side. Returns the path written.
    """
    image_format(path)  # before drawing: a wrong suffix should not cost a render
    fig = render_schedule(schedule, title=title, show_memory=show_memory, dpi=dpi,
                          figsize=figsize)
    return _save(fig, path)


def _over_limit_note(schedule: Schedule) -> str:
    """Red marker text for a schedule over its memory limit: the worst device, if any."""
    over = [(peak / lim, d, peak, lim) for d, (peak, lim)
            in enumerate(zip(schedule.peak_memory, schedule.problem.memory_limit,
                             strict=False))
            if lim is not None and lim > 0 and peak > lim]
    if not over:
        return "OVER MEMORY LIMIT"
    _, d, peak, lim = max(over, key=lambda t: (t[0], -t[1]))  # worst; first on a tie
    return (f"OVER MEMORY LIMIT: dev {d} peaks at {_fmt_mem(peak, schedule)} > "
            f"{_fmt_mem(lim, schedule)}")


def _compare_title_lines(schedule: Schedule, fits: bool, best: float | None) -> list[str]:
    """The title of ``schedule`` in a compare plot: the method, shape, times, bubble ratio,
    "x1.041 of best" and peak memory; when it does not fit, the over-limit note on a second
    line (it would run past the figure's edge at the end of the first)."""
    first = (schedule_title(schedule) + _ratio_text(schedule, best)
             + f"{_SEP}peak mem {_fmt_mem(max(schedule.peak_memory), schedule)}")
    return [first] if fits else [first, _over_limit_note(schedule)]


def _ratio_text(schedule: Schedule, best: float | None) -> str:
    """"x1.041 of best" against ``best`` (the best objective that fits), as compare does."""
    if not best or best <= 0:
        return ""
    what = ""
    if schedule.solver.objective == "span":
        what = " span"
    elif not math.isclose(schedule.objective_value, schedule.makespan, rel_tol=1e-12):
        what = " iteration time"
    return f"   x{schedule.objective_value / best:.3f} of best{what}"


def render_compare(schedules: Sequence[Schedule], *, dpi: float = DEFAULT_DPI,
                   fits: Sequence[bool] | None = None) -> Figure:
    """The figure of :func:`plot_compare` (not saved).

    ``fits`` says per schedule whether it keeps its memory limits (None: all do). "x1.041 of
    best" in a title compares its objective with the best schedule that fits, like the
    ``vs best`` column of ``pipeopt compare``; a schedule that does not fit gets a red "OVER
    MEMORY LIMIT" title. A ``dpi`` that would make a side over :data:`MAX_SIDE_PX` pixels
    raises :class:`~pipeopt.config.ConfigError`.
    """
    schedules = list(schedules)
    if not schedules:
        raise ScheduleError("plot: no schedule to draw (every method failed or was skipped)")
    fit = _fits(schedules, fits)
    w, h, titles, heights = _compare_layout(schedules, fit)
    check_dpi((w, h), dpi, "dpi")
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    # Gradient reductions may run past the last op: the axis ends at the iteration time.
    xmax = max(s.iteration_time for s in schedules) * 1.005 or 1.0
    axes_w = w - _LEFT_IN - _RIGHT_IN
    top = _COMPARE_HEAD_IN
    first: Axes | None = None
    drawn: list[_Drawn] = []
    texts: list[Text] = []
    for s, f, lines, rows in zip(schedules, fit, titles, heights, strict=True):
        # Further title lines (the over-limit note, a wrapped long title) get their room.
        top += _TOP_IN * 0.6 + (len(lines) - 1) * _TITLE_LINE_IN
        ax = fig.add_axes(_axes_rect(w, h, top, rows), sharex=first)
        first = first or ax
        drawn.append(_draw_gantt(ax, s, axes_w, dpi, xmax, rows))
        texts.append(ax.set_title(
            "\n".join(lines), fontsize=_TITLE_PT, loc="left", linespacing=1.1,
            color="black" if f else LIMIT_COLOR, fontweight="normal" if f else "bold"))
        ax.tick_params(axis="x", labelsize=7)
        top += rows + 0.3
    _compare_frame(fig, texts, _legend_handles(schedules, drawn), w, h)
    fig.axes[-1].set_xlabel("time (s)")
    _caption(fig, drawn)
    return fig


def _compare_frame(fig: Figure, texts: Sequence[Text], handles: Sequence[object], w: float,
                   h: float) -> None:
    """The frame of a compare figure ``w`` x ``h`` inches: one font for every title (the
    largest at which none passes the right edge), the heading, and the legend of ``handles``."""
    _fit_texts(fig, texts,
               [_TITLE_PT - 0.5 * i for i in range(int((_TITLE_PT - _MIN_TITLE_PT) / 0.5) + 1)])
    fig.suptitle("methods compared (common time axis)", x=_LEFT_IN / w, ha="left",
                 y=1 - 0.12 / h, fontsize=11, va="top")
    _fit_legend(fig, lambda ncol: fig.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(_LEFT_IN / w, 1 - 0.42 / h),
        ncol=ncol, fontsize=7, frameon=False, borderaxespad=0.0, handlelength=1.5), handles)


def plot_compare(schedules: Sequence[Schedule], path: str | os.PathLike[str], *,
                 dpi: float = DEFAULT_DPI, fits: Sequence[bool] | None = None) -> Path:
    """Draw several schedules one above the other on a common time axis into ``path``
    (written atomically; PNG, SVG or PDF by its suffix), so their makespans compare at a
    glance. ``fits``: per schedule, whether it keeps its memory limits (None: all do); see
    :func:`render_compare`."""
    image_format(path)
    return _save(render_compare(schedules, dpi=dpi, fits=fits), path)


# ----- task-graph schedules (schedule JSON v2) ------------------------------------------------
#: Colours of task groups other than F / B / W (which keep the chain's colours), in order of
#: first appearance: matplotlib's qualitative "tab10" map, then "tab20b" beyond ten groups.
GROUP_CMAPS = ("tab10", "tab20b")
TAIL_LABEL = "tail (after the task, counted by the objective)"


def _link_rows(schedule: GraphSchedule) -> list[int]:
    """Network resource ids drawn below the devices, one chart row each: the directed links
    that carry a timed message or are held by a communication task, in id order, then every
    named network (a NIC, a WAN: resource ids after the links)."""
    g = schedule.graph
    used = {g.edge_link[mm.edge] for mm in schedule.messages}
    used.update(r for i in g.comm_tasks for r in g.holds[i] if r < g.num_links)
    return sorted(used) + list(range(g.num_links, g.num_resources))


def graph_figure_size(schedule: GraphSchedule, show_memory: bool = True
                      ) -> tuple[float, float]:
    """(width, height) in inches of :func:`plot_graph_schedule`'s figure: a row per device
    and per network resource drawn (:func:`_link_rows`), a memory band per device."""
    g = schedule.graph
    typical = _median([b - a for a, b in zip(schedule.start, schedule.end, strict=True)])
    return (_width_of(schedule.objective, [(g.num_tasks / g.devices, typical)]),
            _height(g.devices + len(_link_rows(schedule)), g.devices, show_memory))


def group_colors(groups: Sequence[str]) -> dict[str, tuple[float, float, float, float]]:
    """A colour per distinct group: F, B and W as in chain plots, the others from
    :data:`GROUP_CMAPS` in order of first appearance (cycling past their 30 colours)."""
    palette = [c for name in GROUP_CMAPS for c in colormaps[name].colors]  # type: ignore[attr-defined]
    out: dict[str, tuple[float, float, float, float]] = {}
    others = 0
    for grp in dict.fromkeys(groups):
        if grp in KIND_CMAPS:
            out[grp] = _shade(grp, 1, 3)
        else:
            out[grp] = to_rgba(palette[others % len(palette)])
            others += 1
    return out


def graph_title(schedule: GraphSchedule) -> str:
    """One line: method, graph size (with the communication tasks' count), makespan, objective
    (when tails make it later), status."""
    g = schedule.graph
    comm = f" ({len(g.comm_tasks):,} on the network)" if g.comm_tasks else ""
    out = (f"{schedule.method}   {g.num_tasks:,} tasks{comm} on {g.devices} devices   "
           f"makespan {_fmt_time(schedule.makespan)}")
    if not math.isclose(schedule.objective, schedule.makespan, rel_tol=1e-12):
        out += f"   objective {_fmt_time(schedule.objective)}"
    if schedule.status != "heuristic":
        out += f"   [{schedule.status}]"
    serving = serving_metrics(schedule)
    if serving is not None:  # an inference plan (issue 15): its serving figures
        out += (f"   {serving.throughput_tokens_per_s:,.1f} tokens/s   TTFT p50 "
                f"{_fmt_time(serving.ttft_p50_s)} p99 {_fmt_time(serving.ttft_p99_s)}   TPOT "
                f"{_fmt_time(serving.tpot_s)}")
    return out


def _draw_graph_rows(ax: Axes, schedule: GraphSchedule, links: Sequence[int],
                     axes_width_in: float, dpi: float, xmax: float, height_in: float
                     ) -> list[Patch | Line2D]:
    """Tasks on their device rows (coloured by group), communication tasks on the row of each
    resource they hold, each row's latest-reaching tail hatched, messages on their link's
    row; returns the legend entries. ``links``: the resource rows (:func:`_link_rows`)."""
    g = schedule.graph
    p, half = g.devices, _HALF
    rows = p + len(links)
    start, end = schedule.start, schedule.end
    groups = task_groups(g)
    colors = group_colors(groups)
    row_of = {k: p + r for r, k in enumerate(links)}
    # (row, task) of every box: a device task on its device, a communication task once on
    # each resource it holds.
    placed = [(d, i) for i, d in enumerate(g.device) if d >= 0]
    on_net = [(row_of[r], i) for i in g.comm_tasks for r in g.holds[i]]
    ax.add_collection(PolyCollection(
        [[(0, d - half), (schedule.makespan, d - half), (schedule.makespan, d + half),
          (0, d + half)] for d in range(p)], facecolors=IDLE_COLOR, edgecolors="none",
        zorder=1))
    px_per_s = axes_width_in * dpi / xmax if xmax > 0 else 0.0
    row_px = height_in * dpi / max(1, rows)
    boxes = [(r, start[i], end[i]) for r, i in placed]
    widths_px = [(b - a) * px_per_s for _, a, b in boxes]
    if _median(widths_px) < _RASTER_BELOW_PX:
        keys = list(colors)
        index = {k: i for i, k in enumerate(keys)}
        _paint_raster(ax, p, boxes, [index[groups[i]] for _, i in placed],
                      [colors[k] for k in keys], round(axes_width_in * dpi), xmax,
                      schedule.makespan)
    else:
        _paint_boxes(ax, boxes, [colors[groups[i]] for _, i in placed], widths_px, row_px,
                     rows)
    if on_net:  # few (collectives): always drawn as boxes
        net_boxes = [(r, start[i], end[i]) for r, i in on_net]
        net_px = [(b - a) * px_per_s for _, a, b in net_boxes]
        _paint_boxes(ax, net_boxes, [colors[groups[i]] for _, i in on_net], net_px, row_px,
                     rows)
        placed, boxes, widths_px = placed + on_net, boxes + net_boxes, widths_px + net_px
    zero = [(r, i) for r, i in placed if end[i] <= start[i]]
    if zero:
        _paint_ticks(ax, [(r, start[i]) for r, i in zero], [colors[groups[i]] for _, i in zero],
                     dpi)
    if g.num_tasks <= _MAX_LABELS:  # each task's label where the longest one fits
        _box_labels(ax, boxes, [g.label[i] for _, i in placed],
                    [colors[groups[i]] for _, i in placed], widths_px, row_px, dpi,
                    max(map(len, g.label), default=1))
    comm_groups = {groups[i] for i in g.comm_tasks} - {groups[i] for _, i in placed
                                                       if g.device[i] >= 0}
    handles: list[Patch | Line2D] = [
        Patch(facecolor=c, label=f"{k} (collective)" if k in comm_groups - {ARRIVAL_GROUP}
              else k)
        for k, c in colors.items()]
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle"))
    last: dict[int, int] = {}  # per row, the task whose tail reaches latest
    for d, i in placed:
        t = g.tail[i]
        if t > 0 and (d not in last or end[i] + t > end[last[d]] + g.tail[last[d]]):
            last[d] = i
    if last:
        bars = [[(end[i], d - half), (end[i] + g.tail[i], d - half),
                 (end[i] + g.tail[i], d + half), (end[i], d + half)] for d, i in last.items()]
        hatched = PolyCollection(bars, facecolors="none", edgecolors=REDUCE_COLOR,
                                 hatch=REDUCE_HATCH, linewidths=0.6, zorder=2.6)
        if hasattr(hatched, "set_hatchcolor"):  # matplotlib >= 3.10, as in _draw_gantt
            hatched.set_hatchcolor(REDUCE_COLOR)
        ax.add_collection(hatched)
        handles.append(Patch(facecolor="none", edgecolor=REDUCE_COLOR, hatch=REDUCE_HATCH,
                             linewidth=0.6, label=TAIL_LABEL))
    if schedule.messages:
        on_link = [(row_of[g.edge_link[mm.edge]], mm.start, mm.end) for mm in schedule.messages]
        _paint_boxes(ax, on_link, [LINK_COLOR] * len(on_link),
                     [(b - a) * px_per_s for _, a, b in on_link], row_px, rows)
        handles.append(Patch(facecolor=LINK_COLOR, label="message on its link"))
    ax.set_xlim(0, xmax)
    ax.set_ylim(rows - 0.5, -0.5)  # device 0 on top, links below the devices
    kinds = dict(g.meta).get("device_kind")
    names = [f"dev {d}" + (f" {kinds[d]}" if isinstance(kinds, tuple) and len(kinds) == p
                           else "") for d in range(p)]
    names += [g.resource_name(k) for k in links]
    _device_ticks(ax, [float(r) for r in range(rows)], row_px, dpi, names)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return handles


def render_graph_schedule(schedule: GraphSchedule, *, title: str | None = None,
                          show_memory: bool = True, dpi: float = DEFAULT_DPI,
                          figsize: tuple[float, float] | None = None) -> Figure:
    """The Gantt figure of a task-graph schedule (not saved), laid out as
    :func:`render_schedule` lays out a chain's: a row per device, then a row per directed link
    that carries messages or collectives and one per named network resource (communication
    tasks drawn on every resource they hold); tasks coloured by group
    (:func:`~pipeopt.core.schedule.task_groups`); memory in use per device underneath.
    ``figsize`` (inches) overrides :func:`graph_figure_size`; a ``dpi`` past
    :data:`MAX_SIDE_PX` raises :class:`~pipeopt.config.ConfigError` naming ``--dpi``."""
    g = schedule.graph
    w, h = figsize or graph_figure_size(schedule, show_memory)
    check_dpi((w, h), dpi)
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    links = _link_rows(schedule)
    xmax = schedule.objective * 1.005 or 1.0  # tails may reach past the last task
    gantt_h = _gantt_rows_height(g.devices + len(links))
    mem_h = _memory_rows_height(g.devices) if show_memory else 0.0
    avail = h - _TOP_IN - _BOTTOM_IN - (_GAP_IN if show_memory else 0.0)
    scale = avail / (gantt_h + mem_h) if avail > 0 else 1.0
    gantt_h, mem_h = gantt_h * scale, mem_h * scale
    ax = fig.add_axes(_axes_rect(w, h, _TOP_IN, gantt_h))
    handles = _draw_graph_rows(ax, schedule, links, w - _LEFT_IN - _RIGHT_IN, dpi, xmax,
                               gantt_h)
    _legend_and_title(fig, ax, handles, title or graph_title(schedule))
    if show_memory:
        mem_ax = fig.add_axes(_axes_rect(w, h, _TOP_IN + gantt_h + _GAP_IN, mem_h), sharex=ax)
        timelines, limits, peaks = (schedule.memory_timeline, g.memory_limit,
                                    schedule.peak_memory)
        what = "memory in use"
        if serving_plan(g) is not None:  # a serving plan: the KV cache, weights left out
            w0 = g.static_memory
            timelines = tuple(tuple((t, b - w0[d]) for t, b in steps)
                              for d, steps in enumerate(timelines))
            room = [lim - w0[d] for d, lim in enumerate(limits) if lim is not None]
            limits = (None,) * len(limits)  # scaled to the KV in use, not to the room for it
            peaks = tuple(pk - w0[d] for d, pk in enumerate(peaks))
            what = "KV cache per stage (weights left out" + (
                f"; room for it: at least {min(room):.3g} B)" if room else ")")
        _memory_bands(mem_ax, timelines, limits, peaks, xmax, mem_h, dpi,
                      lambda x: f"{x:.3g} B", what)
        ax.tick_params(axis="x", labelbottom=True, labelsize=8)
    else:
        ax.set_xlabel("time (s)")
    return fig


def plot_graph_schedule(schedule: GraphSchedule, path: str | os.PathLike[str], *,
                        title: str | None = None, show_memory: bool = True,
                        dpi: float = DEFAULT_DPI, figsize: tuple[float, float] | None = None
                        ) -> Path:
    """Draw a task-graph schedule into ``path`` (written atomically; PNG, SVG or PDF by its
    suffix); see :func:`render_graph_schedule`. Returns the path written."""
    image_format(path)
    return _save(render_graph_schedule(schedule, title=title, show_memory=show_memory, dpi=dpi,
                                       figsize=figsize), path)


def render_graph_compare(schedules: Sequence[GraphSchedule], *, dpi: float = DEFAULT_DPI,
                         fits: Sequence[bool] | None = None,
                         values: Sequence[float] | None = None) -> Figure:
    """Task-graph schedules one above the other on a common time axis (not saved): each one's
    device and network rows as :func:`render_graph_schedule` draws them (no memory bands),
    titled by :func:`graph_title` and "x1.041 of best" (``values[k]``, default the
    objective, against the best that fits); a schedule over its memory limits (``fits[k]``
    False) gets a red "OVER MEMORY LIMIT" title. The legend is the first schedule's."""
    schedules = list(schedules)
    if not schedules:
        raise ScheduleError("plot: no schedule to draw (every method failed or was skipped)")
    fit = list(fits) if fits is not None else [True] * len(schedules)
    vals = list(values) if values is not None else [s.objective for s in schedules]
    if len(fit) != len(schedules) or len(vals) != len(schedules):
        raise ValueError(f"fits / values: expected {len(schedules)} entries (one per schedule)")
    best = min((v for v, f in zip(vals, fit, strict=True) if f), default=None)
    links = [_link_rows(s) for s in schedules]
    rows = [_gantt_rows_height(s.graph.devices + len(k)) for s, k in zip(schedules, links,
                                                                       strict=True)]
    w = max(graph_figure_size(s, show_memory=False)[0] for s in schedules)
    h = _eighths(_COMPARE_HEAD_IN + _BOTTOM_IN + sum(rows) + (_TOP_IN * 0.6 + 0.3)
                 * len(schedules))
    check_dpi((w, h), dpi, "dpi")
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    xmax = max(s.objective for s in schedules) * 1.005 or 1.0
    top, first, handles = _COMPARE_HEAD_IN, None, None
    texts = []
    for s, k, f, v, r in zip(schedules, links, fit, vals, rows, strict=True):
        top += _TOP_IN * 0.6
        ax = fig.add_axes(_axes_rect(w, h, top, r), sharex=first)
        first = first or ax
        drawn = _draw_graph_rows(ax, s, k, w - _LEFT_IN - _RIGHT_IN, dpi, xmax, r)
        handles = handles or drawn
        title = graph_title(s)
        if best is not None and best > 0:
            title += f"   x{v / best:.3f} of best"
        if not f:
            title = "OVER MEMORY LIMIT   " + title
        texts.append(ax.set_title(title, fontsize=_TITLE_PT, loc="left",
                                  color="black" if f else LIMIT_COLOR,
                                  fontweight="normal" if f else "bold"))
        ax.tick_params(axis="x", labelsize=7)
        top += r + 0.3
    _compare_frame(fig, texts, handles or [], w, h)
    fig.axes[-1].set_xlabel("time (s)")
    return fig


def plot_graph_compare(schedules: Sequence[GraphSchedule], path: str | os.PathLike[str], *,
                       dpi: float = DEFAULT_DPI, fits: Sequence[bool] | None = None,
                       values: Sequence[float] | None = None) -> Path:
    """Draw :func:`render_graph_compare`'s figure into ``path`` (written atomically; PNG, SVG
    or PDF by its suffix). Returns the path written."""
    image_format(path)
    return _save(render_graph_compare(schedules, dpi=dpi, fits=fits, values=values), path)


def plot_any(schedule: Schedule | GraphSchedule, path: str | os.PathLike[str], *,
             title: str | None = None, show_memory: bool = True, dpi: float = DEFAULT_DPI
             ) -> Path:
    """:func:`plot_schedule` for a chain schedule, :func:`plot_graph_schedule` for a graph's."""
    if isinstance(schedule, GraphSchedule):
        return plot_graph_schedule(schedule, path, title=title, show_memory=show_memory,
                                   dpi=dpi)
    return plot_schedule(schedule, path, title=title, show_memory=show_memory, dpi=dpi)
