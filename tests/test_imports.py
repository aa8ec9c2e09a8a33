"""The package's imports form no cycle and point downstream (docs/architecture.md, layers).

Every ``import`` statement in ``pipeopt/`` counts, wherever it stands: at module level, inside a
function (the lazy imports that keep start-up fast), or under ``if TYPE_CHECKING:``. For cycles
so does a string that is exactly the dotted name of one of the package's modules (a method table
that importlib loads on first use is a lazy import by another spelling); the bare package name
is left out, as it is also the program's name. A package's ``__init__.py`` is the package
module. ``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b`` when
that is a module of the package, to ``a`` otherwise. The parent packages that Python initialises
on the way to a module are not counted: every module would depend on every package above it,
and a package that re-exports its modules would be a cycle by construction. What counts is what
a module names.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeopt"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package in ``root`` by dotted name (packages by their own name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              known: dict[str, Path]) -> list[str]:
    """The package modules that one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's own package, then one level up per extra dot
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        found.append(sub if sub in known else target)
    return found


def import_graph(root: Path, *, strings: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of the same package that it imports (anywhere in its code), and
    with ``strings`` those it names in a string."""
    known = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _imported(node, module, is_package, known)
            elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value != root.name:
                targets = [node.value]
            else:
                continue
            graph[module].update(t for t in targets if t in known and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 30 and graph["pipeopt.cli"]  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_package_that_imports_its_modules_sits_above_them() -> None:
    """A package whose ``__init__`` re-exports its modules' names is above all of them, even
    those it names only by string (``pipeopt.solvers`` looks its searches up in a table): they
    import what they share from a module beside them (``pipeopt.solvers.base``), never from the
    package, whose import is then half done."""
    graph = import_graph(PACKAGE)
    back = [f"{m} -> {pkg}" for pkg, targets in graph.items()
            if any(t.startswith(pkg + ".") for t in targets)
            for m in graph if m.startswith(pkg + ".") and pkg in graph[m]]
    assert not back, back


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / next(iter(files)).split("/")[0]


def test_a_cyclic_fake_package_is_caught(tmp_path: Path) -> None:
    """The check can fail: a cycle through a lazy import, a relative import and a submodule
    named in ``from package import submodule``."""
    root = _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/low.py": "def f():\n    from .sub import high\n    return high\n",
        "fake/sub/__init__.py": "",
        "fake/sub/high.py": "from fake import top\n",
        "fake/top.py": "import fake.low\n",
    })
    graph = import_graph(root)
    assert graph["fake.low"] == {"fake.sub.high"}
    assert graph["fake.sub.high"] == {"fake.top"}
    assert find_cycle(graph) == ["fake.low", "fake.sub.high", "fake.top", "fake.low"]


def test_a_package_and_a_module_its_table_names_are_a_cycle(tmp_path: Path) -> None:
    """pipeopt.solvers before this test: its method table named the searches by string, and
    they imported the options from the package."""
    root = _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/solvers/__init__.py": "_SEARCH = {'greedy': ('fake.solvers.greedy', 'solve')}\n"
                                    "class Options: ...\n",
        "fake/solvers/greedy.py": "from ..solvers import Options\n"
                                  "def solve(): print('fake')\n",
    })
    graph = import_graph(root)
    assert graph["fake.solvers.greedy"] == {"fake.solvers"}  # 'fake' is only a word here
    assert find_cycle(graph) == ["fake.solvers", "fake.solvers.greedy", "fake.solvers"]


def test_an_acyclic_fake_package_passes(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "fake/__init__.py": "from typing import TYPE_CHECKING\n"
                            "if TYPE_CHECKING:\n    from fake.top import g\n",
        "fake/low.py": "import os\n",
        "fake/top.py": "from . import low\ndef g():\n    from fake.low import os\n",
    })
    graph = import_graph(root)
    assert graph == {"fake": {"fake.top"}, "fake.low": set(), "fake.top": {"fake.low"}}
    assert find_cycle(graph) is None


# The layers of docs/architecture.md, bottom first (keep the two lists alike). A module may
# import modules of its own layer or of lower ones; the most specific name decides a module's
# layer (pipeopt.costs.profiler is above pipeopt.costs). Names planned there but not written yet
# are listed so that they are checked when they land; modules listed nowhere are not checked.
LAYERS: list[tuple[str, ...]] = [
    ("pipeopt._gc", "pipeopt._malloc", "pipeopt._version", "pipeopt.clock", "pipeopt.errors",
     "pipeopt.executor._torch", "pipeopt.core"),
    ("pipeopt.problem", "pipeopt.subblocks", "pipeopt.core.graph", "pipeopt.core.schedule",
     "pipeopt.costs.collectives", "pipeopt.costs.zero"),
    ("pipeopt.bounds", "pipeopt.workloads", "pipeopt.workloads.inference", "pipeopt.core.bounds",
     "pipeopt.workloads.periodic", "pipeopt.workloads.moe"),
    ("pipeopt.schedule",),
    ("pipeopt.simulate", "pipeopt.validate_fast", "pipeopt.core.simulate",
     "pipeopt.core.validate"),
    ("pipeopt.schedules", "pipeopt.schedules.periodic"),
    ("pipeopt.solvers", "pipeopt.solvers.inference", "pipeopt.core.greedy", "pipeopt.core.cpsat",
     "pipeopt.core.justify", "pipeopt.solvers.periodic", "pipeopt.solvers.periodic_cpsat",
     "pipeopt.solvers.graph", "pipeopt.solvers.moe", "pipeopt.solvers.relaxation",
     "pipeopt.solvers.kept_devices"),
    ("pipeopt.io", "pipeopt.graphio"),
    ("pipeopt.schema",),
    ("pipeopt.topology", "pipeopt.costs", "pipeopt.costs.inference", "pipeopt.partition",
     "pipeopt.partition.pipedream", "pipeopt.partition.pipeedge", "pipeopt.costs.moe"),
    ("pipeopt.config", "pipeopt.inference_config", "pipeopt.graph_config", "pipeopt.moe_config",
     "pipeopt.workload_config"),
    ("pipeopt.plan", "pipeopt.plan.spec", "pipeopt.plan.candidates", "pipeopt.plan.search",
     "pipeopt.plan.report"),
    ("pipeopt.executor", "pipeopt.executor.periodic", "pipeopt.executor.inference",
     "pipeopt.executor.collectives", "pipeopt.plan.plot", "pipeopt.plot", "pipeopt.plot_periodic",
     "pipeopt.trace", "pipeopt.trace_periodic", "pipeopt.costs.profiler",
     "pipeopt.costs.cli", "pipeopt.models", "pipeopt.cli", "pipeopt.views_cli",
     "pipeopt.__main__"),
]


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the most specific name that covers ``module``."""
    best: tuple[int, int] | None = None  # (length of the name, layer)
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def test_layer_of() -> None:
    assert layer_of("pipeopt.costs.build") == layer_of("pipeopt.costs")
    assert layer_of("pipeopt.costs.profiler") == len(LAYERS) - 1
    assert layer_of("pipeopt.solvers.base") == layer_of("pipeopt.solvers")
    assert layer_of("pipeopt.schedules.pytorch") < layer_of("pipeopt.solvers")
    assert layer_of("pipeopt.problems") is None  # a name, not a prefix of the text


def test_imports_point_down_the_layers() -> None:
    """Import statements only: a table in a lower layer may name a higher module by string (a
    plug-in), as long as that makes no cycle."""
    upward = []
    for module, targets in sorted(import_graph(PACKAGE, strings=False).items()):
        here = layer_of(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = layer_of(target)
            if there is not None and there > here:
                upward.append(f"{module} (layer {here}) -> {target} (layer {there})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layers_cover_the_package() -> None:
    """Today's modules all have a layer (the package itself is above them all: it re-exports).
    ``pipeopt.core`` imports nothing, so it is in the bottom layer, and a module of it that is
    not named here is held to that until it is placed."""
    unplaced = [m for m in import_graph(PACKAGE) if m != "pipeopt" and layer_of(m) is None]
    assert not unplaced, f"add to LAYERS and docs/architecture.md: {unplaced}"


@pytest.mark.parametrize(("old", "new", "names"), [
    ("pipeopt.config", "pipeopt.errors", ["ConfigError", "MAX_OPS", "MAX_DEVICES",
                                          "MAX_CONFIG_BYTES", "check_solver_option",
                                          "solver_option_rule"]),
    ("pipeopt.config", "pipeopt.schema", ["Config", "ConfigFile", "SolverConfig",
                                          "check_totals", "memory_values",
                                          "microbatch_scales", "pydantic_message"]),
    ("pipeopt.io", "pipeopt.schedule", ["FORMAT", "schedule_to_dict"]),
    ("pipeopt", "pipeopt._version", ["__version__"]),
    ("pipeopt.schedules", "pipeopt.schedules.base", ["fused_variant", "NotApplicable"]),
    ("pipeopt.solvers", "pipeopt.solvers.base", ["Progress", "SolveOptions", "OutOfTime",
                                                 "fits_memory", "memory_floor",
                                                 "require_memory", "run_classic",
                                                 "longest_first", "fifo_orders", "relabel"]),
    ("pipeopt.solvers", "pipeopt.bounds", ["lower_bound"]),
    ("pipeopt.executor.torch_schedules", "pipeopt.schedules.pytorch",
     ["TORCH_SCHEDULES", "solve_torch", "torch_names"]),
    ("pipeopt.costs.profiler", "pipeopt.costs.profile", ["FORMAT", "ProfileError",
                                                         "load_profile", "write_profile"]),
])
def test_moved_names_are_still_importable_from_where_they_were(old: str, new: str,
                                                               names: list[str]) -> None:
    before, after = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(before, name) is getattr(after, name), name
