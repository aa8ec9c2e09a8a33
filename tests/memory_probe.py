"""What autograd keeps of a block, measured two ways for the memory tests: the storages its
forward saves for the backward (saved-tensor hooks) and the storages a checkpointed block's
recomputation leaves alive (a dispatch mode), parameters left out of both."""

from __future__ import annotations

import torch


def recomputed_alive_bytes(block, x) -> float:
    """Bytes of the tensors a checkpointed ``block``'s recomputation leaves alive when it ends
    (what autograd keeps for the block's gradients: the peak of its backward), parameters left
    out: weak references to the storages of every op's output, taken by a dispatch mode that
    runs as checkpoint's recomputation context."""
    import weakref
    from contextlib import nullcontext

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    class Alive(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: dict[int, tuple[weakref.ref, int]] = {}
            self.alive = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    old = self.made.get(st.data_ptr())
                    if old is None or old[0]() is None:  # new, or a freed one's address
                        self.made[st.data_ptr()] = (weakref.ref(st), st.nbytes())
            return out

        def __exit__(self, *exc):
            self.alive = sum(n for ptr, (ref, n) in self.made.items()
                             if ref() is not None and ptr not in params)
            return super().__exit__(*exc)

    modes: list[Alive] = []

    def contexts():
        modes.append(Alive())
        return nullcontext(), modes[-1]

    # Without early stop the recomputation runs the whole block and returns, so what is
    # alive at its end is what it saved (early stop ends it by an exception whose traceback
    # would keep the block's locals alive a little longer).
    with set_checkpoint_early_stop(False):
        checkpoint(block, x, use_reentrant=False, context_fn=contexts).sum().backward()
    assert len(modes) == 1 and modes[0].alive > 0
    return float(modes[0].alive)


def saved_bytes(block, x, fn=None) -> float:
    """Bytes autograd saves for the backward of ``fn`` (default ``block``) on ``x``: distinct
    storages, ``block``'s parameters left out; the backward runs, as in a training step."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (fn or block)(x).sum().backward()
    return float(sum(seen.values()))
