"""Replay a served inference plan on torch.distributed: forward only, a KV cache per stage.

A schedule JSON v2 whose graph records a serving plan (:func:`pipeopt.workloads.inference.
serving_plan`: requests, iterations of prefill chunks and decodes) runs here as the plan says,
one process per stage, with the tiny causal GPT of :func:`pipeopt.executor.models.tiny_gpt`
in float64 standing in for the planned model (what is replayed is the plan's structure:
stages, requests, iterations, their groups and each device's order). Each rank runs its
iterations in the schedule's order, an iteration's tokens batched, with a KV cache per request
and block (freed at the end of the iteration in which the request ends); hidden states go to
the next stage and the last stage's greedy tokens back to the first (the ring), through a
:class:`~pipeopt.executor.procs.Mailbox` in the one order of :attr:`Replay.messages`, so a
valid schedule cannot deadlock. :func:`reference_decode` is the check (each request decoded
alone, uncached: the tokens must be equal); :func:`cap_plan` caps the lengths. Details:
docs/executor.md, "pipeopt run of a served inference plan". Torch is imported only in the
functions that run the model, so ``pipeopt run`` checks its flags first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from pipeopt.core.schedule import GraphSchedule
from pipeopt.errors import ConfigError
from pipeopt.executor.procs import (
    ExecutorError,
    Mailbox,
    RankStatus,
    RunConfig,
    check_nccl,
    check_run_flags,
    refuse,
    start,
)
from pipeopt.workloads.inference import (
    Chunk,
    Decode,
    Plan,
    plan_from_meta,
    plan_meta,
    serving_plan,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The keywords of :func:`pipeopt.executor.models.tiny_gpt` a replay takes (``--model-arg``).
MODEL_KEYS = ("layers", "hidden", "heads", "vocab", "seq_len")
#: ``tiny_gpt``'s own defaults, repeated so that flags are checked before torch is imported
#: (a test keeps them equal to the function's).
MODEL_DEFAULTS = (("hidden", 64), ("heads", 4), ("vocab", 128))


# ----- the plan to replay (pure) -----------------------------------------------------------
def cap_plan(plan: Plan, max_prompt: int | None = None, max_output: int | None = None) -> Plan:
    """``plan`` with prompts cut to ``max_prompt`` tokens and outputs to ``max_output`` (None:
    no cap). Iterations keep their index and group: a chunk keeps the part of its range below
    the capped prompt (the chunk that ended the prompt ends the capped one, so the first token
    comes out of the same iteration), decode ``j`` stays while ``j < output``; chunks and
    decodes cut away leave their iteration smaller or empty."""
    for flag, cap in (("--max-prompt", max_prompt), ("--max-output", max_output)):
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"{flag}: must be an integer >= 1, got {cap!r}")
    if max_prompt is None and max_output is None:
        return plan
    prompt = [r.prompt if max_prompt is None else min(r.prompt, max_prompt)
              for r in plan.requests]
    output = [r.output if max_output is None else min(r.output, max_output)
              for r in plan.requests]
    prefill: list[list[Chunk]] = []
    decode: list[list[Decode]] = []
    for it in plan.iterations:
        chunks = []
        for c in it.chunks:
            p = prompt[c.request]
            end = c.cached + c.tokens
            a = min(c.cached, p - 1)
            b = p if end == plan.requests[c.request].prompt else min(end, p - 1)
            if b > a:
                chunks.append(Chunk(c.request, a, b - a))
        prefill.append(chunks)
        decode.append([Decode(d.request, prompt[d.request] + j) for d in it.decodes
                       if (j := d.context - plan.requests[d.request].prompt) < output[d.request]])
    meta = plan_meta(plan)
    meta["requests"] = {"prompt": prompt, "output": output,
                        "arrival": [r.arrival for r in plan.requests]}
    meta["iterations"] = {"group": [it.group for it in plan.iterations],
                          "prefill": prefill, "decode": decode}
    return plan_from_meta(meta)


class Segment(NamedTuple):
    """The rows ``offset .. offset + tokens - 1`` of an iteration: request ``request``'s tokens
    at positions ``position ..``; ``logit``: its last row yields a token."""

    request: int
    offset: int
    position: int
    tokens: int
    logit: bool


def segments(plan: Plan, b: int) -> tuple[Segment, ...]:
    """Iteration ``b``'s rows: its chunks, then its decodes, in the plan's order."""
    it, out, row = plan.iterations[b], [], 0
    for c in it.chunks:
        out.append(Segment(c.request, row, c.cached, c.tokens,
                           c.cached + c.tokens == plan.requests[c.request].prompt))
        row += c.tokens
    for d in it.decodes:
        out.append(Segment(d.request, row, d.context - 1, 1, True))
        row += 1
    return tuple(out)


class Message(NamedTuple):
    """Iteration ``iteration``'s ``hidden`` states (stage ``src`` to ``src + 1``) or its
    sampled ``tokens`` (the last stage back to the first)."""

    kind: str
    iteration: int
    src: int
    dst: int


@dataclass(frozen=True)
class Replay:
    """What every rank replays: the (capped) plan, per device (= stage) the iterations it runs
    in the schedule's order (empty iterations left out), every message in one global order (by
    the schedule's end time of the task that sends it, then sender, then iteration), and the
    source schedule's method."""

    plan: Plan
    orders: tuple[tuple[int, ...], ...]
    method: str
    messages: tuple[Message, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.orders)

    def yielding(self, b: int) -> tuple[int, ...]:
        """Requests whose token iteration ``b`` yields, in its rows' order."""
        return tuple(s.request for s in segments(self.plan, b) if s.logit)

    def feeds_back(self, b: int) -> bool:
        """Whether iteration ``b``'s tokens go back to the first stage: some request it yields
        for decodes again (the message carries all of them, in :meth:`yielding`'s order)."""
        ends = set(self.plan.iterations[b].finished)
        return any(r not in ends for r in self.yielding(b))


