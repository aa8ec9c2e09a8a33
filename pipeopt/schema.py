"""The config's types, below the modules that build them: the pydantic models of the explicit
form's sections, the loaded :class:`Config`, pydantic errors turned into key-path messages, and
the checks that both config forms share.

:mod:`pipeopt.config` reads YAML and builds a :class:`Config`; :mod:`pipeopt.costs` builds one
for the ``model:`` / ``cluster:`` form. Both use these types, so they live here, where neither
has to import the other back. :mod:`pipeopt.config` re-exports every public name.
"""

from __future__ import annotations

import datetime
import difflib
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeopt.costs.collectives import all_reduce_time
from pipeopt.errors import MAX_SEED, MAX_WORKERS, ConfigError
from pipeopt.problem import Problem, Scale

Scalars = float | list[float]
#: One factor per micro-batch for every stage, or a table: one row of factors per stage.
ScaleTable = float | list[float] | list[list[float]]


class _Strict(BaseModel):
    # strict: no silent coercion (true is not 1, "yes" is not true, "4" is not 4); an int is
    # still accepted where a number is expected.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PipelineConfig(_Strict):
    """``pipeline:`` — the shape of the pipeline."""

    devices: int = Field(ge=1, description="pipeline ranks p")
    microbatches: int = Field(ge=1, description="micro-batches per iteration m")
    virtual_stages: int = Field(1, ge=1, description="model chunks per device v")
    placement: Literal["loop", "vshape"] = "loop"
    split_backward: bool = True
    sub_blocks: int = Field(1, ge=1, description="pieces each stage's ops are cut into, run "
                            "in order on the stage's device with other work allowed between "
                            "them (CrossPipe's sub-blocks)")
    microbatch_scale: ScaleTable | None = Field(
        None, description="per micro-batch factor on its op times (and by default memory); "
        "or a table, one row per stage")
    microbatch_memory_scale: ScaleTable | None = Field(
        None, description="per micro-batch factor on its activation memory; or a table, one "
        "row per stage")
    microbatch_message_scale: ScaleTable | None = Field(
        None, description="per micro-batch factor on its message bytes; or a table, one row "
        "per stage boundary")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: flush every iteration; async: a steady state that never "
                            "flushes (PipeDream), solved for its period")
    replicas: int | list[int] | None = Field(
        None, description="async: devices that run each stage round-robin (default 1)")
    replica_bandwidth: Scalars | None = Field(
        None, description="async: bytes/s between the devices of a replicated stage, for "
        "their gradient all-reduce (default: not modelled)")

    @field_validator(*("microbatch_scale", "microbatch_memory_scale",
                       "microbatch_message_scale"), mode="before")
    @classmethod
    def _table_rows(cls, value: Any) -> Any:
        """A list mixing numbers and rows is neither form: say so, naming the first stray."""
        if isinstance(value, list) and any(isinstance(x, list) for x in value):
            for i, x in enumerate(value):
                if not isinstance(x, list):
                    raise ValueError(f"a table's rows must all be lists, row {i} is {x!r:.40}")
        return value


class StagesConfig(_Strict):
    """``stages:`` — per-stage costs (scalar for all stages, or one value per stage)."""

    forward: Scalars
    backward_input: Scalars
    backward_weight: Scalars
    activation_memory: Scalars = 0.0
    weight_grad_memory: Scalars | None = None
    grad_reduce: Scalars = 0.0


class LinksConfig(_Strict):
    """``links:`` — p2p delays (scalar, or one value per neighbouring device pair)."""

    latency: Scalars = 0.0
    bandwidth: Scalars = math.inf
    message_size: Scalars = 0.0


class MemoryConfig(_Strict):
    """``memory:`` — per-device limit (null = unlimited) and static memory (bytes)."""

    limit: float | list[float | None] | None = None
    static: Scalars = 0.0
    weight_bytes: Scalars | None = Field(
        None, description="bytes of one copy of a stage's weights (pipeline.mode: async)")


class SolverConfig(_Strict):
    """``solver:`` — which method and its limits."""

    method: str = "auto"
    time_limit: float = Field(60.0, gt=0, allow_inf_nan=False, description="seconds")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    objective: Literal["makespan", "span"] = "makespan"
    workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    relative_gap: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    time_tolerance: float = Field(0.01, ge=0, le=1, allow_inf_nan=False,
                                  description="relative time auto gives up for less peak memory")
    resolution: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="seconds per CP-SAT time unit")


