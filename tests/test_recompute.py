"""Recomputation per stage (issue 16 item 2, AdaPipe-style): the partition search chooses each
stage's mode jointly with the layer split; hand-computed cases, brute force against the DP and
the ILP, and the model form against every uniform recomputation."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeopt
from pipeopt.config import ConfigError, parse_config
from pipeopt.costs import describe_partition
from pipeopt.io import schedule_json
from pipeopt.partition import (
    PartitionError,
    chain_costs,
    choose_modes,
    evaluate,
    inflight_microbatches,
    with_modes,
)
from pipeopt.partition.dp import best_partition, exhaustive_partition
from pipeopt.partition.ilp import ilp_partition

MODES = ("none", "selective", "full")


def moded(compute, activation, time_factor, act_factor, **kw):
    """Chain costs whose mode m multiplies compute by time_factor[m] and activations by
    act_factor[m] (recomputation: slower backward, fewer bytes kept)."""
    comp = np.asarray(compute, float)
    act = np.asarray(activation, float)
    return with_modes([(name, chain_costs(comp * tf, activation=act * af, **kw))
                       for name, tf, af in zip(MODES, time_factor, act_factor, strict=True)])


# ----- a case by hand -------------------------------------------------------------------------
def hand_case(limit=9.0):
    """4 layers of 1 s and 4 activation bytes (none), 2 stages, 3 micro-batches, 1F1B in
    flight (2, 1), no static bytes, limit 9 bytes per device. Selective: 1.1 s, 2 bytes;
    full: 1.5 s, 1 byte. With recompute none, stage 0 holds 2 micro-batches: 1 layer (8
    bytes) leaves 3 layers (12 bytes) to stage 1, 2 or 3 layers need 16 or 24 bytes: nothing
    fits. Per stage: stage 0 on layers 0-1 in selective (2 x 2 x 2 = 8 bytes, 2.2 s), stage 1
    on layers 2-3 in none (8 bytes, 2 s); the splits 1 + 3 (1 s none, 3.3 s selective:
    10.9 s) and 3 + 1 (4.5 s full, 1 s none: 14.5 s) are worse."""
    return moded([1.0] * 4, [4.0] * 4, (1.0, 1.1, 1.5), (1.0, 0.5, 0.25), stages=2,
                 inflight=[2, 1], device_limit=limit, microbatches=3)


def test_per_stage_fits_where_no_recompute_does_not():
    costs = hand_case()
    with pytest.raises(PartitionError, match="over its limit"):
        best_partition(costs.only(0))
    res = best_partition(costs)
    assert res.partition == ((0, 2), (2, 4))
    assert res.evaluation.modes == ("selective", "none")
    # sum of stage times + (m - 1) x the largest: 2.2 + 2 + 2 x 2.2 = 8.6 s
    assert res.evaluation.objective == pytest.approx(8.6)
    assert res.evaluation.stage_memory == pytest.approx((8.0, 8.0))
    # Uniform selective: stages (0-1, 2-3) of 2.2 s each: 2.2 + 2.2 + 2 x 2.2 = 8.8 s (it
    # also fits (0-2, 3): stage 0 needs 2 x 6 = 12 bytes, no). Uniform full: 3 + 3 + 2 x 3.
    assert best_partition(costs.only(1)).evaluation.objective == pytest.approx(8.8)
    assert best_partition(costs.only(2)).evaluation.objective == pytest.approx(12.0)
    assert ilp_partition(costs).evaluation.objective == pytest.approx(8.6)


def test_choose_modes_takes_the_fastest_that_fit_per_device():
    costs = hand_case()
    assert choose_modes(costs, ((0, 2), (2, 4))) == (1, 0)
    assert choose_modes(costs, ((0, 3), (3, 4))) == (2, 0)  # 3 layers x 1 byte x 2 = 6
    # Nothing fits stage 0 of three layers at a limit of 1 byte: its leanest mode.
    assert choose_modes(hand_case(limit=1.0), ((0, 3), (3, 4))) == (2, 2)
    ev = evaluate(costs, ((0, 3), (3, 4)), (0, 0))
    assert not ev.fits and ev.modes == ("none", "none")
    with pytest.raises(ValueError, match="modes: expected 2 indices"):
        evaluate(costs, ((0, 3), (3, 4)), (0,))


def test_with_modes_refuses_options_that_differ_in_more_than_costs():
    a = chain_costs([1.0, 1.0], stages=2, static=[1.0, 1.0])
    b = chain_costs([2.0, 2.0], stages=2, static=[0.0, 1.0])
    with pytest.raises(ValueError, match="only compute and activation may differ"):
        with_modes([("none", a), ("full", b)])
    with pytest.raises(ValueError, match="distinct"):
        with_modes([("none", a), ("none", a)])


# ----- brute force ----------------------------------------------------------------------------
def brute(costs, per_device=False):
    """The best pipeline objective over every partition and every mode of every stage,
    written out from the formula: sum of stage times and boundary delays + (m-1) x the
    busiest device's time; memory per stage (its share of the limit) or per device."""
    n, s = costs.layers, costs.stages
    best = np.inf
    for cuts in itertools.combinations(range(1, n), s - 1):
        part = list(itertools.pairwise([0, *cuts, n]))
        for modes in itertools.product(range(costs.modes), repeat=s):
            t = [costs.compute_of(m)[k, a:b].sum() for k, ((a, b), m) in
                 enumerate(zip(part, modes, strict=True))]
            mem = [costs.static[a:b].sum() + costs.inflight[k] * costs.activation_of(m)[a:b].sum()
                   for k, ((a, b), m) in enumerate(zip(part, modes, strict=True))]
            load, dev = {}, {}
            for k, d in enumerate(costs.stage_device):
                load[d] = load.get(d, 0.0) + t[k]
                dev[d] = dev.get(d, 0.0) + mem[k]
            if per_device:
                ok = all(dev[d] <= costs.device_limit[d] * (1 + 1e-9) for d in dev)
            else:
                ok = all(mem[k] <= costs.stage_limit[k] * (1 + 1e-9) for k in range(s))
            if not ok:
                continue
            comm = sum(costs.comm[k, b - 1] for k, (_, b) in enumerate(part[:-1]))
            best = min(best, sum(t) + comm + (costs.microbatches - 1) * max(load.values()))
    return best