def replay_of(schedule: GraphSchedule, max_prompt: int | None = None,
              max_output: int | None = None) -> Replay:
    """The :class:`Replay` of a schedule of a serving plan's graph; ValueError when the graph
    records no plan or a device runs another stage's task."""
    plan = serving_plan(schedule.graph)
    if plan is None:
        raise ValueError("schedule: its graph records no serving plan (graph.meta.workload "
                         "inference); pipeopt run replays chain schedules (v1) and served "
                         "inference plans")
    plan = cap_plan(plan, max_prompt, max_output)
    s, n = schedule.graph.devices, len(plan.iterations)
    orders = []
    for d, tasks in enumerate(schedule.device_orders()):
        its = []
        for i in tasks:
            b, k = divmod(i, s)
            if i >= n * s or k != d:
                raise ValueError(f"schedule: device {d} runs task {i}, which is not one of its "
                                 f"stage's iterations")
            if plan.iterations[b].tokens:
                its.append(b)
        orders.append(tuple(its))
    replay = Replay(plan, tuple(orders), schedule.method)
    end, timed = schedule.end, []
    for b in range(n if s > 1 else 0):
        if not plan.iterations[b].tokens:
            continue
        timed += [(end[b * s + k], k, b, Message("hidden", b, k, k + 1)) for k in range(s - 1)]
        if replay.feeds_back(b):
            timed.append((end[b * s + s - 1], s - 1, b, Message("tokens", b, s - 1, 0)))
    return replace(replay, messages=tuple(m for *_, m in sorted(timed)))


def stage_bounds(layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Even ``[first, last)`` ranges of ``layers`` pipeline layers over ``stages``."""
    cuts = [k * layers // stages for k in range(stages + 1)]
    return tuple(itertools.pairwise(cuts))


def prompt_tokens(plan: Plan, vocab: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Each request's prompt token ids, drawn uniformly from ``0 .. vocab - 1`` by ``seed``."""
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(vocab) for _ in range(r.prompt)) for r in plan.requests)


