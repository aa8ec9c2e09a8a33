"""Integer grids for the CP-SAT model: the one place where float seconds and bytes become ints.

CP-SAT works on integers only. A :class:`Grid` maps a float to a whole number of units. When every
value of a kind sits on a common grid (e.g. all times are multiples of 0.5 s, or all memory sizes
are whole bytes) the mapping is exact and the model is the problem itself. Otherwise times are
rounded *down* (the model is a relaxation, so its bound is a proven bound on the real problem and
its orders are re-timed by the simulator) and memory demands are rounded *up* against a capacity
rounded down (the model is a restriction, so its orders keep the real limits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

#: Largest denominator tried when looking for an exact grid (covers decimals to 6 places).
_MAX_DENOMINATOR = 10**6
#: Target units for the largest time value when the data sits on no exact grid (0.1 %).
APPROX_TIME_UNITS = 1000
#: Largest time value in units accepted for an exact grid (beyond, the model gets slow).
MAX_EXACT_TIME_UNITS = 10_000
#: Memory capacities in units: exact grids up to 2**40, else capacities map to ~1e6 units.
MAX_EXACT_MEMORY_UNITS = 2**40
APPROX_MEMORY_UNITS = 10**6


@dataclass(frozen=True)
class Grid:
    """``unit`` (seconds or bytes per integer step); ``exact`` when every value of the data is a
    whole number of units."""

    unit: float
    exact: bool

    def down(self, x: float) -> int:
        """Units of ``x`` rounded down (exactly the value on an exact grid)."""
        u = x / self.unit
        n = round(u)
        if self.exact and abs(u - n) <= 1e-7 * max(1.0, abs(u)):
            return int(n)  # on the grid, up to float noise
        return math.floor(u)

    def up(self, x: float) -> int:
        """Units of ``x`` rounded up (exactly the value on an exact grid)."""
        u = x / self.unit
        n = round(u)
        if self.exact and abs(u - n) <= 1e-7 * max(1.0, abs(u)):
            return int(n)
        return math.ceil(u)

    def seconds(self, n: int) -> float:
        """The float value of ``n`` units."""
        return n * self.unit


def _exact_unit(values: list[float]) -> Fraction | None:
    """The largest unit of which every value is a whole multiple, if the values are short
    decimals / simple fractions; None otherwise."""
    fracs = []
    for x in values:
        fr = Fraction(x).limit_denominator(_MAX_DENOMINATOR)
        if abs(float(fr) - x) > 1e-12 * max(1.0, abs(x)):
            return None
        fracs.append(fr)
    num = 0
    den = 1
    for fr in fracs:
        den = den * fr.denominator // math.gcd(den, fr.denominator)
    for fr in fracs:
        num = math.gcd(num, fr.numerator * (den // fr.denominator))
    return Fraction(num, den) if num else None


def _on_grid(values: Iterable[float], unit: float) -> bool:
    for x in values:
        u = x / unit
        if abs(u - round(u)) > 1e-7 * max(1.0, abs(u)):
            return False
    return True


def time_grid(values: Iterable[float], resolution: float | None = None) -> Grid:
    """The time grid of the model (seconds per unit) for the given durations and delays.

    With ``resolution`` it is used as the unit (exact when every value is a multiple of it).
    Otherwise the coarsest exact grid when the largest value maps to at most
    :data:`MAX_EXACT_TIME_UNITS` units, else ``max / APPROX_TIME_UNITS`` seconds per unit.
    """
    vals = [float(x) for x in values if x > 0]
    if resolution is not None:
        if not (resolution > 0 and math.isfinite(resolution)):
            raise ValueError(f"resolution: must be a positive number of seconds, got {resolution}")
        return Grid(float(resolution), _on_grid(vals, resolution))
    if not vals:
        return Grid(1.0, True)
    top = max(vals)
    unit = _exact_unit(vals)
    if unit is not None and top / float(unit) <= MAX_EXACT_TIME_UNITS + 0.5:
        return Grid(float(unit), _on_grid(vals, float(unit)))
    return Grid(top / APPROX_TIME_UNITS, False)


def memory_grid(values: Iterable[float], capacity: float) -> Grid:
    """The memory grid of one device (bytes per unit) for its demands and free capacity."""
    vals = [float(x) for x in values if x > 0]
    if capacity > 0:
        vals.append(capacity)
    if not vals:
        return Grid(1.0, True)
    top = max(vals)
    unit = _exact_unit(vals)
    if unit is not None and top / float(unit) <= MAX_EXACT_MEMORY_UNITS:
        return Grid(float(unit), _on_grid(vals, float(unit)))
    return Grid(top / APPROX_MEMORY_UNITS, False)