class LevelConfig(_Strict):
    """One level of ``pipedream.levels``: ``units`` of the level below (devices at the first
    level) joined by links of ``bandwidth`` bytes/s."""

    units: int = Field(ge=1, description="units of the level below (devices at the first)")
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s between two units")
    types: dict[str, Annotated[int, Field(ge=1)]] | None = Field(
        None, description="top level only: units of each pipedream.device_types name")


class DeviceTypeConfig(_Strict):
    """One entry of ``pipedream.device_types``: a kind of device (a GPU model) in a
    heterogeneous cluster (HetPipe)."""

    speed: float = Field(1.0, gt=0, allow_inf_nan=False,
                         description="compute speed relative to the layer profile's device")
    memory: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="bytes per device (default memory.limit)")
    levels: list[LevelConfig] | None = Field(
        None, description="inside one top-level unit of this type, innermost first (default: "
        "pipedream.levels without its top level)")
    forward: Scalars | None = Field(None, description="s per layer measured on this type "
                                    "(its own profile, with backward_input and backward_weight)")
    backward_input: Scalars | None = None
    backward_weight: Scalars | None = None


class LayersConfig(_Strict):
    """``pipedream.layers``: the layer profile, one value per layer (``forward`` sets the
    count; the others may be one value for every layer). Seconds per micro-batch, bytes."""

    forward: list[float] = Field(min_length=1)
    backward_input: Scalars
    backward_weight: Scalars
    output_bytes: Scalars = Field(description="bytes of the layer's output (the message on)")
    weight_bytes: Scalars = Field(description="bytes of the layer's weights (one copy)")
    activation_bytes: Scalars = 0.0
    names: list[str] | None = None


class PipedreamConfig(_Strict):
    """``pipedream:`` — PipeDream's planner chooses the stages and their replicas
    (pipeline.mode: async); levels innermost first (devices per node, then nodes). With
    ``device_types`` (HetPipe's mixed GPUs), the top level's ``types`` says how many of its
    units (nodes) are of each type."""

    levels: list[LevelConfig] = Field(min_length=1)
    layers: LayersConfig
    device_types: dict[str, DeviceTypeConfig] | None = Field(None, min_length=1)
    every_node: bool = Field(True, description="every top-level unit runs a stage (false: "
                             "the plan may leave whole units idle)")


class ConfigFile(_Strict):
    """The whole file."""

    pipeline: PipelineConfig
    stages: StagesConfig | None = None
    links: LinksConfig = LinksConfig()
    memory: MemoryConfig = MemoryConfig()
    solver: SolverConfig = SolverConfig()
    model: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    pipedream: PipedreamConfig | None = None


@dataclass(frozen=True)
class Config:
    """A loaded config: the problem it describes and how to solve it."""

    problem: Problem
    solver: SolverConfig
    source: str = "<memory>"
    extras: tuple[tuple[str, Any], ...] = ()

    def extra(self, key: str, default: Any = None) -> Any:
        """Facts a front end added (e.g. the stage partition of a model config)."""
        return dict(self.extras).get(key, default)


def key_path(prefix: str, loc: tuple[Any, ...]) -> str:
    """``prefix`` followed by a pydantic location: ``stages`` + ("forward", 2) ->
    ``stages.forward[2]``; the names pydantic gives to union branches are left out."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _is_branch(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "<top>"


def _is_branch(part: str) -> bool:
    """A pydantic union-branch label such as ``float``, ``list[float]``, ``ModelName``."""
    return (part.startswith(("list[", "tuple[", "dict[", "function-", "literal[",
                             "constrained-"))
            or part in ("int", "float", "str", "bool", "none", "is-instance")
            or part[:1].isupper())


def _yaml_name(val: Any) -> str:
    """How a value read from YAML is shown in a message."""
    if val is None:
        return "null"
    if isinstance(val, bool):
        return "true" if val else "false"
    if isinstance(val, dict):
        return "a mapping"
    if isinstance(val, datetime.date):
        return f"the date {val}"
    return f"{val!r:.60}"


_TYPE_WORDS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "list_type": "a list",
    "tuple_type": "a list", "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)", "model_attributes_type": "a mapping (key: value)",
}


def _quoted_number_hint(val: Any) -> str:
    """For a string that reads as a number: numbers are not taken from strings, say so."""
    if isinstance(val, str):
        try:
            float(val.replace("_", ""))
        except ValueError:
            return ""
        return " (a string: write the number without quotes)"
    return ""


def error_message(err: Any) -> str:
    """The reason of one pydantic error in words (without the key path)."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = f", got {_yaml_name(err.get('input'))}"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}{got}{_quoted_number_hint(err.get('input'))}"
    for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if key in ctx and kind.startswith(("greater", "less")):
            return f"must be {op} {ctx[key]:g}{got}" if isinstance(ctx[key], float) else (
                f"must be {op} {ctx[key]}{got}")
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected', 'one of the listed values')}{got}"
    if kind == "missing":
        return "missing (required)"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("too_long", "too_short"):
        return (f"expected {ctx.get('max_length', ctx.get('min_length'))} items, got "
                f"{ctx.get('actual_length')}")
    if kind == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        return msg.removeprefix("Value error, ")
    msg = err["msg"]
    return msg[0].lower() + msg[1:] + got


