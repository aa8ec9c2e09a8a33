"""Shared test settings: hypothesis profiles sized for a 2-core CI machine, and fixtures
more than one test module uses."""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


@pytest.fixture
def no_cpsat(monkeypatch):
    """``auto`` without CP-SAT's search (fast): hand-made schedules, the greedy and the
    bounds."""
    from pipeopt.solvers import auto as auto_mod

    real = auto_mod._load

    def load(module, func):
        return None if module.endswith("cpsat") else real(module, func)

    monkeypatch.setattr(auto_mod, "_load", load)
    monkeypatch.setattr(auto_mod, "_cpsat_can_follow", lambda problem: False)
