"""Text views of a :class:`~pipeopt.plan.search.Plan`: the ranked table, the Pareto fronts
and the FLOP count of Narayanan et al. used to compare with their reported throughput."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pipeopt.plan.search import CandidateResult, Plan

GIB = 2**30


def narayanan_flops(layers: int, hidden: int, seq_len: int, vocab: int, batch: int) -> float:
    """FLOPs of one training step as Narayanan et al. (SC'21, section 5.1, equation 3) count
    them for their reported TFLOP/s: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), a forward, a
    backward (twice the forward) and the full recomputation's second forward, with
    non-causal attention."""
    b, s, ell, h, v = batch, seq_len, layers, hidden, vocab
    return 96.0 * b * s * ell * h * h * (1 + s / (6 * h) + v / (16 * ell * h))


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(r: CandidateResult, rank: str, priced: bool, moe: bool = False) -> list[str]:
    c = r.candidate
    gap = r.gap
    # The reason's first word (memory, bound, time limit ...); --json has it whole.
    why = r.status if not r.reason else f"{r.status} ({r.reason.split(':')[0]})"
    return [rank, str(c.gpus), str(c.tp), str(c.pp), str(c.dp),
            *([str(c.ep)] if moe else []), str(c.micro_batch_size),
            str(c.microbatches), str(c.virtual_stages), c.recompute, str(c.zero),
            _f(r.step_time_s, ".4g"), _f(r.tokens_per_s, ".4g"),
            _f(None if r.mfu is None else 100 * r.mfu, ".1f"),
            _f(None if r.peak_memory_bytes is None else r.peak_memory_bytes / GIB, ".1f"),
            _f(None if r.bubble_ratio is None else 100 * r.bubble_ratio, ".1f"),
            _f(r.bound_s, ".4g"), _f(None if gap is None else 100 * gap, ".1f"),
            *([_f(r.cost_per_step, ".4g")] if priced else []),
            why]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.rjust(w) if 0 < j < len(row) - 1 else c.ljust(w)
                 for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _head(priced: bool, moe: bool = False) -> list[str]:
    return ["#", "gpus", "tp", "pp", "dp", *(["ep"] if moe else []), "b", "m", "v",
            "recompute", "zero", "step s",
            "tokens/s", "MFU %", "peak GiB", "bubble %", "bound s", "gap %",
            *(["$/step"] if priced else []), "status"]


def ranked_table(result: Plan, top: int = 15) -> str:
    """The best ``top`` candidates (scheduled first, by step time), then a count of the rest
    by status; an MoE model's table has the expert-parallel size in column ``ep``."""
    priced = bool(result.spec.prices)
    moe = result.spec.moe is not None
    rows = [_head(priced, moe)]
    for i, r in enumerate(result.results[:top]):
        rows.append(_row(r, str(i + 1), priced, moe))
    text = _table(rows)
    rest = len(result.results) - min(top, len(result.results))
    if rest:
        text += (f"\n... {rest} more: see --json ({result.count('scheduled')} scheduled, "
                 f"{result.count('pruned', 'memory')} pruned by memory, "
                 f"{result.count('pruned', 'bound')} pruned by bound, "
                 f"{result.count('skipped')} skipped, {result.count('failed')} failed in all)")
    return text


def pareto_table(result: Plan, objective: Literal["memory", "cost"] = "memory") -> str:
    """The Pareto front of step time against peak memory per device (or cost per step):
    the scheduled candidates no other beats on both, fastest first."""
    front = result.pareto(objective)
    if not front:
        return ""
    what = "peak memory" if objective == "memory" else "cost per step"
    rows = [["step s", "peak GiB" if objective == "memory" else "$/step", "configuration"]]
    for r in front:
        val = (r.peak_memory_bytes / GIB if objective == "memory" and r.peak_memory_bytes
               is not None else r.cost_per_step)
        rows.append([_f(r.step_time_s, ".4g"), _f(val, ".4g" if objective == "cost" else ".1f"),
                     r.candidate.label])
    return f"pareto: step time vs {what}\n" + _table(rows)
