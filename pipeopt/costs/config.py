"""Validated ``model:``, ``cluster:`` and ``training:`` sections (pydantic, unknown keys refused).

Every error is raised as :class:`pipeopt.errors.ConfigError` whose message starts with the key
path, e.g. ``model.hidden: must be > 0, got -1``. Units: bytes, seconds, bytes/s, FLOP/s.
See docs/model_config.md for the reference of every key.
"""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeopt.errors import ConfigError
from pipeopt.schema import validate_mapping


class _Strict(BaseModel):
    # strict: true is not 1 and "8" is not 8; numbers must be finite unless a field says so.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# ----- model: ------------------------------------------------------------------------------
class LayerOverride(_Strict):
    """Changes to some transformer blocks (0-based block indices, embedding/head excluded)."""

    layers: list[int] = Field(min_length=1)
    ffn_hidden: int | None = Field(None, gt=0)
    heads: int | None = Field(None, gt=0)
    kv_heads: int | None = Field(None, gt=0)
    activation: Literal["gelu", "swiglu"] | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    time_scale: float = Field(1.0, gt=0, description="multiplies the layer's op times")


class LayerCostSpec(_Strict):
    """One explicit layer (or ``count`` identical layers) of an arbitrary model.

    Times in seconds per micro-batch, or FLOPs (turned into times with the GPU's peak and the
    compute efficiency); backward defaults to the forward for each of B and W.
    """

    name: str = "layer"
    count: int = Field(1, ge=1)
    forward: float | None = Field(None, ge=0)
    backward_input: float | None = Field(None, ge=0)
    backward_weight: float | None = Field(None, ge=0)
    forward_flops: float | None = Field(None, ge=0)
    backward_input_flops: float | None = Field(None, ge=0)
    backward_weight_flops: float | None = Field(None, ge=0)
    params: float = Field(0.0, ge=0, description="parameter count")
    activation_bytes: float = Field(0.0, ge=0)
    weight_grad_bytes: float | None = Field(None, ge=0)
    output_bytes: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _needs_cost(self) -> LayerCostSpec:
        if self.forward is None and self.forward_flops is None:
            raise ValueError("give forward (seconds) or forward_flops")
        return self


class MoESection(_Strict):
    """``model.moe``: a mixture-of-experts model's MoE blocks (counts and widths; see
    :class:`pipeopt.costs.moe.MoESpec`): the MoE workload config's and the model form's."""

    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    expert_ffn: int = Field(ge=1)
    expert_parallel: int = Field(1, ge=1)
    capacity_factor: float | None = Field(None, gt=0)
    shared_experts: int = Field(0, ge=0)
    shared_ffn: int | None = Field(None, ge=1)
    first_dense: int = Field(0, ge=0)
    every: int = Field(1, ge=1)
    dispatch_dtype: str | None = None


class OverheadsSpec(_Strict):
    """``model.overheads``: the runtime's fixed costs (seconds), in place of a profile's."""

    action_s: float = Field(0.0, ge=0, description="added to every F, B and W op")
    message_s: float = Field(0.0, ge=0, description="added to every link's latency")
    step_s: float = Field(0.0, ge=0, description="per step, after each stage's last backward")


class ModelConfig(_Strict):
    """``model:`` — a transformer shape, an explicit layer list, or a measured profile."""

    preset: str | None = None
    profile: str | None = None
    layer_costs: list[LayerCostSpec] | None = None
    overheads: OverheadsSpec | None = None
    layers: int | None = Field(None, gt=0, le=4094)  # + embedding and head: MAX_LAYERS
    hidden: int | None = Field(None, gt=0)
    heads: int | None = Field(None, gt=0)
    kv_heads: int | None = Field(None, gt=0)
    ffn_hidden: int | None = Field(None, gt=0)
    seq_len: int | None = Field(None, gt=0)
    vocab: int | None = Field(None, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    activation: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True
    position_embedding: Literal["learned", "rotary"] = "learned"
    tie_embeddings: bool = False
    dropout: bool = True
    # per_stage: the partition search chooses none / selective / full for each stage
    # (docs/model_config.md, "Recomputation per stage").
    recompute: Literal["none", "selective", "full", "per_stage"] = "none"
    tensor_parallel: int = Field(1, ge=1)
    sequence_parallel: bool = True
    causal: bool = True  # a decoder's causal mask: half the attention FLOPs (transformer.py)
    # FlashAttention: the attention core keeps fp32 softmax statistics, not the s x s scores
    flash_attention: bool = False
    overrides: list[LayerOverride] = []
    # Mixture-of-experts blocks (docs/model_config.md, "Mixture-of-experts models").
    moe: MoESection | None = None


#: Published shapes; any key given next to ``preset`` wins over the preset's value.
PRESETS: dict[str, dict[str, Any]] = {
    # Brown et al. 2020, table 2.1; GPT-2 tokenizer; tied input/output embedding.
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, ffn_hidden=4 * 12288, seq_len=2048,
                      vocab=50257, activation="gelu", norm="layernorm", bias=True,
                      position_embedding="learned", tie_embeddings=True, dropout=True),
    # Touvron et al. 2023 (Llama 2), table 1 and the released configs.
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008,
                      seq_len=4096, vocab=32000, activation="swiglu", norm="rmsnorm",
                      bias=False, position_embedding="rotary", tie_embeddings=False,
                      dropout=False),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824,
                       seq_len=4096, vocab=32000, activation="swiglu", norm="rmsnorm",
                       bias=False, position_embedding="rotary", tie_embeddings=False,
                       dropout=False),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                       seq_len=4096, vocab=32000, activation="swiglu", norm="rmsnorm",
                       bias=False, position_embedding="rotary", tie_embeddings=False,
                       dropout=False),
    # GPT-2 small (Radford et al. 2019).
    "gpt2-small": dict(layers=12, hidden=768, heads=12, ffn_hidden=3072, seq_len=1024,
                       vocab=50257, activation="gelu", norm="layernorm", bias=True,
                       position_embedding="learned", tie_embeddings=True, dropout=True),
}


