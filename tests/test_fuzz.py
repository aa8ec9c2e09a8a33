"""Fuzzing: mutated configs and schedule files are either accepted (and then valid) or
rejected with one clear line; nothing ever crashes.

(a) example configs with keys dropped, renamed or added and values swapped for junk (NaN,
    huge integers, strings, nested lists and mappings) go through ``pipeopt solve``: exit 0
    and a valid schedule file, or exit 2 and one ``pipeopt: error:`` line.
(b) schedule JSON with numbers changed, keys deleted, ops shuffled, types changed or the text
    cut short goes through :func:`pipeopt.io.load_schedule`: a :class:`ScheduleError`, or a
    schedule that the validator accepts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeopt.cli import main
from pipeopt.io import load_schedule, schedule_to_dict
from pipeopt.problem import uniform_problem
from pipeopt.simulate import ScheduleError, validate
from pipeopt.solvers import solve

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("uniform", "heterogeneous", "cross_dc", "gpt_small")

FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Values that replace a config value: wrong types, out of range, not finite, too large.
JUNK = st.one_of(
    st.sampled_from([None, True, False, "", "x", "1e3", "inf", "nan", "gpu", [], {},
                     [1, "a"], [[1.0, 2.0]], {"k": 1}, {"devices": {"nested": [None]}},
                     math.nan, math.inf, -math.inf, 0, -1, 0.5, 2, 7, 64, 1e308, -1e-300,
                     10**6, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-5, max_value=40),
    st.text(max_size=6),
    st.lists(st.floats(-10, 10) | st.integers(-2, 9) | st.none(), max_size=9),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a nested dict/list document (the root excluded)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


MUTATIONS = ("junk", "drop", "rename", "add", "number")


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """``base`` after one to three random mutations."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        path = paths[draw(st.integers(0, len(paths) - 1))]
        parent, key = _parent(doc, path), path[-1]
        how = draw(st.sampled_from(MUTATIONS))
        if how == "drop":
            del parent[key]
        elif how == "rename" and isinstance(parent, dict):
            new = draw(st.sampled_from([f"{key}s", str(key)[:-1], str(key).upper(), "x", 3]))
            parent[new] = parent.pop(key)
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "pipline", "solvr", "limit"]))] = _junk(draw)
        elif how == "number" and isinstance(parent[key], int | float) \
                and not isinstance(parent[key], bool):
            parent[key] = parent[key] * draw(st.sampled_from([-1, 0, 2, 1e-9, 1e9, math.nan]))
        else:
            parent[key] = _junk(draw)
    return doc


def _junk(draw: st.DrawFn) -> Any:
    """A fresh copy of a :data:`JUNK` value: ``sampled_from`` hands out the same list or dict
    object every time, and a later mutation inside it would change what later examples draw
    (hypothesis then fails with FlakyStrategyDefinition)."""
    return copy.deepcopy(draw(JUNK))


@functools.cache
def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text(encoding="utf-8"))


@st.composite
def mutated_config(draw: st.DrawFn) -> dict[str, Any]:
    return draw(mutated(_example(draw(st.sampled_from(EXAMPLES)))))


@FUZZ
@given(mutated_config(), st.sampled_from(["1f1b", "greedy"]))
def test_mutated_configs_solve_or_fail_cleanly(doc: dict[str, Any], method: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.yaml", Path(tmp) / "out.json"
        cfg.write_text(yaml.safe_dump(doc), encoding="utf-8")
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(["solve", str(cfg), "-o", str(out), "--method", method, "--quiet",
                       "--time-limit", "2"])
        message = err.getvalue()
        assert rc in (0, 2), message
        if rc == 0:
            validate(load_schedule(out))
        else:
            lines = message.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("pipeopt: error: "), message
            assert not out.exists()
        assert {p.name for p in Path(tmp).iterdir()} <= {"config.yaml", "out.json"}


# ----- (b) schedule files ------------------------------------------------------------------

@functools.cache
def _schedules() -> tuple[dict[str, Any], ...]:
    """Valid documents: split and fused backward, interleaved, messages on busy links."""
    links = uniform_problem(3, 4, 1.0, 1.0, 0.5, activation=1.0)
    links = links.replace(message_size=(5.0, 5.0),
                          bandwidth=tuple(tuple(10.0 for _ in range(3)) for _ in range(3)))
    return tuple(schedule_to_dict(s) for s in (
        solve(uniform_problem(4, 6, memory_limit=4.0), "greedy", time_limit=1),
        solve(uniform_problem(3, 4, split_backward=False), "1f1b"),
        solve(uniform_problem(2, 4, virtual_stages=2), "interleaved-1f1b"),
        solve(links, "greedy", time_limit=1),
    ))


@st.composite
def mutated_schedule_text(draw: st.DrawFn) -> str:
    doc = _schedules()[draw(st.integers(0, len(_schedules()) - 1))]
    how = draw(st.sampled_from(["mutate", "mutate", "shuffle", "truncate", "swap_times"]))
    if how == "shuffle":
        doc = copy.deepcopy(doc)
        ops = doc["ops"]
        order = draw(st.permutations(range(len(ops))))
        doc["ops"] = [ops[i] for i in order]
    elif how == "swap_times":
        doc = copy.deepcopy(doc)
        a, b = draw(st.integers(0, len(doc["ops"]) - 1)), draw(st.integers(0, len(doc["ops"]) - 1))
        oa, ob = doc["ops"][a], doc["ops"][b]
        oa["start"], ob["start"] = ob["start"], oa["start"]
        oa["end"], ob["end"] = ob["end"], oa["end"]
    elif how == "mutate":
        doc = draw(mutated(doc))
    text = json.dumps(doc)
    if how == "truncate":
        text = text[:draw(st.integers(0, len(text) - 1))]
    return text


@FUZZ
@given(mutated_schedule_text())
def test_mutated_schedules_are_rejected_or_valid(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.json"
        path.write_text(text, encoding="utf-8")
        try:
            sched = load_schedule(path)
        except ScheduleError as exc:
            assert str(exc) and "\n" not in str(exc)
            return
    validate(sched)  # accepted: then it must be a valid schedule of its own problem


def test_unmutated_schedules_load() -> None:
    """The control: every base document is accepted as it is."""
    for doc in _schedules():
        assert validate(schedule_from_text(json.dumps(doc)))


def schedule_from_text(text: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.json"
        path.write_text(text, encoding="utf-8")
        return load_schedule(path)
