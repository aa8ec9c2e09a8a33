"""Point-to-point order on NCCL, checked without a GPU on a model of its blocking semantics.

NCCL matches a send with a receive by their order between the two ranks (no tags), runs the
operations a rank posts on one stream in the order posted, and a send of a message larger than
its buffers blocks that stream until the peer's matching receive runs. A stream also waits for
the work the rank issued before it (the compute that produced a send, and what that compute
waited for). So a pair of ranks whose first unfinished operations are both blocking sends to
each other deadlocks, and a pair that posts its messages in different orders pairs the wrong
ones. :func:`run_model` plays every rank's posted operations under these rules (every message
blocking, the conservative case) and reports a deadlock or a mismatch.

What is checked: the action lists PyTorch's runtime executes for pipeopt schedules (its own
lowering, one stream per pair of ranks and also one stream for all of a rank's messages), and
the operations the async replay (:mod:`pipeopt.executor.periodic`) and the served-plan replay
(:mod:`pipeopt.executor.inference`) really post, recorded by running each rank's code in this
process against a stand-in for ``torch.distributed``. A control: the pre-runtime executor's
order (each receive posted when its consumer runs) deadlocks under 1F1B in the model.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pipeopt.executor import _torch  # noqa: E402
from pipeopt.executor.export import schedule_rows  # noqa: E402
from pipeopt.problem import Op, uniform_problem  # noqa: E402
from pipeopt.schedule import Schedule  # noqa: E402
from pipeopt.schedules import GENERATORS  # noqa: E402
from pipeopt.simulate import simulate  # noqa: E402


# ----- the model ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Comm:
    """One posted operation: ``send`` / ``recv`` with ``peer``, or a collective (``coll``) on
    the ranks ``group``; ``key`` names the message (equal on both sides of a pair)."""

    kind: str
    key: Hashable
    peer: int = -1
    group: tuple[int, ...] = ()


#: A rank's program: ("post", id, Comm) and ("wait", id) in the order the rank issues them.
Program = list[tuple[Any, ...]]


def run_model(programs: dict[int, Program], streams: str = "pair") -> str | None:
    """Play ``programs`` under NCCL's rules; None when every operation completes, else what
    each rank is stuck on. ``streams``: ``pair`` (a stream per pair of ranks, as torch's
    lazily created two-rank communicators) or ``rank`` (one stream for all of a rank's
    point-to-point messages, the stricter case). A send and its receive complete together,
    when both are first on their streams and their ranks have issued everything they follow;
    a collective when every member's is. Raises AssertionError when NCCL would pair two
    different messages."""
    ops: dict[tuple[int, Any], Comm] = {}
    after: dict[tuple[int, Any], set[tuple[int, Any]]] = {}  # op -> ops waited before its post
    queues: dict[tuple[int, Hashable], list[tuple[int, Any]]] = {}  # (rank, stream) -> ops
    for r, prog in programs.items():
        waited: set[tuple[int, Any]] = set()
        for ev in prog:
            if ev[0] == "wait":
                waited.add((r, ev[1]))
                continue
            op_id, c = (r, ev[1]), ev[2]
            ops[op_id], after[op_id] = c, set(waited)
            if c.kind == "coll":
                stream: Hashable = ("coll", c.group)
            else:
                stream = ("p2p", min(r, c.peer), max(r, c.peer)) if streams == "pair" else "p2p"
            queues.setdefault((r, stream), []).append(op_id)
    done: set[tuple[int, Any]] = set()

    def ready(op_id: tuple[int, Any]) -> bool:
        return after[op_id] <= done

    def head(rank: int, stream: Hashable) -> tuple[int, Any] | None:
        q = queues.get((rank, stream), [])
        return next((o for o in q if o not in done), None)

    def stream_of(op_id: tuple[int, Any]) -> Hashable:
        return next(s for (r, s), q in queues.items() if r == op_id[0] and op_id in q)

    def partners(op_id: tuple[int, Any]) -> list[tuple[int, Any]] | None:
        """The ops that complete with ``op_id`` (itself included), when they can now."""
        r, c = op_id[0], ops[op_id]
        if c.kind == "coll":
            heads = [head(q, ("coll", c.group)) for q in c.group]
            if any(h is None for h in heads):
                return None
            for h in heads:
                assert ops[h].key == c.key, f"collective mismatch on {c.group}: {ops[h]} / {c}"
            return heads if all(ready(h) for h in heads) else None  # type: ignore[arg-type]
        q = c.peer
        mine = [o for o in queues[(r, stream_of(op_id))] if ops[o].kind == c.kind
                and ops[o].peer == q]
        want = "recv" if c.kind == "send" else "send"
        theirs = [o for (rr, _), qu in queues.items() if rr == q for o in qu
                  if ops[o].kind == want and ops[o].peer == r]
        theirs.sort(key=lambda o: programs_index[o])
        i = mine.index(op_id)  # NCCL's pairing: the i-th send of r to q is q's i-th receive
        assert i < len(theirs), f"rank {r}'s {c} has no matching {want} on rank {q}"
        other = theirs[i]
        assert ops[other].key == c.key, (f"ranks {r} and {q} post their messages in different "
                                         f"orders: {c} meets {ops[other]}")
        if head(q, stream_of(other)) != other or not ready(other):
            return None
        return [op_id, other]

    programs_index = {(r, ev[1]): i for r, prog in programs.items()
                      for i, ev in enumerate(prog) if ev[0] == "post"}
    progress = True
    while progress:
        progress = False
        for (r, stream) in list(queues):
            h = head(r, stream)
            if h is None or not ready(h):
                continue
            group = partners(h)
            if group:
                done.update(group)
                progress = True
    if len(done) == len(ops):
        return None
    stuck = {r: [ops[h] for (rr, s) in queues if rr == r and (h := head(r, s)) is not None]
             for r in programs}
    return "deadlock: " + "; ".join(f"rank {r} waits on {v}" for r, v in stuck.items() if v)


def test_model_catches_crossed_sends_and_mismatches() -> None:
    """Two ranks that both send first deadlock; the same with one receiving first does not;
    messages posted in different orders are a mismatch."""
    def prog(*comms: Comm) -> Program:
        out: Program = []
        for i, c in enumerate(comms):
            out += [("post", i, c), ("wait", i)]
        return out

    a, b = Comm("send", "a", 1), Comm("recv", "b", 1)
    crossed = {0: prog(a, b), 1: prog(Comm("send", "b", 0), Comm("recv", "a", 0))}
    assert run_model(crossed) is not None
    ok = {0: prog(a, b), 1: prog(Comm("recv", "a", 0), Comm("send", "b", 0))}
    assert run_model(ok) is None and run_model(ok, "rank") is None
    swapped = {0: prog(Comm("send", "x", 1), Comm("send", "y", 1)),
               1: prog(Comm("recv", "y", 0), Comm("recv", "x", 0))}
    with pytest.raises(AssertionError, match="different orders"):
        run_model(swapped)
    # a collective that one member reaches only after a message the other sends after it
    coll = Comm("coll", "ar", group=(0, 1))
    assert run_model({0: prog(coll, Comm("send", "m", 1)),
                      1: prog(Comm("recv", "m", 0), coll)}) is not None


# ----- PyTorch's runtime on pipeopt's schedules ---------------------------------------------------
def runtime_programs(schedule: Schedule) -> dict[int, Program]:
    """What ``_PipelineScheduleRuntime`` posts for ``schedule``: torch's own lowering of the
    actions ``pipeopt run`` hands it, each send and receive posted at its place in the list
    (separate ``isend`` / ``irecv`` calls), a receive waited for where its consumer runs, every
    send waited for at the end of the step."""
    prob = schedule.problem
    rows, _ = schedule_rows(schedule)
    lowered = _torch.lower(_torch.rows_to_actions(rows), prob.stages, prob.microbatches)
    rank = prob.stage_device
    out: dict[int, Program] = {}
    for r, actions in lowered.items():
        prog: Program = []
        sends = []
        for i, a in enumerate(actions):
            t, k, j = a.computation_type.name, a.stage_index, a.microbatch_index
            if t == "SEND_F":
                prog.append(("post", i, Comm("send", ("F", k, j), rank[k + 1])))
                sends.append(i)
            elif t == "SEND_B":
                prog.append(("post", i, Comm("send", ("B", k, j), rank[k - 1])))
                sends.append(i)
            elif t == "RECV_F":
                prog.append(("post", ("RF", k, j), Comm("recv", ("F", k - 1, j), rank[k - 1])))
            elif t == "RECV_B":
                prog.append(("post", ("RB", k, j), Comm("recv", ("B", k + 1, j), rank[k + 1])))
            elif t == "FORWARD" and k > 0 and rank[k - 1] != r:
                prog.append(("wait", ("RF", k, j)))
            elif t in ("FULL_BACKWARD", "BACKWARD_INPUT") and k < prob.stages - 1 \
                    and rank[k + 1] != r:
                prog.append(("wait", ("RB", k, j)))
        prog += [("wait", i) for i in sends]
        out[r] = prog
    return out


def _random_orders(prob: Any, rnd: random.Random) -> list[list[Op]]:
    """Device orders of one random topological order of the ops (always a valid schedule)."""
    deps = {op: [d for d in prob.ops() if (op.kind == "F" and d == Op("F", op.stage - 1,
                                                                        op.microbatch))
                 or (op.kind == "B" and d in (Op("F", op.stage, op.microbatch),
                                              Op("B", op.stage + 1, op.microbatch)))
                 or (op.kind == "W" and d == Op("B", op.stage, op.microbatch))]
            for op in prob.ops()}
    placed: set[Op] = set()
    orders: list[list[Op]] = [[] for _ in range(prob.devices)]
    while len(placed) < len(deps):
        op = rnd.choice(sorted(o for o in deps if o not in placed
                               and all(d in placed for d in deps[o])))
        placed.add(op)
        orders[prob.stage_device[op.stage]].append(op)
    return orders


CASES = [("1f1b", 2, 4, {}), ("1f1b", 4, 8, {}), ("gpipe", 4, 4, {}), ("zb-h1", 4, 8, {}),
         ("zb-h2", 3, 6, {}), ("interleaved-1f1b", 2, 4, {"virtual_stages": 2}),
         ("zb-v", 4, 8, {"virtual_stages": 2, "placement": "vshape"})]


@pytest.mark.parametrize(("method", "p", "m", "kw"), CASES,
                         ids=[f"{c[0]}-p{c[1]}-m{c[2]}" for c in CASES])
def test_runtime_order_is_safe_on_nccl(method: str, p: int, m: int, kw: dict[str, Any]) -> None:
    """Every pair posts its messages in one order on both sides, and nothing deadlocks, with
    a stream per pair and with one stream per rank."""
    prob = uniform_problem(p, m, split_backward=method.startswith("zb"), **kw)
    programs = runtime_programs(simulate(prob, GENERATORS[method](prob), method=method))
    assert run_model(programs) is None
    assert run_model(programs, "rank") is None


def test_runtime_order_is_safe_for_searched_and_random_schedules() -> None:
    """The greedy's schedules and random valid ones (any order a search may return)."""
    from pipeopt.solvers import solve

    rnd = random.Random(7)
    for p, m, v, vshape in ((2, 3, 1, False), (3, 5, 1, False), (4, 4, 2, False),
                            (2, 4, 2, True), (4, 6, 1, False)):
        prob = uniform_problem(p, m, virtual_stages=v, split_backward=True,
                               placement="vshape" if vshape else "loop")
        scheds = [simulate(prob, _random_orders(prob, rnd)) for _ in range(3)]
        scheds.append(solve(prob, "greedy", time_limit=2, seed=0))
        for s in scheds:
            programs = runtime_programs(s)
            assert run_model(programs) is None, s.device_orders()
            assert run_model(programs, "rank") is None, s.device_orders()


