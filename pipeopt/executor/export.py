"""Export a schedule as torch.distributed.pipelining's compute-only CSV.

One row per rank, one cell per compute action in the rank's order: ``<stage><kind><mb>`` with
kind ``F`` (forward), ``I`` (input gradient: our B of a split backward), ``W`` (weight gradient)
or ``B`` (full backward: our fused B). ``_PipelineScheduleRuntime._load_csv(path,
format="compute_only")`` reads it and adds the communication itself; ``pipeopt run`` hands
the same actions to that runtime in memory (the schedule is validated first; tests check that
PyTorch parses, validates and lowers the cells of any valid schedule).
"""

from __future__ import annotations

import csv
import io
import os
import re

from pipeopt.errors import ConfigError
from pipeopt.io import write_atomic
from pipeopt.schedule import Schedule
from pipeopt.simulate import ScheduleError, check


def schedule_rows(schedule: Schedule) -> tuple[list[list[tuple[int, str, int]]], list[int]]:
    """Per rank, ``(stage, kind, microbatch)`` in torch's vocabulary (our split B is ``I``,
    a fused B is ``B``), and the micro-batch relabelling ``order``: the runtime pairs the
    last stage's losses with its forwards in the order they run, so micro-batch ``i`` of the
    rows is the schedule's micro-batch ``order[i]`` (the identity for in-order schedules)."""
    prob = schedule.problem
    orders = schedule.device_orders()
    last = prob.stages - 1
    order = [op.microbatch for d in orders for op in d if op.kind == "F" and op.stage == last]
    label = {j: i for i, j in enumerate(order)}
    b = "I" if prob.split_backward else "B"
    rows = [[(op.stage, b if op.kind == "B" else op.kind, label[op.microbatch]) for op in d]
            for d in orders]
    return rows, order


def torch_actions(schedule: Schedule) -> list[list[str]]:
    """Per rank, the compute actions of ``schedule`` as PyTorch action strings, in order
    (micro-batches relabelled as :func:`schedule_rows` says)."""
    return [[f"{k}{kind}{j}" for k, kind, j in row] for row in schedule_rows(schedule)[0]]


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV text of a valid ``schedule``."""
    violations = check(schedule)
    if violations:
        raise ScheduleError(f"export: invalid schedule: {violations[0]}", violations)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(torch_actions(schedule))
    return buf.getvalue()


def export_torch(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as PyTorch's compute-only CSV to ``path`` (atomically)."""
    write_atomic(path, to_torch_csv(schedule))


# ----- stage split for other trainers: torchtitan and Megatron-LM -------------------------
class ExportError(ConfigError):
    """A plan that the target trainer cannot express; the message says why."""


_BLOCK = re.compile(r"block(\d+)")


def transformer_split(schedule: Schedule, target: str) -> list[tuple[bool, int, int, bool]]:
    """Per stage (in stage order): (holds the embedding, first block, blocks, holds the head),
    from the partition a model-form config recorded in ``problem.meta``. Raises
    :class:`ExportError` naming ``target`` when the schedule has no partition or its layers
    are not a transformer's ``embedding, block0..block{L-1}, head``, and for a schedule cut
    into sub-blocks (``pipeline.sub_blocks`` > 1: neither trainer places a stage's pieces on
    one rank)."""
    k = schedule.problem.sub_blocks
    if k > 1:
        raise ExportError(f"{target}: the schedule cuts every stage into {k} sub-blocks (pieces "
                          f"of a stage's layers on one rank), which {target} cannot place (it "
                          "puts stage s on rank s mod p, or a V); solve with "
                          "pipeline.sub_blocks: 1 to export")
    meta = dict(schedule.problem.meta)
    part, names = meta.get("partition"), meta.get("layer_names")
    if not part or not names:
        raise ExportError(f"{target}: the schedule carries no layer partition (solve a model-"
                          "form config: model: and cluster:, not per-stage costs)")
    blocks = names[1:-1]
    if (names[0] != "embedding" or names[-1] != "head"
            or [_BLOCK.fullmatch(n) and int(_BLOCK.fullmatch(n)[1]) for n in blocks]
            != list(range(len(blocks)))):
        raise ExportError(f"{target}: the plan's layers are not a transformer's embedding, "
                          "block0.., head (model.preset or a transformer shape), so their "
                          f"modules in {target} are unknown")
    out = []
    for a, b in part:
        first, last = max(a, 1), min(b, len(names) - 1)
        out.append((a == 0, first - 1, max(0, last - first), b == len(names)))
    return out


