"""``config.yaml`` -> validated config -> :class:`~pipeopt.problem.Problem`.

The only module that reads YAML. The explicit problem form is SPEC section 1; the
``model:`` / ``cluster:`` form is handed to :mod:`pipeopt.costs`. Every error is a
:class:`ConfigError` whose message starts with the key path (``stages.forward[2]: ...``).
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeopt.problem import Problem, ProblemError, chain_links

Scalars = float | list[float]

#: Largest problem a config may describe: ops = kinds x devices x virtual_stages x microbatches.
#: Every op is a Python object in the solvers and the schedule (about 2 KB each all told:
#: p=64, m=8192, 1.6 M ops, took 2-3 GB to schedule and write), so beyond this a machine runs
#: out of memory before it runs out of patience.
MAX_OPS = 1_000_000
#: Most pipeline ranks (the link matrices hold devices^2 entries).
MAX_DEVICES = 1024
#: Seeds are 32-bit in CP-SAT; more solver threads than this is a typo.
MAX_SEED = 2**31 - 1
MAX_WORKERS = 256


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and the reason."""


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
    microbatch_scale: Scalars | None = Field(
        None, description="per micro-batch factor on its op times (and by default memory)")
    microbatch_memory_scale: Scalars | None = Field(
        None, description="per micro-batch factor on its activation memory")
    microbatch_message_scale: Scalars | None = Field(
        None, description="per micro-batch factor on its message bytes")


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


class SolverConfig(_Strict):
    """``solver:`` — which method and its limits."""

    method: str = "auto"
    time_limit: float = Field(60.0, gt=0, allow_inf_nan=False, description="seconds")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    objective: Literal["makespan", "span"] = "makespan"
    workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    relative_gap: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    resolution: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="seconds per CP-SAT time unit")


def check_solver_option(name: str, value: Any) -> None:
    """Raise :class:`ConfigError` ("time_limit: must be ..., got -1") when ``value`` breaks a
    rule of the ``solver:`` key ``name``: the same rules as :class:`SolverConfig`, for values
    that do not come from a file (``pipeopt.solve(..., time_limit=...)``, command-line flags).
    Keys without a rule here (method, callbacks) pass."""
    why = solver_option_rule(name, value)
    if why is not None:
        raise ConfigError(f"{name}: {why}, got {value!r:.60}")


def solver_option_rule(name: str, value: Any) -> str | None:
    """The rule of the ``solver:`` key ``name`` that ``value`` breaks, or None."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    why = None
    if name == "time_limit" and not (real and math.isfinite(value) and value > 0):
        why = "must be a finite number of seconds > 0"
    elif name == "seed" and not (whole and 0 <= value <= MAX_SEED):
        why = f"must be an integer in 0..{MAX_SEED}"
    elif name == "workers" and value is not None and not (whole and 1 <= value <= MAX_WORKERS):
        why = f"must be an integer in 1..{MAX_WORKERS}, or None for all cores"
    elif name == "relative_gap" and not (real and 0 <= value <= 1):
        why = "must be a number in 0..1"
    elif name == "resolution" and value is not None and not (
            real and math.isfinite(value) and value > 0):
        why = "must be a finite number of seconds > 0, or None to have it chosen"
    elif name == "objective" and value not in ("makespan", "span"):
        why = "must be 'makespan' or 'span'"
    return why


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


#: Sections that may be left empty (``memory:`` with every key commented out reads as null):
#: null there means "all defaults", as an empty mapping does.
_OPTIONAL_SECTIONS = ("links", "memory", "solver", "model", "cluster", "training")


def parse_config(data: Any, source: str = "<memory>",
                 overrides: dict[str, Any] | None = None, *,
                 yaml11_strings: bool = True) -> Config:
    """Validate a config mapping (already parsed from YAML) and build its problem.

    ``overrides`` replace ``solver:`` keys (command-line flags win over the file).
    ``yaml11_strings``: read the strings that plain YAML 1.1 (``yaml.safe_load``) leaves
    unparsed, such as ``1e-3`` or ``inf``, as numbers; :func:`load_config` turns it off, its
    reader parses those already, so a string there was quoted and is refused like ``"1.5"``.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (pipeline, stages, ...), "
                          f"got {_yaml_type(data)}")
    _check_expanded_size(data, source)
    data = {k: _floats_from_strings(v, str(k), frozenset({id(data)}), yaml11_strings)
            for k, v in data.items() if not (k in _OPTIONAL_SECTIONS and v is None)}
    if overrides:
        solver = data.get("solver")
        solver = dict(solver) if isinstance(solver, dict) else {}
        solver.update({k: v for k, v in overrides.items() if v is not None})
        data["solver"] = solver
    check_unknown_keys(data, ConfigFile, "")
    if data.get("pipeline") is None:
        raise ConfigError("pipeline: missing (give at least devices and microbatches)")
    if ("model" in data or "cluster" in data) and data.get("stages") is not None:
        raise ConfigError("stages: cannot be combined with model:/cluster: (give per-stage "
                          "costs or a model, not both)")
    try:
        cfg = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc)) from None
    check_size(cfg.pipeline)
    if cfg.model is not None or cfg.cluster is not None:
        return _from_model(cfg, data, source)
    if cfg.stages is None:
        raise ConfigError("stages: missing (give per-stage costs, or a model: and cluster:)")
    if cfg.training:  # only the model form searches a partition; here it would do nothing
        raise ConfigError(f"training.{next(iter(cfg.training))}: training: is used only with "
                          "model:/cluster: (the explicit form gives per-stage costs already)")
    problem = build_problem(cfg)
    check_totals(problem, "stages")
    return Config(problem=problem, solver=cfg.solver, source=source)


