"""Gantt charts of schedules (matplotlib, Agg backend, no pyplot state).

:func:`plot_schedule` draws one schedule: a row per device with its F / B / W ops coloured by
kind and shaded by micro-batch, idle time (bubbles) as grey gaps, link traffic, and a memory
strip per device underneath. :func:`plot_compare` stacks several schedules on one time axis.
Figure sizes are fixed by :func:`figure_size` (inches, multiples of 1/8), so the PNG is
``int(inches * dpi)`` pixels wide and high.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipeopt.io import write_atomic
from pipeopt.schedule import Schedule, TimedOp
from pipeopt.simulate import ScheduleError

#: Colour map of each op kind; the micro-batch picks the shade within it.
KIND_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}
KIND_NAMES = {"F": "forward", "B": "backward (input)", "W": "backward (weight)"}
IDLE_COLOR = "#e6e6e6"
LINK_COLOR = "#7b3294"
LIMIT_COLOR = "#d62728"
CHUNK_MARK_COLOR = "#333333"

# Layout, in inches: fixed margins make the axes size known before drawing, which is what
# lets labels be dropped when their box is too narrow.
_LEFT_IN, _RIGHT_IN, _TOP_IN, _BOTTOM_IN, _GAP_IN = 0.9, 0.75, 0.75, 0.55, 0.45
_MAX_LABELS = 3000  # text is slow to render; past this many boxes no label would be legible
_MAX_DELAY_LINES = 1500  # latency arrows beyond this count are noise, not information
_LABEL_FONT_PT = 7.0


def _gantt_rows_height(devices: int) -> float:
    return max(1.2, 0.3 * devices)


def _memory_rows_height(devices: int) -> float:
    return max(1.0, 0.22 * devices if devices <= 16 else 3.5 + 0.12 * (devices - 16))


def _eighths(inches: float) -> float:
    """Round up to 1/8 inch: exact in binary, so the PNG is exactly int(inches * dpi) pixels
    for an integer dpi."""
    return math.ceil(inches * 8 - 1e-9) / 8


def _compare_rows_height(schedule: Schedule, count: int) -> float:
    # Many tall pipelines would make a poster: squeeze each one so the page stays under
    # about 30 inches, but never below 1.5 inch per schedule.
    return min(_gantt_rows_height(schedule.problem.devices), max(1.5, 24.0 / max(1, count)))


def _width(schedules: Sequence[Schedule]) -> float:
    # Room for the busiest device's ops: about 0.07 inch per op, clamped to a sane page.
    most = max((len(s.ops) / max(1, s.problem.devices) for s in schedules), default=0.0)
    return _eighths(min(24.0, max(10.0, 4.0 + 0.07 * most)))


def figure_size(schedule: Schedule, show_memory: bool = True) -> tuple[float, float]:
    """(width, height) in inches of :func:`plot_schedule`'s figure for ``schedule``."""
    p = schedule.problem.devices
    h = _TOP_IN + _gantt_rows_height(p) + _BOTTOM_IN
    if show_memory:
        h += _GAP_IN + _memory_rows_height(p)
    return _width([schedule]), _eighths(h)


def compare_figure_size(schedules: Sequence[Schedule]) -> tuple[float, float]:
    """(width, height) in inches of :func:`plot_compare`'s figure."""
    h = _BOTTOM_IN + sum(_TOP_IN * 0.6 + _compare_rows_height(s, len(schedules))
                         for s in schedules) + 0.3 * len(schedules) + 0.4
    return _width(schedules), _eighths(h)


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


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


def _fmt_time(x: float) -> str:
    return f"{x:.4g} s"


def schedule_title(schedule: Schedule) -> str:
    """One line naming the method, the shape, makespan and bubble ratio."""
    pr = schedule.problem
    shape = f"p={pr.devices} m={pr.microbatches}"
    if pr.virtual_stages > 1:
        shape += f" v={pr.virtual_stages} ({pr.placement})"
    out = (f"{schedule.method}   {shape}   makespan {_fmt_time(schedule.makespan)}   "
           f"bubble ratio {schedule.bubble_ratio:.1%}")
    if schedule.solver.status != "heuristic":
        out += f"   [{schedule.solver.status}]"
    return out