def _toml_str(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for these characters)."""
    import json

    return json.dumps(text, ensure_ascii=False)


def to_torchtitan_toml(schedule: Schedule, csv_path: str) -> str:
    """A torchtitan job-config fragment running ``schedule``: its ``[parallelism]`` keys
    (``pipeline_parallel_degree``, ``pipeline_parallel_schedule_csv`` = ``csv_path``, the
    stage split as ``module_fqns_per_model_part`` in torchtitan's decoder module names
    ``tok_embeddings``, ``layers.i``, ``norm``, ``output``) and ``[training]
    local_batch_size`` = micro-batches x micro-batch size.

    With a CSV torchtitan runs ``_PipelineScheduleRuntime``; ``pipeline_parallel_schedule``
    then only decides which stages each rank builds: ``ZBVZeroBubble`` for the v-shape
    (two stages per rank), else a looped one. Raises :class:`ExportError` for what it cannot
    express (more than two stages per rank in a v-shape, no transformer partition)."""
    prob = schedule.problem
    split = transformer_split(schedule, "torchtitan")
    if prob.placement == "vshape" and prob.virtual_stages != 2:
        raise ExportError(f"torchtitan: a v-shape of {prob.virtual_stages} stages per rank; "
                          "torchtitan places v-shapes of exactly 2 (ZBVZeroBubble, DualPipeV)")
    if prob.placement == "vshape":
        placement = "ZBVZeroBubble"
    else:
        placement = "Interleaved1F1B" if prob.virtual_stages > 1 else "1F1B"
    parts = []
    for emb, first, count, head in split:
        fqns = (["tok_embeddings"] if emb else []) + [f"layers.{i}" for i in
                                                      range(first, first + count)]
        parts.append(fqns + (["norm", "output"] if head else []))
    mbs = dict(prob.meta).get("cost_model", {}).get("micro_batch_size") or 1
    lines = [
        f"# pipeopt plan: {prob.devices} ranks x {prob.virtual_stages} stage(s), "
        f"{prob.microbatches} micro-batches, method {schedule.method}",
        "[parallelism]",
        f"pipeline_parallel_degree = {prob.devices}",
        "# with a CSV this only picks each rank's stages; the CSV gives the order",
        f"pipeline_parallel_schedule = {_toml_str(placement)}",
        f"pipeline_parallel_schedule_csv = {_toml_str(csv_path)}",
        f"pipeline_parallel_microbatch_size = {mbs}",
        "module_fqns_per_model_part = [",
        *(f"  [{', '.join(_toml_str(n) for n in fqns)}]," for fqns in parts),
        "]",
        "",
        "[training]",
        f"local_batch_size = {prob.microbatches * mbs}",
        "",
    ]
    return "\n".join(lines)


def megatron_args(schedule: Schedule) -> list[str]:
    """Megatron-LM flags giving ``schedule``'s stage split: ``--pipeline-model-parallel-size``,
    ``--num-layers`` and, with one stage per rank and equal middle stages, the uneven
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, else
    ``--pipeline-model-parallel-layout`` (E embedding, t block, L loss: final norm and head;
    ``|`` between stages; stage s on rank s mod p, Megatron's looped placement); with a known
    micro-batch size, ``--micro-batch-size`` and ``--global-batch-size`` for the same number
    of micro-batches. Megatron runs its own (interleaved) 1F1B order on this split, not the
    schedule's order. Raises :class:`ExportError` for a v-shape (Megatron places stages
    looped only) or no transformer partition."""
    prob = schedule.problem
    split = transformer_split(schedule, "megatron")
    if prob.placement == "vshape" and prob.virtual_stages > 1:
        raise ExportError("megatron: the v-shape placement (stage s and 2p-1-s on one rank) "
                          "cannot be expressed; Megatron puts stage s on rank s mod p "
                          "(use placement: loop)")
    p, layers = prob.devices, sum(c for _, _, c, _ in split)
    args = ["--pipeline-model-parallel-size", str(p), "--num-layers", str(layers)]
    counts = [c for _, _, c, _ in split]
    middle = counts[1:-1]
    if prob.virtual_stages == 1 and p > 1 and counts[0] > 0 and counts[-1] > 0 and (
            len(set(middle)) <= 1 and all(c > 0 for c in middle)):
        args += ["--decoder-first-pipeline-num-layers", str(counts[0]),
                 "--decoder-last-pipeline-num-layers", str(counts[-1])]
    elif p > 1 or prob.virtual_stages > 1:
        stages = []
        for emb, _, count, head in split:
            body = "t" if count == 1 else (f"t*{count}" if count else "")
            stages.append(("E" if emb else "") + body + ("L" if head else ""))
        args += ["--pipeline-model-parallel-layout", "|".join(stages)]
    meta = dict(prob.meta).get("cost_model", {})
    mbs = meta.get("micro_batch_size")
    if mbs:
        dp = meta.get("data_parallel") or 1
        args += ["--micro-batch-size", str(mbs),
                 "--global-batch-size", str(prob.microbatches * mbs * dp)]
    return args


def to_megatron_args(schedule: Schedule) -> str:
    """:func:`megatron_args` as one shell-quoted line (with a newline)."""
    import shlex

    return shlex.join(megatron_args(schedule)) + "\n"