def check_totals(problem: Problem, where: str) -> None:
    """Refuse values so large that one iteration's time or memory overflows a float (each
    value alone is finite, but 1e308 seconds twice is not): schedules need finite times."""
    # Micro-batches of different cost: the summed time factors, the largest message factor
    # (an upper bound on the link time) and the summed memory factors.
    unit_work = sum(sum(problem.durations[k]) for k in problem.kinds)
    work = math.fsum(problem.time_scale) * unit_work
    unit_hops = sum(problem.delay(k, k + 1) + problem.delay(k + 1, k)
                    for k in range(problem.stages - 1))
    m_hops = problem.microbatches * unit_hops * max(1.0, *problem.message_scale)
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
    memory = max(s + math.fsum(problem.memory_scale) * a
                 for s, a in zip(problem.static_memory, per_device, strict=True))
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


def _yaml_type(data: Any) -> str:
    names = {list: "a list", str: "a string", int: "a number", float: "a number",
             bool: "true/false", type(None): "nothing"}
    return names.get(type(data), type(data).__name__)


def check_size(pl: PipelineConfig) -> None:
    """Refuse pipelines too large to schedule in memory (:data:`MAX_OPS`, :data:`MAX_DEVICES`)."""
    if pl.devices > MAX_DEVICES:
        raise ConfigError(f"pipeline.devices: at most {MAX_DEVICES}, got {pl.devices}")
    kinds = 3 if pl.split_backward else 2
    stages = pl.devices * pl.virtual_stages
    if stages > MAX_OPS // kinds:
        raise ConfigError(f"pipeline.virtual_stages: {pl.devices} devices x "
                          f"{pl.virtual_stages} virtual stages is too many stages (at most "
                          f"{MAX_OPS // kinds // pl.devices} virtual stages here)")
    ops = kinds * stages * pl.microbatches
    if ops > MAX_OPS:
        raise ConfigError(
            f"pipeline.microbatches: {pl.microbatches} micro-batches on {stages} stages make "
            f"{ops:,} ops, more than pipeopt schedules ({MAX_OPS:,}; at most "
            f"{MAX_OPS // (kinds * stages):,} micro-batches here)")


def _from_model(cfg: ConfigFile, data: dict[str, Any], source: str) -> Config:
    try:
        from pipeopt.costs import build_from_model  # type: ignore[attr-defined]
    except ImportError:
        raise ConfigError("model: the model/cluster form is not available in this version; "
                          "give per-stage costs under stages:") from None
    return build_from_model(cfg, data, source)


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