# ----- drawing -------------------------------------------------------------------------------
def _draw_gantt(ax: Axes, schedule: Schedule, axes_width_in: float, dpi: float,
                xmax: float, height_in: float) -> None:
    """Ops, idle background, link traffic and latency arrows of ``schedule`` on ``ax``."""
    pr = schedule.problem
    p, m = pr.devices, pr.microbatches
    half = 0.38  # half the height of an op box, in row units

    # Idle time: a grey band per device from 0 to the makespan; ops cover the busy parts.
    idle = [[(0, d - half), (schedule.makespan, d - half), (schedule.makespan, d + half),
             (0, d + half)] for d in range(p)]
    ax.add_collection(PolyCollection(idle, facecolors=IDLE_COLOR, edgecolors="none", zorder=1))

    chunk_of = _chunk_index(schedule)
    boxes: list[list[tuple[float, float]]] = []
    colors = []
    marks: list[list[tuple[float, float]]] = []  # odd chunks: a dark strip along the bottom
    for o in schedule.ops:
        boxes.append([(o.start, o.device - half), (o.end, o.device - half),
                      (o.end, o.device + half), (o.start, o.device + half)])
        colors.append(_shade(o.kind, o.microbatch, m))
        if chunk_of[o.stage] % 2:
            top = o.device + half - 0.14
            marks.append([(o.start, top), (o.end, top), (o.end, o.device + half),
                          (o.start, o.device + half)])
    ops_px = axes_width_in * dpi
    lw = 0.5 if len(schedule.ops) / max(1, p) < 150 else 0.25
    ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors="white",
                                     linewidths=lw, zorder=2))
    if marks:
        ax.add_collection(PolyCollection(marks, facecolors=CHUNK_MARK_COLOR,
                                         edgecolors="white", linewidths=lw, zorder=2.5))

    # Micro-batch numbers inside the boxes, only where they fit.
    px_per_s = ops_px / xmax if xmax > 0 else 0.0
    row_px = 2 * half * height_in * dpi / p
    if row_px >= _LABEL_FONT_PT * dpi / 72 * 1.1 and len(schedule.ops) <= _MAX_LABELS:
        char_px = 0.62 * _LABEL_FONT_PT * dpi / 72
        for o in schedule.ops:
            text = str(o.microbatch)
            if (o.end - o.start) * px_per_s < char_px * len(text) + 3:
                continue
            color = _shade(o.kind, o.microbatch, m)
            ax.text((o.start + o.end) / 2, o.device, text, ha="center", va="center",
                    fontsize=_LABEL_FONT_PT, color=_text_color(color), zorder=4,
                    clip_on=True)

    # Link traffic: a thin bar under the sender's row while a message occupies its link,
    # then a line to the receiver's row at the arrival (the link latency).
    lane_top, lane_bot = half + 0.01, half + 0.11
    if schedule.messages:
        bars = [[(mm.start, mm.src_device + lane_top), (mm.end, mm.src_device + lane_top),
                 (mm.end, mm.src_device + lane_bot), (mm.start, mm.src_device + lane_bot)]
                for mm in schedule.messages]
        ax.add_collection(PolyCollection(bars, facecolors=LINK_COLOR, edgecolors="none",
                                         alpha=0.85, zorder=3))
    segments = _delay_segments(schedule)
    if segments and len(segments) <= _MAX_DELAY_LINES:
        ax.add_collection(LineCollection(segments, colors=LINK_COLOR, linewidths=0.6,
                                         alpha=0.45, zorder=3))

    ax.set_xlim(0, xmax)
    ax.set_ylim(p - 0.5, -0.5)  # device 0 on top
    _device_ticks(ax, [float(d) for d in range(p)], height_in * dpi / p, dpi)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _device_ticks(ax: Axes, positions: list[float], row_px: float, dpi: float) -> None:
    """Label rows "dev d", every row if the labels fit, else every 2nd, 4th, ... row."""
    font_pt = 8.0 if row_px >= 14 else 6.0
    need_px = font_pt * dpi / 72 * 1.2
    step = 1
    while step * row_px < need_px:
        step *= 2
    ax.set_yticks(positions)
    ax.set_yticklabels([f"dev {d}" if d % step == 0 else "" for d in range(len(positions))],
                       fontsize=font_pt)