def pick_error(exc: ValidationError) -> Any:
    """The most telling error of a validation: a value error if any, else the one that got
    deepest into the data (for ``a: [1, "x"]`` the list branch's item error, not the scalar
    branch's "expected a number")."""
    errs = exc.errors()
    for e in errs:
        if e["type"] == "value_error":
            return e
    return max(errs, key=lambda e: len(e["loc"]))  # max keeps the first of equals


def pydantic_message(exc: ValidationError, prefix: str = "") -> str:
    """One line: the key path of the telling error and its reason."""
    err = pick_error(exc)
    loc = err["loc"]
    if err["type"] == "value_error":
        # A model validator names the field itself: "field: reason".
        msg = error_message(err)
        field, sep, rest = msg.partition(": ")
        if sep and field.isidentifier() and " " not in field:
            return f"{key_path(prefix, (*loc, field))}: {rest}"
        return f"{key_path(prefix, loc)}: {msg}"
    return f"{key_path(prefix, loc)}: {error_message(err)}"


def check_unknown_keys(data: Any, model: type[BaseModel], path: str) -> None:
    """Reject unknown keys, at every depth, with a "did you mean" before pydantic's generic
    message; ``path`` is the key path of ``data`` ("" at the top)."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key in data:
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else (
                f"; expected one of {', '.join(fields)}")
            raise ConfigError(f"{where}: unknown key{hint}")
        _unknown_in(data[key], fields[key].annotation, where)


def validate_mapping(model: type[BaseModel], data: Any, prefix: str) -> Any:
    """``data`` validated against ``model``; a non-mapping, an unknown key or a bad value
    becomes ConfigError("prefix.key: reason")."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping (key: value), got "
                          f"{type(data).__name__}")
    check_unknown_keys(data, model, prefix)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, prefix)) from None


def workload_file(data: Any, source: str, file_model: type[BaseModel],
                  spec_model: type[BaseModel]) -> Any:
    """The checked ``workload:`` section of a workload file (inference, MoE): ``data`` must be
    a mapping with only ``file_model``'s keys and mappings under ``workload:`` and ``model:``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with workload: and model:")
    check_unknown_keys(data, file_model, "")
    for key in ("workload", "model"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{key}: missing or not a mapping")
    return validate_mapping(spec_model, data["workload"], "workload")


def _unknown_in(value: Any, ann: Any, path: str) -> None:
    """Unknown keys inside ``value`` given the annotation of its field."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        check_unknown_keys(value, ann, path)
        return
    # ``ann`` itself (list[X]) or the branches of a union (X | list[Y] | None).
    options = [ann, *(a for a in (getattr(ann, "__args__", ()) or ()) if a is not type(None))]
    if isinstance(value, dict):
        for a in options:
            if isinstance(a, type) and issubclass(a, BaseModel):
                check_unknown_keys(value, a, path)
                return
    if isinstance(value, list):
        for a in options:
            if getattr(a, "__origin__", None) is list:
                (item,) = a.__args__
                for i, v in enumerate(value):
                    _unknown_in(v, item, f"{path}[{i}]")
                return