def microbatch_scales(pl: PipelineConfig) -> dict[str, tuple[float, ...]]:
    """The per-micro-batch factors of ``pipeline:`` as :class:`Problem` fields (only those
    given; a scalar applies to every micro-batch). Each must be finite and > 0."""
    m = pl.microbatches
    out: dict[str, tuple[float, ...]] = {}
    for key in SCALE_KEYS:
        raw = getattr(pl, key)
        if raw is None:
            continue
        name = f"pipeline.{key}"
        if isinstance(raw, list) and len(raw) != m:
            raise ConfigError(f"{name}: expected {m} values (pipeline.microbatches), got "
                              f"{len(raw)}")
        vals = _expand(name, raw, m, "micro-batch")
        for i, x in enumerate(vals):
            if not math.isfinite(x):
                raise ConfigError(f"{_at(name, raw, i)}: must be a finite number > 0, got {x}")
            if x <= 0:
                raise ConfigError(f"{_at(name, raw, i)}: must be > 0, got {x:g}")
        out[key] = tuple(float(x) for x in vals)
    return out


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


def build_problem(cfg: ConfigFile) -> Problem:
    """The problem of an explicit-form config (scalars broadcast, lists checked)."""
    pl, st, ln, mem = cfg.pipeline, cfg.stages, cfg.links, cfg.memory
    assert st is not None
    p, v = pl.devices, pl.virtual_stages
    s = p * v
    per_stage = {}
    for key in ("forward", "backward_input", "backward_weight", "activation_memory",
                "grad_reduce"):
        per_stage[key] = _expand(f"stages.{key}", getattr(st, key), s, "stage")
    wgm = st.weight_grad_memory
    per_stage["weight_grad_memory"] = (per_stage["activation_memory"] if wgm is None
                                       else _expand("stages.weight_grad_memory", wgm, s, "stage"))
    units = {"activation_memory": "bytes", "weight_grad_memory": "bytes"}
    for key, vals in per_stage.items():
        raw = getattr(st, key) if getattr(st, key) is not None else st.activation_memory
        _check_values(f"stages.{key}", raw, vals, units.get(key, "seconds"))
    lat = _expand("links.latency", ln.latency, p - 1, "neighbouring device pair")
    bw = _expand("links.bandwidth", ln.bandwidth, p - 1, "neighbouring device pair")
    _check_values("links.latency", ln.latency, lat, "seconds")
    for i, x in enumerate(bw):
        if math.isnan(x) or x <= 0:
            raise ConfigError(f"{_at('links.bandwidth', ln.bandwidth, i)}: must be > 0 "
                              f"(bytes/s; .inf for no transfer time), got {x}")
    if isinstance(ln.latency, int | float) and p > 1:
        # One scalar: every pair of devices is one hop apart (a switched fabric).
        slowest = min(bw)  # once: inside the loops it made loading O(p^3)
        lat_m = tuple(tuple(0.0 if a == b else float(ln.latency) for b in range(p))
                      for a in range(p))
        bw_m = tuple(tuple(math.inf if a == b else slowest for b in range(p)) for a in range(p))
    else:
        lat_m, bw_m = chain_links(p, lat, bw)
    msg = _expand("links.message_size", ln.message_size, s - 1, "stage boundary")
    _check_values("links.message_size", ln.message_size, msg, "bytes")
    limit, static = memory_values(mem, p)
    scales = microbatch_scales(pl)
    try:
        return Problem(
            devices=p, microbatches=pl.microbatches, virtual_stages=v, placement=pl.placement,
            split_backward=pl.split_backward,
            forward=tuple(per_stage["forward"]),
            backward_input=tuple(per_stage["backward_input"]),
            backward_weight=tuple(per_stage["backward_weight"]),
            activation_memory=tuple(per_stage["activation_memory"]),
            weight_grad_memory=tuple(per_stage["weight_grad_memory"]),
            grad_reduce=tuple(per_stage["grad_reduce"]),
            latency=lat_m, bandwidth=bw_m, message_size=tuple(msg),
            memory_limit=tuple(limit), static_memory=tuple(static), **scales,
        )
    except ProblemError as exc:
        raise ConfigError(_section_of(str(exc))) from None


_SECTION = {
    "forward": "stages", "backward_input": "stages", "backward_weight": "stages",
    "activation_memory": "stages", "weight_grad_memory": "stages", "grad_reduce": "stages",
    "latency": "links", "bandwidth": "links", "message_size": "links",
    "memory_limit": "memory.limit", "static_memory": "memory.static",
    "devices": "pipeline", "microbatches": "pipeline", "virtual_stages": "pipeline",
    "placement": "pipeline", **dict.fromkeys(SCALE_KEYS, "pipeline"),
}