def model_kwargs(opts: RunConfig, plan: Plan, stages: int) -> dict[str, int]:
    """The keywords for ``tiny_gpt`` from ``opts.model_options`` (``layers`` default: the
    stages; ``seq_len`` default: the longest request's prompt + output - 1, which it must
    hold); ConfigError naming the ``--model-arg`` that cannot serve ``plan`` on ``stages``
    stages."""
    kw = dict(opts.model_options)
    for key, val in kw.items():
        if key not in MODEL_KEYS:
            raise ConfigError(f"--model-arg: tiny-gpt takes {', '.join(MODEL_KEYS)}, not "
                              f"{key!r}")
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"--model-arg {key}: must be an integer >= 1, got {val!r}")
    longest = max(r.kv_tokens for r in plan.requests)
    kw.setdefault("layers", max(1, stages))
    kw.setdefault("seq_len", longest)
    for key, val in MODEL_DEFAULTS:
        kw.setdefault(key, val)
    if kw["seq_len"] < longest:
        raise ConfigError(f"--model-arg seq_len: must hold the longest request's {longest} "
                          f"positions (prompt + output - 1), got {kw['seq_len']}")
    if kw["layers"] + 2 < stages:
        raise ConfigError(f"--model-arg layers: {kw['layers']} blocks + embedding + head "
                          f"are fewer layers than the plan's {stages} stages")
    if kw["hidden"] % kw["heads"]:
        raise ConfigError(f"--model-arg hidden: must be a multiple of heads "
                          f"({kw['heads']}), got {kw['hidden']}")
    if kw["vocab"] < 2:
        raise ConfigError(f"--model-arg vocab: must be >= 2, got {kw['vocab']}")
    return kw


# ----- the model, forward only with a KV cache ---------------------------------------------
def build_layers(replay: Replay, opts: RunConfig) -> list[nn.Module]:
    """The tiny GPT's pipeline layers (embedding, blocks, head) in float64, drawn by the seed
    (the same on every rank and in the reference)."""
    import torch

    from pipeopt.executor.models import tiny_gpt

    torch.manual_seed(opts.seed)
    spec = tiny_gpt(**model_kwargs(opts, replay.plan, replay.stages))
    return [layer.double().eval() for layer in spec.layers]


