"""Hand-made schedules as per-device order generators (baselines and warm starts).

They take micro-batches first in, first out (0, 1, ...), whatever their cost; to run them in
another order, generate them for ``problem.permute_microbatches(order)`` (its micro-batch i is
the original ``order[i]``).

PyTorch's own schedules, read as data for the ``torch:NAME`` methods, are in
:mod:`pipeopt.schedules.pytorch` (imported on use: it reads them through torch).
"""

from __future__ import annotations

from collections.abc import Callable

from pipeopt.problem import Problem
from pipeopt.schedules.base import (
    SPLIT_COSTS,
    Generator,
    NotApplicable,
    Orders,
    fused_variant,
    split_variant,
)
from pipeopt.schedules.classic import gpipe, interleaved_1f1b, looped_bfs, one_f_one_b
from pipeopt.schedules.controllable_memory import v_half, v_min
from pipeopt.schedules.crosspipe import crosspipe, crosspipe_v, estimated_seconds
from pipeopt.schedules.zb_auto import zb_1p, zb_2p
from pipeopt.schedules.zero_bubble import zb_h1, zb_h2, zb_v
from pipeopt.subblocks import expand_orders, merge

#: Every hand-made schedule by its method name.
GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "looped-bfs": looped_bfs,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "v-half": v_half,
    "v-min": v_min,
    "zb-1p": zb_1p,
    "zb-2p": zb_2p,
    "crosspipe": crosspipe,
    "crosspipe-v": crosspipe_v,
}

def generate(name: str, problem: Problem) -> Orders:
    """The orders of hand-made schedule ``name`` for ``problem``. On a problem cut into
    sub-blocks they are generated for its uncut problem (:func:`pipeopt.subblocks.merge`) and
    each op runs its pieces back to back (:func:`pipeopt.subblocks.expand_orders`), which
    times as the uncut schedule does; raises :class:`NotApplicable` as the generator does."""
    gen = GENERATORS[name]
    if problem.sub_blocks == 1:
        return gen(problem)
    return expand_orders(problem, gen(merge(problem)))


#: Estimated wall time (seconds) of the generators that search (several variants each), for
#: callers under a time limit; the others take a few microseconds per op.
COST_ESTIMATES: dict[str, Callable[[Problem], float]] = {
    "crosspipe": estimated_seconds,
    "crosspipe-v": estimated_seconds,
}

#: Schedules whose published form runs the whole backward as one op: the gradient leaves only
#: when both the input and the weight gradients are done (as autograd computes them together).
#: They are timed on the fused variant of the problem, which is how their published bubble
#: formulas, e.g. 1F1B's (p - 1)(F + B + W), arise.
FUSED_BACKWARD = frozenset({"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"})

__all__ = ["COST_ESTIMATES", "FUSED_BACKWARD", "GENERATORS", "SPLIT_COSTS", "Generator",
           "NotApplicable", "Orders", "fused_variant", "generate", "split_variant"]