# ----- cluster: ----------------------------------------------------------------------------
class TierConfig(_Strict):
    """One link tier: bandwidth per direction (bytes/s) and one-way latency (seconds); a key
    left out keeps the tier's default."""

    bandwidth: float | None = Field(None, gt=0, allow_inf_nan=True)  # .inf: no transfer time
    latency: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _some(self) -> TierConfig:
        if self.bandwidth is None and self.latency is None:
            raise ValueError("give bandwidth (bytes/s), latency (seconds) or both; a tier "
                             "left out keeps its defaults")
        return self


class TiersConfig(_Strict):
    """Overrides of the default link tiers (see :mod:`pipeopt.topology`)."""

    nvlink: TierConfig | None = None
    pcie: TierConfig | None = None
    infiniband: TierConfig | None = None
    wan: TierConfig | None = None


class NodeGroupConfig(_Strict):
    """``count`` nodes of one GPU type inside a datacenter (missing keys from the datacenter,
    then from ``cluster:``)."""

    count: int = Field(ge=1, description="nodes in the group")
    gpu: str | None = None
    gpus_per_node: int | None = Field(None, ge=1)
    nics_per_node: int | None = Field(None, ge=1, description="default: one per GPU")


class DatacenterConfig(_Strict):
    """One datacenter of a heterogeneous cluster (missing keys come from ``cluster:``):
    ``nodes`` is a count, or a list of node groups of different GPUs on the datacenter's one
    fabric."""

    gpu: str | None = None
    nodes: int | list[NodeGroupConfig] | None = None
    gpus_per_node: int | None = Field(None, ge=1)
    nics_per_node: int | None = Field(None, ge=1, description="default: one per GPU")

    @model_validator(mode="after")
    def _check(self) -> DatacenterConfig:
        if isinstance(self.nodes, int) and self.nodes < 1:
            raise ValueError(f"nodes: must be >= 1, got {self.nodes}")
        if isinstance(self.nodes, list) and not self.nodes:
            raise ValueError("nodes: an empty list; give a count >= 1 or a list of node "
                             "groups {gpu, count, gpus_per_node}")
        return self


class ClusterConfig(_Strict):
    """``cluster:`` — GPUs, their grouping into nodes and datacenters, and link tiers."""

    gpu: str = "H100-SXM"
    datacenters: int | list[DatacenterConfig] = 1
    nodes_per_datacenter: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    nics_per_node: int | None = Field(None, ge=1, description="default: one per GPU")
    tiers: TiersConfig = TiersConfig()
    # strict=False on the pair only: YAML gives [flops, efficiency] as a list.
    compute_efficiency: float | list[Annotated[tuple[float, float], Field(strict=False)]] = 0.5
    peak_flops: float | None = Field(None, gt=0, description="FLOP/s, overrides the catalog")
    memory_bytes: float | None = Field(None, gt=0, description="bytes, overrides the catalog")
    memory_reserve: float = Field(0.1, ge=0, lt=1, description="fraction of memory kept free")

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if isinstance(self.datacenters, int) and self.datacenters < 1:
            raise ValueError(f"datacenters: must be >= 1, got {self.datacenters}")
        if isinstance(self.datacenters, list) and not self.datacenters:
            raise ValueError("datacenters: an empty list; give a count >= 1 or a list of "
                             "datacenters")
        eff = self.compute_efficiency
        points = [(None, eff)] if isinstance(eff, float | int) else list(eff)
        if not points:
            raise ValueError("compute_efficiency: give a number or a list of [flops, efficiency]")
        for flops, e in points:
            if not 0 < e <= 1:
                raise ValueError(f"compute_efficiency: must be in (0, 1], got {e}")
            if flops is not None and not (0 < flops < math.inf):
                raise ValueError("compute_efficiency: each point is [flops, efficiency] with "
                                 f"flops a finite number > 0 (FLOPs per op), got {flops}")
        return self


