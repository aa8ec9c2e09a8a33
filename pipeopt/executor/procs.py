"""Process plumbing of a pipelined run: spawned ranks that report their status and die
with their launcher.

:func:`spawn` runs a function on ``world`` fresh processes joined in a process group (gloo on
CPU, nccl on CUDA, a free port on 127.0.0.1) and returns what each rank returned. The parent
waits with a deadline: when a rank raises, the others are killed and :class:`ExecutorError`
names the rank and its error; when a rank's status stops changing for the per-op timeout, or
the whole run's deadline passes, every rank is killed and the error says where each rank was.
This module imports no torch, so that a rank arms its parent-death signal before it loads
torch (seconds on a busy machine) and the function it runs.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


class ExecutorError(RuntimeError):
    """A pipelined run that failed (the message names the rank and the reason)."""


@dataclass
class Fault:
    """Testing hook: make ``rank`` fail (``raise``) or stop answering (``hang``) before its
    first op of step ``step``."""

    rank: int
    mode: str = "raise"
    step: int = 0


class RankStatus:
    """What a rank is doing right now (one line), read by a reporter thread of the worker."""

    def __init__(self) -> None:
        self.text = "starting"


#: Seconds the parent keeps listening after the first failure, so that the root cause (the
#: first report) comes with the peers' follow-up errors.
_GRACE_S = 1.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Resident bytes of one spawned rank (torch, its process group and a small model): about
#: 440 MB measured per rank of ``pipeopt run`` on CPU (issue 18, item 9).
RANK_BYTES = 440 * 2**20

#: Ranks per core beyond which a run is refused: more only time-slices the cores, and every rank
#: still holds its own torch.
RANKS_PER_CORE = 4


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_rank_capacity(ranks: int, cores: int | None, memory_bytes: int | None,
                        max_ranks: int | None = None) -> None:
    """Refuse to start ``ranks`` processes on this machine beyond ``max_ranks`` when given, or
    else beyond ``RANKS_PER_CORE`` per core or ``RANK_BYTES`` each in the available memory
    (``cores``/``memory_bytes`` None: not known, not limiting). Raises ExecutorError with the
    numbers."""
    if max_ranks is not None:
        if ranks > max_ranks:
            raise ExecutorError(f"{ranks} ranks to start, more than --max-ranks {max_ranks}")
        return
    hint = ("; run it under torchrun across machines, or pass --max-ranks N to start them "
            "here anyway")
    if cores is not None and ranks > RANKS_PER_CORE * cores:
        raise ExecutorError(f"{ranks} ranks to start (one process each), more than "
                            f"{RANKS_PER_CORE} per core on this machine's {cores} cores "
                            f"({RANKS_PER_CORE * cores}){hint}")
    if memory_bytes is not None and ranks * RANK_BYTES > memory_bytes:
        raise ExecutorError(f"{ranks} ranks to start need about {ranks * RANK_BYTES / 2**30:.1f} "
                            f"GiB ({RANK_BYTES / 2**20:.0f} MiB each), more than the "
                            f"{memory_bytes / 2**30:.1f} GiB available on this machine{hint}")


RankFn = Callable[..., Any]

#: Seconds between a worker's status reports to the parent.
_STATUS_EVERY_S = 0.5


def resolve_backend(backend: str) -> str:
    """``auto`` -> nccl when CUDA is available, else gloo."""
    if backend == "auto":
        import torch  # here only: this module imports no torch when it loads

        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ExecutorError(f"backend: must be auto, gloo or nccl, got {backend!r}")
    return backend


def rank_device(backend: str, local_rank: int) -> Any:
    """The device a rank computes on (a ``torch.device``)."""
    import torch

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` ends: the parent-death signal on Linux (prctl), else
    a thread that polls the parent's pid."""
    import signal

    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):  # not Linux: poll
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(_STATUS_EVERY_S)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _spawned(rank: int, world: int, port: int, backend: str, timeout: float, threads: int,
             job: bytes, out: Any, parent: int) -> None:
    """Body of one spawned worker: arm the parent-death signal, then load torch and the job
    (``fn`` and its arguments, pickled), join the group, run ``fn``, report through ``out``."""
    die_with_parent(parent)
    status = RankStatus()
    done = threading.Event()

    def report() -> None:  # the rank's status line, to the parent, whenever it changes
        last = None
        while not done.wait(_STATUS_EVERY_S):
            if status.text != last:
                last = status.text
                out.put(("status", rank, last))

    threading.Thread(target=report, daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        from pipeopt._malloc import steady_cpu_allocator

        fn, args = pickle.loads(job)
        torch.set_num_threads(threads)
        if backend == "gloo":
            steady_cpu_allocator()  # see pipeopt._malloc: steady CPU op times
        status.text = "joining the process group"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        device = rank_device(backend, rank)
        status.text = "setting up"
        result = fn(rank, world, device, *args, status=status)
        done.set()
        out.put(("ok", rank, result))
        dist.destroy_process_group()
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        done.set()
        tb = traceback.format_exc(limit=-6)
        out.put(("error", rank, f"{type(exc).__name__}: {exc}\n{tb}"))
        out.close()
        out.join_thread()
        os._exit(1)


def spawn(fn: RankFn, world: int, args: tuple[Any, ...] = (), *, timeout: float = 300.0,
          backend: str = "auto", threads: int | None = None,
          op_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world, device, *args, status=RankStatus)`` on ``world`` new processes in
    one process group and return each rank's result; ``fn`` must be importable (module level)
    and may keep ``status.text`` up to date for error messages. Raises
    :class:`ExecutorError` within ``timeout`` seconds when a rank fails or does not finish,
    and within ``op_timeout`` (plus a second) when a rank's status stops changing during a
    training step (a rank that stops answering). The ranks end with this process
    (:func:`die_with_parent`)."""
    import multiprocessing as mp

    if backend == "auto":
        backend = resolve_backend(backend)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    job = pickle.dumps((fn, args))
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, daemon=True, name=f"pipeopt-rank{r}",
                         args=(r, world, port, backend, timeout, threads, job, out,
                               os.getpid()))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    status: dict[int, str] = {}
    changed: dict[int, float] = {}  # when each rank's status last changed within a step
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    stalled: list[int] = []
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            now = time.monotonic()
            running = [r for r in range(world) if r not in results and r not in errors]
            stalled = [r for r in running if op_timeout is not None and r in changed
                       and now - changed[r] > op_timeout + _GRACE_S]
            if stalled:
                break
            try:
                kind, rank, payload = out.get(timeout=min(0.1, deadline - now))
            except queue_mod.Empty:
                for r in running:  # died without a report (killed, segfault): after a grace
                    if not procs[r].is_alive() and now - dead_since.setdefault(r, now) > _GRACE_S:
                        errors[r] = f"exited with code {procs[r].exitcode} without a report"
                        deadline = min(deadline, now + _GRACE_S)
                continue
            if kind == "status":
                status[rank] = payload
                if payload.startswith("step "):  # set-up is under the run's timeout only
                    changed[rank] = time.monotonic()
            elif kind == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        out.close()
    where = "; ".join(f"rank {r}: {status.get(r, 'no report')}" for r in range(world)
                      if r not in results)
    if errors:
        first = next(iter(errors))
        others = "; ".join(f"rank {r}: {e.splitlines()[0]}" for r, e in errors.items()
                           if r != first)
        raise ExecutorError(f"rank {first} failed: {errors[first].splitlines()[0]}"
                            + (f" (then {others})" if others else "")
                            + f"\nlast status: {where}\n--- rank {first} traceback ---\n"
                            + errors[first])
    if stalled:
        raise ExecutorError(f"rank(s) {stalled} stopped answering: no progress for "
                            f"{op_timeout:g} s (the per-op timeout); all ranks were stopped. "
                            f"Last status: {where}")
    if len(results) < world:
        raise ExecutorError(f"timed out after {timeout:g} s: rank(s) "
                            f"{[r for r in range(world) if r not in results]} did not finish "
                            f"(a peer never answered?); all ranks were stopped. Last status: "
                            f"{where}")
    return [results[r] for r in range(world)]


