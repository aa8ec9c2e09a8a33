"""Point-to-point messages derived from a schedule, in an order that cannot deadlock.

Every cross-device stage boundary carries two messages per micro-batch: the activation (made by
``F`` of the sending stage) downstream and the input gradient (made by ``B``) upstream.
Same-device hand-offs (a V's tip, or a loop on one device) stay local and are not messages.

Ordering rule: on each directed device pair, messages are ordered by the position of their
producing op in the sender's op order (the order it runs them in). The sender posts each
``isend`` right after the producing op, so it sends in that order; the receiver posts its
``irecv`` for that peer in the same order. Backends that match messages between two ranks
strictly in order (gloo) therefore always pair each send with the right receive, whatever the
schedule, and since every receive is posted before the consumer waits on it, a rank only
waits for data its peer produces in an op that the (valid, acyclic) schedule runs earlier.
:func:`check_protocol` plays this protocol abstractly; the executor runs it before every replay
and the tests run it on random valid schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pipeopt.problem import Op
from pipeopt.schedule import Schedule


class Transfer(NamedTuple):
    """One message: the output of ``producer`` on ``src_device`` for ``consumer`` on
    ``dst_device`` (``kind`` F = activation, B = input gradient)."""

    kind: str
    src_device: int
    dst_device: int
    producer: Op
    consumer: Op


@dataclass(frozen=True)
class RankPlan:
    """What one rank does: its ops in order, the messages each op sends afterwards, and per
    peer the messages it receives, in the order the peer sends them."""

    device: int
    ops: tuple[Op, ...]
    sends_after: dict[Op, tuple[Transfer, ...]]
    recvs: dict[int, tuple[Transfer, ...]]
    recv_for: dict[Op, Transfer]


def consumer_of(op: Op, stages: int) -> Op | None:
    """The op of a neighbouring stage that needs ``op``'s output, if any."""
    if op.kind == "F" and op.stage + 1 < stages:
        return Op("F", op.stage + 1, op.microbatch)
    if op.kind == "B" and op.stage > 0:
        return Op("B", op.stage - 1, op.microbatch)
    return None


def plan(schedule: Schedule) -> list[RankPlan]:
    """Per device, its op order and messages (see the module docstring for the ordering)."""
    prob = schedule.problem
    orders = schedule.device_orders()
    position = {op: (d, i) for d, order in enumerate(orders) for i, op in enumerate(order)}
    sends: list[dict[Op, list[Transfer]]] = [{} for _ in orders]
    incoming: list[dict[int, list[tuple[int, Transfer]]]] = [{} for _ in orders]
    for op, (d, i) in position.items():
        cons = consumer_of(op, prob.stages)
        if cons is None:
            continue
        dst = prob.stage_device[cons.stage]
        if dst == d:
            continue  # same-device hand-off, kept in memory
        t = Transfer(op.kind, d, dst, op, cons)
        sends[d].setdefault(op, []).append(t)
        incoming[dst].setdefault(d, []).append((i, t))
    out = []
    for d, order in enumerate(orders):
        recvs = {peer: tuple(t for _, t in sorted(lst)) for peer, lst in
                 sorted(incoming[d].items())}
        recv_for = {t.consumer: t for lst in recvs.values() for t in lst}
        out.append(RankPlan(d, tuple(order), {op: tuple(v) for op, v in sends[d].items()},
                            recvs, recv_for))
    return out


def check_order(plans: list[RankPlan]) -> list[str]:
    """Problems with the message order: each directed pair must see the same sequence on the
    sending side (in op order) and on the receiving side. Empty when consistent."""
    problems = []
    for sender in plans:
        per_peer: dict[int, list[Transfer]] = {}
        for op in sender.ops:
            for t in sender.sends_after.get(op, ()):
                per_peer.setdefault(t.dst_device, []).append(t)
        for peer, seq in per_peer.items():
            got = list(plans[peer].recvs.get(sender.device, ()))
            if got != seq:
                problems.append(f"device {sender.device} -> {peer}: sends "
                                f"{[str(t.producer) for t in seq]} but receives "
                                f"{[str(t.producer) for t in got]}")
    return problems


def producer_of(op: Op, stages: int) -> Op | None:
    """The op of a neighbouring stage whose output ``op`` consumes, if any."""
    if op.kind == "F" and op.stage > 0:
        return Op("F", op.stage - 1, op.microbatch)
    if op.kind == "B" and op.stage + 1 < stages:
        return Op("B", op.stage + 1, op.microbatch)
    return None


def check_protocol(plans: list[RankPlan], stages: int) -> list[str]:
    """Play the ranks' protocol abstractly and report what would go wrong; empty when the run
    completes with every receive matched to the right message.

    Model: each rank runs its ops in order; an op first waits for its received input (sends
    never block); channels deliver in send order and the k-th message on a directed pair fills
    the k-th receive posted for that peer (gloo's rule). Local inputs must have been produced
    earlier on the same rank. Reports a mismatch (wrong message matched) or a deadlock (the
    ops every unfinished rank waits at)."""
    p = len(plans)
    pos = [0] * p
    done: set[Op] = set()
    channel: dict[tuple[int, int], list[Transfer]] = {}
    recv_index = [{t.consumer: (peer, i) for peer, lst in pl.recvs.items()
                   for i, t in enumerate(lst)} for pl in plans]
    problems: list[str] = []
    progress = True
    while progress:
        progress = False
        for r, pl in enumerate(plans):
            while pos[r] < len(pl.ops):
                op = pl.ops[pos[r]]
                if op in pl.recv_for:
                    peer, i = recv_index[r][op]
                    sent = channel.get((peer, r), [])
                    if len(sent) <= i:
                        break  # waits for the peer
                else:
                    prod = producer_of(op, stages)
                    if prod is not None and prod not in done:
                        problems.append(f"rank {r}: {op} runs before its local input {prod}")
                        return problems
                done.add(op)
                for t in pl.sends_after.get(op, ()):
                    sent = channel.setdefault((r, t.dst_device), [])
                    posted = plans[t.dst_device].recvs.get(r, ())
                    if len(sent) >= len(posted) or posted[len(sent)] != t:
                        meant = posted[len(sent)].consumer if len(sent) < len(posted) else None
                        problems.append(f"rank {t.dst_device}: the output of {op} (for "
                                        f"{t.consumer}) would fill the receive posted for "
                                        f"{meant}")
                        return problems
                    sent.append(t)
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {pl.ops[pos[r]]}" for r, pl in enumerate(plans)
             if pos[r] < len(pl.ops)]
    if stuck:
        problems.append("deadlock: " + ", ".join(stuck))
    return problems
