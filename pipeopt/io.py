"""Schedule JSON (SPEC section 2): atomic writing, and loading with full validation.

The document itself is built by :func:`pipeopt.schedule.schedule_to_dict` (below the simulator,
so that ``Schedule.to_dict`` needs nothing above it); it is re-exported here with
:data:`~pipeopt.schedule.FORMAT`.
"""

from __future__ import annotations

import difflib
import errno
import json
import math
import operator
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from pipeopt.errors import MAX_DEVICES, MAX_OPS, ConfigError
from pipeopt.problem import Problem, ProblemError
from pipeopt.schedule import (
    FORMAT,
    Message,
    Schedule,
    SolverInfo,
    TimedOp,
    schedule_header,
    schedule_to_dict,
)
from pipeopt.simulate import ScheduleError, check

_STATUSES = ("optimal", "feasible", "heuristic")
#: The format of task-graph schedules (read by :mod:`pipeopt.graphio`), named in messages.
_FORMAT_V2 = "pipeopt.schedule/v2"


def write_atomic(path: str | os.PathLike[str],
                 data: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename, so readers see the old
    file or the new one, never half of one; the old file survives any failure.

    ``data`` is text (written as UTF-8), bytes, or a function that writes to a binary file.
    The new file keeps the permission bits of the file it replaces, or gets the ones a plain
    ``open()`` would give (0666 less the umask); a symlink is followed, so its target is what
    gets replaced. A target that is not a regular file (a device such as /dev/null, a FIFO)
    is written into directly, never replaced.
    """
    target = Path(path)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    try:
        st: os.stat_result | None = target.stat()
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "it is a directory", str(target))
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A device, FIFO or socket (/dev/null, /dev/stdout, a pipe): write into it. Renaming
        # a file over it would replace the device itself.
        with open(target, "wb") as fh:
            _emit(fh, data)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = st.st_mode & 0o7777 if st is not None else 0o666 & ~_umask()
    # A short temporary name: ".<name>.<random>.tmp" must stay within the file system's
    # 255-byte limit even when the name itself is close to it.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:80]}.", suffix=".tmp",
                               dir=target.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes it 0600: private to the user
        with os.fdopen(fd, "wb") as fh:
            _emit(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _emit(fh: BinaryIO, data: str | bytes | Callable[[BinaryIO], object]) -> None:
    if isinstance(data, str):
        fh.write(data.encode("utf-8"))
    elif isinstance(data, bytes):
        fh.write(data)
    else:
        data(fh)


def write_output(flag: str, path: str | os.PathLike[str],
                 write: Callable[[str], object]) -> None:
    """Run ``write(path)`` (an atomic writer); a file-system error becomes one
    :class:`~pipeopt.errors.ConfigError` line naming ``flag``, and the previous file survives.
    """
    try:
        write(str(path))
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write {path} ({_why_unwritable(path, exc)})") \
            from None


def check_writable(flag: str, path: str | os.PathLike[str]) -> None:
    """Refuse, before any work, an output path that cannot be written: a directory, a folder
    on the way that is a file, or a folder where no file can be created (the atomic write
    needs a temporary file beside the target: a read-only or special file system such as
    /proc refuses it). Devices and pipes, written into directly, are not probed."""
    target = Path(path)
    try:
        if target.is_dir():
            raise ConfigError(f"{flag}: {path} is a directory; give a file name")
        if target.exists() and not target.is_file():
            return  # a device or a FIFO: write_atomic writes into it
        for parent in target.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"{flag}: cannot write {path} ({parent} is a file, not "
                                      "a directory)")
                if not target.exists() and not os.access(parent, os.W_OK | os.X_OK):
                    raise ConfigError(f"{flag}: cannot write {path} (no permission to create "
                                      f"files in {parent})")
                why = _cannot_create_in(parent)
                if why is not None:
                    raise ConfigError(f"{flag}: cannot write {path} ({why})")
                break
        if target.exists() and target.is_file() and not os.access(target, os.W_OK):
            raise ConfigError(f"{flag}: cannot write {path} (no permission)")
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise ConfigError(f"{flag}: cannot write {path} ({exc.strerror or exc})") from None


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` (an existing directory), found by creating and
    removing an empty temporary one; None when it can."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pipeopt-probe.", suffix=".tmp", dir=folder)
    except OSError as exc:
        return _creation_refused(folder, exc)
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)
    return None


def _creation_refused(folder: Path, exc: OSError) -> str:
    """The reason, in words, that creating a file in the existing ``folder`` failed."""
    if exc.errno == errno.EROFS:
        return f"{folder} is on a read-only file system"
    if exc.errno in (errno.ENOENT, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL):
        # The folder exists, yet a new name in it "does not exist": a special file system
        # (/proc, /sys) whose files the kernel makes; pipeopt writes through a new file.
        return (f"{folder} takes no new files: a special file system such as /proc or /sys, "
                "not storage; write to a file on a disk")
    if exc.errno == errno.EACCES:
        return f"no permission to create files in {folder}"
    return str(exc.strerror or exc)


def _why_unwritable(path: str | os.PathLike[str], exc: OSError) -> str:
    try:
        for parent in Path(path).parents:
            if parent.exists():
                if not parent.is_dir():
                    return f"{parent} is a file, not a directory"
                if exc.errno in (errno.EROFS, errno.ENOENT, errno.EPERM) and (
                        not Path(path).exists() or Path(path).is_file()):
                    return _cannot_create_in(parent) or str(exc.strerror or exc)
                break
        if Path(path).is_dir():
            return "it is a directory"
    except OSError:
        pass
    return str(exc.strerror or exc)


def _umask() -> int:
    """The process umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def refuse_overwriting_input(flag: str, output: str | os.PathLike[str] | None,
                             *inputs: str | os.PathLike[str]) -> None:
    """Raise :class:`~pipeopt.errors.ConfigError` naming ``flag`` when ``output`` is the same
    file as one of ``inputs``: writing it would replace what the user had."""
    if output is None:
        return
    out = Path(output)
    for inp in inputs:
        src = Path(inp)
        try:
            same = out.resolve() == src.resolve() or (out.exists() and src.exists()
                                                      and os.path.samefile(out, src))
        except OSError:
            same = False
        if same:
            raise ConfigError(f"{flag}: {output} is the input file {inp}; writing there would "
                              "replace it, choose another file")


def dump_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as SPEC v1 JSON to ``path`` atomically (see :func:`schedule_json`)."""
    write_atomic(path, schedule_json(schedule))


class _Lines(list[str]):
    """A list already written as JSON, one element per string, for :func:`_layout`."""


def schedule_json(schedule: Schedule) -> str:
    """The text :func:`format_json` gives for :func:`schedule_to_dict`, with the ops and
    messages written straight from their tuples: no dict and no encoder call per record
    (a million-op schedule writes in seconds, not half a minute)."""
    try:
        records = _record_lines(schedule)
    except TypeError:  # a time that is not a Python float (an int, a numpy scalar)
        return format_json(schedule_to_dict(schedule))
    return format_json({**schedule_header(schedule), **records})


def _record_lines(schedule: Schedule) -> dict[str, _Lines]:
    """The ``ops`` and ``messages`` of the document, each record as its JSON text."""
    r = float.__repr__  # what json.dumps writes for a float; TypeError for anything else
    kinds = {kind: json.dumps(kind) for kind in ("F", "B", "W", *schedule.problem.kinds)}
    ops = _Lines(
        f'{{"device": {d}, "stage": {k}, "microbatch": {j}, "kind": '
        f'{kinds.get(kind) or json.dumps(kind)}, "start": {r(t0)}, "end": {r(t1)}}}'
        for d, k, j, kind, t0, t1 in sorted(schedule.ops, key=_BY_DEVICE_AND_TIME))
    msgs = _Lines(
        f'{{"src_device": {sd}, "dst_device": {dd}, "src_stage": {sk}, "dst_stage": {dk}, '
        f'"microbatch": {j}, "kind": {kinds.get(kind) or json.dumps(kind)}, "start": {r(t0)}, '
        f'"end": {r(t1)}, "arrival": {r(ta)}}}'
        for sd, dd, sk, dk, j, kind, t0, t1, ta in sorted(schedule.messages,
                                                          key=lambda m: m.start))
    return {"ops": ops, "messages": msgs}


#: :func:`~pipeopt.schedule.by_device_and_time` as a C-level key (the same tuples, about half
#: the time of a Python key function on a million ops).
_BY_DEVICE_AND_TIME = operator.itemgetter(0, 4, 5)


def format_json(doc: Any, *, open_levels: int = 2) -> str:
    """``doc`` as JSON laid out for people and diffs: the keys of the first ``open_levels``
    levels of objects one per line (2: the top level and its sections), then each element of
    a list of records (ops, messages, matrix rows) on its own line, compact. The same values
    as ``json.dumps(doc)``; built with the C encoder, so a 200,000-op schedule writes in a
    fraction of the time ``indent=`` takes."""
    return _layout(doc, 0, open_levels) + "\n"


def _layout(value: Any, depth: int, open_levels: int = 2) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict) and value and depth < open_levels:
        items = ",\n".join(f"{inner}{json.dumps(str(k))}: {_layout(v, depth + 1, open_levels)}"
                           for k, v in value.items())
        return "{\n" + items + "\n" + pad + "}"
    if isinstance(value, _Lines):
        return "[\n" + inner + (",\n" + inner).join(value) + "\n" + pad + "]" if value else "[]"
    if (isinstance(value, list) and value and depth < 3
            and all(isinstance(x, dict | list) for x in value)):
        items = ",\n".join(inner + json.dumps(x, separators=(", ", ": ")) for x in value)
        return "[\n" + items + "\n" + pad + "]"
    return json.dumps(value, separators=(", ", ": "))


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    if key not in doc:
        raise ScheduleError(f"{where}{key}: missing")
    val = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(val, kinds) or (isinstance(val, bool) and bool not in kinds):
        raise ScheduleError(f"{where}{key}: expected {_type_name(kind)}, got {_shown(val)}")
    return val


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", bool: "true/false", type(None): "null"}
    if float in kinds:
        kinds = tuple(k for k in kinds if k is not int)  # an integer is a number
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _shown(val: Any) -> str:
    """A value as it reads in JSON (true, null), cut to 60 characters."""
    if val is None or isinstance(val, bool):
        return json.dumps(val)
    return f"{val!r:.60}"


class TooLarge(float):
    """An integer literal of over 300 digits, larger than any float: infinite as a number, and
    shown as what it was ("an integer of 5000 digits (too large)") instead of "inf"."""

    digits: int

    def __new__(cls, literal: str) -> TooLarge:
        obj = super().__new__(cls, -math.inf if literal.lstrip().startswith("-") else math.inf)
        obj.digits = sum(c.isdigit() for c in literal)
        return obj

    def __repr__(self) -> str:
        sign = "a negative integer" if self < 0 else "an integer"
        return f"{sign} of {self.digits} digits (too large)"

    __str__ = __repr__


def json_int(text: str) -> int | float:
    """``parse_int`` for :func:`json.loads`: an integer literal of over 300 digits, larger
    than any float, becomes :class:`TooLarge` (infinite), so the checks name it instead of
    Python failing on it (ints of over 4300 digits) or on its conversion later."""
    return int(text) if len(text) <= 300 else TooLarge(text)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _time(doc: dict[str, Any], key: str, where: str) -> float:
    val = _get(doc, key, (int, float), where)
    if not math.isfinite(val):
        raise ScheduleError(f"{where}{key}: must be a finite number, got {val}")
    return float(val)


def _index(doc: dict[str, Any], key: str, where: str, n: int) -> int:
    val = _get(doc, key, int, where)
    if not 0 <= val < n:
        raise ScheduleError(f"{where}{key}: must be in 0..{n - 1}, got {val}")
    return val


#: Fields of ``problem`` in a schedule file and the JSON shape each must have.
_PROBLEM_SHAPES: dict[str, str] = {
    "devices": "int", "microbatches": "int", "virtual_stages": "int", "stages": "int",
    "sub_blocks": "int",
    "placement": "str", "split_backward": "bool", "meta": "object",
    "forward": "numbers", "backward_input": "numbers", "backward_weight": "numbers",
    "activation_memory": "numbers", "weight_grad_memory": "numbers",
    "message_size": "numbers", "static_memory": "numbers", "grad_reduce": "numbers",
    "memory_limit": "numbers or null", "latency": "matrix", "bandwidth": "matrix",
    "stage_device": "ints", "microbatch_scale": "numbers or matrix",
    "microbatch_memory_scale": "numbers or matrix", "microbatch_message_scale": "numbers or matrix",
}
_INF_WORDS = ("inf", "-inf", ".inf", "Infinity")


def _check_problem_doc(doc: dict[str, Any]) -> None:
    """The JSON shape of every ``problem`` field (the values are checked by ``Problem``)."""
    for key, val in doc.items():
        where = f"problem.{key}"
        shape = _PROBLEM_SHAPES.get(key)
        if shape is None:
            known_fields({key: val}, list(_PROBLEM_SHAPES), "problem.")
        if shape == "int":
            ok = isinstance(val, int) and not isinstance(val, bool) and val >= 1
            if isinstance(val, TooLarge):
                raise ScheduleError(f"{where}: too large (an integer of {val.digits} digits)")
            if not ok:
                raise ScheduleError(f"{where}: expected an integer >= 1, got {val!r:.60}")
        elif shape == "str":
            if not isinstance(val, str):
                raise ScheduleError(f"{where}: expected a string, got {val!r:.60}")
        elif shape == "bool":
            if not isinstance(val, bool):
                raise ScheduleError(f"{where}: expected true/false, got {val!r:.60}")
        elif shape == "object":
            if val is not None and not isinstance(val, dict):
                raise ScheduleError(f"{where}: expected an object, got {val!r:.60}")
        elif shape == "numbers or matrix":  # one factor per micro-batch, or a table of rows
            if isinstance(val, list) and any(isinstance(x, list) for x in val):
                for i, row in enumerate(val):
                    _check_numbers(f"{where}[{i}]", row, nullable=False)
            else:
                _check_numbers(where, val, nullable=False)
        elif shape == "matrix":
            if not isinstance(val, list):
                raise ScheduleError(f"{where}: expected a list of rows, got {val!r:.60}")
            for i, row in enumerate(val):
                _check_numbers(f"{where}[{i}]", row, nullable=False)
        elif shape == "ints":
            if not isinstance(val, list) or any(
                    not isinstance(x, int) or isinstance(x, bool) for x in val):
                raise ScheduleError(f"{where}: expected a list of integers, got {val!r:.60}")
        else:
            _check_numbers(where, val, nullable=shape.endswith("null"))


def _check_numbers(where: str, val: Any, *, nullable: bool) -> None:
    if not isinstance(val, list):
        raise ScheduleError(f"{where}: expected a list of numbers, got {val!r:.60}")
    for i, x in enumerate(val):
        if not (_is_number(x) or x in _INF_WORDS or (nullable and x is None)):
            null = " or null" if nullable else ""
            raise ScheduleError(f"{where}[{i}]: expected a number{null}, got {x!r:.60}")


_PROBLEM_REQUIRED = ("devices", "microbatches", "forward", "backward_input", "backward_weight")


def _problem(doc: dict[str, Any]) -> Problem:
    _check_problem_doc(doc)
    for key in _PROBLEM_REQUIRED:
        if key not in doc:
            raise ScheduleError(f"problem.{key}: missing")
    # The size caps of configs, before anything of that size is built (a p x p matrix of a
    # 20000-device file alone would take gigabytes).
    p, v = doc["devices"], doc.get("virtual_stages", 1)
    k = doc.get("sub_blocks", 1)
    if p > MAX_DEVICES:
        raise ScheduleError(f"problem.devices: at most {MAX_DEVICES}, got {p}")
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (v, k)):
        kinds = 3 if doc.get("split_backward", True) else 2
        ops = kinds * p * v * k * doc["microbatches"]
        if ops > MAX_OPS:
            raise ScheduleError(f"problem: {ops} ops is more than pipeopt schedules "
                                f"({MAX_OPS:,})")
    try:
        prob = Problem.from_dict(doc)
    except ProblemError as exc:
        msg = str(exc)
        raise ScheduleError(msg if msg.startswith("problem") else f"problem.{msg}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ScheduleError(f"problem: {exc}") from None
    if "stages" in doc and doc["stages"] != prob.stages:
        cut = " x sub_blocks" if prob.sub_blocks > 1 else ""
        raise ScheduleError(f"problem.stages: expected {prob.stages} (devices x "
                            f"virtual_stages{cut}), got {doc['stages']}")
    return prob


#: The fields a schedule document may have at each level (SPEC section 2 and pipeopt's extras).
_TOP_KEYS = ("format", "method", "makespan", "iteration_time", "bubble_ratio", "max_span",
             "peak_memory", "solver", "problem", "ops", "messages", "microbatch_order")
_OP_KEYS = ("device", "stage", "microbatch", "kind", "start", "end")
_MESSAGE_KEYS = ("src_device", "dst_device", "src_stage", "dst_stage", "microbatch", "kind",
                 "start", "end", "arrival")
_SOLVER_KEYS = ("status", "lower_bound", "gap", "wall_time", "objective", "details",
                "objective_lower_bound", "objective_gap")


def known_fields(doc: dict[str, Any], known: Sequence[str], where: str,
                 error: type[Exception] = ScheduleError) -> None:
    """Raise ``error`` for a field of a JSON object that is not in ``known`` (a typo would
    otherwise be ignored), with a did-you-mean; ``where`` prefixes the field's name."""
    for key in doc:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise error(f"{where}{key}: unknown field; {hint}expected one of "
                        f"{', '.join(known)}")


def schedule_from_dict(doc: Any, *, check_semantics: bool = True) -> Schedule:
    """Parse and validate a SPEC v1 document: format version, schema, then the problem's rules
    (via the validator) and the recorded metrics. Raises :class:`ScheduleError` naming the first
    problem found."""
    method = document_method(doc, FORMAT, _TOP_KEYS)
    problem = _problem(_get(doc, "problem", dict))
    p, s, m = problem.devices, problem.stages, problem.microbatches
    raw_ops = _get(doc, "ops", list)
    if len(raw_ops) != problem.num_ops:
        raise ScheduleError(_count_message(problem, raw_ops))
    ops = []
    for i, o in enumerate(raw_ops):
        where = f"ops[{i}]."
        if not isinstance(o, dict):
            raise ScheduleError(f"ops[{i}]: expected an object, got {o!r:.60}")
        known_fields(o, _OP_KEYS, where)
        kind = _get(o, "kind", str, where)
        if kind not in problem.kinds:
            raise ScheduleError(f"{where}kind: must be one of {', '.join(problem.kinds)}, "
                                f"got {kind!r:.60}")
        ops.append(TimedOp(_index(o, "device", where, p), _index(o, "stage", where, s),
                           _index(o, "microbatch", where, m), kind,
                           _time(o, "start", where), _time(o, "end", where)))
    msgs = []
    raw_msgs = doc.get("messages")
    if raw_msgs is not None and not isinstance(raw_msgs, list):
        raise ScheduleError(f"messages: expected a list, got {raw_msgs!r:.60}")
    for i, mm in enumerate(raw_msgs or []):
        where = f"messages[{i}]."
        if not isinstance(mm, dict):
            raise ScheduleError(f"messages[{i}]: expected an object, got {mm!r:.60}")
        known_fields(mm, _MESSAGE_KEYS, where)
        msgs.append(Message(
            _index(mm, "src_device", where, p), _index(mm, "dst_device", where, p),
            _index(mm, "src_stage", where, s), _index(mm, "dst_stage", where, s),
            _index(mm, "microbatch", where, m), _get(mm, "kind", str, where),
            _time(mm, "start", where), _time(mm, "end", where), _time(mm, "arrival", where)))
    info = _solver_info(doc.get("solver"))
    sched = Schedule(problem=problem, method=method, ops=tuple(ops), messages=tuple(msgs),
                     solver=info)
    if check_semantics:
        refuse_violations(check(sched))
        _check_recorded(doc, sched)
    return sched


def document_method(doc: Any, fmt: str, keys: Sequence[str]) -> str:
    """The ``method`` of a schedule document, after checking that it is an object of format
    ``fmt`` with no field outside ``keys``."""
    if not isinstance(doc, dict):
        raise ScheduleError("schedule: expected a JSON object at the top level")
    if doc.get("format") != fmt:
        # A v2 file where only v1 is read (solve, run, export): a task graph has no chain
        # problem to solve or run; say so instead of a bare mismatch.
        hint = (" (a task-graph schedule: plot, trace and simulate read it; solve, run and "
                "export need a chain schedule)" if doc.get("format") == _FORMAT_V2 else "")
        raise ScheduleError(f"format: expected {fmt!r}, got {doc.get('format')!r:.60}{hint}")
    known_fields(doc, keys, "")
    return _get(doc, "method", str)


def refuse_violations(violations: Sequence[str]) -> None:
    """Raise :class:`ScheduleError` naming the first of ``violations`` (and how many more)."""
    if violations:
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ScheduleError(f"invalid schedule: {violations[0]}{more}", violations)


def _count_message(problem: Problem, raw_ops: list[Any]) -> str:
    """Why the number of ops is wrong, with the first missing op when it is cheap to find."""
    n, k = problem.num_ops, len(problem.kinds)
    msg = (f"ops: {len(raw_ops)} listed, the problem has {n} ({k} kinds x {problem.stages} "
           f"stages x {problem.microbatches} micro-batches)")
    if len(raw_ops) < n <= 4 * len(raw_ops) + 64:
        have = {(o.get("kind"), o.get("stage"), o.get("microbatch"))
                for o in raw_ops if isinstance(o, dict) and isinstance(o.get("kind"), str)
                and _is_number(o.get("stage")) and _is_number(o.get("microbatch"))}
        first = next((op for op in problem.ops() if tuple(op) not in have), None)
        if first is not None:
            msg += f"; first missing {first}"
    return msg


def _solver_info(sol: Any) -> SolverInfo:
    """The ``solver`` object (optional: a file written by another tool may leave it out)."""
    if sol is None:
        sol = {}
    if not isinstance(sol, dict):
        raise ScheduleError(f"solver: expected an object, got {sol!r:.60}")
    known_fields(sol, _SOLVER_KEYS, "solver.")
    status = solver_status(sol, ("lower_bound", "objective_lower_bound"))
    # The solver's own bound: on its objective when the file says which, else (SPEC files)
    # the makespan bound, the objective then being the makespan.
    lb = sol["objective_lower_bound"] if "objective_lower_bound" in sol else sol.get(
        "lower_bound")
    objective = sol.get("objective", "makespan")
    if objective not in ("makespan", "span"):
        raise ScheduleError(f"solver.objective: must be makespan or span, got {objective!r:.60}")
    wall = solver_wall_time(sol)
    details = sol.get("details")
    if details is not None and not isinstance(details, dict):
        raise ScheduleError(f"solver.details: expected an object, got {details!r:.60}")
    return SolverInfo(status=status, lower_bound=None if lb is None else float(lb),
                      wall_time=wall, objective=objective,
                      details=tuple((details or {}).items()))


def solver_status(sol: dict[str, Any], bounds: Sequence[str]) -> str:
    """The ``status`` of a ``solver`` object (default ``heuristic``), after checking it and
    that each field in ``bounds`` is a finite number or null (both schedule formats)."""
    status = sol.get("status", "heuristic")
    if status not in _STATUSES:
        raise ScheduleError(f"solver.status: must be one of {', '.join(_STATUSES)}, "
                            f"got {status!r:.60}")
    for key in bounds:
        val = sol.get(key)
        if val is not None and (not _is_number(val) or not math.isfinite(val)):
            raise ScheduleError(f"solver.{key}: expected a finite number or null, got "
                                f"{val!r:.60}")
    return status


def solver_wall_time(sol: dict[str, Any]) -> float:
    """``wall_time`` of a ``solver`` object: seconds >= 0, null or absent meaning 0."""
    wall = sol.get("wall_time")
    if wall is not None and (not _is_number(wall) or not math.isfinite(wall) or wall < 0):
        raise ScheduleError(f"solver.wall_time: expected a finite number >= 0 (seconds) or "
                            f"null, got {wall!r:.60}")
    return float(wall or 0.0)


def _check_recorded(doc: dict[str, Any], sched: Schedule) -> None:
    """The metrics written in the file must be those of its ops."""
    tol = 1e-6 * max(1.0, sched.makespan)  # times, in the file's units
    for key, actual, eps in (("makespan", sched.makespan, tol),
                             ("iteration_time", sched.iteration_time, tol),
                             ("max_span", sched.max_span, tol),
                             ("bubble_ratio", sched.bubble_ratio, 1e-6)):  # a fraction
        if key in doc:
            val = doc[key]
            if not _is_number(val) or not math.isfinite(val) or abs(val - actual) > eps:
                raise ScheduleError(f"{key}: the file says {val!r:.60}, its ops give {actual:g}")
    sol = doc.get("solver")
    sol = sol if isinstance(sol, dict) else {}
    split = "objective_lower_bound" in sol  # the makespan's bound and the objective's apart
    checks = [("objective_lower_bound" if split else "lower_bound", "objective_gap"
               if split else "gap", sched.solver.lower_bound, sched.objective_value,
               sched.solver.objective)]
    if split:
        checks.append(("lower_bound", "gap", sol.get("lower_bound"), sched.makespan,
                       "makespan"))
    for lb_key, gap_key, lb, value, what in checks:
        if lb is not None and lb > value + 1e-6 * max(1.0, abs(value)):
            raise ScheduleError(f"solver.{lb_key}: {lb:g} is above the schedule's own {what} "
                                f"{value:g}: not a lower bound")
        if gap_key not in sol:
            continue
        gap = sol[gap_key]
        actual = None if lb is None or value <= 0 else max(0.0, (value - lb) / value)
        if actual is None:
            if gap is not None:
                raise ScheduleError(f"solver.{gap_key}: the file says {gap!r:.60}, but without "
                                    "a lower bound there is no gap (null)")
        elif not _is_number(gap) or not math.isfinite(gap) or abs(gap - actual) > 1e-6:
            raise ScheduleError(f"solver.{gap_key}: the file says {gap!r:.60}, its lower bound "
                                f"and ops give {actual:g}")
    if "microbatch_order" in doc:
        val, actual = doc["microbatch_order"], list(sched.microbatch_order)
        m = sched.problem.microbatches
        if not isinstance(val, list) or sorted(
                x if isinstance(x, int) and not isinstance(x, bool) else -1 for x in val
        ) != list(range(m)):
            raise ScheduleError(f"microbatch_order: expected a permutation of 0..{m - 1}, got "
                                f"{val!r:.80}")
        if val != actual:
            raise ScheduleError(f"microbatch_order: the file says {val!r:.80}, its ops give "
                                f"{actual!r:.80} (micro-batches by the start of their F on "
                                "stage 0)")
    _check_status(sched)
    if "peak_memory" in doc:
        val = doc["peak_memory"]
        if (not isinstance(val, list) or len(val) != len(sched.peak_memory)
                or any(not _is_number(a) or not math.isfinite(a)
                       or abs(a - b) > 1e-6 * max(1.0, abs(b))
                       for a, b in zip(val, sched.peak_memory, strict=False))):
            raise ScheduleError(f"peak_memory: the file says {val!r:.80}, its ops give "
                                f"{list(sched.peak_memory)}")


#: Largest gap (relative) an ``optimal`` schedule may have: float rounding only. pipeopt's
#: searches say ``optimal`` only when the schedule meets its proven bound; a CP-SAT search on
#: an inexact time grid that stops one grid unit short (a gap of ~0.05 %) says ``feasible``.
OPTIMAL_GAP_TOLERANCE = 1e-6


def _check_status(sched: Schedule) -> None:
    """``optimal`` must agree with the gap of the objective the solver minimised."""
    gap = sched.gap
    if sched.solver.status == "optimal" and gap is not None and gap > OPTIMAL_GAP_TOLERANCE:
        what = ("span" if sched.solver.objective == "span" else
                "makespan" if sched.iteration_time == sched.makespan else "iteration time")
        raise ScheduleError(
            f"solver.status: optimal, but the {what} {sched.objective_value:g} is {gap:.2%} "
            f"above the lower bound {sched.solver.lower_bound:g}; a proven optimum has gap 0 "
            "(use feasible or heuristic)")


#: ``-`` in place of an input file's name: standard input.
STDIN = "-"
#: Largest schedule JSON pipeopt reads (bytes), from a file or standard input: twice what
#: the largest schedule pipeopt makes writes (measured: 998,400 ops on 1024 devices with a
#: message on every link, 226 MiB), far below what would exhaust memory while it is parsed.
MAX_SCHEDULE_BYTES = 512 * 2**20


def input_name(path: str | os.PathLike[str]) -> str:
    """How an input is named in messages: ``<stdin>`` for ``-``, else its path."""
    return "<stdin>" if str(path) == STDIN else str(path)


def read_input(path: str | os.PathLike[str], max_bytes: int, what: str) -> str:
    """The UTF-8 text of the file ``path``, or of standard input when it is ``-``.

    Refused with :class:`InputRefused` before anything is read: a file that is not a regular
    file (a device such as /dev/zero, a FIFO, a socket: they may never end) and one larger
    than ``max_bytes`` (the cap for ``what``, e.g. "a schedule JSON", named in the message).
    Standard input is read up to ``max_bytes`` and refused beyond.
    Other failures are the usual :class:`OSError` (a directory: :class:`IsADirectoryError`).
    """
    if str(path) == STDIN:
        data = sys.stdin.buffer.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise InputRefused(f"more than {size_text(max_bytes)} on standard input, the most "
                               f"pipeopt reads for {what}")
        return data.decode("utf-8")
    # O_NONBLOCK: opening a FIFO must not wait for a writer before it is refused.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise InputRefused(f"{_file_kind(st.st_mode)}, not a regular file: it may never "
                               "end; save it to a file first, or pipe it into -")
        if st.st_size > max_bytes:
            raise InputRefused(f"{size_text(st.st_size)}, more than the {size_text(max_bytes)} "
                               f"pipeopt reads for {what}")
        os.set_blocking(fd, True)
        data = fh.read(max_bytes + 1)  # a file that grows while it is read stops here
    if len(data) > max_bytes:
        raise InputRefused(f"more than {size_text(max_bytes)}, the most pipeopt reads for "
                           f"{what}")
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


