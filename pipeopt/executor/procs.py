"""Process plumbing of a pipelined run: its options (:class:`RunConfig`, checked from the
command line by :func:`check_run_flags`), spawned ranks that report their status and die with
their launcher, and torchrun ranks.

:func:`spawn` runs a function on ``world`` fresh processes joined in a process group (gloo on
CPU, nccl on CUDA, a free port on 127.0.0.1) and returns what each rank returned. The parent
waits with a deadline: when a rank raises, the others are killed and :class:`ExecutorError`
names the rank and its error; when a rank's status stops changing for the per-op timeout, or
the whole run's deadline passes, every rank is killed and the error says where each rank was.
This module imports no torch, so that a rank arms its parent-death signal before it loads
torch (seconds on a busy machine) and the function it runs.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import queue as queue_mod
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pipeopt.errors import ConfigError


class ExecutorError(RuntimeError):
    """A pipelined run that failed (the message names the rank and the reason)."""


class ModelError(ValueError):
    """A model that cannot be built or split for a schedule (the message says why; raised by
    :mod:`pipeopt.executor.models`, here so that the command line catches it without torch)."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message ('' when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@dataclass
class Fault:
    """Testing hook: make ``rank`` fail (``raise``) or stop answering (``hang``) before its
    first op of step ``step``; or, in the replay of a data-parallel graph schedule, train
    wrongly so that ``--check`` must fail: ``scale_grads`` multiplies the rank's gradients of
    iteration ``step`` by ``factor`` before they are reduced, ``skip_reduce`` makes the rank
    apply its own gradients of iteration ``step`` in place of the reduced ones (the
    collective still runs, so the other ranks are not held up)."""

    rank: int
    mode: str = "raise"
    step: int = 0
    factor: float = 2.0


class RankStatus:
    """What a rank is doing right now (one line), read by a reporter thread of the worker."""

    def __init__(self) -> None:
        self.text = "starting"


#: Default tolerance of the gradient comparison (fp32): |a - b| <= ATOL + RTOL * |b|.
RTOL = 1e-5
ATOL = 1e-5
#: The tolerance when both sides run in float64 (``--check`` of a data-parallel graph
#: schedule): far above float64's rounding (3.7e-13 measured with AdamW on
#: examples/dp_cross_dc.yaml), far below what a wrong replay moves (about lr times a gradient).
RTOL64 = 1e-8
ATOL64 = 1e-8

#: ``--autocast`` dtypes (:data:`pipeopt.executor.check.AUTOCAST` maps them to torch's).
AUTOCAST_NAMES = ("bf16", "fp16")

#: :attr:`RunConfig.dtype` values: parameters, buffers and floating inputs in this dtype.
DTYPE_NAMES = ("float32", "float64")


@dataclass(frozen=True)
class RunConfig:
    """How to run a schedule: model name and factory keywords, training steps, batch size
    (default 4 per micro-batch), learning rate, seed, timeout of the whole run and of one op
    or message (seconds), backend (``auto``: nccl with CUDA, else gloo), intra-op threads per
    rank (default: cores / ranks), whether to compare with the one-process reference, the
    optimizer (``sgd``, ``adamw``), gradient clipping to a global norm, autocast (``bf16``,
    ``fp16``) and whether a split backward runs per layer (pipeopt's refinement) or as
    PyTorch's whole-stage split. ``dtype``: ``float32``, or ``float64`` (the model's
    parameters and buffers and the floating inputs cast, in the ranks and the reference:
    what ``--check`` of a data-parallel graph schedule runs in). ``torch_schedule``: run
    PyTorch's own schedule class of that name (e.g. ``Schedule1F1B``) on the same stages
    instead of the schedule's orders (a baseline for benchmarks). ``data_parallel``:
    replicas of the pipeline (rank = replica * devices + pipeline rank), each on its own share
    of a batch ``data_parallel`` times as large, gradients averaged over the replicas after
    each step. ``recompute``: ``None`` checkpoints activations where the schedule's problem
    says (model form: ``full`` recompute, see :func:`~pipeopt.executor.models
    .recompute_plan`), ``full`` / ``none`` on every stage whatever it says. The async and
    the serving replays read the fields they use."""

    model: str = "mlp"
    model_options: tuple[tuple[str, Any], ...] = ()
    steps: int = 1
    batch_size: int | None = None
    lr: float = 0.01
    seed: int = 0
    timeout: float = 300.0
    backend: str = "auto"
    threads: int | None = None
    check: bool = False
    rtol: float = RTOL
    atol: float = ATOL
    fault: Fault | None = None
    op_timeout: float = 120.0
    optimizer: str = "sgd"
    clip_grad_norm: float | None = None
    autocast: str | None = None
    per_layer_split: bool = True
    torch_schedule: str | None = None
    data_parallel: int = 1
    recompute: str | None = None
    dtype: str = "float32"

    def batch(self, microbatches: int) -> int:
        """The batch size for ``microbatches``; must split evenly."""
        bs = self.batch_size or 4 * microbatches
        if bs % microbatches:
            raise ExecutorError(f"batch_size: {bs} does not split into {microbatches} equal "
                                "micro-batches")
        return bs

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw") or (
                self.autocast or "bf16") not in AUTOCAST_NAMES:
            raise ValueError(f"optimizer {self.optimizer!r} / autocast {self.autocast!r}: "
                             f"expected sgd or adamw / {', '.join(AUTOCAST_NAMES)} or None")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: expected {' or '.join(DTYPE_NAMES)}, got {self.dtype!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fields: Any) -> RunConfig:
        """The options ``pipeopt run``'s flags give (checked by :func:`check_run_flags`);
        ``fields`` override them."""
        same = ("model", "steps", "batch_size", "lr", "seed", "timeout", "backend", "threads",
                "check", "op_timeout", "optimizer", "clip_grad_norm", "autocast",
                "data_parallel", "recompute")  # flags named as the fields
        return cls(**{**{k: getattr(args, k) for k in same}, "model_options": model_options(args),
                      "per_layer_split": not args.torch_split, **fields})