# ----- training: ---------------------------------------------------------------------------
Tokens = Annotated[int, Field(ge=1)]


class LengthDistribution(_Strict):
    """``training.sequence_lengths`` as a seeded distribution of lengths (tokens)."""

    distribution: Literal["uniform", "lognormal", "zipf"]
    mean: float | None = Field(None, gt=0, description="lognormal: mean length (tokens)")
    sigma: float = Field(1.0, gt=0, description="lognormal: spread of log(length)")
    exponent: float = Field(1.2, gt=0, description="zipf: P(length >= x) = (min / x)^exponent")
    min: int = Field(1, ge=1, description="tokens")
    max: int | None = Field(None, ge=1, description="tokens")
    seed: int = Field(0, ge=0, le=2**32 - 1)
    tokens_per_microbatch: int | None = Field(None, ge=1, description="pack documents")

    @model_validator(mode="after")
    def _check(self) -> LengthDistribution:
        given = self.model_fields_set
        own = {"uniform": (), "lognormal": ("mean", "sigma"), "zipf": ("exponent",)}
        for key in ("mean", "sigma", "exponent"):
            if key in given and key not in own[self.distribution]:
                raise ValueError(f"{key}: not used by the {self.distribution} distribution")
        if self.distribution == "uniform" and self.max is None:
            raise ValueError("max: missing (the uniform distribution needs min and max)")
        if self.distribution == "lognormal" and self.mean is None:
            raise ValueError("mean: missing (the lognormal distribution needs its mean length)")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max: must be >= min ({self.min}), got {self.max}")
        return self


class TrainingConfig(_Strict):
    """``training:`` — optimizer state, data parallelism and the stage-partition search."""

    # Mixed-precision Adam: fp16/bf16 weights and gradients (2 + 2 bytes) plus fp32 master
    # weights, momentum and variance (12 bytes): 16 bytes per parameter (Rajbhandari et al.
    # 2020, ZeRO, section 3.1).
    bytes_per_param: float = Field(16.0, gt=0, description="weights + grads + optimizer state")
    grad_bytes_per_param: float = Field(2.0, gt=0, description="gradient bytes reduced per param")
    data_parallel: int = Field(1, ge=1)
    # ZeRO (Rajbhandari et al. 2020): 1 shards the optimizer state over the data-parallel
    # replicas, 2 the gradients too, 3 the weights too (pipeopt.costs.zero).
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage; bytes_per_param "
                                            "stays the unsharded total")
    partition: Literal["dp", "ilp", "joint", "uniform"] = "dp"
    partition_objective: Literal["pipeline", "minmax"] = "pipeline"
    stage_layers: list[int] | None = Field(None, description="explicit layers per stage")
    top_k: int = Field(4, ge=1)
    joint_method: str | None = None
    joint_time_limit: float = Field(5.0, gt=0, description="seconds per candidate schedule")
    ilp_time_limit: float = Field(30.0, gt=0, description="seconds for the partition ILP")
    inflight: Literal["1f1b", "gpipe"] = "1f1b"
    sequence_lengths: (list[Tokens | list[Tokens]] | LengthDistribution | None) = Field(
        None, description="per micro-batch, tokens per sequence (or packed document lengths)")


# ----- validation with key-path messages ---------------------------------------------------
def validate_section(model: type[BaseModel], data: Any, prefix: str) -> Any:
    """Validate ``data`` against ``model``; errors become ConfigError("prefix.key: reason")."""
    return validate_mapping(model, {} if data is None else data, prefix)


