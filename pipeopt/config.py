"""``config.yaml`` -> validated config -> :class:`~pipeopt.problem.Problem`.

The only module that reads YAML. The explicit problem form is SPEC section 1; the
``model:`` / ``cluster:`` form is handed to :mod:`pipeopt.costs`. Every error is a
:class:`ConfigError` whose message starts with the key path (``stages.forward[2]: ...``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from pipeopt import subblocks
from pipeopt.errors import (
    MAX_CONFIG_BYTES,
    MAX_DEVICES,
    MAX_OPS,
    MAX_SEED,
    MAX_WORKERS,
    ConfigError,
    check_solver_option,
    solver_option_rule,
)
from pipeopt.problem import Problem, ProblemError, chain_links
from pipeopt.schema import (
    SCALE_KEYS,
    Config,
    ConfigFile,
    LinksConfig,
    MemoryConfig,
    PipedreamConfig,
    PipelineConfig,
    SolverConfig,
    StagesConfig,
    _at,
    _check_values,
    _expand,
    async_extras,
    check_totals,
    check_unknown_keys,
    error_message,
    key_path,
    memory_values,
    microbatch_scales,
    pick_error,
    pydantic_message,
)

# The config's types, error messages and shared checks live in pipeopt.schema and
# pipeopt.errors (below pipeopt.costs, which builds configs too, and pipeopt.solvers, which
# checks its options by the solver: rules); they stay importable from here.
__all__ = [
    "MAX_CONFIG_BYTES", "MAX_CONFIG_VALUES", "MAX_DEVICES", "MAX_OPS", "MAX_SEED",
    "MAX_WORKERS", "SCALE_KEYS", "Config", "ConfigError", "ConfigFile", "LinksConfig",
    "MemoryConfig", "PipelineConfig", "SolverConfig", "StagesConfig", "build_problem",
    "check_size", "check_solver_option", "check_totals", "check_unknown_keys",
    "config_from_schedule", "config_of_document", "error_message", "key_path", "load_config",
    "memory_values", "microbatch_scales", "parse_config", "pick_error", "pydantic_message",
    "read_document", "read_yaml", "solver_option_rule",
]


#: Sections that may be left empty (``memory:`` with every key commented out reads as null):
#: null there means "all defaults", as an empty mapping does.
_OPTIONAL_SECTIONS = ("links", "memory", "solver", "model", "cluster", "training",
                      "pipedream")


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
    if cfg.pipeline.sub_blocks != 1 and cfg.pipeline.mode == "async":
        raise ConfigError(f"pipeline.sub_blocks: pipeline.mode: async runs one op per stage and "
                          f"micro-batch, got {cfg.pipeline.sub_blocks} sub-blocks (leave it out "
                          "or set 1)")
    if cfg.pipedream is not None:
        return _from_pipedream(cfg, source)
    if cfg.model is not None or cfg.cluster is not None:
        return _cut_model(_from_model(cfg, data, source), cfg.pipeline.sub_blocks)
    if cfg.stages is None:
        raise ConfigError("stages: missing (give per-stage costs, or a model: and cluster:)")
    if cfg.training:  # only the model form searches a partition; here it would do nothing
        raise ConfigError(f"training.{next(iter(cfg.training))}: training: is used only with "
                          "model:/cluster: (the explicit form gives per-stage costs already)")
    problem = build_problem(cfg)
    check_totals(problem, "stages")
    return cut_sub_blocks(Config(problem=problem, solver=cfg.solver, source=source,
                                 extras=async_extras(cfg, problem)), cfg.pipeline.sub_blocks)


def _cut_model(config: Config, k: int) -> Config:
    """A model config cut into ``k`` sub-blocks, each piece priced by its own layers
    (:meth:`pipeopt.costs.build.ModelPlan.sub_block_weights`, in each stage's recomputation)."""
    plan, part = config.extra("plan"), config.extra("partition")
    if k == 1 or plan is None or part is None or min(b - a for a, b in part) < k:
        return cut_sub_blocks(config, k)  # (too few layers: refused there, naming the key)
    if plan.recompute_options:
        recompute = (config.extra("partition_search") or {}).get("recompute")
        plan = plan.resolved([tuple(r) for r in part], recompute)
    return cut_sub_blocks(config, k, plan.sub_block_weights(part, k))


def cut_sub_blocks(config: Config, k: int, weights: Any = None) -> Config:
    """``config`` with its problem's stages cut into ``k`` sub-blocks
    (:func:`pipeopt.subblocks.split`, each piece's share of its stage by ``weights``, else
    even; itself when ``k`` is 1). A model config's layer partition must give every stage at
    least ``k`` layers, and its chunk count is then fixed (``auto`` does not re-chunk a cut
    problem)."""
    if k == 1:
        return config
    try:
        problem = subblocks.split(config.problem, k, weights)
    except ProblemError as exc:
        msg = str(exc)
        raise ConfigError(f"pipeline.{msg}" if msg.startswith("sub_blocks") else f"model: {msg}"
                          ) from None
    extras = tuple((key, False if key == "chunks_open" else val) for key, val in config.extras)
    return dataclasses.replace(config, problem=problem, extras=extras)


#: Bound on PipeDream's DP (:func:`planner_work`): layers^3 x the sum over levels of units^2
#: (its states times the choices of each). Measured 1.0e7 to 5.4e7 of these per second (16 to
#: 64 layers, two levels of 2 to 8 units, 2026-12-03), so the bound keeps the plan under about
#: a minute; with device types and memory limits, 6.4e6 to 8.1e7 per second (24 to 64 layers,
#: 1 to 3 types of 2 to 8 nodes, under a load average of 14, 2026-12-03), so at most about
#: a minute and a half.
MAX_PLANNER_WORK = 6e8


def planner_work(layers: int, types: Sequence[Any], limited: bool,
                 every_node: bool = True) -> float:
    """The size of PipeDream's DP on ``layers`` and ``DeviceType`` s (a count comparable with
    :data:`MAX_PLANNER_WORK`): per type, layers^3 x the sum over its levels (its top-level
    units included) of units^2, times all the devices when a memory limit puts the devices
    after a stage into the state; the top level's DP over the units left of each type adds
    layers^2 x prod(units + 1) x sum(units), times the devices again when idle nodes are
    allowed under a memory limit (one table per number of devices in use). With one type and
    no limit: layers^3 x sum units^2."""
    work = 0.0
    devices = sum(ty.devices for ty in types)
    for ty in types:
        inner = sum(lv.units ** 2 for lv in ty.levels) + ty.units ** 2
        work += layers ** 3 * inner * (devices if limited and ty.memory is not None else 1)
    if len(types) > 1 or not every_node:
        work += layers ** 2 * math.prod(ty.units + 1 for ty in types) * sum(
            ty.units for ty in types) * (devices if limited and not every_node else 1)
    return work


def _own_profile(name: str, dt: Any, n: int) -> tuple[tuple[float, float, float], ...] | None:
    """A device type's own layer times (``forward``, ``backward_input``, ``backward_weight``:
    all three or none; not with ``speed``)."""
    where = f"pipedream.device_types.{name}"
    keys = ("forward", "backward_input", "backward_weight")
    given = [k for k in keys if getattr(dt, k) is not None]
    if not given:
        return None
    for k in keys:
        if k not in given:
            raise ConfigError(f"{where}.{k}: missing (a type's own profile gives forward, "
                              "backward_input and backward_weight)")
    if "speed" in dt.model_fields_set:
        raise ConfigError(f"{where}.speed: not with its own profile (its times are measured "
                          "on it)")
    cols = []
    for k in keys:
        raw = getattr(dt, k)
        vals = [float(x) for x in _expand(f"{where}.{k}", raw, n, "layer")]
        _check_values(f"{where}.{k}", raw, vals, "s")
        cols.append(vals)
    return tuple(zip(*cols, strict=True))


def _device_types(pd: PipedreamConfig, limit: float | None, n: int) -> list[Any]:
    """The planner's device types of a ``pipedream:`` section (``n`` layers): one (the
    profile's own) without ``device_types``; else one per name, its top-level units from the
    top level's ``types``, its memory its own or ``memory.limit``, its times its own profile's
    or the layers' / its speed."""
    from pipeopt.partition.pipedream import DeviceType, Level

    top_k = len(pd.levels) - 1
    top = pd.levels[-1]
    where = f"pipedream.levels[{top_k}].types"
    for k, lv in enumerate(pd.levels[:-1]):
        if lv.types is not None:
            raise ConfigError(f"pipedream.levels[{k}].types: only the top level's units "
                              f"(levels[{top_k}]) have device types")
    inner = tuple(Level(lv.units, lv.bandwidth) for lv in pd.levels[:-1])
    if pd.device_types is None:
        if top.types is not None:
            raise ConfigError(f"{where}: names device types, but pipedream.device_types is "
                              "missing (give each type's speed and memory there)")
        return [DeviceType("device", top.units, inner, memory=limit)]
    known = ", ".join(pd.device_types)
    if top.types is None:
        raise ConfigError(f"{where}: missing; with pipedream.device_types, give how many of "
                          f"the top level's {top.units} units are of each type ({known})")
    for name in top.types:
        if name not in pd.device_types:
            raise ConfigError(f"{where}.{name}: unknown device type (pipedream.device_types "
                              f"has {known})")
    for name in pd.device_types:
        if name not in top.types:
            raise ConfigError(f"pipedream.device_types.{name}: no units of this type in "
                              f"{where}")
    if sum(top.types.values()) != top.units:
        raise ConfigError(f"{where}: {sum(top.types.values())} units by type, but "
                          f"pipedream.levels[{top_k}].units is {top.units}")
    out = []
    for name, dt in pd.device_types.items():
        levels = inner if dt.levels is None else tuple(Level(lv.units, lv.bandwidth)
                                                       for lv in dt.levels)
        for k, lv in enumerate(dt.levels or ()):
            if lv.types is not None:
                raise ConfigError(f"pipedream.device_types.{name}.levels[{k}].types: only the "
                                  f"top level's units (pipedream.levels[{top_k}]) have types")
        out.append(DeviceType(name, top.types[name], levels, dt.speed,
                              limit if dt.memory is None else dt.memory,
                              _own_profile(name, dt, n)))
    return out


def _from_pipedream(cfg: ConfigFile, source: str) -> Config:
    """The ``pipedream:`` form: PipeDream's planner (:mod:`pipeopt.partition.pipedream`) chooses
    the stages, their device types and replicas from a layer profile and levels of devices
    (of one type, or of ``pipedream.device_types``); the problem is its plan's chain (one
    device per stage, the replicas as an extra), each stage's memory limit its type's (or
    ``memory.limit``), static memory ``memory.static`` + one copy of the stage's weights,
    weight bytes from the layers."""
    from pipeopt.partition.pipedream import Layer, plan_cluster, plan_problem, plan_sync_s
    from pipeopt.solvers import ASYNC_METHODS

    pl, pd, mem = cfg.pipeline, cfg.pipedream, cfg.memory
    assert pd is not None
    if pl.mode != "async":
        raise ConfigError("pipedream: PipeDream's planner plans an asynchronous pipeline; set "
                          "pipeline.mode: async")
    why = "the planner chooses the stages and their replicas from pipedream.layers and levels"
    for key, given in (("stages", cfg.stages is not None), ("model", cfg.model is not None),
                       ("cluster", cfg.cluster is not None), ("training", bool(cfg.training)),
                       ("links", cfg.links != LinksConfig()),
                       ("pipeline.replicas", pl.replicas is not None),
                       ("pipeline.replica_bandwidth", pl.replica_bandwidth is not None),
                       ("pipeline.virtual_stages", pl.virtual_stages != 1),
                       ("pipeline.sub_blocks", pl.sub_blocks != 1),
                       ("memory.weight_bytes", mem.weight_bytes is not None),
                       *((f"pipeline.{k}", getattr(pl, k) is not None) for k in SCALE_KEYS)):
        if given:
            raise ConfigError(f"{key}: not with pipedream: ({why})")
    for key in ("limit", "static"):
        if isinstance(getattr(mem, key), list):
            raise ConfigError(f"memory.{key}: one value with pipedream: (the plan chooses the "
                              "stages, so per-device values have no devices to name)")
    lc = pd.layers
    n = len(lc.forward)
    cols = {}
    for key in ("forward", "backward_input", "backward_weight", "output_bytes", "weight_bytes",
                "activation_bytes"):
        raw = getattr(lc, key)
        cols[key] = [float(x) for x in _expand(f"pipedream.layers.{key}", raw, n, "layer")]
        _check_values(f"pipedream.layers.{key}", raw, cols[key],
                      "bytes" if key.endswith("bytes") else "s")
    names = lc.names or [f"layer{i}" for i in range(n)]
    if len(names) != n:
        raise ConfigError(f"pipedream.layers.names: expected {n} names (one per layer), got "
                          f"{len(names)}")
    limit = None if mem.limit is None or isinstance(mem.limit, list) else float(mem.limit)
    static = 0.0 if isinstance(mem.static, list) else float(mem.static)  # lists refused above
    types = _device_types(pd, limit, n)
    hetero = pd.device_types is not None
    devices = sum(ty.devices for ty in types)
    if pl.devices != devices:
        shape = (" + ".join(f"{ty.devices} {ty.name}" for ty in types) if hetero else
                 " x ".join(str(lv.units) for lv in pd.levels))
        raise ConfigError(f"pipeline.devices: must be the levels' {devices} devices ({shape}), "
                          f"got {pl.devices}")
    limited = any(ty.memory is not None for ty in types)
    work = planner_work(n, types, limited, pd.every_node)
    if work > MAX_PLANNER_WORK:
        units = [lv.units for lv in pd.levels]
        raise ConfigError(f"pipedream.layers: {n} layers on levels of {units} units are too "
                          f"many for the planner (its DP's size {work:.3g}, at most "
                          f"{MAX_PLANNER_WORK:.3g}: layers^3 x sum units^2"
                          f"{', x devices with a memory limit' if limited else ''}); merge "
                          "layers")
    layers = [Layer(names[i], cols["forward"][i], cols["backward_input"][i],
                    cols["backward_weight"][i], cols["output_bytes"][i], cols["weight_bytes"][i],
                    cols["activation_bytes"][i]) for i in range(n)]
    method = "periodic" if cfg.solver.method == "auto" else cfg.solver.method
    policy = ASYNC_METHODS.get(method, ("stash", ""))[0]  # an unknown method fails at solve
    try:
        result = plan_cluster(layers, types, pd.levels[-1].bandwidth, policy=policy,
                              static_bytes=static, every_node=pd.every_node)
    except ConfigError as exc:  # the planner names its own argument; here it is a key
        msg = str(exc)
        raise ConfigError(f"pipedream.{msg}" if msg.startswith("device_types") else msg
                          ) from None
    prob, reps = plan_problem(layers, result, microbatches=pl.microbatches, static_bytes=static)
    try:
        prob = prob.replace(split_backward=pl.split_backward)
    except ProblemError as exc:
        raise ConfigError(f"memory: {exc}") from None
    check_totals(prob, "pipedream.layers")
    wb = tuple(math.fsum(cols["weight_bytes"][st.first:st.last + 1]) for st in result.stages)
    summary = (("config", result.config()), ("period", result.period),
               ("devices", result.devices), ("cluster_devices", devices),
               ("levels", tuple((lv.units, lv.bandwidth) for lv in pd.levels)),
               ("stages", tuple((names[st.first], names[st.last], st.replicas,
                                 result.type_of(st).name) for st in result.stages)),
               ("types", tuple((ty.name, ty.devices, ty.speed, ty.memory,
                                ty.profile is not None) for ty in types) if hetero else ()),
               ("policy", policy))
    return Config(problem=prob, solver=cfg.solver, source=source,
                  extras=(("mode", "async"), ("weight_bytes", wb), ("replicas", reps),
                          ("sync_s", plan_sync_s(layers, result)),
                          ("pipedream_plan", summary)))


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
    if stages * pl.sub_blocks > MAX_OPS // kinds:
        raise ConfigError(f"pipeline.sub_blocks: {stages} stages x {pl.sub_blocks} sub-blocks "
                          f"is too many pieces (at most {MAX_OPS // kinds // stages} "
                          "sub-blocks here)")
    stages *= pl.sub_blocks
    ops = kinds * stages * pl.microbatches
    if ops > MAX_OPS and pl.sub_blocks > 1:
        most = MAX_OPS // (kinds * stages // pl.sub_blocks * pl.microbatches)
        raise ConfigError(
            f"pipeline.sub_blocks: {pl.microbatches} micro-batches on {stages} pieces "
            f"({pl.sub_blocks} sub-blocks per stage) make {ops:,} ops, more than pipeopt "
            f"schedules ({MAX_OPS:,}; at most {most} sub-blocks here)")
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
    built = build_from_model(cfg, data, source)
    extras = async_extras(cfg, built.problem)
    return dataclasses.replace(built, extras=built.extras + extras) if extras else built


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


def read_document(path: str | os.PathLike[str]) -> tuple[Any, bool]:
    """Read and parse a config input once (``-``: standard input): the parsed document and
    whether it is a schedule JSON (a JSON object with a ``format`` key) rather than a config.

    A YAML file is read with the config's size cap; a ``.json`` file and standard input with
    the schedule's (either may hold a schedule), then a config found there with the config's.
    A ``.json`` file that is not a JSON object gives (None, True): :func:`config_from_schedule`
    reads it again to name its problem. Unreadable or malformed input raises
    :class:`ConfigError`; a FIFO or a device is refused before anything is read."""
    from pipeopt.io import MAX_SCHEDULE_BYTES, STDIN, input_name, json_int, size_text

    name = input_name(path)
    is_json = str(path).lower().endswith(".json")
    if not is_json and str(path) != STDIN:
        return read_yaml(path), False
    text = _read_text(path, MAX_SCHEDULE_BYTES, "a schedule JSON")  # or a config
    try:
        doc = json.loads(text, parse_int=json_int)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and "format" in doc:
        return doc, True
    if is_json and not isinstance(doc, dict):
        return None, True
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name}: more than {size_text(MAX_CONFIG_BYTES)}, the most "
                          "pipeopt reads for a config")
    return _parse_yaml(text, name), False


