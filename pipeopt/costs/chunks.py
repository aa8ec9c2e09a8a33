"""The model form's chunking decision: ``auto`` chooses the chunks per device v (1 or 2).

A model-form config whose ``pipeline:`` leaves ``virtual_stages`` and ``placement`` out lets
the planner cut the model: besides the v = 1 problem it describes, :func:`solve_config` builds
the v = 2 problems from the same layers and cluster (looped, as interleaved 1F1B places
stages, and v-shaped, as ZB-V does), each with its own partition search, runs ``auto`` on
every one and keeps the best by the rule ``auto`` applies to its own candidates: the fastest
iteration time, or within ``solver.time_tolerance`` of it the lowest peak memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from pipeopt.errors import ConfigError
from pipeopt.problem import Problem, ProblemError
from pipeopt.schedule import Schedule
from pipeopt.schema import Config

logger = logging.getLogger(__name__)

#: (virtual stages, placement) of the variants tried besides the configured one.
VARIANTS: tuple[tuple[int, str], ...] = ((2, "vshape"), (2, "loop"))


@dataclass(frozen=True)
class Variant:
    """One chunking: its label (``v=2 vshape``), its problem, or why it was not built."""

    label: str
    problem: Problem | None
    note: str = ""


def chunk_variants(config: Config, time_limit: float | None = None) -> list[Variant]:
    """The chunkings ``auto`` may choose among for ``config``: the configured problem first,
    then the :data:`VARIANTS` that the config leaves open (none for an explicit config, a
    method other than auto's choice, a pipeline that fixes ``virtual_stages`` or
    ``placement``, explicit ``training.stage_layers`` or the joint partition search). A
    variant that cannot be built (too few layers, no partition that fits) carries the reason.
    With ``time_limit`` (seconds) each variant's partition ILP gets at most a third of it
    over the number of variants (and so do the two schedules with which ``recompute:
    per_stage`` compares its backward worlds, together)."""
    plan = config.extra("plan")
    first = Variant(f"v={config.problem.virtual_stages} {config.problem.placement}",
                    config.problem)
    if plan is None or not config.extra("chunks_open", False) or plan.devices == 1:
        return [first]
    # Only here: the model form's partition search imports numpy and networkx (about a
    # second of an explicit config's time limit otherwise).
    from pipeopt.costs.build import search_plan

    tc = plan.training
    if tc.stage_layers is not None or tc.partition == "joint":
        return [first]
    if time_limit is not None:
        # Building the variants may take a third of the limit: the searches keep the rest.
        cap = time_limit / (3 * len(VARIANTS))
        # recompute: per_stage may schedule two partitions (search_plan): half each.
        tc = tc.model_copy(update={"ilp_time_limit": max(min(tc.ilp_time_limit, cap), 1e-3),
                                   "joint_time_limit": max(min(tc.joint_time_limit, cap / 2),
                                                           1e-3)})
    out = [first]
    for v, placement in VARIANTS:
        label = f"v={v} {placement}"
        alt = replace(plan, virtual_stages=v, placement=placement, training=tc)
        if len(plan.layers) < alt.stages:
            out.append(Variant(label, None, f"{alt.stages} stages need as many layers, the "
                                            f"model has {len(plan.layers)}"))
            continue
        try:
            alt, part, report = search_plan(alt)
            problem = alt.problem(part, {"partition_search": report}, report.get("recompute"))
        except (ConfigError, ProblemError) as exc:
            out.append(Variant(label, None, str(exc)))
            continue
        out.append(Variant(label, problem))
    return out


def _peak(schedule: Schedule) -> float:
    return max(schedule.peak_memory, default=0.0)


def choose(found: list[tuple[str, Schedule]], tolerance: float,
           objective: str = "makespan") -> tuple[str, Schedule, str]:
    """The chunking to keep among solved ``(label, schedule)`` pairs: the fastest (iteration
    time, or max span with ``objective="span"``), or within ``tolerance`` (relative) of it
    the lowest peak memory (bytes); and one line comparing it with the others."""
    def value(s: Schedule) -> float:
        return s.max_span if objective == "span" else s.iteration_time

    fastest = min(found, key=lambda x: value(x[1]))
    limit = value(fastest[1]) * (1 + tolerance) + 1e-12
    near = [x for x in found if value(x[1]) <= limit]
    lean = min(near, key=lambda x: (_peak(x[1]), value(x[1])))
    best = lean if _peak(lean[1]) < _peak(fastest[1]) else fastest
    others = ", ".join(f"{label} {value(s):.6g} s" for label, s in found if label != best[0])
    line = f"chose {best[0]} ({value(best[1]):.6g} s; {others or 'no other'})"
    if best is not fastest:
        line += f"; {fastest[0]} is faster but needs more memory (solver.time_tolerance)"
    return best[0], best[1], line


def solve_config(config: Config, method: str, *, time_limit: float | None = None,
                 **options: Any) -> Schedule:
    """Solve ``config``: :func:`pipeopt.solvers.solve` on its problem, except ``auto`` on a
    model-form config that leaves the chunking open: then every :func:`chunk_variants` is
    solved with an equal share of what is left of ``time_limit`` (seconds, building the
    variants included) and :func:`choose` keeps one; its ``solver.details['chunks']`` says
    which and why. Raises what :func:`~pipeopt.solvers.solve` raises when no variant solves.
    """
    from pipeopt.solvers import NotApplicable, solve

    if time_limit is not None:
        options["time_limit"] = time_limit
    if method != "auto":
        return solve(config.problem, method, **options)
    t0 = time.perf_counter()
    variants = chunk_variants(config, time_limit)
    if len(variants) == 1:
        return solve(config.problem, method, **options)
    usable = [x for x in variants if x.problem is not None]
    found: list[tuple[str, Schedule]] = []
    errors: list[str] = []
    for i, var in enumerate(usable):
        if time_limit is not None:  # an equal share of what is left
            left = time_limit - (time.perf_counter() - t0)
            options["time_limit"] = max(left / (len(usable) - i), 1e-3)
        assert var.problem is not None
        try:
            found.append((var.label, solve(var.problem, method, **options)))
        except NotApplicable as exc:
            errors.append(f"{var.label}: {exc}")
    if not found:
        raise NotApplicable("; ".join(errors))
    _, best, line = choose(found, options.get("time_tolerance", 0.01),
                           options.get("objective", "makespan"))
    skipped = [f"{x.label} not built: {x.note}" for x in variants if x.problem is None]
    if skipped or errors:
        line += "; " + "; ".join(skipped + errors)
    logger.info("chunks: %s", line)
    info = replace(best.solver, details=(*best.solver.details, ("chunks", line)))
    return replace(best, solver=info)
