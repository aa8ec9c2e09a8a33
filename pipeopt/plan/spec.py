"""The plan config: ``model:``, ``cluster:``, ``training:`` (with ``global_batch_size``) and
``plan:`` (the search space and its limits), validated into an immutable :class:`PlanSpec`.

Every error is a :class:`~pipeopt.errors.ConfigError` whose message starts with the key path,
e.g. ``plan.micro_batch_size[1]: must be >= 1, got 0``. The model, cluster and training keys
are those of the model form (docs/model_config.md), checked by its own parsers; the keys the
planner chooses itself (tensor parallelism, micro-batch size, recompute, data parallelism,
the pipeline) are refused there with a pointer to the ``plan:`` key that chooses them.

A mixture-of-experts model gives ``model.moe`` with the keys of the model form's and the MoE
workload config's (:class:`pipeopt.costs.config.MoESection`: ``experts``, ``top_k``,
``expert_ffn``, ``capacity_factor``, ``shared_experts``, ``shared_ffn``, ``first_dense``,
``every``, ``dispatch_dtype``) except ``expert_parallel``, which the planner chooses
(``plan.expert_parallel``). Tensor parallelism splits the experts too (expert
tensor-parallel size = TP); every recompute mode and ZeRO stage applies to an MoE model as to
a dense one (ZeRO shards the routed experts over their DP / EP replicas, the rest over DP).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeopt.config import read_yaml
from pipeopt.costs.build import shape_of, topology_of
from pipeopt.costs.config import (
    ClusterConfig,
    ModelConfig,
    MoESection,
    TrainingConfig,
    parse_cluster,
    parse_model,
    parse_training,
)
from pipeopt.costs.moe import MoESpec
from pipeopt.costs.transformer import TransformerShape
from pipeopt.costs.zero import GRAD_BYTES, WEIGHT_BYTES
from pipeopt.costs.zero import ZERO_STAGES as _ZERO_STAGES
from pipeopt.errors import ConfigError
from pipeopt.schema import MemoryConfig, check_unknown_keys, pydantic_message, validate_mapping
from pipeopt.solvers import UnknownMethod, check_method

#: The recompute modes the planner enumerates: the three uniform over the model's blocks, and
#: ``per_stage`` (issue 16 item 2, AdaPipe-style), where the partition search chooses each
#: stage's mode with its layers (the model form's ``model.recompute: per_stage``).
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full", "per_stage")
#: ZeRO stages the planner knows (Rajbhandari et al., "ZeRO", SC'20, section 5): 0 (plain
#: data parallelism), 1 (optimizer state sharded over the data-parallel group), 2 (gradients
#: too), 3 (weights too); memory and collectives in :mod:`pipeopt.costs.zero`.
ZERO_STAGES: tuple[int, ...] = _ZERO_STAGES
#: ZeRO stages enumerated when ``plan.zero`` is not given: 0 and 1, whose collectives (one
#: all-reduce's bytes per step) cost no more than plain data parallelism's; ZeRO-2/3 pay
#: collectives in every micro-batch (list them to weigh that against their memory).
DEFAULT_ZERO: tuple[int, ...] = (0, 1)
#: Bytes per parameter that ZeRO-1 keeps whole on every replica: the 16-bit weights and
#: gradients of mixed-precision training (2 + 2; ZeRO, section 3.1). The rest of
#: ``training.bytes_per_param`` (Adam's fp32 master weights, momentum and variance, 12 bytes
#: by default) is divided by the data-parallel size: 2 + 2 + 12 / DP (ZeRO, figure 1, P_os).
ZERO1_KEPT_BYTES = WEIGHT_BYTES + GRAD_BYTES


#: model: keys the planner chooses, and the plan: key that lists its choices.
_CHOSEN_MODEL_KEYS = {"tensor_parallel": "plan.tensor_parallel",
                      "micro_batch_size": "plan.micro_batch_size",
                      "recompute": "plan.recompute"}
#: training: keys that the planner sets per candidate or that describe another search.
_CHOSEN_TRAINING_KEYS = {
    "data_parallel": "the planner chooses it (DP = GPUs / (TP x PP))",
    "zero_stage": "the planner chooses it; list the stages to try under plan.zero",
    "partition": "the planner partitions each candidate itself (exact DP for one chunk per "
                 "device, uniform for more)",
    "stage_layers": "each candidate has its own number of stages",
    "top_k": "the joint partition search is not used by the planner",
    "joint_method": "the joint partition search is not used by the planner",
    "joint_time_limit": "the planner sets it to plan.screen_time_limit (per_stage weighs "
                        "its split and fused backward in that time)",
    "sequence_lengths": "the planner prices every micro-batch at model.seq_len",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PlanSection(_Strict):
    """``plan:`` — the choices to enumerate (None: every value that fits the cluster) and the
    search's limits (seconds)."""

    tensor_parallel: list[int] | None = Field(
        None, min_length=1, description="TP sizes (default: divisors of the GPUs per node "
        "that divide the heads)")
    pipeline_parallel: list[int] | None = Field(
        None, min_length=1, description="PP sizes (default: every divisor of GPUs / TP)")
    expert_parallel: list[int] | None = Field(
        None, min_length=1, description="EP sizes of an MoE model (default: every divisor "
        "of model.moe.experts; each candidate's must also divide its DP)")
    micro_batch_size: list[int] = Field([1, 2, 4, 8], min_length=1)
    virtual_stages: list[int] = Field([1, 2], min_length=1)
    recompute: list[str] = Field(list(RECOMPUTE_MODES), min_length=1,
                                 description="modes of RECOMPUTE_MODES")
    zero: list[Literal[0, 1, 2, 3]] = Field(list(DEFAULT_ZERO), min_length=1,
                                           description="ZeRO stages of ZERO_STAGES")
    gpus: list[int] | None = Field(
        None, min_length=1, description="GPU counts to plan for, each the first N GPUs of "
        "the cluster (default: all of them)")
    time_limit: float = Field(600.0, gt=0, description="seconds for the whole plan")
    jobs: int = Field(1, ge=1, le=256, description="candidates scheduled at once (processes)")
    screen_time_limit: float = Field(
        2.0, gt=0, description="seconds per candidate in the first search round")
    halving: int = Field(3, ge=2, description="each round keeps 1/halving of the candidates, "
                         "with halving times the time limit")
    method: str = Field("auto", description="the search of the rounds after the first")
    finalists: int = Field(9, ge=1, description="candidates of the first round searched "
                           "again (the best ones)")
    pareto: bool = Field(False, description="prune only candidates that a schedule in hand "
                         "beats on time and on memory (and cost): exact Pareto fronts, "
                         "weaker pruning")


