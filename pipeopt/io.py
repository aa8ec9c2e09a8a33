"""Schedule JSON (SPEC section 2): atomic writing, and loading with full validation."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from pipeopt.problem import Problem, ProblemError
from pipeopt.schedule import Message, Schedule, SolverInfo, TimedOp
from pipeopt.simulate import ScheduleError, check

FORMAT = "pipeopt.schedule/v1"
_STATUSES = ("optimal", "feasible", "heuristic")


def _num(x: float | None) -> float | str | None:
    """JSON has no infinity: write it as the string "inf"."""
    if x is None:
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The SPEC v1 document for ``schedule`` (metrics computed from its times)."""
    s = schedule
    return {
        "format": FORMAT,
        "method": s.method,
        "makespan": s.makespan,
        "iteration_time": s.iteration_time,
        "bubble_ratio": s.bubble_ratio,
        "max_span": s.max_span,
        "peak_memory": list(s.peak_memory),
        "solver": {
            "status": s.solver.status,
            "lower_bound": _num(s.solver.lower_bound),
            "gap": s.gap,
            "wall_time": s.solver.wall_time,
            "objective": s.solver.objective,
            "details": dict(s.solver.details),
        },
        "problem": s.problem.to_dict(),
        "ops": [
            {"device": o.device, "stage": o.stage, "microbatch": o.microbatch, "kind": o.kind,
             "start": o.start, "end": o.end}
            for o in sorted(s.ops, key=lambda o: (o.device, o.start, o.end))
        ],
        "messages": [m._asdict() for m in sorted(s.messages, key=lambda m: m.start)],
    }


def write_atomic(path: str | os.PathLike[str],
                 data: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename, so readers see the old
    file or the new one, never half of one; the old file survives any failure.

    ``data`` is text (written as UTF-8), bytes, or a function that writes to a binary file.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(data, str):
                fh.write(data.encode("utf-8"))
            elif isinstance(data, bytes):
                fh.write(data)
            else:
                data(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def dump_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as SPEC v1 JSON to ``path`` atomically."""
    write_atomic(path, json.dumps(schedule_to_dict(schedule), indent=1) + "\n")


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    if key not in doc:
        raise ScheduleError(f"{where}{key}: missing")
    val = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(val, kinds) or (isinstance(val, bool) and bool not in kinds):
        raise ScheduleError(f"{where}{key}: expected {_type_name(kind)}, got {val!r:.60}")
    return val


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", bool: "true/false", type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _time(doc: dict[str, Any], key: str, where: str) -> float:
    val = _get(doc, key, (int, float), where)
    if not math.isfinite(val):
        raise ScheduleError(f"{where}{key}: must be a finite number, got {val}")
    return float(val)


def schedule_from_dict(doc: Any, *, check_semantics: bool = True) -> Schedule:
    """Parse and validate a SPEC v1 document: format version, schema, then the problem's rules
    (via the validator) and the recorded metrics. Raises :class:`ScheduleError` naming the first
    problem found."""
    if not isinstance(doc, dict):
        raise ScheduleError("schedule: expected a JSON object at the top level")
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise ScheduleError(f"format: expected {FORMAT!r}, got {fmt!r}")
    method = _get(doc, "method", str)
    prob_doc = _get(doc, "problem", dict)
    try:
        problem = Problem.from_dict(prob_doc)
    except ProblemError as exc:
        raise ScheduleError(f"problem.{exc}") from None
    except (TypeError, ValueError) as exc:
        raise ScheduleError(f"problem: {exc}") from None
    ops = []
    for i, o in enumerate(_get(doc, "ops", list)):
        where = f"ops[{i}]."
        if not isinstance(o, dict):
            raise ScheduleError(f"ops[{i}]: expected an object")
        kind = _get(o, "kind", str, where)
        if kind not in problem.kinds:
            raise ScheduleError(f"{where}kind: must be one of {', '.join(problem.kinds)}, "
                                f"got {kind!r}")
        ops.append(TimedOp(_get(o, "device", int, where), _get(o, "stage", int, where),
                           _get(o, "microbatch", int, where), kind,
                           _time(o, "start", where), _time(o, "end", where)))
    msgs = []
    for i, mm in enumerate(doc.get("messages") or []):
        where = f"messages[{i}]."
        if not isinstance(mm, dict):
            raise ScheduleError(f"messages[{i}]: expected an object")
        msgs.append(Message(
            _get(mm, "src_device", int, where), _get(mm, "dst_device", int, where),
            _get(mm, "src_stage", int, where), _get(mm, "dst_stage", int, where),
            _get(mm, "microbatch", int, where), _get(mm, "kind", str, where),
            _time(mm, "start", where), _time(mm, "end", where), _time(mm, "arrival", where)))
    sol = doc.get("solver") or {}
    if not isinstance(sol, dict):
        raise ScheduleError("solver: expected an object")
    status = sol.get("status", "heuristic")
    if status not in _STATUSES:
        raise ScheduleError(f"solver.status: must be one of {', '.join(_STATUSES)}, "
                            f"got {status!r}")
    lb = sol.get("lower_bound")
    if lb is not None and (not isinstance(lb, int | float) or isinstance(lb, bool)
                           or not math.isfinite(lb)):
        raise ScheduleError(f"solver.lower_bound: expected a finite number or null, got {lb!r}")
    objective = sol.get("objective", "makespan")
    if objective not in ("makespan", "span"):
        raise ScheduleError(f"solver.objective: must be makespan or span, got {objective!r}")
    details = sol.get("details") or {}
    info = SolverInfo(status=status, lower_bound=None if lb is None else float(lb),
                      wall_time=float(sol.get("wall_time") or 0.0), objective=objective,
                      details=tuple(details.items()) if isinstance(details, dict) else ())
    sched = Schedule(problem=problem, method=method, ops=tuple(ops), messages=tuple(msgs),
                     solver=info)
    if check_semantics:
        violations = check(sched)
        if violations:
            more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
            raise ScheduleError(f"invalid schedule: {violations[0]}{more}", violations)
        _check_recorded(doc, sched)
    return sched


def _check_recorded(doc: dict[str, Any], sched: Schedule) -> None:
    """The metrics written in the file must be those of its ops."""
    tol = 1e-6 * max(1.0, sched.makespan)
    for key, actual in (("makespan", sched.makespan), ("bubble_ratio", sched.bubble_ratio)):
        if key in doc:
            val = doc[key]
            if not isinstance(val, int | float) or abs(val - actual) > tol:
                raise ScheduleError(f"{key}: the file says {val!r}, its ops give {actual:g}")
    if "peak_memory" in doc:
        val = doc["peak_memory"]
        if (not isinstance(val, list) or len(val) != len(sched.peak_memory)
                or any(not isinstance(a, int | float) or abs(a - b) > 1e-6 * max(1.0, abs(b))
                       for a, b in zip(val, sched.peak_memory, strict=False))):
            raise ScheduleError(f"peak_memory: the file says {val!r:.80}, its ops give "
                                f"{list(sched.peak_memory)}")


def load_schedule(path: str | os.PathLike[str], *, check_semantics: bool = True) -> Schedule:
    """Read a schedule JSON file and validate it (see :func:`schedule_from_dict`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{path}: not a UTF-8 text file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    return schedule_from_dict(doc, check_semantics=check_semantics)
