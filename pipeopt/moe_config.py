"""The MoE training config (``workload: {kind: moe, ...}`` beside a ``model:`` with ``moe:``).

A config file whose ``workload:`` section has ``kind: moe`` describes training an MoE
transformer on a pipeline, one stage per GPU, each MoE block's dispatch and combine all-to-all
scheduled as tasks on the stage's expert-parallel network (docs/moe.md):

```yaml
workload:
  kind: moe
  gpu: H100                     # catalog name, one GPU per stage
  stages: 8                     # or the blocks per stage: [1, 1, 1, 1, 1, 1, 1, 1]
  microbatches: 16
  expert_network: {latency: 5.0e-6, bandwidth: 25.0e+9}   # the EP group's slowest hop
  method: search                # search, or a hand-made schedule: 1f1b, zb-h1, ...
model:
  preset: ...                   # or the shape keys of docs/model_config.md
  moe: {experts: 8, top_k: 2, expert_ffn: 14336, expert_parallel: 8}
```

:func:`parse_moe` checks it (a :class:`~pipeopt.errors.ConfigError` naming the key) and prices
it (:func:`pipeopt.costs.moe.pipeline_of`); :func:`solve_moe` runs the method and the
hand-made baselines; the schedule is a task-graph schedule, written as schedule JSON v2.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeopt.config import read_yaml
from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.errors import ConfigError
from pipeopt.schema import check_unknown_keys, pydantic_message
from pipeopt.workloads.moe import MoEPipeline

#: The hand-made schedules a config may name (``method``), besides ``search``.
HAND_MADE = ("1f1b", "zb-h1", "zb-h2", "gpipe")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LinkSpec(_Strict):
    """A hop: one-way latency (s), per-direction bandwidth (bytes/s)."""

    latency: float = Field(0.0, ge=0)
    bandwidth: float = Field(math.inf, gt=0, allow_inf_nan=True)


class MoESection(_Strict):
    """``model.moe``: see :class:`pipeopt.costs.moe.MoESpec`."""

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


class WorkloadSpec(_Strict):
    """The ``workload:`` section."""

    kind: str
    gpu: str
    stages: int | list[int]
    microbatches: int = Field(ge=1, le=4096)
    expert_network: LinkSpec
    link: LinkSpec = LinkSpec()
    efficiency: float = Field(0.5, gt=0, le=1)
    memory_fraction: float = Field(0.9, gt=0, le=1)
    bytes_per_param: float = Field(16.0, gt=0)
    split_backward: bool = True
    method: str = "search"
    overlap: bool = False
    time_limit: float = Field(30.0, gt=0)
    workers: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0)


class _File(_Strict):
    workload: dict[str, Any]
    model: dict[str, Any]


@dataclass(frozen=True)
class MoEConfig:
    """A checked MoE config: the priced pipeline, the method and its options."""

    pipeline: MoEPipeline
    method: str = "search"
    overlap: bool = False
    time_limit: float = 30.0
    workers: int | None = None
    seed: int = 0
    source: str = "<memory>"


def is_moe(data: Any) -> bool:
    """Whether a parsed config mapping is an MoE config (``workload.kind: moe``)."""
    return (isinstance(data, dict) and isinstance(data.get("workload"), dict)
            and data["workload"].get("kind") == "moe")


def parse_moe(data: Any, source: str = "<memory>") -> MoEConfig:
    """Check a parsed MoE config and price its pipeline (see the module docstring)."""
    from pipeopt.costs.build import shape_of
    from pipeopt.costs.config import parse_model
    from pipeopt.costs.gpus import lookup
    from pipeopt.costs.moe import Cluster, MoESpec, pipeline_of

    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with workload: and model:")
    check_unknown_keys(data, _File, "")
    for key in ("workload", "model"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{key}: missing or not a mapping")
    check_unknown_keys(data["workload"], WorkloadSpec, "workload")
    try:
        spec = WorkloadSpec.model_validate(data["workload"])
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, "workload")) from None
    if spec.kind != "moe":
        raise ConfigError(f"workload.kind: must be 'moe', got {spec.kind!r}")
    if spec.method != "search" and spec.method not in HAND_MADE:
        raise ConfigError(f"workload.method: must be search or one of {', '.join(HAND_MADE)}, "
                          f"got {spec.method!r}")
    model = dict(data["model"])
    if not isinstance(model.get("moe"), dict):
        raise ConfigError("model.moe: missing or not a mapping (experts, top_k, expert_ffn, "
                          "...)")
    raw = model.pop("moe")
    check_unknown_keys(raw, MoESection, "model.moe")
    try:
        sec = MoESection.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(exc, "model.moe")) from None
    try:
        moe = MoESpec(**sec.model_dump())
    except ValueError as exc:
        raise ConfigError(f"model.moe.{exc}") from None
    mcfg = parse_model(model)
    if mcfg.layer_costs is not None or mcfg.profile is not None:
        raise ConfigError("model.moe: needs a transformer shape (not layer_costs or profile)")
    shape = shape_of(mcfg)
    try:
        gpu = lookup(spec.gpu)
    except KeyError as exc:
        raise ConfigError(f"workload.gpu: {exc.args[0]}") from None
    stages = spec.stages if isinstance(spec.stages, int) else len(spec.stages)
    layers = None if isinstance(spec.stages, int) else spec.stages
    if stages < 1:
        raise ConfigError(f"workload.stages: must be >= 1, got {spec.stages}")
    cluster = Cluster(
        flop_rate=gpu.peak_flops(shape.dtype) * spec.efficiency,
        ep_latency=spec.expert_network.latency, ep_bandwidth=spec.expert_network.bandwidth,
        link_latency=spec.link.latency, link_bandwidth=spec.link.bandwidth,
        memory_limit=gpu.memory_bytes * spec.memory_fraction,
        bytes_per_param=spec.bytes_per_param)
    try:
        pipe = pipeline_of(shape, moe, stages, spec.microbatches, cluster,
                           split_backward=spec.split_backward, stage_layers=layers)
    except ValueError as exc:
        text = str(exc)
        where = "workload." if text.startswith(("stages", "stage_layers")) else "model."
        raise ConfigError(f"{where}{text.replace('stage_layers', 'stages')}") from None
    over = [s for s in range(stages)
            if pipe.static_memory[s] > (pipe.memory_limit[s] or math.inf)]
    if over:
        s = over[0]
        raise ConfigError(f"workload.stages: stage {s}'s parameters need "
                          f"{pipe.static_memory[s] / 2**30:.1f} GiB, over the GPU's "
                          f"{(pipe.memory_limit[s] or 0) / 2**30:.1f} GiB "
                          f"(memory_fraction {spec.memory_fraction:g}); use more stages")
    if spec.method == "1f1b" and spec.split_backward:
        pipe = replace(pipe, split_backward=False)  # 1F1B runs a fused backward
    return MoEConfig(pipe, spec.method, spec.overlap, spec.time_limit, spec.workers, spec.seed,
                     source)


def load_moe(path: str | os.PathLike[str]) -> MoEConfig:
    """Read and check the MoE config file ``path``."""
    return parse_moe(read_yaml(path), str(path))


@dataclass(frozen=True)
class MoEResult:
    """The chosen schedule and the baselines measured beside it: per name (``1f1b``,
    ``zb-h1``, each without and with ``+overlap``), its iteration time (s) and peak memory
    (bytes), or the reason it has none."""

    schedule: GraphSchedule
    baselines: tuple[tuple[str, float | None, float | None, str], ...]


def solve_moe(cfg: MoEConfig) -> MoEResult:
    """Run the config's method (the search within ``time_limit`` s, or a hand-made schedule)
    and the 1F1B / ZB-H1 baselines without and with overlap. Raises ConfigError when no
    schedule fits the memory limits."""
    from pipeopt.core.greedy import Stuck
    from pipeopt.core.validate import check
    from pipeopt.solvers import moe as sm

    pipe = cfg.pipeline
    base = []
    for name in ("1f1b", "zb-h1"):
        variant = replace(pipe, split_backward=name != "1f1b")
        for overlap in (False, True):
            label = name + ("+overlap" if overlap else "")
            try:
                s = sm.hand_made(variant, name, overlap=overlap)
            except (ValueError, Stuck) as exc:
                base.append((label, None, None, str(exc)))
                continue
            problems = check(s)
            base.append((label, s.objective, max(s.peak_memory),
                         problems[0] if problems else ""))
    try:
        if cfg.method == "search":
            sched = sm.search(pipe, time_limit=cfg.time_limit, workers=cfg.workers,
                              seed=cfg.seed)
        else:
            sched = sm.hand_made(pipe, cfg.method, overlap=cfg.overlap)
    except (ValueError, Stuck) as exc:
        raise ConfigError(f"workload.method: {exc}") from None
    problems = check(sched)
    if problems:
        raise ConfigError(f"workload.method: {cfg.method} breaks a limit: {problems[0]}")
    return MoEResult(sched, tuple(base))


def summary_lines(result: MoEResult) -> list[str]:
    """What ``pipeopt solve`` prints for an MoE config."""
    s = result.schedule
    gib = 2**30
    lines = [f"method        {s.method}",
             f"iteration     {s.objective:.6g} s",
             f"peak memory   {max(s.peak_memory) / gib:.2f} GiB"]
    if s.lower_bound is not None:
        lines.append(f"lower bound   {s.lower_bound:.6g} s (gap {100 * (s.gap or 0):.1f} %)")
    for name, t, mem, why in result.baselines:
        if t is None or mem is None:
            lines.append(f"{name:<13} n/a ({why})")
        else:
            note = f" ({why})" if why else ""
            lines.append(f"{name:<13} {t:.6g} s, {mem / gib:.2f} GiB, "
                         f"{t / s.objective:.2f}x the chosen{note}")
    return lines


def solve_command(data: Any, source: str, *, method: str | None = None,
                  time_limit: float | None = None, output: str | None = None,
                  as_json: bool = False) -> list[str]:
    """``pipeopt solve`` on a parsed MoE config: solve it (``method`` and ``time_limit``, the
    command's flags, override ``workload.method`` / ``workload.time_limit``), write the
    schedule as JSON v2 to ``output`` (atomically) and return the lines to print (one JSON line
    with ``as_json``)."""
    import json

    from pipeopt.graphio import dump_graph_schedule
    from pipeopt.io import write_output

    if not is_moe(data):
        raise ConfigError(f"{source}: not an MoE config (workload.kind: moe)")
    if method is not None and method != "search" and method not in HAND_MADE:
        raise ConfigError(f"--method: an MoE config takes search or one of "
                          f"{', '.join(HAND_MADE)}, got {method!r}")
    if method is not None:
        data = {**data, "workload": {**data["workload"], "method": method}}
    cfg = parse_moe(data, source)
    if time_limit is not None:
        cfg = replace(cfg, time_limit=time_limit)
    res = solve_moe(cfg)
    if as_json:
        s = res.schedule
        lines = [json.dumps({**s.summary(), "baselines": {
            name: {"iteration_time": t, "peak_memory": mem, "note": why}
            for name, t, mem, why in res.baselines}})]
    else:
        lines = summary_lines(res)
    if output:
        write_output("--output", output, lambda path: dump_graph_schedule(res.schedule, path))
        if not as_json:
            lines.append(f"written       {output}")
    return lines


@dataclass(frozen=True)
class MoERun:
    """An MoE pipeline in the :class:`~pipeopt.solvers.graph.GraphWorkload` shape of
    :mod:`pipeopt.graph_config` (for ``solve_graph`` / ``compare_graph``): ``graph`` is
    :func:`pipeopt.workloads.moe.build` of ``pipeline`` (what the searches run on); the
    hand-made schedules are 1F1B (fused backward) and ZB-H1, each without and with the
    all-to-all overlapped (``+overlap``: :func:`pipeopt.solvers.moe.hand_made`'s window 2).
    """

    pipeline: MoEPipeline

    @property
    def graph(self) -> TaskGraph:
        """The searches' graph (built on each read: the pipeline is small data)."""
        from pipeopt.workloads.moe import build

        return build(self.pipeline)

    @property
    def hand_made(self) -> tuple[str, ...]:
        """``1f1b``, ``1f1b+overlap`` and, with a split backward, ``zb-h1``,
        ``zb-h1+overlap``."""
        names = ("1f1b", "1f1b+overlap")
        if self.pipeline.split_backward:
            names += ("zb-h1", "zb-h1+overlap")
        return names

    def hand_made_orders(self, name: str) -> tuple[TaskGraph, list[list[int]]]:
        """The graph and device orders of hand-made schedule ``name``."""
        from pipeopt.schedules import NotApplicable
        from pipeopt.solvers import moe as sm
        from pipeopt.workloads.moe import build

        if name not in self.hand_made:
            raise NotApplicable(f"{name}: not a hand-made schedule of this workload "
                                f"({', '.join(self.hand_made)})")
        family, _, how = name.partition("+")
        pipe = replace(self.pipeline, split_backward=family != "1f1b")
        graph = build(pipe)
        try:
            sched = sm.hand_made(pipe, family, overlap=bool(how), graph=graph)
        except ValueError as exc:  # Stuck under memory too
            raise NotApplicable(f"{name}: {exc}") from None
        return graph, sched.device_orders()