@dataclass(frozen=True)
class PlanSpec:
    """A validated plan config. ``model`` / ``cluster`` / ``training`` / ``memory`` are the
    model form's sections as given (mappings, without the planner's own keys), ready to be
    completed per candidate; the parsed sections beside them are for reading."""

    model: dict[str, Any]
    cluster: dict[str, Any]
    training: dict[str, Any]
    memory: dict[str, Any] | None
    global_batch_size: int
    plan: PlanSection
    model_cfg: ModelConfig
    cluster_cfg: ClusterConfig
    training_cfg: TrainingConfig
    #: Dollars per GPU-hour by GPU model name (empty: no prices given).
    prices: tuple[tuple[str, float], ...] = ()
    source: str = "<memory>"
    #: ``model.moe`` of a mixture-of-experts model (``expert_parallel`` 1: each candidate sets
    #: its own); None for a dense model.
    moe: MoESpec | None = None

    def shape(self, tensor_parallel: int = 1, micro_batch_size: int = 1,
              recompute: str = "none") -> TransformerShape:
        """The model's :class:`TransformerShape` with the planner's choices filled in."""
        from dataclasses import replace

        return replace(shape_of(self.model_cfg), tensor_parallel=tensor_parallel,
                       micro_batch_size=micro_batch_size, recompute=recompute)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one training step: global batch x sequence length."""
        return self.global_batch_size * self.shape().seq_len


def _section(data: dict[str, Any], key: str, required: bool) -> dict[str, Any]:
    val = data.get(key)
    if val is None:
        if required:
            raise ConfigError(f"{key}: missing (a plan config needs model:, cluster:, "
                              "training: {global_batch_size} and optionally plan:)")
        return {}
    if not isinstance(val, dict):
        raise ConfigError(f"{key}: expected a mapping (key: value), got {type(val).__name__}")
    return dict(val)


def _positive_list(values: list[int] | None, key: str) -> None:
    for i, x in enumerate(values or ()):
        if x < 1:
            raise ConfigError(f"plan.{key}[{i}]: must be >= 1, got {x}")
    if values is not None and len(set(values)) != len(values):
        raise ConfigError(f"plan.{key}: a value is listed twice ({values})")


def _prices(raw: Any, cluster: ClusterConfig) -> tuple[tuple[str, float], ...]:
    """``cluster.price_per_gpu_hour``: one number for every GPU, or ``{gpu name: price}``."""
    from pipeopt.costs.gpus import lookup

    names = sorted({g.name for g in topology_of(cluster).gpu_models})
    if isinstance(raw, bool) or not isinstance(raw, int | float | dict):
        raise ConfigError("cluster.price_per_gpu_hour: expected dollars per GPU-hour (a "
                          f"number) or a mapping {{gpu: dollars}}, got {raw!r}")
    table = raw if isinstance(raw, dict) else dict.fromkeys(names, raw)
    out = {}
    for name, price in table.items():
        where = "cluster.price_per_gpu_hour" + (f".{name}" if isinstance(raw, dict) else "")
        if isinstance(price, bool) or not isinstance(price, int | float) or not (
                0 <= price < math.inf):
            raise ConfigError(f"{where}: must be a finite number >= 0 (dollars per GPU-hour), "
                              f"got {price!r}")
        try:
            gpu = lookup(str(name)).name
        except KeyError as exc:
            raise ConfigError(f"{where}: {exc.args[0]}") from None
        out[gpu] = float(price)
    missing = [n for n in names if n not in out]
    if missing:
        raise ConfigError(f"cluster.price_per_gpu_hour: no price for {missing[0]} (give one "
                          "per GPU model of the cluster, or a single number)")
    return tuple(sorted(out.items()))


def _moe(model: dict[str, Any]) -> MoESpec | None:
    """``model.moe`` taken out of ``model`` and checked (None: a dense model); other keys that
    look like MoE keys are pointed to it."""
    stray = [k for k in model if k != "moe" and ("expert" in str(k).lower()
                                                 or "moe" in str(k).lower())]
    if stray:
        raise ConfigError(f"model.{stray[0]}: mixture-of-experts keys go under model.moe "
                          "(experts, top_k, expert_ffn, capacity_factor, shared_experts, ...)")
    if "moe" not in model:
        return None
    raw = model.pop("moe")
    if isinstance(raw, dict) and "expert_parallel" in raw:
        raise ConfigError("model.moe.expert_parallel: chosen by the planner; list the values to "
                          "try under plan.expert_parallel")
    sec = validate_mapping(MoESection, raw, "model.moe")
    try:
        return MoESpec(**sec.model_dump())
    except ValueError as exc:
        raise ConfigError(f"model.moe.{exc}") from None


def _check_moe_plan(moe: MoESpec, section: PlanSection, model_cfg: ModelConfig) -> None:
    """The plan: keys an MoE model restricts (module docstring)."""
    if model_cfg.overrides:
        raise ConfigError("model.overrides: not with model.moe (the planner prices every MoE "
                          "block alike)")
    layers = model_cfg.layers or 0
    if not any(moe.is_moe(i) for i in range(layers)):
        raise ConfigError(f"model.moe.first_dense: {moe.first_dense} leaves no MoE block among "
                          f"the model's {layers} blocks (a dense model: leave out model.moe)")
    for i, ep in enumerate(section.expert_parallel or ()):
        if moe.experts % ep:
            raise ConfigError(f"plan.expert_parallel[{i}]: must divide model.moe.experts "
                              f"({moe.experts}), got {ep}")


def parse_plan(data: Any, source: str = "<memory>") -> PlanSpec:
    """Validate a plan config mapping (parsed YAML) into a :class:`PlanSpec`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (model, cluster, "
                          f"training, plan), got {type(data).__name__}")
    known = ("model", "cluster", "training", "plan", "memory")
    for key in data:
        if key == "pipeline":
            raise ConfigError("pipeline: not used in a plan config (the planner chooses the "
                              "pipeline: plan.pipeline_parallel, plan.virtual_stages)")
        if key not in known:
            raise ConfigError(f"{key}: unknown section of a plan config; known: "
                              f"{', '.join(known)}")
    model = _section(data, "model", True)
    cluster = _section(data, "cluster", True)
    training = _section(data, "training", True)
    for key, where in _CHOSEN_MODEL_KEYS.items():
        if key in model:
            raise ConfigError(f"model.{key}: chosen by the planner; list the values to try "
                              f"under {where}")
    moe = _moe(model)
    for key in ("layer_costs", "profile"):
        if key in model:
            raise ConfigError(f"model.{key}: the planner needs a transformer shape (a preset "
                              "or layers, hidden, heads, ...) to price each tensor-parallel "
                              "size, micro-batch size and recompute mode")
    for key, why in _CHOSEN_TRAINING_KEYS.items():
        if key in training:
            raise ConfigError(f"training.{key}: not used in a plan config ({why})")
    gbs = training.pop("global_batch_size", None)
    if gbs is None:
        raise ConfigError("training.global_batch_size: missing (sequences per training step)")
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ConfigError(f"training.global_batch_size: must be an integer >= 1 (sequences "
                          f"per step), got {gbs!r}")
    price = cluster.pop("price_per_gpu_hour", None)
    model_cfg = parse_model(model)
    cluster_cfg = parse_cluster(cluster)
    training_cfg = parse_training(training)
    if training_cfg.bytes_per_param < ZERO1_KEPT_BYTES:
        raise ConfigError(f"training.bytes_per_param: must be >= {ZERO1_KEPT_BYTES:g} (16-bit "
                          "weights and gradients) for the ZeRO-1 estimate, got "
                          f"{training_cfg.bytes_per_param:g}")
    memory = data.get("memory")
    if memory is not None:
        if not isinstance(memory, dict):
            raise ConfigError("memory: expected a mapping (limit, static)")
        check_unknown_keys(memory, MemoryConfig, "memory")
        try:
            MemoryConfig.model_validate(memory)
        except ValidationError as exc:
            raise ConfigError(pydantic_message(exc, "memory")) from None
        if isinstance(memory.get("limit"), list) or isinstance(memory.get("static"), list):
            raise ConfigError("memory: give one limit / static value for every device (lists "
                              "are per pipeline rank, which the planner chooses)")
    raw_plan = data.get("plan") or {}
    if not isinstance(raw_plan, dict):
        raise ConfigError(f"plan: expected a mapping (key: value), got "
                          f"{type(raw_plan).__name__}")
    check_unknown_keys(raw_plan, PlanSection, "plan")
    try:
        section = PlanSection.model_validate(raw_plan)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, "plan")) from None
    for key in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "micro_batch_size",
                "virtual_stages", "gpus"):
        _positive_list(getattr(section, key), key)
    for i, mode in enumerate(section.recompute):
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"plan.recompute[{i}]: must be one of "
                              f"{', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    for key in ("recompute", "zero"):
        vals = getattr(section, key)
        if len(set(vals)) != len(vals):
            raise ConfigError(f"plan.{key}: a value is listed twice ({vals})")
    if moe is not None:
        _check_moe_plan(moe, section, model_cfg)
    elif section.expert_parallel is not None:
        raise ConfigError("plan.expert_parallel: only for a mixture-of-experts model (give "
                          "model.moe: experts, top_k, expert_ffn, ...)")
    try:
        check_method(section.method)
    except UnknownMethod as exc:
        raise ConfigError(f"plan.method: {exc}") from None
    total = topology_of(cluster_cfg).num_gpus
    for i, n in enumerate(section.gpus or ()):
        if n > total:
            raise ConfigError(f"plan.gpus[{i}]: the cluster has {total} GPUs, got {n}")
    heads = model_cfg.heads or 1
    for i, t in enumerate(section.tensor_parallel or ()):
        if heads % t:
            raise ConfigError(f"plan.tensor_parallel[{i}]: must divide model.heads ({heads}), "
                              f"got {t}")
    prices = () if price is None else _prices(price, cluster_cfg)
    return PlanSpec(model=model, cluster=cluster, training=training, memory=memory,
                    global_batch_size=gbs, plan=section, model_cfg=model_cfg,
                    cluster_cfg=cluster_cfg, training_cfg=training_cfg, prices=prices,
                    source=source, moe=moe)


def load_plan(path: str | os.PathLike[str]) -> PlanSpec:
    """Read and validate a plan config file."""
    return parse_plan(read_yaml(path), str(path))