def _section_of(msg: str) -> str:
    """Prefix a problem error with the config section its field comes from."""
    field = msg.split(":", 1)[0].split("[", 1)[0]
    sec = _SECTION.get(field)
    if sec is None:
        return msg
    if sec.startswith("memory."):
        return sec + msg[len(field):]
    return f"{sec}.{msg}"


class _SafeLoader(yaml.SafeLoader):
    """Safe loading only (no Python objects, no arbitrary tags). Also reads ``1e9`` (YAML 1.1
    wants ``1.0e9``), ``inf`` and ``nan`` as numbers, and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(f"duplicate key {key!r} (first at line "
                                    f"{seen[key].line + 1}); each key may appear once",
                                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        """An integer, or :class:`~pipeopt.io.TooLarge` when it has over 300 digits (larger
        than any float; Python refuses to read integers of over 4300 digits), which
        :func:`parse_config` refuses naming the key."""
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > 300:
            text = str(node.value).replace("_", "")
            try:
                float(text)
            except ValueError:  # a hex/octal/sexagesimal literal: let YAML read it
                pass
            else:
                from pipeopt.io import TooLarge

                return TooLarge(text)
        return super().construct_yaml_int(node)


_SafeLoader.add_constructor("tag:yaml.org,2002:int", _SafeLoader.construct_yaml_int)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


#: Numbers that YAML 1.1 (PyYAML) reads as strings but YAML 1.2 and people read as numbers.
_MORE_FLOATS = re.compile(r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+"
                          r"|[-+]?(?:inf|Inf|INF)|nan|NaN|NAN)$")
_SafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _MORE_FLOATS,
                                  list("-+0123456789iInN"))


#: Most values a config may hold once YAML aliases are expanded: far above any real config
#: (a per-stage list for 1024 devices x 16 virtual stages is 16k values), far below what an
#: alias "bomb" (nested anchors, each repeated tenfold) expands to.
MAX_CONFIG_VALUES = 1_000_000


def _check_expanded_size(data: Any, source: str) -> None:
    """Refuse a document that holds more than :data:`MAX_CONFIG_VALUES` values once its YAML
    aliases are expanded. Counted with shared nodes memoised, so the count itself stays cheap;
    a node that contains itself is left for :func:`_floats_from_strings` to name."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, dict | list):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:  # a cycle: reported with its path by _floats_from_strings
            return 1
        active.add(key)
        children = node.values() if isinstance(node, dict) else node
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_CONFIG_VALUES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        total = size(data)
    except RecursionError:
        raise ConfigError(f"{source}: not usable YAML: nested too deeply") from None
    if total > MAX_CONFIG_VALUES:
        raise ConfigError(f"{source}: holds more than {MAX_CONFIG_VALUES:,} values once its "
                          "YAML aliases (*name) are expanded; write the values out, or use "
                          "fewer nested aliases")


def _floats_from_strings(data: Any, path: str = "", inside: frozenset[int] = frozenset(),
                         convert: bool = True) -> Any:
    """``data`` with the strings of :data:`_MORE_FLOATS` read as numbers (when ``convert``),
    for mappings that were parsed by plain ``yaml.safe_load`` rather than :func:`read_yaml`.
    A value that contains itself (a YAML alias to an enclosing anchor) is refused, and so is
    an integer too large for any number (:class:`~pipeopt.io.TooLarge`)."""
    if isinstance(data, dict | list):
        if id(data) in inside:
            raise ConfigError(f"{path or '<top>'}: refers to itself (a YAML alias to an "
                              "enclosing anchor)")
        inside = inside | {id(data)}
        if isinstance(data, dict):
            return {k: _floats_from_strings(v, f"{path}.{k}" if path else str(k), inside,
                                            convert) for k, v in data.items()}
        return [_floats_from_strings(v, f"{path}[{i}]", inside, convert)
                for i, v in enumerate(data)]
    if isinstance(data, float) and type(data) is not float:
        from pipeopt.io import TooLarge

        if isinstance(data, TooLarge):
            raise ConfigError(f"{path or '<top>'}: too large (an integer of {data.digits} "
                              "digits, more than any number pipeopt takes)")
    if convert and isinstance(data, str) and _MORE_FLOATS.match(data):
        return float(data.replace("_", ""))
    return data


