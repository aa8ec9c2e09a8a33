"""``config.yaml`` -> validated config -> :class:`~pipeopt.problem.Problem`.

The only module that reads YAML. The explicit problem form is SPEC section 1; the
``model:`` / ``cluster:`` form is handed to :mod:`pipeopt.costs`. Every error is a
:class:`ConfigError` whose message starts with the key path (``stages.forward[2]: ...``).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeopt.problem import Problem, ProblemError, chain_links

Scalars = float | list[float]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PipelineConfig(_Strict):
    """``pipeline:`` — the shape of the pipeline."""

    devices: int = Field(ge=1, description="pipeline ranks p")
    microbatches: int = Field(ge=1, description="micro-batches per iteration m")
    virtual_stages: int = Field(1, ge=1, description="model chunks per device v")
    placement: Literal["loop", "vshape"] = "loop"
    split_backward: bool = True


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
    time_limit: float = Field(60.0, gt=0, description="seconds")
    seed: int = 0
    objective: Literal["makespan", "span"] = "makespan"
    workers: int | None = Field(None, ge=1)
    relative_gap: float = Field(0.0, ge=0, le=1)
    resolution: float | None = Field(None, gt=0, description="seconds per CP-SAT time unit")


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


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<top>"


def _unknown_keys(data: Any, model: type[BaseModel], loc: tuple[Any, ...]) -> None:
    """Reject unknown keys with a "did you mean" before pydantic's generic message."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else (
                f"; expected one of {', '.join(fields)}")
            raise ConfigError(f"{_path((*loc, key))}: unknown key{hint}")
        ann = fields[key].annotation
        sub = _model_in(ann)
        if sub is not None:
            _unknown_keys(data[key], sub, (*loc, key))


def _model_in(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _pydantic_message(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(x for x in first["loc"] if not (isinstance(x, str) and (
        x.startswith(("list[", "float", "int", "none", "function")))))
    msg = first["msg"]
    val = first.get("input")
    shown = "" if isinstance(val, dict) else f", got {val!r:.60}"
    return f"{_path(loc)}: {msg[0].lower() + msg[1:]}{shown}"


def parse_config(data: Any, source: str = "<memory>",
                 overrides: dict[str, Any] | None = None) -> Config:
    """Validate a config mapping (already parsed from YAML) and build its problem.

    ``overrides`` replace ``solver:`` keys (command-line flags win over the file).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (pipeline, stages, ...), "
                          f"got {type(data).__name__}")
    data = dict(data)
    if overrides:
        solver = dict(data.get("solver") or {})
        solver.update({k: v for k, v in overrides.items() if v is not None})
        data["solver"] = solver
    _unknown_keys(data, ConfigFile, ())
    try:
        cfg = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_message(exc)) from None
    if cfg.model is not None or cfg.cluster is not None:
        return _from_model(cfg, data, source)
    if cfg.stages is None:
        raise ConfigError("stages: missing (give per-stage costs, or a model: and cluster:)")
    problem = build_problem(cfg)
    return Config(problem=problem, solver=cfg.solver, source=source)


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
    for key in ("forward", "backward_input", "backward_weight"):
        for i, x in enumerate(per_stage[key]):
            if not math.isfinite(x) or x < 0:
                raise ConfigError(f"stages.{key}[{i}]: must be a finite number >= 0, got {x}")
    lat = _expand("links.latency", ln.latency, p - 1, "neighbouring device pair")
    bw = _expand("links.bandwidth", ln.bandwidth, p - 1, "neighbouring device pair")
    for name, vals in (("links.latency", lat), ("links.bandwidth", bw)):
        for i, x in enumerate(vals):
            if math.isnan(x) or x < 0 or (name == "links.bandwidth" and x == 0):
                raise ConfigError(f"{name}[{i}]: must be {'> 0' if 'band' in name else '>= 0'}"
                                  f", got {x}")
    if isinstance(ln.latency, int | float) and p > 1:
        # One scalar: every pair of devices is one hop apart (a switched fabric).
        lat_m = tuple(tuple(0.0 if a == b else float(ln.latency) for b in range(p))
                      for a in range(p))
        bw_m = tuple(tuple(math.inf if a == b else min(bw) for b in range(p)) for a in range(p))
    else:
        lat_m, bw_m = chain_links(p, lat, bw)
    msg = _expand("links.message_size", ln.message_size, s - 1, "stage boundary")
    limit = _expand("memory.limit", mem.limit, p, "device")
    static = _expand("memory.static", mem.static, p, "device")
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
            memory_limit=tuple(limit), static_memory=tuple(static),
        )
    except ProblemError as exc:
        raise ConfigError(_section_of(str(exc))) from None


_SECTION = {
    "forward": "stages", "backward_input": "stages", "backward_weight": "stages",
    "activation_memory": "stages", "weight_grad_memory": "stages", "grad_reduce": "stages",
    "latency": "links", "bandwidth": "links", "message_size": "links",
    "memory_limit": "memory.limit", "static_memory": "memory.static",
    "devices": "pipeline", "microbatches": "pipeline", "virtual_stages": "pipeline",
    "placement": "pipeline",
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
    """Safe loading only (no Python objects); ``.inf``/``inf`` read as infinity."""


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file safely; unreadable or malformed files raise :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    try:
        data = yaml.load(text, Loader=_SafeLoader)
    except yaml.constructor.ConstructorError as exc:
        raise ConfigError(f"{path}: refused a YAML tag that would build a Python object "
                          f"({exc.problem})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    return data


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read, validate and resolve a ``config.yaml``; keyword arguments override ``solver:``."""
    return parse_config(read_yaml(path), source=str(path), overrides=overrides)
