"""Executable docs: notebooks/bubble_ratios.ipynb runs top to bottom (nbclient), draws its
plots and checks its own claims, and is kept without outputs; the code blocks of docs/api.md
run as one script."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "bubble_ratios.ipynb"
#: Wall-clock limit for the whole notebook (seconds); it takes about 4 s on 2 cores.
TIME_LIMIT_S = 60


@pytest.mark.slow
def test_bubble_ratios_notebook_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook runs top to bottom within the time limit, no cell raises, every plot cell
    draws, each sweep reports the searches per point, and the cell that checks the summary's
    claims gets to its end."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (dev extra)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (dev extra)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (dev extra)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel imports pipeopt from the repository root, installed or not.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    client = nbclient.NotebookClient(nb, timeout=TIME_LIMIT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - t0
    assert elapsed < TIME_LIMIT_S

    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]
    assert all(cell.execution_count is not None for cell in code)  # every cell ran

    def tags(cell: Any) -> list[str]:
        return list(cell.metadata.get("tags", []))

    def stdout(cell: Any) -> str:
        return "".join(out.text for out in cell.outputs
                       if out.output_type == "stream" and out.name == "stdout")

    # Every cell that draws at top level is tagged "plot", and every plot cell shows an image.
    draws = re.compile(r"^(plot_sweep|display)\(", re.M)
    untagged = [cell.source[:60] for cell in code
                if draws.search(cell.source) and "plot" not in tags(cell)]
    assert not untagged, untagged
    plots = [cell for cell in code if "plot" in tags(cell)]
    assert len(plots) >= 5  # four sweeps and the Gantt charts
    for cell in plots:
        images = [out for out in cell.outputs if "image/png" in out.get("data", {})]
        assert images, f"plot cell drew nothing: {cell.source[:60]!r}"

    # The four sweeps name the series that coincide and report each search per point; cpsat,
    # where installed, with its status at every point.
    sweeps = [cell for cell in code if "sweep" in tags(cell)]
    assert len(sweeps) == 4
    setup = stdout(code[0])
    assert "search methods available:" in setup
    for cell in sweeps:
        text = stdout(cell)
        assert "identical curves:" in text, cell.source[:60]
        if "'cpsat'" in setup:
            assert "cpsat:\n" in text, cell.source[:60]
            points = [line for line in text.split("cpsat:\n", 1)[1].splitlines()
                      if ": makespan" in line]
            assert points, text
            assert all(re.search(r"\b(optimal|feasible)\b", line) for line in points), points

    # The summary's figures are printed, and its claims are checked by asserts in the last cell.
    out = "".join(stdout(cell) for cell in code)
    for heading in ("1. micro-batches", "2. stages", "3. memory limit", "4. WAN latency"):
        assert heading in out
    assert "all claims hold" in stdout(code[-1])


def test_bubble_ratios_notebook_is_committed_clean() -> None:
    """The notebook is kept without outputs: no outputs, no execution counts."""
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    assert code
    dirty = [i for i, cell in enumerate(code)
             if cell.get("outputs") or cell.get("execution_count") is not None]
    assert not dirty, f"code cells {dirty} keep outputs: clear them before committing"


def test_api_doc_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """The code blocks of docs/api.md run, in order, as one script in an empty folder."""
    import re

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:  # the planner's examples need no torch; the executor's do
        blocks = [b for b in blocks if "pipeopt.executor" not in b]
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(blocks), "docs/api.md", "exec"), {"__name__": "__api_doc__"})
    out = capsys.readouterr().out
    assert "deadlock:" in out
    if have_torch:
        assert "True True" in out and "ms predicted on the measured op times" in out
    for name in ("config.yaml", "zb-h1.json", "zb-h1.png", "compare.png", "zb-h1.trace.json"):
        assert (tmp_path / name).exists(), name


def test_config_doc_example_loads() -> None:
    """The complete example of docs/config.md is a valid config with the shapes it claims."""
    import re

    import yaml

    from pipeopt.config import parse_config

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert blocks
    cfg = parse_config(yaml.safe_load(blocks[0]))
    prob = cfg.problem
    assert (prob.devices, prob.microbatches, prob.stages) == (4, 8, 4)
    assert prob.forward == (1.0, 1.0, 1.0, 1.2)
    # Devices 0 and 3 talk through the slowest tier between them.
    assert prob.latency[0][3] == 0.020 and prob.bandwidth[0][3] == 1.25e9
    assert prob.memory_limit == (40.0e9,) * 4
