"""pipeopt: schedule search and optimization for pipeline-parallel training.

The flow: config -> Problem -> solver -> Schedule (timed by the simulator, checked by the
validator) -> JSON. The planner's API is re-exported here, imported on first use, so that the
command line starts (and answers Ctrl-C) before pydantic, numpy and the solvers are loaded.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from pipeopt._version import __version__ as __version__  # read by --version too

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "Config": "pipeopt.config", "ConfigError": "pipeopt.config",
    "load_config": "pipeopt.config", "parse_config": "pipeopt.config",
    "dump_schedule": "pipeopt.io", "load_schedule": "pipeopt.io",
    "Op": "pipeopt.problem", "Problem": "pipeopt.problem", "ProblemError": "pipeopt.problem",
    "uniform_problem": "pipeopt.problem",
    "Schedule": "pipeopt.schedule", "SolverInfo": "pipeopt.schedule",
    "TimedOp": "pipeopt.schedule",
    "NotApplicable": "pipeopt.schedules",
    "DeadlockError": "pipeopt.simulate", "ScheduleError": "pipeopt.simulate",
    "check": "pipeopt.simulate", "simulate": "pipeopt.simulate", "validate": "pipeopt.simulate",
    "SolveOptions": "pipeopt.solvers", "compare": "pipeopt.solvers",
    "lower_bound": "pipeopt.solvers", "methods": "pipeopt.solvers", "solve": "pipeopt.solvers",
}

__all__ = [
    "Config", "ConfigError", "DeadlockError", "NotApplicable", "Op", "Problem", "ProblemError",
    "Schedule", "ScheduleError", "SolveOptions", "SolverInfo", "TimedOp", "check", "compare",
    "dump_schedule", "load_config", "load_schedule", "lower_bound", "methods", "parse_config",
    "simulate", "solve", "uniform_problem", "validate",
]


class _Package(types.ModuleType):
    """``simulate`` names both a submodule and its function. Importing the submodule binds the
    module as this package's attribute; this keeps the name for the function (the submodule
    stays in ``sys.modules``), as an eager ``from pipeopt.simulate import simulate`` would."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "simulate" and isinstance(value, types.ModuleType):
            self.__dict__.pop(name, None)  # resolved again, as the function, by __getattr__
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and editors see
    from pipeopt.config import Config, ConfigError, load_config, parse_config
    from pipeopt.io import dump_schedule, load_schedule
    from pipeopt.problem import Op, Problem, ProblemError, uniform_problem
    from pipeopt.schedule import Schedule, SolverInfo, TimedOp
    from pipeopt.schedules import NotApplicable
    from pipeopt.simulate import DeadlockError, ScheduleError, check, simulate, validate
    from pipeopt.solvers import SolveOptions, compare, lower_bound, methods, solve
