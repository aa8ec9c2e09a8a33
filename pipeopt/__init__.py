"""pipeopt: schedule search and optimization for pipeline-parallel training.

The flow: config -> Problem -> solver -> Schedule (timed by the simulator, checked by the
validator) -> JSON. The planner's API is re-exported here.
"""

from pipeopt.config import Config, ConfigError, load_config, parse_config
from pipeopt.io import dump_schedule, load_schedule
from pipeopt.problem import Op, Problem, ProblemError, uniform_problem
from pipeopt.schedule import Schedule, SolverInfo, TimedOp
from pipeopt.schedules import NotApplicable
from pipeopt.simulate import DeadlockError, ScheduleError, check, simulate, validate
from pipeopt.solvers import SolveOptions, compare, lower_bound, methods, solve

__version__ = "0.1.0"

__all__ = [
    "Config", "ConfigError", "DeadlockError", "NotApplicable", "Op", "Problem", "ProblemError",
    "Schedule", "ScheduleError", "SolveOptions", "SolverInfo", "TimedOp", "check", "compare",
    "dump_schedule", "load_config", "load_schedule", "lower_bound", "methods", "parse_config",
    "simulate", "solve", "uniform_problem", "validate",
]