def _block_step(block: Any, x: torch.Tensor, segs: Sequence[Segment],
                cache: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``block`` (:class:`pipeopt.executor.models.Block`) on an iteration's rows ``x``
    (tokens x hidden): the linear layers over all rows, attention per segment over its
    request's cached keys and values (extended here) and causally over its own rows."""
    import torch
    from torch.nn import functional as F

    c = x.shape[1]
    h = block.heads
    d = c // h
    q, k, v = block.qkv(block.ln1(x)).split(c, dim=1)
    outs = []
    for s in segs:
        rows = slice(s.offset, s.offset + s.tokens)
        qs, ks, vs = (z[rows].reshape(s.tokens, h, d).transpose(0, 1) for z in (q, k, v))
        if s.request in cache:
            old_k, old_v = cache[s.request]
            ks, vs = torch.cat((old_k, ks), dim=1), torch.cat((old_v, vs), dim=1)
        keys = ks.shape[1]
        if keys != s.position + s.tokens:
            raise ExecutorError(f"request {s.request}: {keys - s.tokens} keys cached, its "
                                f"tokens start at position {s.position} (an iteration out of "
                                "order)")
        cache[s.request] = (ks, vs)
        scores = (qs @ ks.transpose(-2, -1)) / math.sqrt(d)
        # Row i (position s.position + i) sees keys 0 .. s.position + i.
        mask = torch.ones(s.tokens, keys, dtype=torch.bool, device=x.device).triu(
            keys - s.tokens + 1)
        att = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ vs
        outs.append(att.transpose(0, 1).reshape(s.tokens, c))
    x = x + block.proj(torch.cat(outs))
    return x + block.fc2(F.gelu(block.fc1(block.ln2(x))))


def stage_forward(layers: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor,
                  segs: Sequence[Segment], caches: Sequence[dict[int, Any]]) -> torch.Tensor:
    """One stage on one iteration: token ids or hidden rows in; hidden rows, or the logits of
    the rows that yield a token when the stage holds the head, out. ``caches``: one per block
    of ``layers``, in order."""
    from pipeopt.executor.models import Block, Embedding, Head

    blocks = iter(caches)
    for layer in layers:
        if isinstance(layer, Embedding):
            x = layer.tok(x) + layer.pos[positions]
        elif isinstance(layer, Block):
            x = _block_step(layer, x, segs, next(blocks))
        elif isinstance(layer, Head):
            x = layer(x[[s.offset + s.tokens - 1 for s in segs if s.logit]])
        else:
            raise ExecutorError(f"layer {type(layer).__name__}: not a tiny-gpt layer")
    return x


# ----- one rank ------------------------------------------------------------------------------
def serve_rank(rank: int, world: int, device: Any, replay: Replay, opts: RunConfig,
               status: RankStatus | None = None) -> dict[str, Any]:
    """Run stage ``rank``'s iterations in its order (process group joined). Returns the
    tokens and logits of every request (last rank; others empty), the most KV entries held at
    once and those left at the end (per request, not per layer), and the wall time (s)."""
    import torch
    import torch.distributed as dist

    from pipeopt.executor.models import Block

    status = status or RankStatus()
    plan, s = replay.plan, replay.stages
    if world != s:
        raise ExecutorError(f"world size {world} does not match the plan's {s} stages")
    all_layers = build_layers(replay, opts)
    a, b_ = stage_bounds(len(all_layers), s)[rank]
    layers = [layer.to(device) for layer in all_layers[a:b_]]
    kw = model_kwargs(opts, plan, s)
    hidden = kw["hidden"]
    caches: list[dict[int, Any]] = [{} for layer in layers if isinstance(layer, Block)]
    prompts = prompt_tokens(plan, kw["vocab"], opts.seed)
    first, last = rank == 0, rank == s - 1
    f64 = torch.float64

    def buffer(key: tuple[str, int]) -> torch.Tensor:
        kind, b = key
        if kind == "hidden":
            return torch.empty(plan.iterations[b].tokens, hidden, dtype=f64, device=device)
        return torch.empty(len(replay.yielding(b)), dtype=torch.int64, device=device)

    mail = Mailbox(rank, [((m.kind, m.iteration), m.src, m.dst) for m in replay.messages],
                   buffer)

    def take(kind: str, b: int, src: int) -> torch.Tensor:
        status.text = (f"{status.text.split(';')[0]}; waiting for the {kind} of iteration {b} "
                       f"from rank {src}")
        return mail.take((kind, b))

    latest: dict[int, int] = {}  # first stage: each request's newest token
    applied: set[int] = set()
    previous: dict[tuple[int, int], int] = {}  # (request, iteration) -> its iteration before
    for r, its in enumerate(plan.request_iterations):
        for p, q in itertools.pairwise(its):
            previous[(r, q)] = p
    tokens: dict[int, list[int]] = {}
    logits: dict[int, list[torch.Tensor]] = {}
    held: dict[int, int] = {}  # request -> KV entries this stage holds for it
    peak = 0
    order = replay.orders[rank]
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        for n, b in enumerate(order):
            it, segs = plan.iterations[b], segments(plan, b)
            status.text = f"step {n + 1}/{len(order)}: iteration {b} on stage {rank}"
            if first:
                for seg in segs:
                    if last or seg.position < plan.requests[seg.request].prompt:
                        continue
                    p = previous[(seg.request, b)]  # a decode: the ring brings p's tokens
                    if p not in applied:
                        got = take("tokens", p, s - 1).tolist()
                        latest.update(zip(replay.yielding(p), got, strict=True))
                        applied.add(p)
                ids = [t for seg in segs for t in (
                    prompts[seg.request][seg.position:seg.position + seg.tokens]
                    if seg.position < plan.requests[seg.request].prompt
                    else (latest[seg.request],))]
                x = torch.tensor(ids, dtype=torch.int64, device=device)
            else:
                x = take("hidden", b, rank - 1)
            positions = torch.tensor([seg.position + i for seg in segs
                                      for i in range(seg.tokens)], device=device)
            out = stage_forward(layers, x, positions, segs, caches)
            for seg in segs:
                held[seg.request] = held.get(seg.request, 0) + seg.tokens
            peak = max(peak, sum(held.values()))
            if not last:
                mail.send(("hidden", b), out)
            elif out.shape[0]:
                picked = out.argmax(dim=-1)
                for r, tok, row in zip(replay.yielding(b), picked.tolist(), out, strict=True):
                    tokens.setdefault(r, []).append(tok)
                    logits.setdefault(r, []).append(row.cpu())
                if first:
                    latest.update(zip(replay.yielding(b), picked.tolist(), strict=True))
                elif replay.feeds_back(b):
                    mail.send(("tokens", b), picked)
            for r in it.finished:  # the request ends: its KV cache goes
                for cache in caches:
                    cache.pop(r, None)
                held.pop(r, None)
        status.text = f"step {len(order)}/{len(order)}: waiting for sends to finish"
        mail.finish()
        dist.barrier()  # no rank leaves while a peer still reads from it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    left = sum(held.values()) + sum(len(c) for c in caches)
    # numpy, not tensors: a tensor crosses to the parent as a shared-memory handle that needs
    # this process alive when it is read, and the rank ends once it has reported.
    return {"tokens": tokens, "logits": {r: torch.stack(v).numpy() for r, v in logits.items()},
            "peak_kv_tokens": peak, "kv_left": left, "wall_s": wall}


# ----- the reference and the run -----------------------------------------------------------
def reference_decode(replay: Replay, opts: RunConfig
                     ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every request decoded greedily alone in this process by the model's uncached forward
    (the whole sequence each step): its tokens and the logits of each."""
    import torch

    layers = build_layers(replay, opts)
    model = torch.nn.Sequential(*layers)
    prompts = prompt_tokens(replay.plan, model_kwargs(
        opts, replay.plan, replay.stages)["vocab"], opts.seed)
    tokens, logits = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (with the ranks, too)
    try:
        for r, req in enumerate(replay.plan.requests):
            seq, rows = list(prompts[r]), []
            for _ in range(req.output):  # the whole sequence through the model every step
                with torch.no_grad():
                    rows.append(model(torch.tensor([seq]))[0, -1])
                seq.append(int(rows[-1].argmax()))
            tokens.append(seq[len(prompts[r]):])
            logits.append(torch.stack(rows))
    finally:
        torch.set_num_threads(threads)
    return tokens, logits


@dataclass
class ServeResult:
    """A replayed serving plan: the tokens of every request, and with the check the
    reference's and the largest logit difference; per rank the most KV entries held at once
    (tokens, per request, not per layer) and those left at the end (0: all freed); times s."""

    method: str
    ranks: int
    iterations: int
    tokens: list[list[int]]
    wall_s: float
    peak_kv_tokens: list[int]
    kv_left: list[int]
    reference_tokens: list[list[int]] | None = None
    reference_s: float | None = None
    tokens_match: bool | None = None
    max_abs_logit_diff: float | None = None
    mismatched: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {"method": self.method, "ranks": self.ranks, "iterations": self.iterations,
                "requests": len(self.tokens), "tokens": self.tokens, "wall_s": self.wall_s,
                "peak_kv_tokens": self.peak_kv_tokens, "kv_left": self.kv_left,
                "reference_s": self.reference_s, "tokens_match": self.tokens_match,
                "max_abs_logit_diff": self.max_abs_logit_diff, "mismatched": self.mismatched}


def run_serving(replay: Replay, opts: RunConfig | None = None) -> ServeResult | None:
    """Replay ``replay`` on spawned gloo (or nccl) ranks, one per stage, or as this rank
    under torchrun (the result then on rank 0 only, None elsewhere); with ``opts.check``
    compare every request's tokens with :func:`reference_decode`."""
    opts = opts or RunConfig(model="tiny-gpt", check=True)
    build_layers(replay, opts)  # a model that cannot be built fails here, before any rank
    reports = start(serve_rank, replay.stages, (replay, opts), opts, opts.backend)
    return None if reports is None else _result(replay, opts, reports)


def _result(replay: Replay, opts: RunConfig, reports: Sequence[dict[str, Any]]
            ) -> ServeResult:
    """The result of every rank's report, checked against the reference on request."""
    got, logits = reports[-1]["tokens"], reports[-1]["logits"]
    n = len(replay.plan.requests)
    res = ServeResult(replay.method, replay.stages,
                      sum(1 for it in replay.plan.iterations if it.tokens),
                      [got.get(r, []) for r in range(n)], max(r["wall_s"] for r in reports),
                      [r["peak_kv_tokens"] for r in reports], [r["kv_left"] for r in reports])
    if opts.check:
        t0 = time.perf_counter()
        ref, ref_logits = reference_decode(replay, opts)
        res.reference_s = time.perf_counter() - t0
        res.reference_tokens = ref
        res.mismatched = [r for r in range(n) if res.tokens[r] != ref[r]]
        res.tokens_match = not res.mismatched
        res.max_abs_logit_diff = max(
            (float(abs(logits[r] - ref_logits[r].numpy()).max()) for r in range(n)
             if r in logits and logits[r].shape == tuple(ref_logits[r].shape)),
            default=math.inf)
    return res


# ----- pipeopt run ---------------------------------------------------------------------------
#: ``pipeopt run`` flags of training replays, refused for a served plan (flag, attribute).
TRAINING_FLAGS = (("--batch-size", "batch_size"), ("--clip-grad-norm", "clip_grad_norm"),
                  ("--autocast", "autocast"), ("--recompute", "recompute"),
                  ("--torch-split", "torch_split"), ("--costs-out", "costs_out"))


def check_serve_args(args: argparse.Namespace) -> tuple[Replay, RunConfig]:
    """Check ``pipeopt run``'s flags for a served plan and load it, importing no torch;
    ConfigError naming the flag."""
    from pipeopt.graphio import load_graph_schedule

    refuse([(flag, getattr(args, attr, None), f"applies to training schedules; "
             f"{args.schedule} is a served inference plan (forward only)")
            for flag, attr in TRAINING_FLAGS]
           + [("--data-parallel", getattr(args, "data_parallel", 1) != 1, "applies to training "
               "schedules; a served plan runs one pipeline"),
              ("--model", args.model != "tiny-gpt", "a served plan replays on tiny-gpt (its "
               f"KV-cached forward is written for it), got {args.model!r}")])
    sched = load_graph_schedule(args.schedule)
    try:
        replay = replay_of(sched, getattr(args, "max_prompt", None),
                           getattr(args, "max_output", None))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_run_flags(args, replay.stages)
    opts = RunConfig.from_args(args)
    model_kwargs(opts, replay.plan, replay.stages)  # its ConfigErrors before torch
    return replay, opts


def cmd_run_serving(args: argparse.Namespace) -> int:
    """``pipeopt run`` of a served plan: replay it, print what came out; exit 1 when a
    request's tokens differ from the one-process decode (``--check``; a failed rank:
    :func:`~pipeopt.executor.cli.cmd_run`)."""
    replay, opts = check_serve_args(args)
    check_nccl(opts.backend)
    res = run_serving(replay, opts)
    if res is None:  # a torchrun rank other than 0
        return 0
    bad = bool(opts.check and not res.tokens_match)
    plan, kw = replay.plan, model_kwargs(opts, replay.plan, replay.stages)
    if args.json:
        print(json.dumps({**res.to_dict(), "schedule": args.schedule, "model": "tiny-gpt",
                          "model_args": kw}))
        return 1 if bad else 0
    capped = getattr(args, "max_prompt", None) or getattr(args, "max_output", None)
    print(f"schedule      {args.schedule} ({res.method}, served plan, {res.ranks} ranks)")
    print(f"model         tiny-gpt {', '.join(f'{k}={v}' for k, v in kw.items())} (float64), "
          f"not the planned model")
    print(f"requests      {len(plan.requests)}: prompts {min(r.prompt for r in plan.requests)}"
          f"-{max(r.prompt for r in plan.requests)} tokens, outputs "
          f"{min(r.output for r in plan.requests)}-{max(r.output for r in plan.requests)}"
          f"{' (capped)' if capped else ''}; {res.iterations} "
          f"iterations")
    print(f"replay        {res.wall_s:.4g} s, {plan.output_tokens / res.wall_s:.4g} tokens/s "
          "on this machine")
    print(f"KV cache      at most {', '.join(map(str, res.peak_kv_tokens))} tokens' entries "
          f"held at once per rank (in each of its blocks); {sum(res.kv_left)} left at the end")
    if opts.check:
        verdict = "ok" if res.tokens_match else f"MISMATCH in requests {res.mismatched[:10]}"
        print(f"check         tokens equal a one-process greedy decode: {verdict} (max logit "
              f"diff {res.max_abs_logit_diff:.3g}; reference {res.reference_s:.3g} s)")
    return 1 if bad else 0
