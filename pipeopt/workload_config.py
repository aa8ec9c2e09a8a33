"""The one entry point for a config: read and parse it once, then say which workload it is.

:func:`read_workload` reads a config input once (a file, ``-`` for standard input, or a
schedule JSON whose problem to solve again; :func:`pipeopt.config.read_document`) and returns a
:class:`Workload`: its kind and its parsed document. :func:`workload_kind` is the one test on
a parsed mapping, in this order:

* ``workload: {kind: inference}`` -> ``inference`` (:mod:`pipeopt.inference_config`);
* ``workload: {kind: moe}`` -> ``moe``, a task-graph workload (:mod:`pipeopt.moe_config`);
* a top-level ``data_parallel:`` section, or ``training.collectives`` other than ``scalar``
  -> ``dataparallel``, a task-graph workload (:mod:`pipeopt.graph_config`);
* ``pipeline.mode: async`` -> ``async`` (the periodic search);
* anything else, and a schedule JSON -> ``chain`` (``pipeopt.config.parse_config`` names what
  is wrong with a mapping that is no config at all).

This module imports only the config reader, so that telling a chain config apart costs no
import of the task-graph searches; the command line (``pipeopt solve`` / ``compare``) and
:func:`pipeopt.graph_config.graph_loader` use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pipeopt.config import Config, config_of_document, read_document
from pipeopt.errors import ConfigError

WorkloadKind = Literal["chain", "async", "inference", "dataparallel", "moe"]

#: Every kind :func:`workload_kind` returns.
KINDS: tuple[WorkloadKind, ...] = ("chain", "async", "inference", "dataparallel", "moe")
#: The kinds solved as task graphs by :mod:`pipeopt.solvers.graph` (schedule JSON v2).
GRAPH_KINDS: tuple[WorkloadKind, ...] = ("dataparallel", "moe")
#: The values of ``workload.kind``, each a kind of its own.
SECTION_KINDS: tuple[WorkloadKind, ...] = ("inference", "moe")
#: The model form's ``training:`` keys of scheduled collectives besides ``collectives``
#: (:class:`pipeopt.graph_config.TrainingCollectives`; a test keeps the two alike).
SCHEDULED_ONLY = ("reduction", "collective_algorithm", "delayed_reduction", "bucket_bytes",
                  "iterations")


@dataclass(frozen=True)
class Workload:
    """A config read once: ``kind`` (see the module docstring), ``data`` the parsed document
    (a mapping for a config; for a schedule JSON its document, or None when the file is not
    a JSON object), ``source`` the input's name in messages, ``path`` as given and
    ``from_schedule`` whether it is a schedule JSON. Nothing downstream changes ``data``:
    the loaders copy what they alter."""

    kind: WorkloadKind
    data: Any
    source: str
    path: str
    from_schedule: bool = False

    @property
    def is_graph(self) -> bool:
        """Whether it is a task-graph workload (:data:`GRAPH_KINDS`)."""
        return self.kind in GRAPH_KINDS


def workload_kind(data: Any) -> WorkloadKind:
    """The kind of the parsed config ``data`` (see the module docstring). A ``workload:``
    section that is not a mapping, or whose ``kind`` is missing or unknown, raises
    :class:`ConfigError` naming the key."""
    if not isinstance(data, dict):
        return "chain"
    if "workload" in data:
        section = data["workload"]
        known = " or ".join(SECTION_KINDS)
        if not isinstance(section, dict):
            raise ConfigError(f"workload: expected a mapping with kind: {known}, got "
                              f"{section!r}")
        if "kind" not in section:
            raise ConfigError(f"workload.kind: missing (give {known})")
        kind = section["kind"]
        for name in SECTION_KINDS:
            if kind == name:
                return name
        raise ConfigError(f"workload.kind: must be {known}, got {kind!r}")
    if "data_parallel" in data:
        return "dataparallel"
    training = data.get("training")
    if isinstance(training, dict) and training.get("collectives", "scalar") != "scalar":
        return "dataparallel"
    pipeline = data.get("pipeline")
    if isinstance(pipeline, dict) and pipeline.get("mode") == "async":
        return "async"
    return "chain"


def read_workload(path: str | os.PathLike[str]) -> Workload:
    """Read and parse ``path`` once and tell its kind (:class:`ConfigError` when it cannot be
    read, parsed or told)."""
    from pipeopt.io import input_name

    doc, is_schedule = read_document(path)
    kind: WorkloadKind = "chain" if is_schedule else workload_kind(doc)
    return Workload(kind, doc, input_name(path), str(path), is_schedule)


def chain_config(work: Workload, **overrides: Any) -> Config:
    """The :class:`~pipeopt.config.Config` of a ``chain`` or ``async`` workload; keyword
    arguments override ``solver:``. Another kind raises :class:`ConfigError`."""
    if work.kind not in ("chain", "async"):
        raise ConfigError(f"{work.source}: a {work.kind} config, not a pipeline chain")
    data = work.data
    training = data.get("training") if isinstance(data, dict) else None
    if isinstance(training, dict) and training.get("collectives") == "scalar":
        # the chain's own reduction (one time after the last W): the default, said aloud
        for key in SCHEDULED_ONLY:
            if key in training:
                raise ConfigError(f"training.{key}: used only with training.collectives: "
                                  "scheduled (here scalar)")
        data = {**data, "training": {k: v for k, v in training.items() if k != "collectives"}}
    return config_of_document(work.path, data, work.from_schedule, **overrides)
