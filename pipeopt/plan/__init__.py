"""``pipeopt plan``: the whole parallel configuration of a training run, not only its
pipeline schedule (issue 16).

Given a dense transformer, a cluster and a global batch size, the planner enumerates tensor,
pipeline and data parallel sizes, micro-batch size and count, chunks per device, recompute
mode and ZeRO stage (:mod:`pipeopt.plan.candidates`), prunes by memory and by proven lower
bounds, and schedules the survivors with the search (:mod:`pipeopt.plan.search`). See
docs/plan.md.

>>> from pipeopt.plan import load_plan, plan          # doctest: +SKIP
>>> result = plan(load_plan("examples/plan_gpt3.yaml"))  # doctest: +SKIP
>>> result.best.candidate.label                         # doctest: +SKIP
"""

from __future__ import annotations

from pipeopt.plan.candidates import (
    Candidate,
    Estimate,
    bytes_per_param,
    config_of,
    enumerate_candidates,
    estimate,
)
from pipeopt.plan.report import narayanan_flops, pareto_table, ranked_table
from pipeopt.plan.search import CandidateResult, Plan, PlanProgress, plan, rank_key
from pipeopt.plan.spec import (
    RECOMPUTE_MODES,
    ZERO_STAGES,
    PlanSection,
    PlanSpec,
    load_plan,
    parse_plan,
)

__all__ = [
    "RECOMPUTE_MODES", "ZERO_STAGES", "Candidate", "CandidateResult", "Estimate", "Plan",
    "PlanProgress", "PlanSection", "PlanSpec", "bytes_per_param", "config_of",
    "enumerate_candidates", "estimate", "load_plan", "narayanan_flops", "pareto_table",
    "parse_plan", "plan", "rank_key", "ranked_table",
]
