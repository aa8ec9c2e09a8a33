"""The inference config (``workload: {kind: inference, ...}`` beside ``model:``) and its result.

A config file with a top-level ``workload:`` section of kind ``inference`` describes serving a
batch of requests on a pipeline (docs/inference.md):

```yaml
workload:
  kind: inference
  gpu: H100             # catalog name, one GPU per stage (or a list: one name per stage)
  stages: 4             # or the layers per stage: [20, 20, 20, 20], or serving / pipeedge:
                        # the partition chosen over the listed GPUs (partition.pipeedge)
  requests:             # a list of {prompt, output, arrival (s, optional)} ...
    - {prompt: 512, output: 128}
  # requests: {count: 300, seed: 0, prompt_median: 512, output_median: 128,
  #            arrival_rate: 2.0}   # ... or this (arrival_rate: Poisson, requests/s)
  method: search        # search | round-robin | separated
  token_budget: 8192    # tokens per iteration of the baselines
  ttft_limit: 10.0      # s, the p99 TTFT the search must meet (optional)
  # cpsat_time: 10      # s of CP-SAT reordering the search's best plan (small plans)
  # costs: {profile: fwd.json}   # FLOP rates measured by pipeopt profile --forward-only
model: {preset: llama2-70b, dtype: fp16}
```

:func:`load_inference` reads and checks it (a :class:`~pipeopt.errors.ConfigError` naming the
key), :func:`solve_inference` runs the method; ``pipeopt solve -o`` writes the served plan's
schedule as schedule JSON v2 (:mod:`pipeopt.graphio`: the plan in ``graph.meta.plan``, the
serving figures in ``metrics``), which ``pipeopt plot`` and ``trace`` draw.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeopt.config import read_yaml
from pipeopt.errors import ConfigError
from pipeopt.partition.pipeedge import MAX_DEVICES as MAX_EDGE_DEVICES
from pipeopt.partition.pipeedge import (
    EdgeCluster,
    EdgePartition,
    link_of,
    pipeedge_partition,
    serving_partition,
)
from pipeopt.schema import workload_file
from pipeopt.solvers.inference import Link, Served, round_robin, search, separated
from pipeopt.workloads.inference import Request, StageModel, sample_requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RequestSpec(_Strict):
    """One request (tokens)."""

    prompt: int = Field(ge=1)
    output: int = Field(ge=1)
    arrival: float = Field(0.0, ge=0)  # s


class Distribution(_Strict):
    """Log-normal prompt and output lengths (tokens) drawn with ``seed``."""

    count: int = Field(ge=1, le=100_000)
    seed: int = 0
    prompt_median: float = Field(gt=0)
    output_median: float = Field(gt=0)
    prompt_sigma: float = Field(1.0, ge=0)
    output_sigma: float = Field(1.0, ge=0)
    max_prompt: int = Field(4096, ge=1)
    max_output: int = Field(4096, ge=1)
    #: Requests/s of a Poisson arrival process (seeded by ``seed``); None: all at 0.
    arrival_rate: float | None = Field(None, gt=0)


class LinkSpec(_Strict):
    """Links between stages: one-way latency (s), per-direction bandwidth (bytes/s): one
    number for every link, or a matrix ``bandwidth[u][v]`` from GPU u to GPU v of
    ``workload.gpu`` (0: no link; the diagonal is not read)."""

    latency: float = Field(0.0, ge=0)
    bandwidth: (Annotated[float, Field(gt=0, allow_inf_nan=True)]
                | list[list[Annotated[float, Field(ge=0, allow_inf_nan=True)]]]) = math.inf


class CostsSpec(_Strict):
    """Where the stages' costs come from beside the model's shape: ``profile``, a forward-only
    profile file (relative to the config file) whose measured times set each stage's FLOP rate
    (:func:`pipeopt.costs.inference.profiled_stage_models`)."""

    profile: str = Field(min_length=1)


class WorkloadSpec(_Strict):
    """The ``workload:`` section."""

    kind: Literal["inference"]
    gpu: str | list[str]
    stages: int | list[int] | Literal["serving", "pipeedge"]
    requests: list[RequestSpec] | Distribution
    method: Literal["search", "round-robin", "separated"] = "search"
    token_budget: float = Field(8192, ge=1)
    ttft_limit: float | None = Field(None, gt=0)
    time_limit: float = Field(60.0, gt=0)
    #: s of CP-SAT reordering the search's best plan (0: none; for small plans).
    cpsat_time: float = Field(0.0, ge=0)
    link: LinkSpec = LinkSpec()
    efficiency: float = Field(1.0, gt=0, le=1)
    bandwidth_efficiency: float = Field(1.0, gt=0, le=1)
    memory_fraction: float = Field(1.0, gt=0, le=1)
    costs: CostsSpec | None = None


class _File(_Strict):
    workload: dict[str, Any]
    model: dict[str, Any]


@dataclass(frozen=True)
class InferenceConfig:
    """A checked inference config: requests, stage models, link, method and its options."""

    requests: tuple[Request, ...]
    stages: tuple[StageModel, ...]
    link: Link
    method: str
    token_budget: float
    ttft_limit: float | None
    source: str = "<memory>"
    time_limit: float = 60.0  # s of wall time for the search (it stops starting candidates)
    #: The devices and layers chosen by ``stages: serving | pipeedge`` (None: given).
    partition: EdgePartition | None = None
    gpus: tuple[str, ...] = ()  # the GPU of each stage, in pipeline order
    cpsat_time: float = 0.0  # s of CP-SAT on the search's best plan (0: none)


def parse_inference(data: Any, source: str = "<memory>") -> InferenceConfig:
    """Check a parsed inference config and price its stages (see the module docstring)."""
    from pipeopt.costs.build import shape_of
    from pipeopt.costs.config import parse_model
    from pipeopt.costs.gpus import lookup
    from pipeopt.costs.inference import hbm_bandwidth, profiled_stage_models, stage_models

    spec = workload_file(data, source, _File, WorkloadSpec)
    shape = shape_of(parse_model(data["model"]))
    names = [spec.gpu] if isinstance(spec.gpu, str) else spec.gpu
    for k, name in enumerate(names):
        try:
            lookup(name)
            hbm_bandwidth(name)
        except KeyError as exc:
            where = "" if isinstance(spec.gpu, str) else f"[{k}]"
            raise ConfigError(f"workload.gpu{where}: {exc.args[0]}") from None
    link = spec.link
    bw = link.bandwidth
    if isinstance(bw, list) and (len(bw) != len(names) or any(len(r) != len(names)
                                                              for r in bw)):
        raise ConfigError(f"workload.link.bandwidth: expected {len(names)} x {len(names)} "
                          f"bytes/s (one row and column per GPU of workload.gpu)")
    if isinstance(spec.requests, Distribution):
        d = spec.requests
        reqs = sample_requests(d.count, d.seed, prompt_median=d.prompt_median,
                               output_median=d.output_median, prompt_sigma=d.prompt_sigma,
                               output_sigma=d.output_sigma, max_prompt=d.max_prompt,
                               max_output=d.max_output, arrival_rate=d.arrival_rate)
    else:
        if not spec.requests:
            raise ConfigError("workload.requests: need at least one request")
        reqs = tuple(Request(r.prompt, r.output, r.arrival) for r in spec.requests)
    profile = None if spec.costs is None else _profile(spec, spec.costs, names, source)
    part = None
    if isinstance(spec.stages, str):  # the partition chosen over the GPUs (docs/inference.md)
        part = _partition(spec, shape, names, reqs)
        gpus = tuple(names[d] for d in part.devices)
        layers: int | list[int] = list(part.layers)
        lat, hop_bw = link_of(_cluster(spec, names), part)
        links = Link(lat, hop_bw)
    else:
        count = spec.stages if isinstance(spec.stages, int) else len(spec.stages)
        gpus = tuple(names) if isinstance(spec.gpu, list) else (spec.gpu,) * count
        layers = spec.stages
        k = len(gpus)
        if isinstance(bw, list):  # hop s -> s + 1 between the listed GPUs, then back
            links = Link(link.latency, tuple(bw[s][(s + 1) % k] if k > 1 else math.inf
                                             for s in range(k)))
            if any(b <= 0 for b in links.bandwidth):  # type: ignore[union-attr]
                raise ConfigError("workload.link.bandwidth: the pipeline needs a link from "
                                  "each GPU to the next and from the last to the first")
        else:
            links = Link(link.latency, bw)
    gpu_arg = list(gpus) if isinstance(spec.gpu, list) else spec.gpu
    try:
        if profile is not None:
            models = profiled_stage_models(shape, gpu_arg, layers, profile,
                                           bandwidth_efficiency=spec.bandwidth_efficiency,
                                           memory_fraction=spec.memory_fraction)
        else:
            models = stage_models(shape, gpu_arg, layers, efficiency=spec.efficiency,
                                  bandwidth_efficiency=spec.bandwidth_efficiency,
                                  memory_fraction=spec.memory_fraction)
    except ValueError as exc:
        raise ConfigError(f"workload.{exc}") from None
    if spec.cpsat_time > 0 and spec.method != "search":
        raise ConfigError(f"workload.cpsat_time: reorders the search's plan; method "
                          f"{spec.method} takes none")
    return InferenceConfig(reqs, models, links, spec.method, spec.token_budget,
                           spec.ttft_limit, source, spec.time_limit, part, gpus,
                           spec.cpsat_time)


def _profile(spec: WorkloadSpec, costs: CostsSpec, names: list[str], source: str) -> Any:
    """The forward-only profile of ``workload.costs.profile`` (a path relative to the config
    file), refused beside the keys it replaces or cannot serve."""
    from pipeopt.costs.profile import ProfileError, load_forward_profile

    if "efficiency" in spec.model_fields_set:
        raise ConfigError("workload.efficiency: cannot be combined with workload.costs.profile "
                          "(the profile measures each stage's FLOP rate)")
    if isinstance(spec.stages, str):
        raise ConfigError(f"workload.stages: {spec.stages} partitions at the catalog's peak "
                          f"FLOP/s; with workload.costs.profile give a stage count or the "
                          f"layers per stage")
    if len(set(names)) > 1:
        raise ConfigError("workload.costs.profile: one profile prices every stage alike, but "
                          f"workload.gpu lists different GPUs ({', '.join(sorted(set(names)))})")
    path = Path(costs.profile)
    if not path.is_absolute() and source and not source.startswith("<"):
        path = Path(source).parent / path
    try:
        return load_forward_profile(path)
    except ProfileError as exc:
        raise ConfigError(f"workload.costs.profile: {exc}") from None


def _cluster(spec: WorkloadSpec, names: list[str]) -> EdgeCluster:
    n = len(names)
    bw = spec.link.bandwidth
    matrix = bw if isinstance(bw, list) else [[bw] * n for _ in range(n)]
    return EdgeCluster(tuple(names), tuple(tuple(float(x) for x in row) for row in matrix),
                       spec.link.latency, spec.memory_fraction, spec.efficiency,
                       spec.bandwidth_efficiency)


def _partition(spec: WorkloadSpec, shape: Any, names: list[str],
               reqs: tuple[Request, ...]) -> EdgePartition:
    """``stages: serving`` or ``pipeedge`` over the GPUs of ``workload.gpu``."""
    if isinstance(spec.gpu, str):
        raise ConfigError(f"workload.stages: {spec.stages} chooses among the GPUs of "
                          f"workload.gpu: give them as a list")
    if len(names) > MAX_EDGE_DEVICES:
        raise ConfigError(f"workload.gpu: at most {MAX_EDGE_DEVICES} GPUs for stages: "
                          f"{spec.stages}, got {len(names)}")
    prompt = sum(r.prompt for r in reqs) / len(reqs)
    output = sum(r.output for r in reqs) / len(reqs)
    try:
        cluster = _cluster(spec, names)
        if spec.stages == "serving":
            return serving_partition(shape, cluster, prompt=prompt, output=output)
        return pipeedge_partition(shape, cluster, batch=1, context=prompt + output / 2)
    except ValueError as exc:
        raise ConfigError(f"workload.stages: {spec.stages}: {exc}") from None


def load_inference(path: str | os.PathLike[str]) -> InferenceConfig:
    """Read and check the inference config file ``path``."""
    return parse_inference(read_yaml(path), str(path))


def solve_inference(cfg: InferenceConfig) -> tuple[Served, bool]:
    """Run the config's method; returns the timed plan and whether the TTFT limit is met.
    The search stops starting candidates after ``cfg.time_limit`` s (its plan then says so in
    its method name: ``... (time limit)``)."""
    try:
        if cfg.method == "round-robin":
            served = round_robin(cfg.requests, cfg.stages, cfg.token_budget, cfg.link)
        elif cfg.method == "separated":
            served = separated(cfg.requests, cfg.stages, cfg.token_budget, cfg.link)
        else:
            res = search(cfg.requests, cfg.stages, ttft_limit=cfg.ttft_limit, link=cfg.link,
                         time_limit=cfg.time_limit, cpsat_time=cfg.cpsat_time)
            best = res.best if res.complete else replace(
                res.best, method=f"{res.best.method} (time limit)")
            return best, res.met_limit
    except ValueError as exc:  # e.g. a request whose KV does not fit
        raise ConfigError(f"workload: {exc}") from None
    return served, served.meets(cfg.ttft_limit)