#: Largest config pipeopt reads (bytes), from a file or standard input: room for
#: MAX_CONFIG_VALUES values with comments; the profile of a model (``model.profile``) too.
MAX_CONFIG_BYTES = 32 * 2**20


def _read_text(path: str | os.PathLike[str], max_bytes: int, what: str) -> str:
    """The text of a config file (``-``: standard input); :class:`ConfigError` if it cannot
    be read."""
    from pipeopt.io import input_name, read_input

    name = input_name(path)
    try:
        return read_input(path, max_bytes, what)
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory, expected a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not a UTF-8 text file, expected YAML") from None


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file (``-``: standard input) safely; unreadable or malformed files raise
    :class:`ConfigError`."""
    from pipeopt.io import input_name

    return _parse_yaml(_read_text(path, MAX_CONFIG_BYTES, "a config"), input_name(path))


def _parse_yaml(text: str, path: str) -> Any:
    """The YAML document ``text`` read from ``path`` (for messages)."""
    if "\x00" in text:
        raise ConfigError(f"{path}: a binary file (NUL bytes), expected YAML text")
    try:
        data = yaml.load(text, Loader=_SafeLoader)
    except yaml.constructor.ConstructorError as exc:
        raise ConfigError(f"{path}: {_yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML{_where(exc)}: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not usable YAML: nested too deeply") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty, expected a YAML mapping of sections "
                          "(pipeline, stages, ...)")
    return data


def _where(exc: Any) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""


def _yaml_problem(exc: yaml.constructor.ConstructorError) -> str:
    problem = exc.problem or ""
    if "could not determine a constructor" in problem:
        quoted = re.search(r"'([^']*)'", problem)
        tag = (quoted.group(1) if quoted else "?").replace("tag:yaml.org,2002:", "!!")
        return (f"refused the YAML tag {tag}{_where(exc)}: configs are read with safe "
                "loading, which builds no Python objects; use plain values")
    return f"not valid YAML{_where(exc)}: {problem.strip()}"


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read, validate and resolve a ``config.yaml`` (``-``: standard input); keyword arguments
    override ``solver:``.

    A ``.json`` file with a ``format`` key is read as a schedule JSON instead
    (:func:`config_from_schedule`, which also names what is wrong with one that is not a JSON
    object); a ``.json`` object without one is a config written in JSON. On standard input a
    JSON object with a ``format`` key is a schedule, anything else a config."""
    from pipeopt.io import MAX_SCHEDULE_BYTES, STDIN, input_name, json_int, size_text

    name = input_name(path)
    is_json = str(path).lower().endswith(".json")
    if not is_json and str(path) != STDIN:
        return parse_config(read_yaml(path), source=name, overrides=overrides,
                            yaml11_strings=False)
    text = _read_text(path, MAX_SCHEDULE_BYTES, "a schedule JSON")  # or a config
    try:
        doc = json.loads(text, parse_int=json_int)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and "format" in doc:
        return config_from_schedule(name, doc, **overrides)
    if is_json and not isinstance(doc, dict):
        return config_from_schedule(path, None, **overrides)  # the loader names the problem
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name}: more than {size_text(MAX_CONFIG_BYTES)}, the most "
                          "pipeopt reads for a config")
    return parse_config(_parse_yaml(text, name), source=name, overrides=overrides,
                        yaml11_strings=False)


def config_from_schedule(path: str | os.PathLike[str], doc: dict[str, Any] | None = None,
                         **overrides: Any) -> Config:
    """The problem of a schedule JSON (for example the measured costs that ``pipeopt run
    --costs-out`` writes), to solve again; ``doc`` is the file already parsed, if it was.
    ``overrides`` are ``solver:`` keys (defaults otherwise). The schedule is validated first."""
    from pipeopt.io import load_schedule, schedule_from_dict

    sched = load_schedule(path) if doc is None else schedule_from_dict(doc)
    try:
        solver = SolverConfig.model_validate({k: v for k, v in overrides.items()
                                              if v is not None})
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, "solver")) from None
    return Config(problem=sched.problem, solver=solver, source=str(path),
                  extras=(("from_schedule", sched.method),))
