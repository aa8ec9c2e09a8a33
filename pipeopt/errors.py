"""What user input may be, shared by every layer, with no pipeopt imports of its own.

:class:`ConfigError` is what an input (a config, a command-line flag, an output path, a
``solve`` option) gets when it cannot be used; the size limits and the rules of the solver
options say when. The modules that read input (config, costs, io, solvers, the command lines)
all use them, so they live below them all; :mod:`pipeopt.config` re-exports every name.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

#: Largest problem a config may describe: ops = kinds x devices x virtual_stages x microbatches.
#: Every op is a Python object in the solvers and the schedule (about 2 KB each all told:
#: p=64, m=8192, 1.6 M ops, took 2-3 GB to schedule and write), so beyond this a machine runs
#: out of memory before it runs out of patience.
MAX_OPS = 1_000_000
#: Most pipeline ranks (the link matrices hold devices^2 entries).
MAX_DEVICES = 1024
#: Seeds are 32-bit in CP-SAT; more solver threads than this is a typo.
MAX_SEED = 2**31 - 1
MAX_WORKERS = 256
#: Largest config pipeopt reads (bytes), from a file or standard input: room for
#: pipeopt.config.MAX_CONFIG_VALUES values with comments; the profile of a model
#: (``model.profile``) too.
MAX_CONFIG_BYTES = 32 * 2**20


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and the reason."""


def check_solver_option(name: str, value: Any) -> None:
    """Raise :class:`ConfigError` ("time_limit: must be ..., got -1") when ``value`` breaks a
    rule of the ``solver:`` key ``name``: the same rules as
    :class:`~pipeopt.schema.SolverConfig`, for values
    that do not come from a file (``pipeopt.solve(..., time_limit=...)``, command-line flags).
    Keys without a rule here (method, callbacks) pass."""
    why = solver_option_rule(name, value)
    if why is not None:
        raise ConfigError(f"{name}: {why}, got {value!r:.60}")


def solver_option_rule(name: str, value: Any) -> str | None:
    """The rule of the ``solver:`` key ``name`` that ``value`` breaks, or None."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    why = None
    if name == "time_limit" and not (real and math.isfinite(value) and value > 0):
        why = "must be a finite number of seconds > 0"
    elif name == "seed" and not (whole and 0 <= value <= MAX_SEED):
        why = f"must be an integer in 0..{MAX_SEED}"
    elif name == "workers" and value is not None and not (whole and 1 <= value <= MAX_WORKERS):
        why = f"must be an integer in 1..{MAX_WORKERS}, or None for all cores"
    elif name in ("relative_gap", "time_tolerance") and not (real and 0 <= value <= 1):
        why = "must be a number in 0..1"
    elif name == "resolution" and value is not None and not (
            real and math.isfinite(value) and value > 0):
        why = "must be a finite number of seconds > 0, or None to have it chosen"
    elif name == "known_bound" and value is not None and not (
            real and math.isfinite(value) and value >= 0):
        why = "must be a finite number of seconds >= 0 (a proven lower bound), or None"
    elif name == "objective" and value not in ("makespan", "span"):
        why = "must be 'makespan' or 'span'"
    return why
