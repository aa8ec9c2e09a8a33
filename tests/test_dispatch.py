"""The one entry point for a config (pipeopt.workload_config): each kind reaches its route in
`pipeopt solve` and `pipeopt compare`, the input is read once (standard input too), MoE
configs compare as every task-graph config does, and bad input names its key."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import pipeopt.cli
import pipeopt.io
from pipeopt.cli import main
from pipeopt.config import read_yaml
from pipeopt.errors import ConfigError
from pipeopt.workload_config import KINDS, read_workload, workload_kind

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: An example of each kind.
BY_KIND = {"chain": "uniform.yaml", "async": "async.yaml", "inference": "inference.yaml",
           "dataparallel": "dp_cross_dc.yaml", "moe": "moe.yaml"}

#: The command's route per kind: the cli function each kind must reach (None: the chain's
#: own code in cmd_solve / cmd_compare).
SOLVE_ROUTE = {"async": "_solve_async", "inference": "_solve_inference",
               "dataparallel": "_solve_graph", "moe": "_solve_graph", "chain": None}
COMPARE_ROUTE = {"async": "_compare_async", "dataparallel": "_compare_graph",
                 "moe": "_compare_graph", "chain": None}


def small_moe() -> dict[str, Any]:
    """examples/moe.yaml cut to 2 blocks on 2 stages and 3 micro-batches."""
    data = yaml.safe_load((EXAMPLES / "moe.yaml").read_text(encoding="utf-8"))
    data["model"]["layers"] = 2
    data["workload"].update(stages=2, microbatches=3, time_limit=1.0)
    return data


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every input pipeopt reads (pipeopt.io.read_input, the one reader of a config)."""
    seen: list[str] = []
    real = pipeopt.io.read_input

    def counting(path: Any, max_bytes: int, what: str) -> str:
        seen.append(str(path))
        return real(path, max_bytes, what)

    monkeypatch.setattr(pipeopt.io, "read_input", counting)
    return seen