def config_of_document(path: str | os.PathLike[str], doc: Any, is_schedule: bool,
                       **overrides: Any) -> Config:
    """The :class:`Config` of what :func:`read_document` returned for ``path``; keyword
    arguments override ``solver:``."""
    from pipeopt.io import input_name

    if is_schedule:
        return config_from_schedule(path if doc is None else input_name(path), doc,
                                    **overrides)
    return parse_config(doc, source=input_name(path), overrides=overrides,
                        yaml11_strings=False)


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read, validate and resolve a ``config.yaml`` (``-``: standard input); keyword arguments
    override ``solver:``.

    A ``.json`` file with a ``format`` key is read as a schedule JSON instead
    (:func:`config_from_schedule`, which also names what is wrong with one that is not a JSON
    object); a ``.json`` object without one is a config written in JSON. On standard input a
    JSON object with a ``format`` key is a schedule, anything else a config."""
    doc, is_schedule = read_document(path)
    return config_of_document(path, doc, is_schedule, **overrides)


def config_from_schedule(path: str | os.PathLike[str], doc: dict[str, Any] | None = None,
                         **overrides: Any) -> Config:
    """The problem of a schedule JSON (for example the measured costs that ``pipeopt run
    --costs-out`` writes), to solve again; ``doc`` is the file already parsed, if it was.
    ``overrides`` are ``solver:`` keys (defaults otherwise). The schedule is validated first.
    A schedule that fused the backward of a split problem gives that split problem back
    (:func:`pipeopt.schedules.split_variant`), so every method is priced as before."""
    from pipeopt.io import load_schedule, schedule_from_dict

    sched = load_schedule(path) if doc is None else schedule_from_dict(doc)
    try:
        solver = SolverConfig.model_validate({k: v for k, v in overrides.items()
                                              if v is not None})
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, "solver")) from None
    from pipeopt.schedules.base import split_variant  # a fused schedule's split costs

    return Config(problem=split_variant(sched.problem), solver=solver, source=str(path),
                  extras=(("from_schedule", sched.method),))