def test_lazy_receives_deadlock_in_the_model() -> None:
    """The control: a receive posted only where its consumer runs, a send right after its
    producer (the executor before it moved onto PyTorch's runtime), deadlocks under 1F1B: the
    last rank sends its first gradient while the first sends its second activation."""
    prob = uniform_problem(2, 4)
    sched = simulate(prob, GENERATORS["1f1b"](prob))
    rank = prob.stage_device
    programs: dict[int, Program] = {}
    for r, order in enumerate(sched.device_orders()):
        prog: Program = []
        for i, op in enumerate(order):
            src = op.stage - 1 if op.kind == "F" else op.stage + 1
            if op.kind != "W" and 0 <= src < prob.stages:
                key = ("F" if op.kind == "F" else "B", src, op.microbatch)
                prog += [("post", ("r", i), Comm("recv", key, rank[src])), ("wait", ("r", i))]
            dst = op.stage + 1 if op.kind == "F" else op.stage - 1
            if op.kind != "W" and 0 <= dst < prob.stages:
                prog.append(("post", ("s", i), Comm("send", (op.kind, op.stage, op.microbatch),
                                                    rank[dst])))
        programs[r] = prog
    assert (run_model(programs) or "").startswith("deadlock")


# ----- the async and the served-plan replays, as they really post -------------------------
class _Recorder:
    """A stand-in for ``torch.distributed`` that records what one rank posts and waits for;
    receives are filled with zeros (token ids stay valid), nothing is sent anywhere."""

    def __init__(self) -> None:
        self.prog: Program = []
        self.n = 0

    def _post(self, comm: Comm) -> Any:
        self.n += 1
        op_id, prog = self.n, self.prog
        prog.append(("post", op_id, comm))

        class Work:
            def wait(self) -> bool:
                prog.append(("wait", op_id))
                return True

            def is_completed(self) -> bool:
                return False

        return Work()

    def isend(self, tensor: Any, dst: int, tag: int = 0, **_: Any) -> Any:
        return self._post(Comm("send", (tag, tuple(tensor.shape)), dst))

    def irecv(self, tensor: Any, src: int, tag: int = 0, **_: Any) -> Any:
        tensor.zero_()
        return self._post(Comm("recv", (tag, tuple(tensor.shape)), src))

    def all_reduce(self, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        return self._post(Comm("coll", ("all_reduce", tensor.numel()), group=group))

    @staticmethod
    def new_group(ranks: list[int], backend: str | None = None) -> tuple[int, ...]:
        return tuple(ranks)

    @staticmethod
    def barrier(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def destroy_process_group(group: Any = None) -> None:
        return None


def _record(monkeypatch: pytest.MonkeyPatch, world: int, run: Any) -> dict[int, Program]:
    """Each rank's program: ``run(rank)`` with ``torch.distributed`` recorded."""
    import torch.distributed as dist

    out = {}
    for r in range(world):
        rec = _Recorder()
        for name in ("isend", "irecv", "all_reduce", "new_group", "barrier",
                     "destroy_process_group"):
            monkeypatch.setattr(dist, name, getattr(rec, name))
        run(r)
        out[r] = rec.prog
    return out


@pytest.mark.parametrize(("method", "replicas"), [("pipedream", None), ("pipedream-2bw", None),
                                                  ("pipemare", None), ("pipedream", (1, 2, 1)),
                                                  ("pipedream-2bw", (1, 2, 1))])
def test_async_replay_posts_a_safe_order(monkeypatch: pytest.MonkeyPatch, method: str,
                                         replicas: tuple[int, ...] | None) -> None:
    """The async replay's sends, receives and replica all-reduces (recorded from its own
    code, two iterations of 4 micro-batches) match pair by pair and cannot deadlock."""
    from pipeopt.executor.periodic import _run_rank
    from pipeopt.executor.procs import RankStatus, RunConfig
    from pipeopt.schedules.periodic import async_pattern

    prob = uniform_problem(3, 4, f=1.0, b=2.0, w=0.5)
    s = async_pattern(prob, method, (1.0,) * 3, replicas=replicas or ())
    cfg = RunConfig(model="mlp", model_options=(("width", 4),), steps=2)
    programs = _record(monkeypatch, sum(s.replicas), lambda r: _run_rank(
        r, sum(s.replicas), torch.device("cpu"), s, cfg, RankStatus()))
    assert any(c.kind == "coll" for prog in programs.values() for *_, c in
               (ev for ev in prog if ev[0] == "post")) == bool(replicas)
    assert run_model(programs) is None
    assert run_model(programs, "rank") is None


def test_served_plan_replay_posts_a_safe_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served-plan replay on 3 ranks (continuous batching with chunked prefill, the ring
    of tokens back to the first stage; stages 1 and 2 run neighbouring iterations swapped, so
    a rank runs them in another order than its messages arrive), recorded from its own code."""
    from pipeopt.core.simulate import simulate as simulate_graph
    from pipeopt.executor.inference import replay_of, serve_rank
    from pipeopt.executor.procs import RankStatus, RunConfig
    from pipeopt.workloads import inference as wi

    unit = wi.StageModel(linear_flops_per_token=0.0, attention_flops_per_key=0.0,
                         weight_bytes=1.0, kv_bytes_per_token=1.0, peak_flops=1.0,
                         hbm_bandwidth=1.0)
    reqs = (wi.Request(7, 3, 0.0), wi.Request(2, 5, 0.0), wi.Request(5, 1, 1.0),
            wi.Request(3, 4, 2.0), wi.Request(9, 2, 6.0))
    plan = wi.continuous_plan(reqs, 2, 4, chunked=True, timing=wi.Timing((unit,) * 3))
    orders = wi.plan_orders(plan, 3)
    n = len(plan.iterations)
    for k in (1, 2):
        its = list(range(n))
        for b in range(1, n - 1, 2):
            its[b], its[b + 1] = its[b + 1], its[b]
        orders[k] = [wi.task_id(3, b, k) for b in its]
    replay = replay_of(simulate_graph(wi.build(plan, (unit,) * 3), orders, check=False))
    assert replay.orders[0] != replay.orders[1]
    opts = RunConfig(model="tiny-gpt", model_options=(("vocab", 16),))
    programs = _record(monkeypatch, 3, lambda r: serve_rank(
        r, 3, torch.device("cpu"), replay, opts, RankStatus()))
    assert sum(ev[0] == "post" for prog in programs.values() for ev in prog) == 2 * len(
        replay.messages)
    assert run_model(programs) is None
    assert run_model(programs, "rank") is None
