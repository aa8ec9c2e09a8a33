"""Lower bounds on the iteration time that hold for every schedule of a problem.

Used to report how far any schedule can be from optimal and to seed the search. Each bound
counts only work and delays that no schedule can avoid; all in seconds.
"""

from __future__ import annotations

import math

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


def round_trip(problem: Problem, stage: int) -> float:
    """Least time from the start of F(stage, j) to the start of B(stage, j): the forward through
    the later stages and the backward back down to stage + 1, with link delays."""
    s = problem.stages
    t = sum(problem.forward[k] for k in range(stage, s))
    t += sum(problem.durations["B"][k] for k in range(stage + 1, s))
    t += sum(problem.delay(k, k + 1) + problem.delay(k + 1, k) for k in range(stage, s - 1))
    return t


def round_trips(problem: Problem) -> tuple[float, ...]:
    """:func:`round_trip` of every stage, in one pass from the last stage down (O(stages),
    where calling it per stage is O(stages^2): minutes at 1024 devices)."""
    s = problem.stages
    fwd, bwd = problem.forward, problem.durations["B"]
    out = [0.0] * s
    acc = 0.0
    for k in range(s - 1, -1, -1):
        acc += fwd[k]
        if k + 1 < s:
            acc += bwd[k + 1] + problem.delay(k, k + 1) + problem.delay(k + 1, k)
        out[k] = acc
    return tuple(out)


def _single_stage(problem: Problem, device: int) -> int | None:
    stages = problem.device_stages[device]
    return stages[0] if len(stages) == 1 else None


def _free_memory(problem: Problem, device: int) -> float:
    """Memory for activations on ``device`` with the validator's slack (inf without a limit)."""
    lim = problem.memory_limit[device]
    if lim is None:
        return math.inf
    return lim * (1 + 1e-9) + 1e-12 - problem.static_memory[device]


def _max_in_flight(problem: Problem, device: int, stage: int) -> int:
    """How many F's of ``stage`` can start on ``device`` before any of them is released."""
    act = problem.activation_memory[stage]
    free = _free_memory(problem, device)
    return _whole(free, act, problem.microbatches)


def _whole(amount: float, per: float, most: int) -> int:
    """How many items of size ``per`` fit in ``amount``, capped at ``most`` (safe for tiny,
    zero and infinite values)."""
    if per <= 0:
        return most
    q = amount / per
    if not q < most:  # (an infinite quotient included)
        return most
    return max(0, math.floor(q))


def warmup_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, idle time that no schedule avoids between its first F and its first B.

    For a device holding one stage k: from the start of its first op (an F) to the start of its
    first B at least :func:`round_trip` passes, and in between it can only run F's of stage k.
    Each of those holds its activation until a B or W ends, so at most
    ``L = (limit - static) // activation`` of them fit (and at most m exist). The idle time is
    at least ``round_trip - min(L, m) * forward``. Devices with several stages get 0.
    """
    out = []
    trips = round_trips(problem)
    for d in range(problem.devices):
        k = _single_stage(problem, d)
        if k is None:
            out.append(0.0)
            continue
        n = _max_in_flight(problem, d, k)
        out.append(max(0.0, trips[k] - n * problem.forward[k]))
    return tuple(out)


def cooldown_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, idle time that no schedule avoids between its last F and that micro-batch's B.

    For a device holding one stage k: after its last F starts, at least :func:`round_trip`
    passes before that micro-batch's B starts. In between the device runs only that F and the
    B / W of micro-batches still holding memory when the F started: x of them hold a whole
    activation (B and W still to run), y only the weight-gradient part (W to run), with
    ``(1 + x) * activation + y * weight_grad <= limit - static`` and ``x + y <= m - 1``. The
    idle time is at least ``round_trip - forward - max(x * (B + W) + y * W)``.
    """
    out = []
    m = problem.microbatches
    trips = round_trips(problem)
    # Devices with the same memory and op times have the same answer: search once per kind
    # (the loop below is O(m) per device).
    work_in_window: dict[tuple[float, float, float, float, float], float] = {}
    for d in range(problem.devices):
        k = _single_stage(problem, d)
        if k is None:
            out.append(0.0)
            continue
        free = _free_memory(problem, d)
        act = problem.activation_memory[k]
        if problem.split_backward:
            wgm, bw, w = problem.weight_grad_memory[k], problem.durations["B"][k] + \
                problem.backward_weight[k], problem.backward_weight[k]
        else:
            wgm, bw, w = 0.0, problem.durations["B"][k], 0.0  # a fused B frees everything
        key = (free, act, wgm, bw, w)
        if key not in work_in_window:
            best = 0.0
            for x in range(m):
                if (1 + x) * act > free:
                    break
                left = m - 1 - x
                y = _whole(free - (1 + x) * act, wgm, left) if w > 0 else 0
                best = max(best, x * bw + y * w)
            work_in_window[key] = best
        out.append(max(0.0, trips[k] - problem.forward[k] - work_in_window[key]))
    return tuple(out)


def pipeline_idle(problem: Problem) -> tuple[float, ...]:
    """Per device, the warm-up and cool-down idle times together: their windows do not overlap
    when more micro-batches exist than fit in memory at once (the last F then starts after the
    first B), otherwise the larger of the two."""
    out = []
    for d, (a, b) in enumerate(zip(warmup_idle(problem), cooldown_idle(problem), strict=True)):
        k = _single_stage(problem, d)
        disjoint = k is not None and _max_in_flight(problem, d, k) < problem.microbatches
        out.append(a + b if disjoint else max(a, b))
    return tuple(out)


def warmup_bound(problem: Problem) -> tuple[float, ...]:
    """Per device: :func:`device_bound` plus the :func:`pipeline_idle` it cannot avoid."""
    return tuple(b + i for b, i in zip(device_bound(problem), pipeline_idle(problem),
                                       strict=True))


def makespan_lower_bound(problem: Problem) -> float:
    """A lower bound on the makespan (and so on the iteration time) of any schedule."""
    return max(critical_path(problem), *device_bound(problem), *warmup_bound(problem))


def span_lower_bound(problem: Problem) -> float:
    """A lower bound on the largest per-device span: a device's work plus the idle time of its
    warm-up and cool-down (:func:`pipeline_idle`)."""
    idle = pipeline_idle(problem)
    return max(problem.device_work(d) + idle[d] for d in range(problem.devices))


def iteration_lower_bound(problem: Problem) -> float:
    """A lower bound on the iteration time: the makespan bound, and for each device holding one
    stage, its :func:`warmup_bound` plus that stage's gradient reduction (the device's last op
    is the stage's last W, or fused B, after which the reduction runs)."""
    out = makespan_lower_bound(problem)
    for d, bound in enumerate(warmup_bound(problem)):
        stages = problem.device_stages[d]
        if len(stages) == 1:
            out = max(out, bound + problem.grad_reduce[stages[0]])
    return out
