"""Executable docs: notebooks/bubble_ratios.ipynb runs top to bottom (nbclient) and draws its
plots, and the code blocks of docs/api.md run as one script."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "bubble_ratios.ipynb"
#: Wall-clock limit for the whole notebook (seconds); it takes far less on 2 cores.
TIME_LIMIT_S = 120


@pytest.mark.slow
def test_bubble_ratios_notebook_runs(monkeypatch: pytest.MonkeyPatch) -> None:
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
    outputs = [out for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # four sweeps and one Gantt chart
    assert elapsed < TIME_LIMIT_S


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