def parse_model(data: Any) -> ModelConfig:
    """Validate ``model:`` after filling in a preset's keys."""
    if isinstance(data, dict) and data.get("preset") is not None:
        name = str(data["preset"]).lower()
        if name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(PRESETS)}"
            raise ConfigError(f"model.preset: unknown preset {data['preset']!r}{hint}")
        data = {**PRESETS[name], **data}
    cfg = validate_section(ModelConfig, data, "model")
    forms = [k for k in ("profile", "layer_costs") if getattr(cfg, k) is not None]
    if len(forms) > 1:
        raise ConfigError("model.layer_costs: cannot be combined with model.profile")
    if forms:
        given = list(data) if isinstance(data, dict) else []
        if "preset" in given:
            raise ConfigError(f"model.preset: cannot be combined with model.{forms[0]} "
                              "(give a transformer shape or explicit layers, not both)")
        shape = [k for k in ("layers", "hidden", "heads", "seq_len", "vocab") if k in given]
        if shape:
            raise ConfigError(f"model.{forms[0]}: cannot be combined with model.{shape[0]} "
                              "(give a transformer shape or explicit layers, not both)")
        # Only dtype (the GPU peak that turns FLOPs into seconds) applies to explicit layers;
        # every other key describes a transformer shape and would be silently ignored.
        unused = [k for k in given if k not in ("profile", "layer_costs", "dtype", "overheads")]
        if unused:
            what = ("the profile's measured times and bytes already include it"
                    if forms[0] == "profile" else "give each layer's costs for it instead")
            raise ConfigError(f"model.{unused[0]}: not used with model.{forms[0]} ({what}); "
                              "remove it")
        return cfg
    for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if getattr(cfg, key) is None:
            raise ConfigError(f"model.{key}: missing (give a transformer shape, a preset, "
                              "layer_costs or a profile)")
    assert cfg.hidden is not None and cfg.heads is not None
    if cfg.hidden % cfg.heads:
        raise ConfigError(f"model.heads: must divide model.hidden ({cfg.hidden}), "
                          f"got {cfg.heads}")
    kv = cfg.kv_heads or cfg.heads
    if cfg.heads % kv:
        raise ConfigError(f"model.kv_heads: must divide model.heads ({cfg.heads}), got {kv}")
    t = cfg.tensor_parallel
    if cfg.heads % t or (kv % t and t % kv):
        raise ConfigError(f"model.tensor_parallel: must divide model.heads ({cfg.heads}), "
                          f"got {t}")
    for i, ov in enumerate(cfg.overrides):
        for b in ov.layers:
            if not 0 <= b < (cfg.layers or 0):
                raise ConfigError(f"model.overrides[{i}].layers: block index must be in "
                                  f"0..{(cfg.layers or 0) - 1}, got {b}")
        # The same shape rules as the whole model, on the overridden blocks' shape.
        where = f"model.overrides[{i}]"
        oh = ov.heads or cfg.heads
        okv = ov.kv_heads or cfg.kv_heads or oh  # as transformer_layers merges them
        if ov.heads is not None and cfg.hidden % oh:
            raise ConfigError(f"{where}.heads: must divide model.hidden ({cfg.hidden}), "
                              f"got {oh}")
        if oh % okv:
            key = "kv_heads" if ov.kv_heads is not None else "heads"
            raise ConfigError(f"{where}.{key}: kv_heads ({okv}) must divide heads ({oh})")
        if oh % t or (okv % t and t % okv):
            raise ConfigError(f"{where}.heads: model.tensor_parallel ({t}) must divide the "
                              f"heads ({oh})")
    return cfg


def parse_cluster(data: Any) -> ClusterConfig:
    """Validate ``cluster:`` (GPU names are checked against the catalog)."""
    from pipeopt.costs.gpus import lookup

    cfg = validate_section(ClusterConfig, data, "cluster")
    names = [("cluster.gpu", cfg.gpu)]
    if isinstance(cfg.datacenters, list):
        for i, dc in enumerate(cfg.datacenters):
            where = f"cluster.datacenters[{i}]"
            if dc.gpu:
                names.append((f"{where}.gpu", dc.gpu))
            if isinstance(dc.nodes, list):
                names += [(f"{where}.nodes[{j}].gpu", g.gpu)
                          for j, g in enumerate(dc.nodes) if g.gpu]
    for where, name in names:
        try:
            lookup(name)
        except KeyError as exc:
            raise ConfigError(f"{where}: {exc.args[0]}") from None
    return cfg


def parse_training(data: Any) -> TrainingConfig:
    """Validate ``training:``."""
    cfg = validate_section(TrainingConfig, data, "training")
    if cfg.stage_layers is not None:
        for i, n in enumerate(cfg.stage_layers):
            if n < 1:
                raise ConfigError(f"training.stage_layers[{i}]: must be >= 1 (no empty "
                                  f"stage), got {n}")
    lengths = cfg.sequence_lengths
    if isinstance(lengths, list):
        for i, x in enumerate(lengths):
            if x == []:
                raise ConfigError(f"training.sequence_lengths[{i}]: an empty micro-batch; give "
                                  "its sequence length or the lengths of its documents")
    if cfg.joint_method is not None and cfg.joint_method != "classic":
        from pipeopt.solvers import UnknownMethod, check_method

        try:
            check_method(cfg.joint_method)
        except UnknownMethod as exc:
            raise ConfigError(f"training.joint_method: {exc} (or 'classic')") from None
    return cfg