# ----- the command line's checks (no torch imported) ---------------------------------------------
def under_torchrun() -> bool:
    """True when this process is one rank started by torchrun (RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def number(text: str) -> int | float | str:
    """A ``--model-arg`` value: an int, else a float, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def model_options(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The ``--model-arg KEY=VALUE`` items as (key, :func:`number`) pairs; ConfigError for
    one without a key or an ``=``."""
    out = []
    for item in args.model_arg or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-arg: expected KEY=VALUE, got {item!r}")
        out.append((key, number(val)))
    return tuple(out)


def check_run_flags(args: argparse.Namespace, ranks: int, microbatches: int | None = None
                    ) -> None:
    """The checks of ``pipeopt run``'s flags every replay shares (ConfigError naming the flag):
    times and rates finite and > 0, counts in range, ``--batch-size`` a multiple of
    ``microbatches`` (when given), ``--model-arg`` items, and ``ranks`` processes that this
    machine holds (:func:`check_rank_capacity`; not under torchrun, which starts its own)."""
    for flag, val, what in (("--timeout", args.timeout, "number of seconds"),
                            ("--op-timeout", args.op_timeout, "number of seconds"),
                            ("--lr", args.lr, "number"),
                            ("--clip-grad-norm", args.clip_grad_norm, "number")):
        if val is not None and not (math.isfinite(val) and val > 0):
            raise ConfigError(f"{flag}: must be a finite {what} > 0, got {val}")
    for flag, val, least in (("--steps", args.steps, 1), ("--seed", args.seed, 0),
                             ("--data-parallel", args.data_parallel, 1),
                             ("--threads", args.threads, 1), ("--max-ranks", args.max_ranks, 1)):
        if val is not None and val < least:
            raise ConfigError(f"{flag}: must be >= {least}, got {val}")
    m = microbatches
    if m is not None and args.batch_size is not None and (args.batch_size < 1
                                                          or args.batch_size % m):
        raise ConfigError(f"--batch-size: must be a positive multiple of the schedule's {m} "
                          f"micro-batches, got {args.batch_size}")
    model_options(args)
    if not under_torchrun():
        try:
            check_rank_capacity(ranks, os.cpu_count(), available_memory_bytes(), args.max_ranks)
        except ExecutorError as exc:
            raise ConfigError(f"run: {exc}") from None


def refuse(refusals: Iterable[tuple[str, object, str]]) -> None:
    """ConfigError ``FLAG: WHY`` for the first (flag, given, why) whose ``given`` is true."""
    for flag, given, why in refusals:
        if given:
            raise ConfigError(f"{flag}: {why}")


def check_nccl(backend: str) -> None:
    """ConfigError for ``--backend nccl`` where torch sees no CUDA GPU (imports torch)."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--backend nccl: needs CUDA GPUs, and this torch "
                              f"({torch.__version__}) sees none; use --backend gloo")


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


