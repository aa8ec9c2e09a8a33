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
  method: search                # search, a hand-made schedule (1f1b, zb-h1+overlap, ...),
                                # greedy, cpsat or auto (pipeopt.solvers.graph)
model:
  preset: ...                   # or the shape keys of docs/model_config.md
  moe: {experts: 8, top_k: 2, expert_ffn: 14336, expert_parallel: 8}
```

:func:`parse_moe` checks it (a :class:`~pipeopt.errors.ConfigError` naming the key) and prices
it (:func:`pipeopt.costs.moe.pipeline_of`). :class:`MoERun` is the pipeline as a workload of
:mod:`pipeopt.solvers.graph` (its hand-made schedules, its own ``search``, the core greedy,
CP-SAT and auto): :func:`pipeopt.graph_config.load_moe_graph` loads the file that way, so
``pipeopt solve`` / ``compare`` run it as they run every task-graph config, and write
schedule JSON v2.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pipeopt.config import read_yaml
from pipeopt.core.graph import TaskGraph
from pipeopt.core.schedule import GraphSchedule
from pipeopt.costs.config import MoESection
from pipeopt.errors import ConfigError
from pipeopt.schema import validate_mapping, workload_file
from pipeopt.solvers.graph import graph_methods
from pipeopt.workloads.moe import MoEPipeline

#: The hand-made op orders of an MoE pipeline (:data:`pipeopt.schedules.GENERATORS` names);
#: each is also run with the all-to-all overlapped, as ``NAME+overlap``. The zero-bubble ones
#: need ``workload.split_backward``; 1F1B always runs a fused backward.
HAND_MADE = ("1f1b", "zb-h1", "zb-h2", "gpipe")
#: The hand-made schedules ``pipeopt solve`` prints beside the chosen one (those a split
#: backward lacks are left out).
BASELINES = ("1f1b", "1f1b+overlap", "zb-h1", "zb-h1+overlap")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LinkSpec(_Strict):
    """A hop: one-way latency (s), per-direction bandwidth (bytes/s)."""

    latency: float = Field(0.0, ge=0)
    bandwidth: float = Field(math.inf, gt=0, allow_inf_nan=True)


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
    """A checked MoE config: the priced pipeline, the method (a name of
    :class:`MoERun`'s methods: ``workload.method``, with ``+overlap`` when
    ``workload.overlap``), its options (seconds), and facts to print (key, text)."""

    pipeline: MoEPipeline
    method: str = "search"
    time_limit: float = 30.0
    workers: int | None = None
    seed: int = 0
    source: str = "<memory>"
    facts: tuple[tuple[str, str], ...] = ()

    @property
    def baselines(self) -> tuple[str, ...]:
        """:data:`BASELINES` that this pipeline has (ZB-H1 needs a split backward)."""
        return tuple(b for b in BASELINES if b in MoERun.hand_made_of(self.pipeline))


def parse_moe(data: Any, source: str = "<memory>") -> MoEConfig:
    """Check a parsed MoE config and price its pipeline (see the module docstring)."""
    from pipeopt.costs.build import shape_of
    from pipeopt.costs.config import parse_model
    from pipeopt.costs.gpus import lookup
    from pipeopt.costs.moe import Cluster, MoESpec, pipeline_of

    spec = workload_file(data, source, _File, WorkloadSpec)
    if spec.kind != "moe":
        raise ConfigError(f"workload.kind: must be 'moe', got {spec.kind!r}")
    model = dict(data["model"])
    if not isinstance(model.get("moe"), dict):
        raise ConfigError("model.moe: missing or not a mapping (experts, top_k, expert_ffn, "
                          "...)")
    raw = model.pop("moe")
    sec = validate_mapping(MoESection, raw, "model.moe")
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
    method = spec.method
    if spec.overlap:
        if method not in HAND_MADE:
            raise ConfigError(f"workload.overlap: overlaps a hand-made schedule's all-to-all "
                              f"({', '.join(HAND_MADE)}), not method {method!r}")
        method += "+overlap"
    known = graph_methods(MoERun(pipe))
    if method not in known:
        raise ConfigError(f"workload.method: must be one of {', '.join(known)}, got "
                          f"{spec.method!r}")
    facts = (
        ("stages", f"{stages} on {stages} x {gpu.name}, MoE blocks per stage "
         + ", ".join(str(len(b)) for b in pipe.stages)),
        ("experts", f"{moe.experts} routed, top-{moe.top_k}, expert-parallel "
         f"{moe.expert_parallel}"),
        ("all-to-all", f"on each stage's 'a2a s': {spec.expert_network.latency * 1e6:g} us, "
         f"{spec.expert_network.bandwidth / 1e9:g} GB/s (the EP group's slowest hop)"),
        ("memory", f"limit {(pipe.memory_limit[0] or math.inf) / 2**30:.1f} GiB per GPU "
         f"(memory_fraction {spec.memory_fraction:g})"),
    )
    return MoEConfig(pipe, method, spec.time_limit, spec.workers, spec.seed, source, facts)


def load_moe(path: str | os.PathLike[str]) -> MoEConfig:
    """Read and check the MoE config file ``path``."""
    return parse_moe(read_yaml(path), str(path))


@dataclass(frozen=True)
class MoERun:
    """An MoE pipeline as a workload of :mod:`pipeopt.solvers.graph` (its ``GraphWorkload``
    shape, as :class:`pipeopt.graph_config.DataParallelRun`): ``graph`` is
    :func:`pipeopt.workloads.moe.build` of ``pipeline`` (what the searches run on, built once
    here); the hand-made schedules are those of :data:`HAND_MADE` the pipeline has, each
    without and with the all-to-all overlapped (``+overlap``: :func:`pipeopt.solvers.moe.
    hand_made`'s window 2); its own search is ``search`` (:func:`pipeopt.solvers.moe.search`).
    """

    pipeline: MoEPipeline
    graph: TaskGraph = field(init=False, repr=False, compare=False)

    #: The workload's own searches (beside the core greedy / cpsat / auto).
    searches: ClassVar[tuple[str, ...]] = ("search",)

    def __post_init__(self) -> None:
        from pipeopt.workloads.moe import build

        object.__setattr__(self, "graph", build(self.pipeline))

    @staticmethod
    def hand_made_of(pipeline: MoEPipeline) -> tuple[str, ...]:
        """The hand-made schedule names of ``pipeline`` (see the class docstring)."""
        families = [f for f in HAND_MADE if pipeline.split_backward or f in ("1f1b", "gpipe")]
        return tuple(name for f in families for name in (f, f"{f}+overlap"))

    @property
    def hand_made(self) -> tuple[str, ...]:
        """``1f1b``, ``1f1b+overlap``, ``zb-h1``, ... (:meth:`hand_made_of`)."""
        return self.hand_made_of(self.pipeline)

    def hand_made_orders(self, name: str) -> tuple[TaskGraph, list[list[int]]]:
        """The graph and device orders of hand-made schedule ``name`` (1F1B runs the fused
        backward: its own graph)."""
        from pipeopt.schedules import NotApplicable
        from pipeopt.solvers import moe as sm
        from pipeopt.workloads.moe import build

        if name not in self.hand_made:
            raise NotApplicable(f"{name}: not a hand-made schedule of this workload "
                                f"({', '.join(self.hand_made)})")
        family, _, how = name.partition("+")
        pipe = self.pipeline
        if family == "1f1b" and pipe.split_backward:
            pipe = replace(pipe, split_backward=False)
        graph = self.graph if pipe is self.pipeline else build(pipe)
        try:
            sched = sm.hand_made(pipe, family, overlap=bool(how), graph=graph)
        except ValueError as exc:  # Stuck under memory too
            raise NotApplicable(f"{name}: {exc}") from None
        return graph, sched.device_orders()

    def search(self, name: str, *, time_limit: float, seed: int = 0,
               workers: int | None = None) -> GraphSchedule:
        """Run the workload's own search ``name`` (``search``) on :attr:`graph` within
        ``time_limit`` seconds; NotApplicable when no candidate fits the memory limits."""
        from pipeopt.schedules import NotApplicable
        from pipeopt.solvers import moe as sm

        if name not in self.searches:
            raise NotApplicable(f"{name}: not a search of this workload "
                                f"({', '.join(self.searches)})")
        try:
            return sm.search(self.pipeline, time_limit=time_limit, workers=workers, seed=seed)
        except ValueError as exc:
            raise NotApplicable(str(exc)) from None
