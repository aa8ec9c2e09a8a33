"""Bad input never crashes: every case exits with status 2 and one ``pipeopt: error:`` line that
names the key path and the reason (configs in both forms, command-line flags, unreadable files,
corrupted schedule JSON for ``simulate``, ``plot`` and ``run``)."""

from __future__ import annotations

import copy
import datetime
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeopt.cli import main

# ----- valid starting points ---------------------------------------------------------------

EXPLICIT: dict[str, Any] = {
    "pipeline": {"devices": 4, "microbatches": 8},
    "stages": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0,
               "activation_memory": 1.0, "weight_grad_memory": 0.5},
    "links": {"latency": 0.0},
    "memory": {"limit": 4.0},
    "solver": {"method": "greedy", "time_limit": 5, "workers": 1},
}

MODEL: dict[str, Any] = {
    "pipeline": {"devices": 4, "microbatches": 8},
    "model": {"preset": "gpt2-small", "seq_len": 1024, "micro_batch_size": 4},
    "cluster": {"gpu": "L4", "gpus_per_node": 4, "compute_efficiency": 0.4,
                "tiers": {"nvlink": {"bandwidth": 32.0e9, "latency": 5.0e-6}}},
    "training": {"partition": "dp"},
    "solver": {"method": "greedy", "time_limit": 5, "workers": 1},
}

Mutation = Callable[[dict[str, Any]], None]


def put(path: str, value: Any) -> Mutation:
    """Set ``a.b.c`` (creating sections on the way)."""
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            doc = doc.setdefault(key, {})
        doc[last] = value
    return apply


def drop(path: str) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[key]
        del doc[last]
    return apply


def both(*mutations: Mutation) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        for m in mutations:
            m(doc)
    return apply


def self_alias(doc: dict[str, Any]) -> None:
    loop: list[Any] = []
    loop.append(loop)
    doc["pipeline"]["devices"] = loop