def pin_to_cores(rank: int, world: int, threads: int, pid: int = 0) -> list[int] | None:
    """Bind process ``pid`` (0: this one; every thread it starts from then on) to cores of its
    own: rank ``r`` of ``world`` to the ``r``-th run of ``threads`` of the CPUs this process
    may use, when all ranks' threads fit on them; returns those CPUs, or None (nothing
    changed: they do not fit, or the system has no ``sched_setaffinity``). Unbound, the
    kernel may run two ranks that wake each other (a send, the matching receive) on one core
    for whole runs while the other idles."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not allowed or world * threads > len(allowed):
        return None
    mine = allowed[rank * threads:(rank + 1) * threads]
    try:
        os.sched_setaffinity(pid, mine)
    except ProcessLookupError:  # the process is gone: its end is reported elsewhere
        return None
    except OSError as exc:  # affinity refused (a sandbox, seccomp): the rank runs unbound
        print(f"pipeopt: rank {rank} not bound to CPUs {mine} ({exc}); it runs unbound",
              file=sys.stderr)
        return None
    return mine


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
        fn, args = pickle.loads(job)
        status.text = "joining the process group"
        dist = _join(backend, threads, timeout, init_method=f"tcp://127.0.0.1:{port}",
                     rank=rank, world_size=world)
        status.text = "setting up"
        result = fn(rank, world, rank_device(backend, rank), *args, status=status)
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
          op_timeout: float | None = None, pin: bool | None = None) -> list[Any]:
    """Run ``fn(rank, world, device, *args, status=RankStatus)`` on ``world`` new processes in
    one process group and return each rank's result; ``fn`` must be importable (module level)
    and may keep ``status.text`` up to date for error messages. Raises
    :class:`ExecutorError` within ``timeout`` seconds when a rank fails or does not finish,
    and within ``op_timeout`` (plus a second) when a rank's status stops changing during a
    training step (a rank that stops answering). The ranks end with this process
    (:func:`die_with_parent`). ``pin``: bind each rank to cores of its own
    (:func:`pin_to_cores`, where all ranks' ``threads`` fit on this process's CPUs); default:
    on gloo, whose ranks compute on the CPU (``threads`` defaults to the CPUs this process
    may use shared out among the ranks, so a run already assumes those cores are its own)."""
    import multiprocessing as mp

    backend = resolve_backend(backend)
    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count() or 1)  # CPUs this launcher may use (taskset, cpusets;
    # a CPU quota such as docker --cpus is not seen: pass threads= there)
    threads = threads or max(1, usable // world)
    pin = backend == "gloo" if pin is None else pin
    ctx = mp.get_context("spawn")
    job = pickle.dumps((fn, args))
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, daemon=True, name=f"pipeopt-rank{r}",
                         args=(r, world, port, backend, timeout, threads, job, out,
                               os.getpid()))
             for r in range(world)]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    status: dict[int, str] = {}
    changed: dict[int, float] = {}  # when each rank's status last changed within a step
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    stalled: list[int] = []
    try:  # from the first start: ranks already started are stopped whatever happens
        for r, p in enumerate(procs):
            p.start()
            if pin and p.pid is not None:  # right after its start: its threads inherit it
                pin_to_cores(r, world, threads, p.pid)
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
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
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


class Mailbox:
    """One rank's point-to-point messages in one global order, the same on every rank
    (``messages``: (key, source rank, destination rank)): receives are posted, non-blocking,
    as early as that order allows and sends as the rank reaches them, so each pair of ranks
    issues its messages in the same order on both sides (what nccl needs, pairing messages by
    order, not by tag; gloo is content with it) and a rank waits only for a message sent
    before the task that needs it starts. ``make(key)``: a receive buffer."""

    def __init__(self, rank: int, messages: Sequence[tuple[Hashable, int, int]],
                 make: Callable[[Any], Any]) -> None:
        self.rank, self.make = rank, make
        self.queue = [m for m in messages if rank in m[1:]]
        self.next = 0
        self.posted: dict[Hashable, tuple[Any, Any]] = {}  # key -> (work, buffer)
        self.sends: list[tuple[Any, Any]] = []  # (work, tensor) of sends not seen complete
        self._post_receives()

    def _post_receives(self) -> None:
        import torch.distributed as dist

        while self.next < len(self.queue) and self.queue[self.next][2] == self.rank:
            key, src, _ = self.queue[self.next]
            buf = self.make(key)
            self.posted[key] = (dist.irecv(buf, src=src), buf)
            self.next += 1

    def send(self, key: Hashable, tensor: Any) -> None:
        """Send message ``key`` (it must be this rank's next in the order)."""
        import torch.distributed as dist

        m = self.queue[self.next] if self.next < len(self.queue) else None
        if m is None or m[:2] != (key, self.rank):
            raise ExecutorError(f"rank {self.rank}: sends {key}, the message order expects "
                                f"{m and m[0]}")
        t = tensor.detach().contiguous()
        self.sends = [(w, x) for w, x in self.sends if not w.is_completed()]
        self.sends.append((dist.isend(t, dst=m[2]), t))
        self.next += 1
        self._post_receives()

    def take(self, key: Hashable) -> Any:
        """Message ``key``'s tensor, once it has arrived."""
        if key not in self.posted:
            raise ExecutorError(f"rank {self.rank}: needs {key} before the message order lets "
                                "it arrive (a schedule whose times do not follow its data flow)")
        work, buf = self.posted.pop(key)
        work.wait()
        return buf

    def finish(self) -> None:
        """Wait for every send (each has its receive posted by then)."""
        if self.next != len(self.queue) or self.posted:
            raise ExecutorError(f"rank {self.rank}: {len(self.queue) - self.next} messages "
                                f"not sent, {len(self.posted)} not used")
        for work, _ in self.sends:
            work.wait()


def torchrun(fn: RankFn, args: tuple[Any, ...], *, backend: str, timeout: float,
             threads: int | None) -> list[Any] | None:
    """Run ``fn(rank, world, device, *args)`` as this rank started by torchrun (RANK,
    WORLD_SIZE, MASTER_ADDR, ...; process group joined here, timing out after ``timeout``
    seconds): rank 0 gets every rank's result, the others None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = resolve_backend(backend)
    dist = _join(backend, threads, timeout)
    try:
        payload = fn(rank, world, rank_device(backend, int(os.environ.get("LOCAL_RANK", rank))),
                     *args)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    return gathered


def _join(backend: str, threads: int | None, timeout: float, **where: Any) -> Any:
    """Load torch, set ``threads`` intra-op threads (None: torch's default), pin the CPU
    allocator on gloo (see :mod:`pipeopt._malloc`: steady CPU op times) and join the process
    group (``where``: ``init_method``, ``rank``, ``world_size``; default: torchrun's
    environment), its operations timing out after ``timeout`` seconds; returns
    ``torch.distributed``."""
    import torch
    import torch.distributed as dist

    from pipeopt._malloc import steady_cpu_allocator

    if threads:
        torch.set_num_threads(threads)
    if backend == "gloo":
        steady_cpu_allocator()
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **where)
    return dist


def start(fn: RankFn, world: int, args: tuple[Any, ...], cfg: RunConfig,
          backend: str) -> list[Any] | None:
    """``fn`` as this rank under torchrun (:func:`torchrun`: the results on rank 0, None
    elsewhere), else on ``world`` spawned ranks (:func:`spawn`); ``cfg``'s timeouts and
    threads."""
    if under_torchrun():
        return torchrun(fn, args, backend=backend, timeout=cfg.timeout, threads=cfg.threads)
    return spawn(fn, world, args, timeout=cfg.timeout, backend=backend, threads=cfg.threads,
                 op_timeout=cfg.op_timeout)


def spawn_jobs(fn: RankFn, world: int, jobs: Sequence[tuple[Any, RunConfig]], backend: str,
               *extra: Any) -> list[list[Any]]:
    """Every (schedule, config) job, one after the other, as ``fn(rank, world, device,
    schedule, cfg, *extra, status=...)`` on one set of ``world`` spawned ranks on ``backend``
    (the first job's threads; timeout: the sum of the jobs', op timeout: the longest); per
    job, every rank's report."""
    per_rank = spawn(_each_job, world, (fn, list(jobs), extra), backend=backend,
                     timeout=sum(c.timeout for _, c in jobs), threads=jobs[0][1].threads,
                     op_timeout=max(c.op_timeout for _, c in jobs))
    return [[per_rank[r][i] for r in range(world)] for i in range(len(jobs))]


def _each_job(rank: int, world: int, device: Any, fn: RankFn,
              jobs: Sequence[tuple[Any, RunConfig]], extra: tuple[Any, ...],
              status: RankStatus | None = None) -> list[Any]:
    return [fn(rank, world, device, s, c, *extra, status=status) for s, c in jobs]