def check_totals(problem: Problem, where: str) -> None:
    """Refuse values so large that one iteration's time or memory overflows a float (each
    value alone is finite, but 1e308 seconds twice is not): schedules need finite times."""
    # Micro-batches of different cost: the summed time factors, the largest message factor
    # (an upper bound on the link time) and the summed memory factors.
    unit_work = sum(sum(problem.durations[k]) for k in problem.kinds)
    work = math.fsum(problem.device_work(d) for d in range(problem.devices))
    unit_hops = sum(problem.delay(k, k + 1) + problem.delay(k + 1, k)
                    for k in range(problem.stages - 1))
    m_hops = problem.microbatches * unit_hops * max(
        [1.0, *(x for row in problem.message_table for x in row)])  # no rows: one stage
    total = work + m_hops + sum(problem.grad_reduce)
    if not math.isfinite(total):
        # Name what overflows: the micro-batch factors, the link delays alone, or the op times.
        key = where
        if where == "stages":
            if not math.isfinite(work) and math.isfinite(problem.microbatches * unit_work):
                key = "pipeline.microbatch_scale"
            elif math.isfinite(work) and not math.isfinite(m_hops):
                key = ("links" if not math.isfinite(problem.microbatches * unit_hops)
                       else _scale_key(problem, "microbatch_message_scale"))
        raise ConfigError(f"{key}: the times of one iteration add up to more than a float "
                          f"holds ({total}); use smaller time units")
    per_device = [sum(problem.activation_memory[k] for k in ks) for ks in problem.device_stages]
    act, table = problem.activation_memory, problem.memory_table
    memory = max(s + math.fsum(act[k] * math.fsum(table[k]) for k in ks)
                 for s, ks in zip(problem.static_memory, problem.device_stages, strict=True))
    if not math.isfinite(memory):
        unit = max(s + problem.microbatches * a
                   for s, a in zip(problem.static_memory, per_device, strict=True))
        key = _scale_key(problem, "microbatch_memory_scale") if (
            where == "stages" and math.isfinite(unit)) else where
        raise ConfigError(f"{key}: the memory of one iteration adds up to more than a float "
                          f"holds ({memory}); use larger memory units")


def _scale_key(problem: Problem, field: str) -> str:
    """The ``pipeline:`` key that set a resolved micro-batch factor: ``field`` itself, or the
    one it defaults to (message -> memory -> time factor)."""
    order = SCALE_KEYS[:SCALE_KEYS.index(field) + 1]
    given = [k for k in order if getattr(problem, k)]
    return f"pipeline.{given[-1] if given else field}"