# (id, base config, mutation, extra command-line arguments, key path, reason)
CONFIG_CASES: list[tuple[str, dict[str, Any], Mutation, list[str], str, str]] = [
    # unknown keys, with "did you mean"
    ("unknown-section", EXPLICIT, put("pipelin", {}), [], "pipelin:",
     "did you mean 'pipeline'?"),
    ("unknown-stage-key", EXPLICIT, put("stages.forwrd", 1), [], "stages.forwrd:",
     "did you mean 'forward'?"),
    ("unknown-solver-key", EXPLICIT, put("solver.time_limt", 3), [], "solver.time_limt:",
     "did you mean 'time_limit'?"),
    ("unknown-key-no-match", EXPLICIT, put("memory.zzz", 1), [], "memory.zzz:",
     "unknown key; expected one of limit, static"),
    ("non-string-key", EXPLICIT, put("stages.5", 1), [], "stages.5:", "unknown key"),
    # wrong types
    ("devices-string", EXPLICIT, put("pipeline.devices", "four"), [], "pipeline.devices:",
     "expected an integer, got 'four'"),
    ("devices-fraction", EXPLICIT, put("pipeline.devices", 2.5), [], "pipeline.devices:",
     "expected an integer, got 2.5"),
    ("devices-bool", EXPLICIT, put("pipeline.devices", True), [], "pipeline.devices:",
     "expected an integer, got true"),
    ("forward-bool", EXPLICIT, put("stages.forward", True), [], "stages.forward:",
     "expected a number, got true"),
    ("forward-string-in-list", EXPLICIT, put("stages.forward", [1, "x", 1, 1]), [],
     "stages.forward[1]:", "expected a number, got 'x'"),
    ("forward-mapping", EXPLICIT, put("stages.forward", {"a": 1}), [], "stages.forward:",
     "expected a number, got a mapping"),
    ("split-backward-yes", EXPLICIT, put("pipeline.split_backward", "yes"), [],
     "pipeline.split_backward:", "expected true or false"),
    ("memory-limit-string", EXPLICIT, put("memory.limit", "lots"), [], "memory.limit:",
     "expected a number"),
    ("stages-a-list", EXPLICIT, put("stages", [1, 2]), [], "stages:",
     "expected a mapping (key: value)"),
    ("pipeline-a-number", EXPLICIT, put("pipeline", 3), [], "pipeline:",
     "expected a mapping (key: value), got 3"),
    ("time-limit-a-date", EXPLICIT, put("solver.time_limit", datetime.date(2001, 1, 1)),
     [], "solver.time_limit:", "expected a number, got the date 2001-01-01"),
    ("value-contains-itself", EXPLICIT, self_alias, [], "pipeline.devices[0]:",
     "refers to itself"),
    # out of range: negative, NaN, infinite, zero
    ("devices-zero", EXPLICIT, put("pipeline.devices", 0), [], "pipeline.devices:",
     "must be >= 1, got 0"),
    ("microbatches-negative", EXPLICIT, put("pipeline.microbatches", -3), [],
     "pipeline.microbatches:", "must be >= 1, got -3"),
    ("virtual-stages-zero", EXPLICIT, put("pipeline.virtual_stages", 0), [],
     "pipeline.virtual_stages:", "must be >= 1"),
    ("placement-unknown", EXPLICIT, put("pipeline.placement", "zigzag"), [],
     "pipeline.placement:", "must be 'loop' or 'vshape', got 'zigzag'"),
    ("forward-negative", EXPLICIT, put("stages.forward", [1.0, 1.0, -1.0, 1.0]), [],
     "stages.forward[2]:", "must be a finite number >= 0 (seconds), got -1.0"),
    ("forward-nan", EXPLICIT, put("stages.forward", float("nan")), [], "stages.forward:",
     "must be a finite number >= 0"),
    ("backward-input-inf", EXPLICIT, put("stages.backward_input", [1, float("inf"), 1, 1]), [],
     "stages.backward_input[1]:", "must be a finite number >= 0"),
    ("activation-negative", EXPLICIT, put("stages.activation_memory", -1), [],
     "stages.activation_memory:", "must be a finite number >= 0 (bytes)"),
    ("weight-grad-above-activation", EXPLICIT, put("stages.weight_grad_memory", 2.0), [],
     "stages.weight_grad_memory[0]:", "must be <= activation_memory[0]"),
    ("grad-reduce-nan", EXPLICIT, put("stages.grad_reduce", float("nan")), [],
     "stages.grad_reduce:", "must be a finite number >= 0"),
    ("latency-negative", EXPLICIT, put("links.latency", -0.1), [], "links.latency:",
     "must be a finite number >= 0 (seconds)"),
    ("bandwidth-zero", EXPLICIT, put("links.bandwidth", [1e9, 0, 1e9]), [],
     "links.bandwidth[1]:", "must be > 0"),
    ("memory-limit-negative", EXPLICIT, put("memory.limit", [4, 4, -1, 4]), [],
     "memory.limit[2]:", "must be a number >= 0 (bytes) or null"),
    ("memory-static-inf", EXPLICIT, put("memory.static", float("inf")), [], "memory.static:",
     "must be a finite number >= 0 (bytes)"),
    ("time-limit-negative", EXPLICIT, put("solver.time_limit", -1), [], "solver.time_limit:",
     "must be > 0, got -1"),
    ("time-limit-inf", EXPLICIT, put("solver.time_limit", float("inf")), [],
     "solver.time_limit:", "must be a finite number"),
    ("workers-zero", EXPLICIT, put("solver.workers", 0), [], "solver.workers:",
     "must be >= 1"),
    ("relative-gap-two", EXPLICIT, put("solver.relative_gap", 2), [], "solver.relative_gap:",
     "must be <= 1"),
    ("seed-huge", EXPLICIT, put("solver.seed", 10**30), [], "solver.seed:",
     "must be <= 2147483647"),
    ("objective-unknown", EXPLICIT, put("solver.objective", "speed"), [], "solver.objective:",
     "must be 'makespan' or 'span'"),
    # list lengths that do not match the stage / device / link count
    ("forward-too-short", EXPLICIT, put("stages.forward", [1, 1, 1]), [], "stages.forward:",
     "expected 4 values (one per stage), got 3"),
    ("forward-per-chunk", EXPLICIT,
     both(put("pipeline.virtual_stages", 2), put("stages.forward", [1, 1, 1, 1])), [],
     "stages.forward:", "expected 8 values (one per stage), got 4"),
    ("latency-wrong-length", EXPLICIT, put("links.latency", [0, 0]), [], "links.latency:",
     "expected 3 values (one per neighbouring device pair), got 2"),
    ("message-size-wrong-length", EXPLICIT, put("links.message_size", [1, 2]), [],
     "links.message_size:", "expected 3 values (one per stage boundary), got 2"),
    ("memory-limit-wrong-length", EXPLICIT, put("memory.limit", [4, 4]), [], "memory.limit:",
     "expected 4 values (one per device), got 2"),
    # micro-batches of different cost
    ("microbatch-scale-zero", EXPLICIT, put("pipeline.microbatch_scale", [1, 1, 1, 0, 1, 1, 1, 1]),
     [], "pipeline.microbatch_scale[3]:", "must be > 0, got 0"),
    ("microbatch-scale-wrong-length", EXPLICIT, put("pipeline.microbatch_scale", [1] * 7), [],
     "pipeline.microbatch_scale:", "expected 8 values (pipeline.microbatches), got 7"),
    ("microbatch-memory-scale-nan", EXPLICIT,
     put("pipeline.microbatch_memory_scale", float("nan")), [],
     "pipeline.microbatch_memory_scale:", "must be a finite number > 0, got nan"),
    ("microbatch-scale-word", EXPLICIT, put("pipeline.microbatch_scale", "long"), [],
     "pipeline.microbatch_scale:", "expected a number, got 'long'"),
    # missing sections and keys
    ("pipeline-missing", EXPLICIT, drop("pipeline"), [], "pipeline:", "missing"),
    ("stages-missing", EXPLICIT, drop("stages"), [], "stages:", "missing"),
    ("backward-input-missing", EXPLICIT, drop("stages.backward_input"), [],
     "stages.backward_input:", "missing (required)"),
    # sizes no machine can schedule
    ("microbatches-huge", EXPLICIT, put("pipeline.microbatches", 10**12), [],
     "pipeline.microbatches:", "more than pipeopt schedules"),
    ("devices-huge", EXPLICIT, put("pipeline.devices", 10**30), [], "pipeline.devices:",
     "at most 1024"),
    # methods: unknown, or unable to express the problem
    ("method-unknown-in-file", EXPLICIT, put("solver.method", "gredy"), [], "solver.method:",
     "unknown method 'gredy'; did you mean 'greedy'?"),
    ("method-flag-unknown", EXPLICIT, lambda d: None, ["--method", "nope"], "--method:",
     "unknown method 'nope'"),
    ("method-flag-close", EXPLICIT, lambda d: None, ["--method", "1f1"], "--method:",
     "did you mean '1f1b'?"),
    ("microbatches-fewer-than-zb-v-needs", EXPLICIT,
     both(put("pipeline.virtual_stages", 2), put("pipeline.placement", "vshape"),
          put("pipeline.microbatches", 4)), ["--method", "zb-v"],
     "pipeline.microbatches", "needs pipeline.microbatches >= 2 * pipeline.devices (8), got 4"),
    ("microbatches-not-divisible-interleaved", EXPLICIT,
     both(put("pipeline.virtual_stages", 2), put("pipeline.microbatches", 6)),
     ["--method", "interleaved-1f1b"], "pipeline.microbatches", "divisible by 4"),
    # memory: nothing fits, or a hand-made schedule does not
    ("memory-below-any-schedule", EXPLICIT, put("memory.limit", 0.5), ["--method", "auto"],
     "memory.limit[0] = 0.5", "device 0 needs at least 1"),
    ("memory-below-any-schedule-cpsat", EXPLICIT,
     both(put("memory.limit", [4, 4, 4, 0.5]), put("memory.static", 0.25)),
     ["--method", "cpsat"], "memory.limit[3] = 0.5",
     "fits with memory.limit >= [1.25, 1.25, 1.25, 1.25]"),
    ("memory-too-small-for-1f1b", EXPLICIT, put("memory.limit", 2.5), ["--method", "1f1b"],
     "memory.limit[0]:", "hand-made schedules do not adapt to memory limits"),
    # command-line flags
    ("time-limit-flag-negative", EXPLICIT, lambda d: None, ["--time-limit", "-1"],
     "--time-limit", "must be a finite number of seconds > 0"),
    ("time-limit-flag-word", EXPLICIT, lambda d: None, ["--time-limit", "abc"],
     "--time-limit", "expected a number of seconds, got 'abc'"),
    ("time-limit-flag-nan", EXPLICIT, lambda d: None, ["--time-limit", "nan"],
     "--time-limit", "must be a finite number of seconds > 0"),
    ("seed-flag-negative", EXPLICIT, lambda d: None, ["--seed", "-1"], "--seed",
     "must be in 0..2147483647"),
    ("objective-flag-unknown", EXPLICIT, lambda d: None, ["--objective", "speed"],
     "--objective", "invalid choice: 'speed'"),
    ("unknown-flag", EXPLICIT, lambda d: None, ["--bogus"], "--bogus", "unrecognized arguments"),
    # the model / cluster form
    ("gpu-unknown", MODEL, put("cluster.gpu", "H1000"), [], "cluster.gpu:",
     "unknown GPU 'H1000'; did you mean 'H200'?"),
    ("gpu-not-a-string", MODEL, put("cluster.gpu", 5), [], "cluster.gpu:",
     "expected a string, got 5"),
    ("datacenter-gpu-unknown", MODEL, put("cluster.datacenters", [{"gpu": "X9"}]), [],
     "cluster.datacenters[0].gpu:", "unknown GPU 'X9'"),
    ("datacenter-not-a-mapping", MODEL, put("cluster.datacenters", [5]), [],
     "cluster.datacenters[0]:", "expected a mapping (key: value), got 5"),
    ("preset-unknown", MODEL, put("model.preset", "gpt5"), [], "model.preset:",
     "unknown preset 'gpt5'"),
    ("model-key-typo", MODEL, put("model.hiden", 768), [], "model.hiden:",
     "did you mean 'hidden'?"),
    ("tier-key-typo", MODEL, put("cluster.tiers.nvlnk", {"bandwidth": 1e9, "latency": 0}), [],
     "cluster.tiers.nvlnk:", "did you mean 'nvlink'?"),
    ("override-key-typo", MODEL, put("model.overrides", [{"layers": [0], "time_scal": 2}]), [],
     "model.overrides[0].time_scal:", "did you mean 'time_scale'?"),
    ("hidden-bool", MODEL, put("model.hidden", True), [], "model.hidden:",
     "expected an integer, got true"),
    ("seq-len-fraction", MODEL, put("model.seq_len", 10.5), [], "model.seq_len:",
     "expected an integer, got 10.5"),
    ("dtype-unknown", MODEL, put("model.dtype", "fp8"), [], "model.dtype:",
     "must be 'bf16', 'fp16' or 'fp32'"),
    ("efficiency-above-one", MODEL, put("cluster.compute_efficiency", 2), [],
     "cluster.compute_efficiency:", "must be in (0, 1]"),
    ("efficiency-nan", MODEL, put("cluster.compute_efficiency", float("nan")), [],
     "cluster.compute_efficiency:", "must be a finite number"),
    ("efficiency-curve-triple", MODEL, put("cluster.compute_efficiency", [[1e9, 0.5, 3]]), [],
     "cluster.compute_efficiency[0]:", "expected 2 items, got 3"),
    ("tier-latency-nan", MODEL, put("cluster.tiers.nvlink.latency", float("nan")), [],
     "cluster.tiers.nvlink.latency:", "must be a finite number"),
    ("memory-reserve-one", MODEL, put("cluster.memory_reserve", 1), [],
     "cluster.memory_reserve:", "must be < 1"),
    ("stage-layers-wrong-length", MODEL, put("training.stage_layers", [1, 2]), [],
     "training.stage_layers:", "expected 4 values (one per stage), got 2"),
    ("partition-unknown", MODEL, put("training.partition", "magic"), [],
     "training.partition:", "must be 'dp', 'ilp', 'joint' or 'uniform'"),
    ("more-devices-than-layers", MODEL, put("pipeline.devices", 64), [], "pipeline.devices:",
     "need at least 64 layers, the model has 14"),
    ("stages-with-model", MODEL, put("stages", {"forward": 1}), [], "stages:",
     "cannot be combined with model:/cluster:"),
    ("links-with-cluster", MODEL, put("links", {"latency": 0}), [], "links:",
     "not used with cluster:"),
    ("model-memory-too-small", MODEL, put("memory.limit", 1000), [], "memory:",
     "no partition into 4 stages fits in memory"),
    ("layer-cost-without-time", MODEL, put("model", {"layer_costs": [{"name": "x"}] * 8}), [],
     "model.layer_costs[0]:", "give forward (seconds) or forward_flops"),
    ("training-in-explicit-form", EXPLICIT, put("training.partition", "dp"), [],
     "training.partition:", "training: is used only with model:/cluster:"),
    ("links-overflow", EXPLICIT, lambda d: d["links"].update(message_size=1e308,
                                                            bandwidth=1e-308), [],
     "links:", "add up to more than a float holds"),
    ("model-microbatches-huge", MODEL, put("pipeline.microbatches", 10**9), [],
     "pipeline.microbatches:", "more than pipeopt schedules"),
    ("datacenters-empty-list", MODEL, put("cluster.datacenters", []), [],
     "cluster.datacenters:", "an empty list"),
    ("layers-too-many", MODEL, put("model.layers", 5000), [], "model.layers:",
     "must be <= 4094, got 5000"),
    ("layer-costs-count-huge", MODEL,
     put("model", {"layer_costs": [{"forward": 1.0, "count": 100_000_000}]}), [],
     "model.layer_costs:", "100000000 layers (counts included), at most 4096"),
    ("efficiency-curve-at-zero-flops", MODEL,
     put("cluster.compute_efficiency", [[0, 0.5], [1e12, 0.6]]), [],
     "cluster.compute_efficiency:", "flops a finite number > 0"),
    ("override-heads-not-dividing", MODEL, put("model.overrides", [{"layers": [0], "heads": 7}]),
     [], "model.overrides[0].heads:", "must divide model.hidden (768), got 7"),
    ("override-kv-heads-above-heads", MODEL,
     put("model.overrides", [{"layers": [0], "kv_heads": 64}]), [],
     "model.overrides[0].kv_heads:", "kv_heads (64) must divide heads (12)"),
    ("shape-key-beside-layer-costs", MODEL,
     put("model", {"layer_costs": [{"forward": 1.0, "count": 8}], "recompute": "full"}), [],
     "model.recompute:", "not used with model.layer_costs"),
    ("preset-beside-layer-costs", MODEL,
     put("model", {"layer_costs": [{"forward": 1.0, "count": 8}], "preset": "gpt2-small"}), [],
     "model.preset:", "cannot be combined with model.layer_costs"),
    ("sequence-lengths-wrong-length", MODEL, put("training.sequence_lengths", [1024] * 3), [],
     "training.sequence_lengths:", "expected 8 values (pipeline.microbatches), got 3"),
    ("sequence-lengths-zero", MODEL, put("training.sequence_lengths", [1024] * 7 + [0]), [],
     "training.sequence_lengths[7]:", "must be >= 1, got 0"),
    ("sequence-lengths-distribution-unknown", MODEL,
     put("training.sequence_lengths", {"distribution": "gauss"}), [],
     "training.sequence_lengths.distribution:", "must be 'uniform', 'lognormal' or 'zipf'"),
    ("sequence-lengths-key-unused", MODEL,
     put("training.sequence_lengths", {"distribution": "uniform", "min": 1, "max": 9,
                                       "sigma": 2}), [],
     "training.sequence_lengths.sigma:", "not used by the uniform distribution"),
    ("sequence-lengths-with-layer-costs", MODEL,
     both(put("model", {"layer_costs": [{"forward": 1.0, "count": 8}]}),
          put("training.sequence_lengths", [1024] * 8)), [],
     "training.sequence_lengths:", "needs a transformer model"),
    ("joint-method-typo", MODEL, put("training.joint_method", "greedyy"), [],
     "training.joint_method:", "did you mean 'greedy'?"),
    ("explicit-partition-too-big", MODEL,
     lambda d: (put("training.stage_layers", [11, 1, 1, 1])(d), put("memory.limit", 2e9)(d)),
     ["--method", "1f1b"], "memory:", "device 0, holding stage 0 (layers 0..10)"),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_error(rc: int, err: str, *phrases: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("pipeopt: error:"), line
    for phrase in phrases:
        assert phrase in line, f"{phrase!r} not in {line!r}"
    return line


@pytest.mark.parametrize(("base", "mutate", "args", "where", "reason"),
                         [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], base: dict[str, Any],
                    mutate: Mutation, args: list[str], where: str, reason: str) -> None:
    doc = copy.deepcopy(base)
    mutate(doc)
    cfg, out = tmp_path / "config.yaml", tmp_path / "out.json"
    cfg.write_text(yaml.safe_dump(doc), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-o", str(out), "-q", *args], capsys)
    _assert_one_error(rc, err, where, reason)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temp files


# ----- files that are not YAML configs -----------------------------------------------------

GOOD_YAML = yaml.safe_dump(EXPLICIT)

# (id, file content (text, bytes, or None: no file), reason)
FILE_CASES: list[tuple[str, str | bytes | None, str]] = [
    ("missing-file", None, "no such file"),
    ("binary-not-utf8", b"\xff\xfe\x00\x01\x80garbage", "not a UTF-8 text file"),
    ("binary-with-nul", b"pipeline:\x00\x00\x01", "a binary file (NUL bytes)"),
    ("empty-file", "", "the file is empty"),
    ("only-comments", "# pipeline:\n#   devices: 4\n", "the file is empty"),
    ("list-at-top", "- pipeline\n- stages\n", "expected a mapping of sections"),
    ("scalar-at-top", "hello\n", "got a string"),
    ("python-object-tag", "pipeline: !!python/object/apply:os.system ['echo hi']\n",
     "refused the YAML tag !!python/object/apply:os.system"),
    ("python-name-tag", "pipeline: !!python/name:os.system\n", "safe loading"),
    ("custom-tag", "pipeline: !thing {devices: 4}\n", "refused the YAML tag !thing"),
    ("unclosed-bracket", "pipeline: {devices: 4\nstages: [\n", "not valid YAML (line 2"),
    ("tab-indent", "pipeline:\n\tdevices: 4\n", "cannot start any token"),
    ("duplicate-section", GOOD_YAML + "pipeline:\n  devices: 2\n",
     "duplicate key 'pipeline'"),
    ("duplicate-nested-key", "pipeline:\n  devices: 4\n  devices: 2\n  microbatches: 8\n",
     "duplicate key 'devices' (first at line 2)"),
    ("unhashable-key", GOOD_YAML + "? [1, 2]\n: 3\n", "found unhashable key"),
    # Nine levels of tenfold aliases: a billion values once expanded, a few lines on disk.
    ("alias-bomb", GOOD_YAML + "extra:\n  l0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n" + "".join(
        f"  l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)),
     "holds more than 1,000,000 values once its YAML aliases (*name) are expanded"),
]


@pytest.mark.parametrize(("content", "reason"), [c[1:] for c in FILE_CASES],
                         ids=[c[0] for c in FILE_CASES])
def test_unusable_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              content: str | bytes | None, reason: str) -> None:
    cfg, out = tmp_path / "config.yaml", tmp_path / "out.json"
    if isinstance(content, bytes):
        cfg.write_bytes(content)
    elif content is not None:
        cfg.write_text(content, encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-o", str(out)], capsys)
    _assert_one_error(rc, err, str(cfg), reason)
    assert not out.exists()


def test_integer_of_5000_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Python refuses to read integers of over 4300 digits; it is named as too large, not inf.
    cfg = tmp_path / "config.yaml"
    cfg.write_text(GOOD_YAML.replace("forward: 1.0", "forward: 1" + "0" * 5000), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-q"], capsys)
    _assert_one_error(rc, err, "stages.forward:", "too large (an integer of 5001 digits")
    cfg.write_text(GOOD_YAML.replace("devices: 4", "devices: 4" + "0" * 5000), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-q"], capsys)
    line = _assert_one_error(rc, err, "pipeline.devices:", "too large")
    assert "inf" not in line


def test_strict_types_hold_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18 item 11: a quoted number is a string in every spelling ("1e-3" as "1.5"),
    model-form memory.static is checked as the explicit form's, and a time limit is checked by
    the same rule in a config, a flag and the Python API."""
    import pipeopt

    cfg = tmp_path / "config.yaml"
    for text in ('"1e-3"', '"1.5"', "'inf'", '["1e-3", 1, 1, 1]'):
        cfg.write_text(GOOD_YAML.replace("forward: 1.0", f"forward: {text}"), encoding="utf-8")
        rc, _, err = _run(["solve", str(cfg), "-q"], capsys)
        _assert_one_error(rc, err, "stages.forward", "expected a number, got '",
                          "a string: write the number without quotes")
    cfg.write_text(GOOD_YAML.replace("forward: 1.0", "forward: 1e-3"), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-q", "--method", "1f1b"], capsys)
    assert rc == 0, err  # unquoted, it is a number (YAML 1.2), though PyYAML reads text

    model = copy.deepcopy(MODEL)
    model["memory"] = {"static": -1.0}
    cfg.write_text(yaml.safe_dump(model), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-q"], capsys)
    _assert_one_error(rc, err, "memory.static:", "must be a finite number >= 0 (bytes), got -1")

    rule = "must be a finite number of seconds > 0"
    cfg.write_text(GOOD_YAML, encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-q", "--time-limit", "-1"], capsys)
    _assert_one_error(rc, err, "--time-limit", rule)
    prob = pipeopt.uniform_problem(devices=2, microbatches=2, f=1.0, b=1.0, w=1.0)
    for bad in (-1, 0, float("nan"), float("inf"), True):
        with pytest.raises(pipeopt.ConfigError, match=f"time_limit: {rule}"):
            pipeopt.solve(prob, "greedy", time_limit=bad)
    with pytest.raises(pipeopt.ConfigError, match=r"workers: must be an integer in 1\.\.256"):
        pipeopt.solve(prob, "greedy", workers=0)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
@pytest.mark.parametrize("command", ["solve", "simulate"])
def test_endless_device_refused_before_reading(device: str, command: str) -> None:
    """Issue 18 item 10: `solve /dev/zero` read for ever, growing without bound."""
    if not Path(device).exists():
        pytest.skip(f"no {device}")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pipeopt", command, device],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    _assert_one_error(proc.returncode, proc.stderr, f"{device}: cannot read (a character "
                      "device, not a regular file: it may never end")


def test_oversized_or_special_inputs_refused_before_reading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import os
    import sys
    import time

    import pipeopt.io

    for name, cap in (("big.yaml", "32 MiB"), ("big.json", "512 MiB")):
        big = tmp_path / name
        with open(big, "wb") as fh:
            fh.truncate(3 * 2**30)  # sparse: 3 GiB that takes no disk
        t0 = time.perf_counter()
        for command in (["solve", str(big), "-q"], ["simulate", str(big)]):
            if name.endswith(".yaml") and command[0] == "simulate":
                continue
            rc, _, err = _run(command, capsys)
            _assert_one_error(rc, err, f"{big}: cannot read (3 GiB, more than the {cap} "
                              "pipeopt reads for a")
        assert time.perf_counter() - t0 < 10  # not read
        big.unlink()
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # no writer: opening it for reading must not wait for one
    rc, _, err = _run(["solve", str(fifo), "-q"], capsys)
    _assert_one_error(rc, err, "a pipe (FIFO), not a regular file", "pipe it into -")
    # Standard input has the same caps.
    monkeypatch.setattr(pipeopt.io, "MAX_SCHEDULE_BYTES", 1000)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"#" * 5000)))
    rc, _, err = _run(["solve", "-", "-q"], capsys)
    _assert_one_error(rc, err, "<stdin>: cannot read (more than 1000 bytes on standard input, "
                      "the most pipeopt reads for a schedule JSON)")


def test_directory_instead_of_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(["solve", str(tmp_path)], capsys)
    _assert_one_error(rc, err, str(tmp_path), "is a directory, expected a YAML file")


def test_missing_command_and_argument(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run([], capsys)
    _assert_one_error(rc, err, "COMMAND", "required")
    rc, _, err = _run(["solve"], capsys)
    _assert_one_error(rc, err, "config", "required")
    rc, _, err = _run(["frobnicate"], capsys)
    _assert_one_error(rc, err, "invalid choice: 'frobnicate'")


def test_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(GOOD_YAML, encoding="utf-8")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory", encoding="utf-8")
    rc, out, err = _run(["solve", str(cfg), "-o", str(blocker / "out.json"), "-q"], capsys)
    _assert_one_error(rc, err, "--output: cannot write", "out.json")
    assert "written" not in out


def test_empty_sections_mean_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``memory:`` with every key commented out reads as null: the defaults, not an error."""
    cfg, out = tmp_path / "config.yaml", tmp_path / "out.json"
    cfg.write_text("pipeline: {devices: 2, microbatches: 4}\n"
                   "stages: {forward: 1e0, backward_input: 1, backward_weight: 1}\n"
                   "memory:\n  # limit: 4\nlinks:\nsolver:\n", encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg), "-o", str(out), "--method", "1f1b", "-q"], capsys)
    assert rc == 0, err
    assert out.exists()


# ----- corrupted schedule files: simulate, plot, run --------------------------------------

@pytest.fixture(scope="module")
def schedule_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A valid greedy schedule (split backward, messages on contended links)."""
    root = tmp_path_factory.mktemp("sched")
    cfg, out = root / "c.yaml", root / "s.json"
    cfg.write_text(yaml.safe_dump({
        "pipeline": {"devices": 3, "microbatches": 4},
        "stages": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.5,
                   "activation_memory": 1.0, "weight_grad_memory": 0.5},
        "links": {"latency": 0.1, "bandwidth": 10.0, "message_size": 5.0},
        "memory": {"limit": 3.0}}), encoding="utf-8")
    assert main(["solve", str(cfg), "--method", "greedy", "-o", str(out), "-q", "--json"]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["messages"] and doc["problem"]["split_backward"]
    return doc


def _op_index(doc: dict[str, Any], name: str) -> int:
    """Index in ``doc['ops']`` of the op written as ``<stage><kind><microbatch>``."""
    for i, o in enumerate(doc["ops"]):
        if f"{o['stage']}{o['kind']}{o['microbatch']}" == name:
            return i
    raise KeyError(name)


def _shift(name: str, by: float) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        o = doc["ops"][_op_index(doc, name)]
        o["start"] += by
        o["end"] += by
    return apply


def _set_op(name: str, key: str, value: Any) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        doc["ops"][_op_index(doc, name)][key] = value
    return apply


def _delete_op(name: str) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        del doc["ops"][_op_index(doc, name)]
    return apply


def _duplicate_op(doc: dict[str, Any]) -> None:
    doc["ops"][_op_index(doc, "0F1")] = dict(doc["ops"][_op_index(doc, "0F0")])


class Text:
    """A mutation of the file's text (rather than of the parsed document)."""

    def __init__(self, change: Callable[[str], str]) -> None:
        self.change = change


def _raw(text: str) -> Text:
    return Text(lambda good: text)


def _render(doc: dict[str, Any], mutate: Mutation | Text) -> str:
    """The text of ``doc`` after ``mutate``."""
    if isinstance(mutate, Text):
        return mutate.change(json.dumps(doc, indent=1))
    d = copy.deepcopy(doc)
    mutate(d)
    return json.dumps(d)


# (id, mutation of the document or of its text, key path / first violation, reason)
JSON_CASES: list[tuple[str, Mutation | Text, str, str]] = [
    ("not-json", _raw("hello"), "not valid JSON", "line 1"),
    ("truncated", Text(lambda good: good[: len(good) // 2]), "not valid JSON", "line"),
    ("empty", _raw(""), "not valid JSON", "line 1"),
    ("list-at-top", _raw("[1, 2]"), "schedule:", "expected a JSON object at the top level"),
    ("deeply-nested", _raw("[" * 100_000), "not", "JSON"),
    ("wrong-format", put("format", "pipeopt.schedule/v0"), "format:",
     "expected 'pipeopt.schedule/v1'"),
    ("method-not-string", put("method", 5), "method:", "expected a string"),
    ("ops-missing", drop("ops"), "ops:", "missing"),
    ("ops-not-list", put("ops", {"a": 1}), "ops:", "expected a list"),
    ("op-deleted", _delete_op("1B2"), "ops: 35 listed, the problem has 36",
     "first missing 1B2"),
    ("op-twice", _duplicate_op, "invalid schedule: 0F0: scheduled twice", "more"),
    # The last device's first op waits only for its input, whatever order a method chose.
    ("op-too-early", _shift("2F0", -0.5), "invalid schedule: 2F0:", "before its input 1F0"),
    ("op-overlaps", _set_op("0F1", "end", 3.0), "invalid schedule: 0F1:",
     "its duration is 1"),
    ("op-start-nan", _set_op("2B3", "start", float("nan")), "ops[", "start: must be a finite"),
    ("op-start-string", _set_op("2B3", "start", "soon"), "ops[", "start: expected"),
    ("op-device-out-of-range", _set_op("0F0", "device", 7), "ops[", "device: must be in 0..2"),
    ("op-device-wrong", _set_op("0F0", "device", 1), "invalid schedule: 0F0:",
     "on device 1, its stage is on device 0"),
    ("op-kind-unknown", _set_op("0F0", "kind", "X"), "ops[", "kind: must be one of F, B, W"),
    ("op-microbatch-bool", _set_op("0F0", "microbatch", True), "ops[",
     "microbatch: expected an integer"),
    ("problem-devices-string", put("problem.devices", "3"), "problem.devices:",
     "expected an integer >= 1"),
    ("problem-forward-short", put("problem.forward", [1.0, 1.0]), "problem.forward:",
     "expected 3 values"),
    ("problem-forward-junk", put("problem.forward", [1.0, {"a": 1}, 1.0]), "problem.forward[1]:",
     "expected a number"),
    ("problem-unknown-field", put("problem.speed", 1), "problem.speed:", "unknown field"),
    ("problem-microbatches-huge", put("problem.microbatches", 10**12), "problem:",
     "ops is more than pipeopt schedules (1,000,000)"),
    ("problem-devices-huge", put("problem.devices", 20000), "problem.devices:",
     "at most 1024, got 20000"),
    ("problem-meta-number", put("problem.meta", 3.5), "problem.meta:", "expected an object"),
    ("memory-limit-lowered", put("problem.memory_limit", [1.0, 1.0, 1.0]),
     "invalid schedule: device 0:", "exceeds the limit 1"),
    ("makespan-edited", put("makespan", 1.0), "makespan:", "the file says 1.0"),
    ("makespan-nan", put("makespan", float("nan")), "makespan:", "the file says nan"),
    ("solver-status-unknown", put("solver.status", "great"), "solver.status:",
     "must be one of optimal, feasible, heuristic"),
    ("solver-not-object", put("solver", [1]), "solver:", "expected an object"),
    ("wall-time-junk", put("solver.wall_time", {"s": 1}), "solver.wall_time:",
     "expected a finite number"),
    ("all-ops-shifted-later", lambda d: [o.update(start=o["start"] + 5, end=o["end"] + 5)
                                         for o in d["ops"]] and None,
     "invalid schedule:", "the first op starts at 5"),
    ("bubble-ratio-edited", lambda d: d.update(bubble_ratio=d["bubble_ratio"] + 1e-4),
     "bubble_ratio:", "the file says"),
    ("lower-bound-above-makespan", lambda d: d["solver"].update(lower_bound=d["makespan"] * 2),
     "solver.lower_bound:", "not a lower bound"),
    ("gap-edited", lambda d: d["solver"].update(gap=0.5), "solver.gap:", "the file says 0.5"),
    ("optimal-with-97pct-gap", lambda d: d["solver"].update(
        status="optimal", lower_bound=0.03 * d["makespan"], gap=0.97),
     "solver.status:", "optimal, but the makespan"),
    ("start-400-digits", Text(lambda good: re.sub(r'"start": [0-9.e+-]+', '"start": 1' + "0" * 400,
                                                  good, count=1)),
     "ops[0].start:", "must be a finite number, got an integer of 401 digits (too large)"),
    ("makespan-5000-digits", lambda d: d.update(makespan=10**4000), "makespan:",
     "the file says an integer of 4001 digits (too large)"),
    ("devices-5000-digits", Text(lambda good: re.sub(r'"devices": [0-9]+', '"devices": 3' + "0"
                                                     * 5000, good, count=1)), "problem.devices:",
     "too large (an integer of 5001 digits)"),
    ("op-field-typo", lambda d: d["ops"][0].update(strat=99.0), "ops[0].strat:",
     "unknown field; did you mean 'start'?"),
    ("top-field-typo", put("makespn", 1.0), "makespn:", "did you mean 'makespan'?"),
    ("solver-field-typo", put("solver.lower_bund", 1.0), "solver.lower_bund:",
     "did you mean 'lower_bound'?"),
    ("problem-field-typo", put("problem.microbatchs", 4), "problem.microbatchs:",
     "did you mean 'microbatches'?"),
    ("message-duplicated", lambda d: d["messages"].append(dict(d["messages"][0])),
     "invalid schedule: message", "listed more than once"),
    ("messages-not-list", put("messages", 5), "messages:", "expected a list"),
    ("message-delayed-wrongly", lambda d: d["messages"][0].update(arrival=99.0),
     "invalid schedule: message", "takes"),
    ("microbatch-scale-zero", lambda d: d["problem"].update(microbatch_scale=[1, 0, 1, 1]),
     "problem.microbatch_scale[1]:", "must be > 0"),
    ("microbatch-scale-short", lambda d: d["problem"].update(microbatch_scale=[2, 2]),
     "problem.microbatch_scale:", "expected 4 values, got 2"),
    ("microbatch-order-not-a-permutation", put("microbatch_order", [0, 0, 1, 2]),
     "microbatch_order:", "expected a permutation of 0..3"),
]


def test_edited_bubble_ratio_caught_at_any_time_scale(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # Times in microseconds: a makespan in the millions must not widen the check of a fraction.
    cfg, out = tmp_path / "c.yaml", tmp_path / "s.json"
    cfg.write_text(yaml.safe_dump({
        "pipeline": {"devices": 4, "microbatches": 8},
        "stages": {"forward": 40e3, "backward_input": 50e3, "backward_weight": 34e3},
        "links": {"latency": 160e3}}), encoding="utf-8")
    assert main(["solve", str(cfg), "--method", "1f1b", "-o", str(out), "-q"]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["makespan"] > 1e6 and doc["bubble_ratio"] > 0.1
    doc["bubble_ratio"] = 0.0
    out.write_text(json.dumps(doc), encoding="utf-8")
    capsys.readouterr()
    rc, _, err = _run(["simulate", str(out)], capsys)
    _assert_one_error(rc, err, "bubble_ratio:", "the file says 0.0")


def test_status_agrees_with_the_gap_of_what_was_minimised(tmp_path: Path) -> None:
    """``optimal`` is checked against the objective's gap: CP-SAT's files stay valid, both an
    optimal iteration time whose makespan (SPEC ``gap``) is 17% above its bound and a search on
    an inexact time grid that stopped 0.01-0.1% short (which says ``feasible``)."""
    import pipeopt
    from pipeopt.problem import Problem
    from pipeopt.simulate import ScheduleError

    base = pipeopt.uniform_problem(devices=4, microbatches=4, f=1.0, b=1.0, w=1.0).to_dict()
    reduce = Problem.from_dict({**base, "grad_reduce": [0, 0, 0, 9]})
    three = pipeopt.uniform_problem(devices=3, microbatches=4, f=1.0, b=1.0, w=1.0).to_dict()
    odd = Problem.from_dict({**three, "forward": [0.91343, 1.23771, 0.57211],
                             "backward_input": [1.40417, 0.62989, 1.12711],
                             "backward_weight": [0.31555, 0.87013, 0.5129]})
    for prob in (reduce, odd):
        sched = pipeopt.solve(prob, "cpsat", time_limit=5, workers=1)
        path = tmp_path / "s.json"
        pipeopt.dump_schedule(sched, path)
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert pipeopt.load_schedule(path).solver.status == sched.solver.status
        if prob is reduce:
            assert doc["solver"]["status"] == "optimal" and doc["solver"]["gap"] > 0.1
            doc["solver"].update(objective_lower_bound=20.0, objective_gap=1 / 6)
            reason = "the iteration time 24 is 16.67% above the lower bound 20"
        else:
            assert doc["solver"]["status"] in ("optimal", "feasible")
            assert doc["solver"]["gap"] < 0.002
            if doc["solver"]["gap"] == 0:
                continue
            doc["solver"]["status"] = "optimal"
            reason = "% above the lower bound"
        path.write_text(json.dumps(doc), encoding="utf-8")
        with pytest.raises(ScheduleError, match=re.escape(reason)):
            pipeopt.load_schedule(path)


@pytest.mark.parametrize("command", ["simulate", "plot", "solve"])
@pytest.mark.parametrize(("mutate", "where", "reason"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_corrupted_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            schedule_doc: dict[str, Any], command: str,
                            mutate: Mutation | Text, where: str, reason: str) -> None:
    src = tmp_path / "s.json"
    src.write_text(_render(schedule_doc, mutate), encoding="utf-8")
    png = tmp_path / "s.png"
    extra = {"plot": ["-o", str(png)], "solve": ["--method", "greedy", "-q"]}.get(command, [])
    rc, out, err = _run([command, str(src), *extra], capsys)
    _assert_one_error(rc, err, where, reason)
    assert not png.exists() and "valid" not in out


def test_schedule_file_missing_or_directory(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("simulate", "plot", "trace"):
        rc, _, err = _run([command, str(tmp_path / "none.json")], capsys)
        _assert_one_error(rc, err, "none.json", "cannot read")
        rc, _, err = _run([command, str(tmp_path)], capsys)
        _assert_one_error(rc, err, str(tmp_path), "cannot read")


def test_untouched_schedule_still_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         schedule_doc: dict[str, Any]) -> None:
    """The control: the unmutated document is accepted by every command."""
    src = tmp_path / "s.json"
    src.write_text(json.dumps(schedule_doc), encoding="utf-8")
    rc, out, err = _run(["simulate", str(src)], capsys)
    assert rc == 0 and "valid" in out, err
    again = tmp_path / "again.json"  # solve takes a schedule JSON in place of a config
    rc, out, err = _run(["solve", str(src), "--method", "greedy", "-q", "-o", str(again)],
                        capsys)
    assert rc == 0 and again.exists(), err


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs the torch extra")

RUN_CASES = [c for c in JSON_CASES if c[0] in (
    "truncated", "wrong-format", "op-deleted", "op-too-early", "problem-forward-junk",
    "makespan-edited", "memory-limit-lowered")]


@needs_torch
@pytest.mark.parametrize(("mutate", "where", "reason"), [c[1:] for c in RUN_CASES],
                         ids=[c[0] for c in RUN_CASES])
def test_run_rejects_corrupted_schedule_before_starting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        schedule_doc: dict[str, Any], mutate: Mutation | Text, where: str, reason: str
) -> None:
    import pipeopt.executor.launch as launch

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was about to be started for a corrupted schedule")

    monkeypatch.setattr(launch, "run_pipeline", no_launch)
    src = tmp_path / "s.json"
    src.write_text(_render(schedule_doc, mutate), encoding="utf-8")
    rc, _, err = _run(["run", str(src), "--model", "mlp"], capsys)
    _assert_one_error(rc, err, where, reason)


RUN_FLAG_CASES = [
    (["--threads", "-3"], "--threads: must be >= 1, got -3"),
    (["--timeout", "nan"], "--timeout: must be a finite number of seconds > 0"),
    (["--timeout", "inf"], "--timeout: must be a finite number of seconds > 0"),
    (["--lr", "inf"], "--lr: must be a finite number > 0"),
    (["--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["--batch-size", "0"], "--batch-size: must be a positive multiple of the schedule's 4"),
    (["--batch-size", "6"], "--batch-size: must be a positive multiple of the schedule's 4"),
    (["--model-arg", "widht=8"], "mlp takes no argument 'widht'; did you mean 'width'?"),
    (["--model-arg", "width=-4"], "model: mlp(width=-4, layers=4) failed: RuntimeError"),
    (["--model", "os:system"], "model: os:system() failed: TypeError"),
    (["--costs-out", "."], "--costs-out: . is a directory"),
]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize(("flags", "phrase"), RUN_FLAG_CASES,
                         ids=[" ".join(c[0]) for c in RUN_FLAG_CASES])
def test_run_flags_checked_before_any_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        schedule_doc: dict[str, Any], flags: list[str], phrase: str) -> None:
    import pipeopt.executor.procs as procs

    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("processes were about to be started despite a bad flag")

    monkeypatch.setattr(procs, "spawn", no_spawn)  # every replay starts its ranks through it
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "s.json"
    src.write_text(json.dumps(schedule_doc), encoding="utf-8")
    rc, _, err = _run(["run", str(src), "--model", "mlp", *flags], capsys)
    _assert_one_error(rc, err, phrase)


def test_export_to_a_bad_path(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              schedule_doc: dict[str, Any]) -> None:
    src = tmp_path / "s.json"
    src.write_text(json.dumps(schedule_doc), encoding="utf-8")
    rc, _, err = _run(["export", str(src), "-o", str(tmp_path)], capsys)
    _assert_one_error(rc, err, "--output: cannot write", "it is a directory")
    rc, _, err = _run(["export", str(src), "-o", str(src / "x.csv")], capsys)
    _assert_one_error(rc, err, "--output: cannot write", "s.json is a file, not a directory")


def test_config_written_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .json config (JSON is YAML) is a config; a .json schedule is a problem to re-solve."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(EXPLICIT), encoding="utf-8")
    out = tmp_path / "s.json"
    rc, _, err = _run(["solve", str(cfg), "-q", "-o", str(out)], capsys)
    assert rc == 0 and out.exists(), err
    rc, text, err = _run(["solve", str(out), "-q", "--method", "1f1b"], capsys)
    assert rc == 0 and "1f1b" in text, err
    bad = dict(EXPLICIT, pipeline={"devices": 0, "microbatches": 8})
    cfg.write_text(json.dumps(bad), encoding="utf-8")
    rc, _, err = _run(["solve", str(cfg)], capsys)
    _assert_one_error(rc, err, "pipeline.devices", ">= 1")


@pytest.mark.parametrize("command", [
    ["solve", "{cfg}", "-o", "{cfg}"],
    ["compare", "{cfg}", "--plot", "{cfg}"],
    ["plot", "{sched}", "-o", "{sched}"],
    ["trace", "{sched}", "-o", "{sched}"],
    ["export", "{sched}", "-o", "{sched}"],
    pytest.param(["run", "{sched}", "--costs-out", "{sched}"], marks=needs_torch),
    ["solve", "{cfg}", "-o", "{link}"],  # another name for the same file
], ids=["solve", "compare", "plot", "trace", "export", "run", "solve-link"])
def test_output_never_replaces_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         schedule_doc: dict[str, Any],
                                         command: list[str]) -> None:
    cfg, sched, link = tmp_path / "c.yaml", tmp_path / "s.json", tmp_path / "link.yaml"
    cfg.write_text(yaml.safe_dump(EXPLICIT), encoding="utf-8")
    sched.write_text(json.dumps(schedule_doc), encoding="utf-8")
    link.symlink_to(cfg)
    before = {p: p.read_bytes() for p in (cfg, sched)}
    args = [a.format(cfg=cfg, sched=sched, link=link) for a in command]
    rc, _, err = _run(args, capsys)
    flag = args[-2]
    _assert_one_error(rc, err, flag, "is the input file")
    assert {p: p.read_bytes() for p in (cfg, sched)} == before
