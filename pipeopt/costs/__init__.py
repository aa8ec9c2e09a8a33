"""Cost model: from a ``model:`` / ``cluster:`` description to per-stage costs.

- :mod:`pipeopt.costs.transformer` — analytic FLOPs, parameters, activation and message bytes;
- :mod:`pipeopt.costs.gpus` — the GPU catalog (dense peaks, memory);
- :mod:`pipeopt.costs.profile` — profile files of measured per-layer costs, read without torch;
- :mod:`pipeopt.costs.profiler` — measures them on a torch model (above the cost model: it runs
  layers through the executor's backward split);
- :mod:`pipeopt.costs.build` — the config front end: :func:`build_from_model` (called by
  :mod:`pipeopt.config`) and :func:`describe_partition`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeopt.schema import Config, ConfigFile


def build_from_model(cfg: ConfigFile, data: dict[str, Any], source: str) -> Config:
    """The :class:`~pipeopt.config.Config` of a model/cluster config (see
    :func:`pipeopt.costs.build.build_from_model`)."""
    from pipeopt.costs.build import build_from_model as build

    return build(cfg, data, source)


def describe_partition(config: Config) -> str:
    """A table of the stages of a model/cluster config: layers, times, memory ("" otherwise)."""
    if not dict(config.problem.meta).get("stage_costs"):
        return ""  # an explicit config: no need to import the model form's numpy / networkx
    from pipeopt.costs.build import describe_partition as describe

    return describe(config)


__all__ = ["build_from_model", "describe_partition"]