class InputRefused(OSError):
    """An input file that pipeopt refuses to read; the message says why."""


def size_text(n_bytes: float) -> str:
    """Bytes in binary units, for messages: 268435456 -> "256 MiB"."""
    if n_bytes < 1024:
        return f"{n_bytes:.0f} bytes"
    exp = min(3, int(math.log(n_bytes, 1024)))
    return f"{n_bytes / 1024 ** exp:.4g} {('KiB', 'MiB', 'GiB')[exp - 1]}"


def read_schedule_doc(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a schedule file (``-``: standard input), any format; unreadable,
    oversized or malformed input raises :class:`ScheduleError` naming the file."""
    name = input_name(path)
    try:
        text = read_input(path, MAX_SCHEDULE_BYTES, "a schedule JSON")
    except OSError as exc:
        raise ScheduleError(f"{name}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{name}: not a UTF-8 text file") from None
    try:
        return json.loads(text, parse_int=json_int)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{name}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ScheduleError(f"{name}: not a schedule: JSON nested too deeply") from None


def load_schedule(path: str | os.PathLike[str], *, check_semantics: bool = True) -> Schedule:
    """Read a schedule JSON file (``-``: standard input) and validate it (see
    :func:`schedule_from_dict`)."""
    return schedule_from_dict(read_schedule_doc(path), check_semantics=check_semantics)