def _routes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Stand-ins for every non-chain route of the CLI, recording (name, what it was given)."""
    called: list[tuple[str, Any]] = []
    for name in {*SOLVE_ROUTE.values(), *COMPARE_ROUTE.values()} - {None}:
        def record(args: Any, data: Any, _name: str = str(name)) -> int:
            called.append((_name, data))
            return 0

        monkeypatch.setattr(pipeopt.cli, str(name), record)
    return called


def test_every_example_has_a_kind_and_every_kind_an_example() -> None:
    for kind, name in BY_KIND.items():
        work = read_workload(EXAMPLES / name)
        assert work.kind == kind, name
        assert work.is_graph == (kind in ("dataparallel", "moe"))
        assert isinstance(work.data, dict) and not work.from_schedule
    assert set(BY_KIND) == set(KINDS)
    for path in sorted(EXAMPLES.glob("*.yaml")):  # every bundled example is told
        assert read_workload(path).kind in KINDS


@pytest.mark.parametrize("kind", sorted(BY_KIND))
def test_solve_reaches_the_route_of_its_kind_reading_the_file_once(
        kind: str, monkeypatch: pytest.MonkeyPatch, reads: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    called = _routes(monkeypatch)
    path = EXAMPLES / BY_KIND[kind]
    args = ["solve", str(path), "-q"] + (["--method", "1f1b"] if kind == "chain" else [])
    assert main(args) == 0
    assert reads == [str(path)]
    route = SOLVE_ROUTE[kind]
    if route is None:  # the chain solved for real by cmd_solve
        assert called == [] and "makespan" in capsys.readouterr().out
    else:
        assert [c[0] for c in called] == [route]
        if kind != "async":  # the parsed mapping, not a path to read again
            assert called[0][1] == read_yaml(path)


@pytest.mark.parametrize("kind", sorted(COMPARE_ROUTE))
def test_compare_reaches_the_route_of_its_kind_reading_the_file_once(
        kind: str, monkeypatch: pytest.MonkeyPatch, reads: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    called = _routes(monkeypatch)
    path = EXAMPLES / BY_KIND[kind]
    args = ["compare", str(path), "-q"] + (["--methods", "1f1b,gpipe"] if kind == "chain"
                                           else [])
    assert main(args) == 0
    route = COMPARE_ROUTE[kind]
    if route is None:
        assert called == [] and "1f1b" in capsys.readouterr().out
    else:
        assert [c[0] for c in called] == [route]
    assert reads == [str(path)]


@pytest.mark.parametrize("kind", ["async", "inference", "dataparallel", "moe"])
def test_standard_input_takes_the_route_of_its_kind(kind: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    reads: list[str]) -> None:
    """What `-` holds is told as a file is (it can be read only once)."""
    called = _routes(monkeypatch)
    path = EXAMPLES / BY_KIND[kind]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    assert main(["solve", "-", "-q"]) == 0
    assert reads == ["-"] and [c[0] for c in called] == [SOLVE_ROUTE[kind]]
    if kind != "async":
        assert called[0][1] == read_yaml(path)


def test_a_schedule_json_is_a_chain_and_read_once(tmp_path: Path, reads: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["solve", str(EXAMPLES / "uniform.yaml"), "--method", "1f1b", "-q",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    reads.clear()
    work = read_workload(out)
    assert (work.kind, work.from_schedule) == ("chain", True) and reads == [str(out)]
    reads.clear()
    assert main(["solve", str(out), "--method", "greedy", "-q"]) == 0
    assert reads == [str(out)]
    assert capsys.readouterr().out.startswith("method        greedy")


def test_moe_on_standard_input_is_read_once_and_solved(
        monkeypatch: pytest.MonkeyPatch, reads: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    text = yaml.safe_dump(small_moe()).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    assert main(["solve", "-", "--method", "zb-h1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert reads == ["-"]
    assert doc["method"] == "zb-h1"
    assert set(doc["baselines"]) == {"1f1b", "1f1b+overlap", "zb-h1", "zb-h1+overlap"}
    # the chosen hand-made schedule is the same schedule as its baseline row
    assert doc["baselines"]["zb-h1"]["iteration_time"] == pytest.approx(doc["iteration_time"])


def test_moe_compare_ranks_every_method(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "moe.yaml"
    cfg.write_text(yaml.safe_dump(small_moe()), encoding="utf-8")
    assert main(["compare", str(cfg), "--json", "-q", "--time-limit", "1"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["1f1b", "1f1b+overlap", "zb-h1", "zb-h1+overlap", "zb-h2",
                          "zb-h2+overlap", "gpipe", "gpipe+overlap", "search", "greedy",
                          "cpsat"]
    fits = [r for r in rows.values() if r["fits"]]
    best = min(r["iteration_time"] for r in fits)
    assert min(r["ratio"] for r in fits) == pytest.approx(1.0)
    for r in fits:
        assert r["ratio"] == pytest.approx(r["iteration_time"] / best)
    # the search tries these orders on its own graph (split backward, not overlapped): it is
    # never worse than those of them that fit
    hand = [rows[m]["iteration_time"] for m in ("zb-h1", "zb-h2", "gpipe") if rows[m]["fits"]]
    assert hand
    assert rows["search"]["iteration_time"] <= min(hand) + 1e-12
    assert main(["compare", str(cfg), "--methods", "zb-h1,search"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["method", "s/iteration"]
    assert [line.split()[0] for line in table[2:4]] == ["zb-h1", "search"]


@pytest.mark.parametrize(("data", "message"), [
    ({"workload": 5, "model": {}},
     "workload: expected a mapping with kind: inference or moe, got 5"),
    ({"workload": {"gpu": "H100"}}, "workload.kind: missing (give inference or moe)"),
    ({"workload": {"kind": "train"}}, "workload.kind: must be inference or moe, got 'train'"),
])
def test_a_bad_workload_section_names_the_key(data: dict[str, Any], message: str,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        workload_kind(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    for command in ("solve", "compare"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err == f"pipeopt: error: {message}\n"


def test_command_errors_name_the_key(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(EXAMPLES / "inference.yaml")]) == 2
    assert capsys.readouterr().err.startswith(
        "pipeopt: error: workload.kind: inference: compare ranks training schedules")
    cfg = tmp_path / "moe.yaml"
    cfg.write_text(yaml.safe_dump(small_moe()), encoding="utf-8")
    assert main(["solve", str(cfg), "--objective", "span"]) == 2
    assert "pipeopt: error: --objective: a task-graph config" in capsys.readouterr().err
    assert main(["compare", str(cfg), "--methods", "zb-h1,fast"]) == 2
    assert capsys.readouterr().err.startswith(
        "pipeopt: error: --methods: unknown method 'fast'")
    tight = small_moe()
    tight["workload"].update(memory_fraction=0.07)  # 5.2 of 5.6 GiB: no schedule fits
    cfg.write_text(yaml.safe_dump(tight), encoding="utf-8")
    assert main(["solve", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeopt: error: workload.method: search: ") and "memory" in err
    assert main(["solve", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err == f"pipeopt: error: {tmp_path / 'none.yaml'}: no such file\n"
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n", encoding="utf-8")
    assert main(["compare", str(listed)]) == 2
    assert "expected a mapping of sections" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_by_both_commands_without_waiting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # no writer: opening it must not wait for one
    for command in ("solve", "compare"):
        assert main([command, str(fifo), "-q"]) == 2
        err = capsys.readouterr().err
        assert "a pipe (FIFO), not a regular file" in err and "pipe it into -" in err


def test_collectives_scalar_is_the_chain_said_aloud(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``training.collectives: scalar`` (the default) is a chain config; a key of scheduled
    collectives beside it is named."""
    from pipeopt.graph_config import TrainingCollectives
    from pipeopt.workload_config import SCHEDULED_ONLY

    assert set(SCHEDULED_ONLY) == set(TrainingCollectives.model_fields) - {"collectives"}
    data = read_yaml(EXAMPLES / "dp_cross_dc.yaml")
    chain = {k: v for k, v in data["training"].items()
             if k not in (*SCHEDULED_ONLY, "collectives")}
    path = tmp_path / "scalar.yaml"
    path.write_text(yaml.safe_dump({**data, "training": {**chain, "collectives": "scalar"}}),
                    encoding="utf-8")
    assert read_workload(path).kind == "chain"
    assert main(["solve", str(path), "--method", "1f1b", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({**data, "training": chain}), encoding="utf-8")
    assert main(["solve", str(plain), "--method", "1f1b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == said["makespan"]
    path.write_text(yaml.safe_dump({**data, "training": {**chain, "collectives": "scalar",
                                                         "iterations": 2}}), encoding="utf-8")
    assert main(["solve", str(path)]) == 2
    assert capsys.readouterr().err == ("pipeopt: error: training.iterations: used only with "
                                       "training.collectives: scheduled (here scalar)\n")