def _expand(name: str, value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ConfigError(f"{name}: expected {n} values (one per {what}), got {len(value)}")
        return list(value)
    return [value] * n


def _at(name: str, raw: Any, i: int) -> str:
    """Key path of the ``i``-th expanded value: indexed only when the config gave a list."""
    return f"{name}[{i}]" if isinstance(raw, list) else name


def _check_values(name: str, raw: Any, vals: list[Any], unit: str) -> None:
    """Every value finite and >= 0."""
    for i, x in enumerate(vals):
        if not math.isfinite(x) or x < 0:
            raise ConfigError(f"{_at(name, raw, i)}: must be a finite number >= 0 ({unit}), "
                              f"got {x}")


#: ``pipeline:`` keys of the per-micro-batch factors, by their :class:`Problem` field.
SCALE_KEYS = ("microbatch_scale", "microbatch_memory_scale", "microbatch_message_scale")


def microbatch_scales(pl: PipelineConfig) -> dict[str, Scale]:
    """The per-micro-batch factors of ``pipeline:`` as :class:`Problem` fields (only those
    given; a scalar applies to every micro-batch, a table gives one row per stage, or per stage
    boundary for messages). Each must be finite and > 0."""
    m, stages = pl.microbatches, pl.devices * pl.virtual_stages
    out: dict[str, Scale] = {}
    for key in SCALE_KEYS:
        raw = getattr(pl, key)
        if raw is None:
            continue
        name = f"pipeline.{key}"
        if isinstance(raw, list) and raw and all(isinstance(r, list) for r in raw):
            rows, what = ((stages - 1, "stage boundary") if key == "microbatch_message_scale"
                          else (stages, "stage"))
            if len(raw) != rows:
                raise ConfigError(f"{name}: a table needs {rows} rows (one per {what}), got "
                                  f"{len(raw)}")
            out[key] = tuple(_scale_row(f"{name}[{k}]", row, m) for k, row in enumerate(raw))
        else:
            out[key] = _scale_row(name, raw, m)
    return out


def _scale_row(name: str, raw: Any, m: int) -> tuple[float, ...]:
    """``m`` factors (a scalar is every micro-batch's), each finite and > 0."""
    if isinstance(raw, list) and len(raw) != m:
        raise ConfigError(f"{name}: expected {m} values (pipeline.microbatches), got "
                          f"{len(raw)}")
    vals = _expand(name, raw, m, "micro-batch")
    for i, x in enumerate(vals):
        if not math.isfinite(x):
            raise ConfigError(f"{_at(name, raw, i)}: must be a finite number > 0, got {x}")
        if x <= 0:
            raise ConfigError(f"{_at(name, raw, i)}: must be > 0, got {x:g}")
    return tuple(float(x) for x in vals)


def memory_values(mem: MemoryConfig, p: int) -> tuple[list[float | None], list[float]]:
    """``memory:`` per device, checked (both forms): limits >= 0 or None, static memory
    finite and >= 0 (bytes)."""
    limit = _expand("memory.limit", mem.limit, p, "device")
    for i, x in enumerate(limit):
        if x is not None and (math.isnan(x) or x < 0):
            raise ConfigError(f"{_at('memory.limit', mem.limit, i)}: must be a number >= 0 "
                              f"(bytes) or null for no limit, got {x}")
    static = _expand("memory.static", mem.static, p, "device")
    _check_values("memory.static", mem.static, static, "bytes")
    return limit, [float(x) for x in static]


#: Bytes of one weight copy per parameter when a model config gives parameter counts: the
#: 16-bit copy that mixed-precision training runs the forward and backward with (Micikevicius
#: et al., "Mixed Precision Training", ICLR'18), which is what a stash keeps per version.
WEIGHT_COPY_BYTES_PER_PARAM = 2.0


def async_extras(cfg: ConfigFile, problem: Problem) -> tuple[tuple[str, Any], ...]:
    """``pipeline.mode`` and, in async mode, the weight bytes of each stage as
    :class:`Config` extras (``mode``, ``weight_bytes``); () in sync mode.

    ``memory.weight_bytes`` (one value, or one per stage) is required by the explicit form in
    async mode; the model form defaults it to each stage's parameters times
    :data:`WEIGHT_COPY_BYTES_PER_PARAM`. It is refused in sync mode, where it would do
    nothing."""
    raw = cfg.memory.weight_bytes
    if cfg.pipeline.mode == "sync":
        if raw is not None:
            raise ConfigError("memory.weight_bytes: used only with pipeline.mode: async (the "
                              "extra weight versions of an asynchronous pipeline)")
        for key in ("replicas", "replica_bandwidth"):
            if getattr(cfg.pipeline, key) is not None:
                raise ConfigError(f"pipeline.{key}: used only with pipeline.mode: async")
        return ()
    if problem.virtual_stages != 1:
        raise ConfigError(f"pipeline.virtual_stages: pipeline.mode: async runs one stage per "
                          f"device, got {problem.virtual_stages}")
    if not problem.uniform_microbatches:
        raise ConfigError("pipeline.microbatch_scale: pipeline.mode: async repeats one "
                          "micro-batch's pattern, so every micro-batch must cost the same")
    s = problem.stages
    if raw is None:
        rows = dict(problem.meta).get("stage_costs")
        if not rows:
            raise ConfigError("memory.weight_bytes: pipeline.mode: async needs the bytes of one "
                              "copy of each stage's weights (one value, or one per stage)")
        wb = [float(r["params"]) * WEIGHT_COPY_BYTES_PER_PARAM for r in rows]
    else:
        wb = [float(x) for x in _expand("memory.weight_bytes", raw, s, "stage")]
        _check_values("memory.weight_bytes", raw, wb, "bytes")
    reps = _expand("pipeline.replicas", cfg.pipeline.replicas or 1, s, "stage")
    for i, r in enumerate(reps):
        if r < 1:
            raise ConfigError(f"{_at('pipeline.replicas', cfg.pipeline.replicas, i)}: must be an "
                              f"integer >= 1 (devices running the stage), got {r}")
    out = (("mode", "async"), ("weight_bytes", tuple(wb)), ("replicas", tuple(reps)))
    raw_bw = cfg.pipeline.replica_bandwidth
    if raw_bw is None:
        return out
    bws = [float(x) for x in _expand("pipeline.replica_bandwidth", raw_bw, s, "stage")]
    for i, x in enumerate(bws):
        if not (x > 0):  # inf: a network too fast to count
            raise ConfigError(f"{_at('pipeline.replica_bandwidth', raw_bw, i)}: must be > 0 "
                              f"bytes/s, got {x}")
    sync = tuple(all_reduce_time(r, w, 0.0, b) if r > 1 else 0.0
                 for r, w, b in zip(reps, wb, bws, strict=True))
    return (*out, ("sync_s", sync))
