"""Lower bounds on the iteration time that hold for every schedule of a problem.

Used to report how far any schedule can be from optimal and to seed the search. Each bound
counts only work and delays that no schedule can avoid; all in seconds.
"""

from __future__ import annotations

from pipeopt.problem import Problem


def earliest_arrival(problem: Problem) -> tuple[float, ...]:
    """Per stage, the earliest time its first F can start: the forward chain before it, with
    link delays."""
    out = [0.0]
    for k in range(1, problem.stages):
        out.append(out[-1] + problem.forward[k - 1] + problem.delay(k - 1, k))
    return tuple(out)


def critical_path(problem: Problem) -> float:
    """One micro-batch all the way forward and back, then stage 0's weight gradient."""
    s = problem.stages
    t = earliest_arrival(problem)[-1] + problem.forward[s - 1]
    for k in range(s - 1, -1, -1):
        t += problem.durations["B"][k]
        if k > 0:
            t += problem.delay(k, k - 1)
    if problem.split_backward:
        t += problem.backward_weight[0]
    return t


def device_bound(problem: Problem) -> tuple[float, ...]:
    """Per device: the earliest arrival of its first micro-batch plus all of its work."""
    arr = earliest_arrival(problem)
    return tuple(min(arr[k] for k in problem.device_stages[d]) + problem.device_work(d)
                 for d in range(problem.devices))


def makespan_lower_bound(problem: Problem) -> float:
    """A lower bound on the makespan (and so on the iteration time) of any schedule."""
    return max(critical_path(problem), *device_bound(problem))


def span_lower_bound(problem: Problem) -> float:
    """A lower bound on the largest per-device span: the busiest device's work."""
    return max(problem.device_work(d) for d in range(problem.devices))