@st.composite
def moded_chains(draw, virtual=False):
    n = draw(st.integers(2, 6))
    p = draw(st.integers(1, 2)) if virtual else draw(st.integers(1, min(n, 3)))
    s = 2 * p if virtual else p
    if s > n:
        s, p = n, n  # fall back to one stage per device
        virtual = False
    val = st.floats(0.0, 3.0, allow_nan=False)
    comp = [[draw(val) for _ in range(n)] for _ in range(s)]
    act = [draw(st.floats(0.0, 1.0)) for _ in range(n)]
    slow = sorted(draw(st.floats(1.0, 2.0)) for _ in range(2))
    lean = sorted((draw(st.floats(0.0, 1.0)) for _ in range(2)), reverse=True)
    kw = dict(stages=s, static=[draw(st.floats(0.0, 1.0)) for _ in range(n)],
              comm=[[draw(st.floats(0.0, 1.0)) for _ in range(n)] for _ in range(s - 1)]
              if s > 1 else None,
              inflight=inflight_microbatches(p, s // p, 4),
              device_limit=draw(st.sampled_from([None, 1.0, 2.0, 4.0])),
              microbatches=draw(st.integers(1, 6)))
    if virtual:
        kw["stage_device"] = [k % p for k in range(s)]
    return moded(comp, act, (1.0, *slow), (1.0, *lean), **kw)


@given(moded_chains())
def test_dp_chooses_modes_as_brute_force(costs):
    want = brute(costs)
    assert exhaustive_partition(costs)[0] == pytest.approx(want, rel=1e-9, abs=1e-12)
    if want == np.inf:
        with pytest.raises(PartitionError, match="over its limit"):
            best_partition(costs)
        return
    ev = best_partition(costs).evaluation
    assert ev.fits and ev.objective == pytest.approx(want, rel=1e-9, abs=1e-12)
    # Never worse than any mode on every stage.
    for m in range(costs.modes):
        try:
            uniform = best_partition(costs.only(m)).evaluation.objective
        except PartitionError:
            continue
        assert ev.objective <= uniform * (1 + 1e-9) + 1e-12


@settings(max_examples=25, deadline=None)
@given(moded_chains(virtual=True))
def test_ilp_chooses_modes_per_device_as_brute_force(costs):
    want = brute(costs, per_device=True)
    if want == np.inf:
        with pytest.raises(PartitionError):
            ilp_partition(costs)
        return
    ev = ilp_partition(costs).evaluation
    assert ev.fits and ev.objective == pytest.approx(want, rel=1e-6, abs=1e-9)


# ----- the model form -------------------------------------------------------------------------
def cfg(recompute, limit, **training):
    """A 10-layer model on 4 A100s whose memory binds at a few tens of MB per device."""
    return {"pipeline": {"devices": 4, "microbatches": 8},
            "model": {"layers": 8, "hidden": 256, "heads": 4, "seq_len": 512, "vocab": 1000,
                      "recompute": recompute},
            "cluster": {"gpu": "A100-80GB", "gpus_per_node": 4},
            "memory": {"limit": limit}, "training": training}


def search(recompute, limit, **training):
    """(config, partition_search report), or None when the model does not fit with the
    in-flight counts assumed (no partition, or only with one micro-batch in flight)."""
    try:
        c = parse_config(cfg(recompute, limit, **training))
    except ConfigError:
        return None
    rep = dict(c.problem.meta)["partition_search"]
    return None if "inflight_fallback" in rep else (c, rep)


def test_model_form_fits_where_no_recompute_does_not():
    # 5.5e7: at 5e7 every stage needs full once the backward's recompute transient (one
    # block's recomputed activations) is counted too (issue 18 item 1).
    assert search("none", 5.5e7) is None
    c, rep = search("per_stage", 5.5e7)
    modes = [r["recompute"] for r in dict(c.problem.meta)["stage_costs"]]
    assert modes == rep["recompute"] and len(set(modes)) > 1  # only some stages need more
    assert all(r["memory_estimate_bytes"] <= 5.5e7 for r in dict(c.problem.meta)["stage_costs"])
    sched = pipeopt.solve(c.problem, "greedy", time_limit=2)
    assert max(sched.peak_memory) <= 5.5e7


@pytest.mark.parametrize("limit", [5e7, 6e7, 7e7, 9e7, 1.2e8])
def test_model_form_never_worse_than_uniform_recompute(limit):
    # Analytic objective of the exact DP: per stage searches a superset of every uniform
    # mode's (partition, modes) pairs.
    _, per = search("per_stage", limit)
    for mode in MODES:
        got = search(mode, limit)
        if got is not None:
            assert per["analytic_objective_s"] <= got[1]["analytic_objective_s"] * (1 + 1e-9)
    # Scheduled iteration time, the joint search with the same (deterministic) scheduler.
    joint = dict(partition="joint", joint_method="classic", top_k=2)
    c, per = search("per_stage", limit, **joint)

    def best(rep):
        return min(x["iteration_time_s"] for x in rep["candidates"]
                   if x["iteration_time_s"] is not None)

    from pipeopt.solvers.auto import best_classic

    assert best(per) == pytest.approx(best_classic(c.problem).iteration_time)
    for mode in MODES:
        got = search(mode, limit, **joint)
        if got is not None:
            assert best(per) <= best(got[1]) * (1 + 1e-9)


def test_fused_backward_only_where_full_recompute_pays():
    # Loose memory: no stage needs full recomputation, the backward stays split.
    c, rep = search("per_stage", 1.2e8)
    assert c.problem.split_backward and "full" not in rep["recompute"]
    kept = [w for w in rep["recompute_worlds"] if w["kept"]]
    assert len(rep["recompute_worlds"]) == 2 and kept[0]["split_backward"]
    # Tight memory: only full recomputation on some stages fits the 1F1B counts, so the
    # backward is fused (the known simplification) and said so.
    c, rep = search("per_stage", 5e7)
    assert not c.problem.split_backward and "full" in rep["recompute"]
    assert any("recompute: per_stage runs full" in n for n in dict(c.problem.meta)["notes"])
    text = describe_partition(c)
    assert "recompute per stage: " in text and "backward fused" in text
    header, *rows = text.splitlines()
    assert header.rstrip().endswith("recompute")
    assert [r.split()[-1] for r in rows[:4]] == rep["recompute"]
    # The schedule JSON carries each stage's mode.
    doc = json.loads(schedule_json(pipeopt.solve(c.problem, "greedy", time_limit=2)))
    assert [r["recompute"] for r in doc["problem"]["meta"]["stage_costs"]] == rep["recompute"]


def test_split_backward_asked_for_leaves_full_out():
    doc = cfg("per_stage", 5e7)
    doc["pipeline"]["split_backward"] = True
    # Without full recomputation 5e7 bytes fit only one micro-batch in flight per stage.
    rep = dict(parse_config(doc).problem.meta)["partition_search"]
    assert "inflight_fallback" in rep and "full" not in rep["recompute"]
    doc["memory"]["limit"] = 7e7
    c = parse_config(doc)
    rep = dict(c.problem.meta)["partition_search"]
    assert c.problem.split_backward and "full" not in rep["recompute"]
    assert "recompute_worlds" not in rep
    assert "chooses among none and selective only" in dict(c.problem.meta)["notes"][0]
    # A fused backward asked for: one search, full allowed.
    doc["pipeline"]["split_backward"] = False
    doc["memory"]["limit"] = 5e7
    c = parse_config(doc)
    assert "full" in dict(c.problem.meta)["partition_search"]["recompute"]


def test_uniform_modes_give_their_mode_in_stage_costs():
    c = parse_config(cfg("selective", 1.2e8))
    assert {r["recompute"] for r in dict(c.problem.meta)["stage_costs"]} == {"selective"}
    assert "recompute per stage" not in describe_partition(c)


def test_per_stage_with_virtual_stages_and_sequence_lengths():
    doc = cfg("per_stage", 6e7)
    doc["pipeline"]["virtual_stages"] = 2
    c = parse_config(doc)
    meta = dict(c.problem.meta)
    assert len(meta["stage_costs"]) == 8
    assert meta["partition_search"]["method"] in ("ilp", "dp")
    # With micro-batches of different length, each stage's rows of the time and memory
    # tables are those of the uniform model in the stage's mode (the ratios are per layer).
    from pipeopt.costs.build import make_plan
    from pipeopt.schema import ConfigFile

    lengths = {"sequence_lengths": [512, 256, 384, 512, 128, 512, 256, 512],
               "stage_layers": [3, 2, 2, 3]}
    part = ((0, 3), (3, 5), (5, 7), (7, 10))
    plan = make_plan(ConfigFile.model_validate(cfg("per_stage", None, **lengths)))
    with pytest.raises(ValueError, match=r"among \['none', 'selective'\]"):
        plan.problem(part, recompute=["none", "selective", "full", "selective"])
    fused = plan.fused_world()
    mixed = fused.problem(part, recompute=["none", "selective", "full", "selective"])
    assert not mixed.split_backward
    for k, mode in enumerate(["none", "selective", "full", "selective"]):
        doc = cfg(mode, None, **lengths)
        doc["pipeline"]["split_backward"] = False
        same = parse_config(doc).problem
        for field in ("forward", "backward_input", "activation_memory"):
            assert getattr(mixed, field)[k] == pytest.approx(getattr(same, field)[k])
        assert mixed.time_table[k] == pytest.approx(same.time_table[k])
        assert mixed.memory_table[k] == pytest.approx(same.memory_table[k])
    with pytest.raises(ValueError, match="recompute: expected 4 modes"):
        plan.problem(part, recompute=["none"])


def test_chunk_variants_search_modes_too():
    """The v = 2 chunkings that auto may choose are built with their own per-stage modes."""
    from pipeopt.costs.chunks import chunk_variants

    c = parse_config(cfg("per_stage", 7e7))
    variants = {v.label: v for v in chunk_variants(c)}
    v2 = variants["v=2 vshape"].problem
    assert v2 is not None
    rows = dict(v2.meta)["stage_costs"]
    assert len(rows) == 8 and all(r["recompute"] in MODES for r in rows)


def test_per_stage_needs_a_transformer_shape():
    with pytest.raises(ConfigError, match=r"^model\.recompute: not used with model\.layer_costs"):
        parse_config({"pipeline": {"devices": 2, "microbatches": 4},
                      "model": {"layer_costs": [{"forward": 1.0, "count": 4}],
                                "recompute": "per_stage"},
                      "cluster": {"gpus_per_node": 2}})
    with pytest.raises(ConfigError, match=r"^model\.recompute: must be 'none', 'selective', "
                                          r"'full' or 'per_stage'"):
        parse_config(cfg("adaptive", None))


@pytest.mark.parametrize("training", [{"partition": "uniform"},
                                      {"stage_layers": [2, 2, 3, 3]}])
def test_given_partitions_get_the_fastest_modes_that_fit(training):
    """A partition not searched (uniform, explicit) runs each stage in the fastest mode whose
    memory estimate fits: every faster mode of that stage would be over the limit (with the
    recompute transient the search keeps free on every device, the largest of the modes',
    in place of the stage's own: issue 18 item 1)."""
    from pipeopt.costs.build import make_plan
    from pipeopt.schema import ConfigFile

    c, _ = search("per_stage", 6e7, **training)
    meta = dict(c.problem.meta)
    part = tuple(tuple(x) for x in meta["partition"])
    plan = make_plan(ConfigFile.model_validate(cfg("per_stage", 6e7, **training)))
    world = plan if c.problem.split_backward else (plan.fused_world() or plan)
    checked = 0
    for r in meta["stage_costs"]:
        assert r["memory_estimate_bytes"] <= 6e7
        for faster in MODES[:MODES.index(r["recompute"])]:
            row = plan.resolved(part, (faster,) * 4).stage_costs(part)[r["stage"]]
            kept = (row["memory_estimate_bytes"] - row["backward_transient_bytes"]
                    + world.transient_reserve())
            assert kept > 6e7
            checked += 1
    assert checked > 0  # some stage needed more than recompute none