def _chunk_index(schedule: Schedule) -> list[int]:
    """Per global stage, which of its device's chunks it is (0 for the first)."""
    pr = schedule.problem
    out = [0] * pr.stages
    for stages in pr.device_stages:
        for c, k in enumerate(stages):
            out[k] = c
    return out


def _delay_segments(schedule: Schedule) -> list[list[tuple[float, float]]]:
    """Lines from a producer's end on its row to the arrival on the consumer's row.

    For messages that occupy a link the line starts where the transmission ends; for
    latency-only links it starts at the producer's end. Links with no delay draw nothing.
    """
    pr = schedule.problem
    segs: list[list[tuple[float, float]]] = []
    if schedule.messages:
        for mm in schedule.messages:
            if mm.arrival > mm.end:
                segs.append([(mm.end, mm.src_device + 0.38), (mm.arrival, mm.dst_device)])
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
        delay = pr.delay(o.stage, dst)
        if delay <= 0:
            continue
        consumer = ends.get((o.kind, dst, o.microbatch))
        if consumer is None:
            continue
        segs.append([(o.end, o.device), (o.end + delay, consumer.device)])
    return segs


def _draw_memory(ax: Axes, schedule: Schedule, xmax: float, height_in: float,
                 dpi: float) -> None:
    """Memory in use per device as a step plot in its own band; limits dashed."""
    pr = schedule.problem
    p = pr.devices
    limits = [lim for lim in pr.memory_limit if lim is not None]
    full = max([*schedule.peak_memory, *limits, 0.0])
    full = full if full > 0 else 1.0
    band = 0.8
    rows_px = height_in * dpi
    label_rows = rows_px / p >= 10
    for d, steps in enumerate(schedule.memory_timeline):
        base = -d - band / 2
        xs = [t for t, _ in steps] + [max(xmax, steps[-1][0])]
        ys = [base + band * b / full for _, b in steps]
        ys.append(ys[-1])
        ax.fill_between(xs, base, ys, step="post", color="#6a8caf", alpha=0.35, lw=0)
        ax.step(xs, ys, where="post", color="#2c4f73", lw=0.8)
        lim = pr.memory_limit[d]
        if lim is not None:
            y = base + band * lim / full
            ax.plot([0, xmax], [y, y], ls="--", lw=0.8, color=LIMIT_COLOR)
        if label_rows:
            ax.text(xmax, base + band * 0.5, f" peak {_fmt_bytes(schedule.peak_memory[d])}",
                    fontsize=6, va="center", ha="left", color="#2c4f73", clip_on=False)
    ax.set_xlim(0, xmax)
    ax.set_ylim(-p + 0.5, 0.5)
    _device_ticks(ax, [float(-d) for d in range(p)], rows_px / p, dpi)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    limit_txt = ", dashed: memory limit" if limits else ""
    ax.set_title(f"memory in use (each band: 0 to {_fmt_bytes(full)}{limit_txt})",
                 fontsize=9, loc="left")
    ax.set_xlabel("time (s)")


def _legend_handles(schedule: Schedule) -> list[Patch | Line2D]:
    m = schedule.problem.microbatches
    handles: list[Patch | Line2D] = []
    for kind in schedule.problem.kinds:
        name = KIND_NAMES[kind] if schedule.problem.split_backward or kind != "B" else "backward"
        handles.append(Patch(facecolor=_shade(kind, m // 2, m), label=f"{kind}: {name}"))
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle (bubble)"))
    if schedule.problem.virtual_stages > 1:
        handles.append(Patch(facecolor=CHUNK_MARK_COLOR, label="underlined: odd chunk"))
    if schedule.messages:
        handles.append(Patch(facecolor=LINK_COLOR, label="link busy (sender)"))
    if schedule.messages or any(pr_lat > 0 for row in schedule.problem.latency
                                for pr_lat in row):
        handles.append(Line2D([], [], color=LINK_COLOR, alpha=0.6, lw=1,
                              label="message delay"))
    return handles


def _axes_rect(fig_w: float, fig_h: float, top_in: float, height_in: float
               ) -> tuple[float, float, float, float]:
    """Figure-relative [left, bottom, width, height] of an axes ``top_in`` below the top."""
    return (_LEFT_IN / fig_w, 1 - (top_in + height_in) / fig_h,
            (fig_w - _LEFT_IN - _RIGHT_IN) / fig_w, height_in / fig_h)


def render_schedule(schedule: Schedule, *, title: str | None = None, show_memory: bool = True,
                    dpi: float = 100, figsize: tuple[float, float] | None = None) -> Figure:
    """The Gantt figure of ``schedule`` (not saved); ``figsize`` in inches overrides
    :func:`figure_size`."""
    w, h = figsize or figure_size(schedule, show_memory)
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    p = schedule.problem.devices
    xmax = schedule.makespan * 1.005 or 1.0
    gantt_h = _gantt_rows_height(p)
    mem_h = _memory_rows_height(p) if show_memory else 0.0
    # When the caller picks the size, scale the rows to fill it.
    avail = h - _TOP_IN - _BOTTOM_IN - (_GAP_IN if show_memory else 0.0)
    scale = avail / (gantt_h + mem_h) if avail > 0 else 1.0
    gantt_h, mem_h = gantt_h * scale, mem_h * scale
    ax = fig.add_axes(_axes_rect(w, h, _TOP_IN, gantt_h))
    axes_w = w - _LEFT_IN - _RIGHT_IN
    _draw_gantt(ax, schedule, axes_w, dpi, xmax, gantt_h)
    ax.set_title(title or schedule_title(schedule), fontsize=11, loc="left", pad=22)
    ax.legend(handles=_legend_handles(schedule), loc="lower left", bbox_to_anchor=(0, 1.0),
              ncol=8, fontsize=7, frameon=False, borderaxespad=0.1, handlelength=1.5)
    if show_memory:
        mem_ax = fig.add_axes(_axes_rect(w, h, _TOP_IN + gantt_h + _GAP_IN, mem_h),
                              sharex=ax)
        _draw_memory(mem_ax, schedule, xmax, mem_h, dpi)
        ax.tick_params(axis="x", labelbottom=True, labelsize=8)
    else:
        ax.set_xlabel("time (s)")
    return fig


def _save_png(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Save ``fig`` as PNG atomically (a temporary file in the same folder and a rename)."""
    return write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=fig.dpi))


def plot_schedule(schedule: Schedule, path: str | os.PathLike[str], *, title: str | None = None,
                  show_memory: bool = True, dpi: float = 100,
                  figsize: tuple[float, float] | None = None) -> Path:
    """Draw ``schedule`` as a Gantt chart into the PNG ``path`` (written atomically).

    The image is ``figure_size(schedule, show_memory)`` inches (or ``figsize``) times ``dpi``
    pixels. Returns the path written.
    """
    if dpi <= 0 or not math.isfinite(dpi):
        raise ValueError(f"dpi: must be > 0, got {dpi}")
    fig = render_schedule(schedule, title=title, show_memory=show_memory, dpi=dpi,
                          figsize=figsize)
    return _save_png(fig, path)


def plot_compare(schedules: Sequence[Schedule], path: str | os.PathLike[str], *,
                 dpi: float = 100) -> Path:
    """Draw several schedules one above the other on a common time axis into the PNG
    ``path`` (written atomically), so their makespans compare at a glance."""
    schedules = list(schedules)
    if not schedules:
        raise ScheduleError("plot: no schedule to draw (every method failed or was skipped)")
    w, h = compare_figure_size(schedules)
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    xmax = max(s.makespan for s in schedules) * 1.005 or 1.0
    axes_w = w - _LEFT_IN - _RIGHT_IN
    best = min(s.makespan for s in schedules)
    top = 0.4
    first: Axes | None = None
    for s in schedules:
        rows = _compare_rows_height(s, len(schedules))
        top += _TOP_IN * 0.6
        ax = fig.add_axes(_axes_rect(w, h, top, rows), sharex=first)
        first = first or ax
        _draw_gantt(ax, s, axes_w, dpi, xmax, rows)
        rel = f"   x{s.makespan / best:.3f} of best" if best > 0 else ""
        ax.set_title(schedule_title(s) + rel + f"   peak mem {_fmt_bytes(max(s.peak_memory))}",
                     fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        top += rows + 0.3
    fig.suptitle("methods compared (common time axis)", x=_LEFT_IN / w, ha="left",
                 y=1 - 0.12 / h, fontsize=11)
    fig.axes[-1].set_xlabel("time (s)")
    return _save_png(fig, path)
