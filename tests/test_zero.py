"""ZeRO stages 0-3 in the cost model (Rajbhandari et al., SC'20): bytes per parameter against
the paper's figure 1, communication bytes per step against its section 7, and a tiny model's
memory per GPU and collective seconds per op checked by hand in the built problem."""

from __future__ import annotations

from typing import Any

import pytest

from pipeopt.config import ConfigError, parse_config
from pipeopt.costs.build import make_plan
from pipeopt.costs.collectives import all_gather_time, all_reduce_time, reduce_scatter_time
from pipeopt.costs.zero import (
    zero_bytes_per_param,
    zero_comm_bytes,
    zero_op_comm_times,
    zero_step_comm_time,
    zero_transient_bytes,
)
from pipeopt.graph_config import load_dataparallel
from pipeopt.schema import ConfigFile


def test_bytes_per_param_reproduce_the_papers_figure_1() -> None:
    """Figure 1 of the paper: Psi = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB."""
    psi = 7.5e9
    gb = [psi * zero_bytes_per_param(s, 16.0, 64) / 1e9 for s in range(4)]
    assert gb[0] == 120.0
    assert gb[1] == pytest.approx(31.4, abs=0.05)   # (2 + 2 + 12/64) Psi
    assert gb[2] == pytest.approx(16.6, abs=0.05)   # (2 + 14/64) Psi
    assert gb[3] == pytest.approx(1.9, abs=0.05)    # 16/64 Psi
    # One replica: nothing to shard.
    assert {zero_bytes_per_param(s, 16.0, 1) for s in range(4)} == {16.0}


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match="zero_stage: must be one of"):
        zero_bytes_per_param(4, 16.0, 2)
    with pytest.raises(ValueError, match="data_parallel: must be an integer >= 1"):
        zero_op_comm_times(3, 1.0, 0, 1e-6, 1e9)
    with pytest.raises(ValueError, match=r"bytes_per_param: must be >= 4 \(what ZeRO-1"):
        zero_bytes_per_param(1, 3.0, 2)
    with pytest.raises(ValueError, match="microbatches: must be an integer >= 1"):
        zero_comm_bytes(2, 1.0, 2, 0)


def test_comm_bytes_per_step_by_hand() -> None:
    """1000 parameters, 4 replicas, 3 micro-batches, 2-byte gradients and weights: each ring
    collective sends 3/4 of its buffer (G = W = 2000 bytes)."""
    assert zero_comm_bytes(0, 1000, 4, 3) == 2 * 0.75 * 2000 == 3000   # all-reduce
    assert zero_comm_bytes(1, 1000, 4, 3) == 3000                       # section 7.2.1
    assert zero_comm_bytes(2, 1000, 4, 3) == 0.75 * (3 * 2000 + 2000) == 6000
    assert zero_comm_bytes(3, 1000, 4, 3) == 0.75 * 3 * (2 * 2000 + 2000) == 13500
    # One micro-batch: ZeRO-2 moves the all-reduce's bytes, ZeRO-3 1.5 times them (ZeRO,
    # sections 7.2.1 and 7.2.2).
    base = zero_comm_bytes(0, 1000, 4, 1)
    assert zero_comm_bytes(2, 1000, 4, 1) == base
    assert zero_comm_bytes(3, 1000, 4, 1) == 1.5 * base


def test_op_and_step_seconds_by_hand() -> None:
    """A 1e6-parameter layer over 4 replicas at 1e-5 s and 1e10 B/s per hop: a ring all-gather
    of 2e6 bytes is 3 (1e-5 + 5e5 / 1e10) = 1.8e-4 s, the reduce-scatter as long."""
    one = 3 * (1e-5 + 2e6 / 4 / 1e10)
    assert one == pytest.approx(1.8e-4)
    assert zero_op_comm_times(0, 1e6, 4, 1e-5, 1e10) == (0.0, 0.0, 0.0)
    assert zero_op_comm_times(1, 1e6, 4, 1e-5, 1e10) == (0.0, 0.0, 0.0)
    assert zero_op_comm_times(2, 1e6, 4, 1e-5, 1e10) == pytest.approx((0.0, 0.0, one))
    assert zero_op_comm_times(3, 1e6, 4, 1e-5, 1e10) == pytest.approx((one, one, one))
    assert zero_step_comm_time(0, 1e6, 4, 1e-5, 1e10) == pytest.approx(2 * one)
    assert zero_step_comm_time(1, 1e6, 4, 1e-5, 1e10) == pytest.approx(2 * one)
    assert zero_step_comm_time(2, 1e6, 4, 1e-5, 1e10) == pytest.approx(one)
    assert zero_step_comm_time(3, 1e6, 4, 1e-5, 1e10) == 0.0
    assert zero_op_comm_times(3, 1e6, 1, 1e-5, 1e10) == (0.0, 0.0, 0.0)
    assert zero_transient_bytes(2, 1e6, 4) == 2e6
    assert zero_transient_bytes(3, 1e6, 4) == 4e6
    assert zero_transient_bytes(1, 1e6, 4) == 0.0


# ----- the tiny model in the model form ----------------------------------------------------
# h = 64, s = 32, V = 128, learned positions, untied head: a block holds 12h^2 + 13h = 49,984
# parameters, the embedding Vh + sh = 10,240, the head (final layer norm and its own
# projection) 2h + Vh = 8,320. Two pipeline ranks, even split: [embedding, block0, block1] =
# 110,208 and [block2, block3, head] = 108,288 parameters; two replicas.
BLOCK, EMB, HEAD = 12 * 64**2 + 13 * 64, 128 * 64 + 32 * 64, 2 * 64 + 128 * 64
STAGE_PARAMS = (EMB + 2 * BLOCK, 2 * BLOCK + HEAD)


def tiny_config(zero: int, **training: Any) -> dict[str, Any]:
    return {
        "pipeline": {"devices": 2, "microbatches": 4},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128},
        "cluster": {"gpu": "A100-80GB", "nodes_per_datacenter": 2, "gpus_per_node": 2,
                    "peak_flops": 1e12, "compute_efficiency": 1.0},
        "training": {"data_parallel": 2, "zero_stage": zero, "partition": "uniform",
                     **training},
    }


def _plan_and_problem(zero: int) -> tuple[Any, Any]:
    data = tiny_config(zero)
    plan = make_plan(ConfigFile.model_validate(data))
    return plan, parse_config(data).problem


def test_params_of_the_tiny_model_by_hand() -> None:
    plan, problem = _plan_and_problem(0)
    assert [lc.params for lc in plan.layers] == [EMB, BLOCK, BLOCK, BLOCK, BLOCK, HEAD]
    assert STAGE_PARAMS == (110_208, 108_288)
    assert problem.static_memory == (16 * 110_208, 16 * 108_288)


@pytest.mark.parametrize(("zero", "expected"), [
    # ZeRO-0: 16 bytes per parameter.
    (0, (16 * 110_208, 16 * 108_288)),
    # ZeRO-1: 2 + 2 + 12/2 = 10 bytes per parameter.
    (1, (10 * 110_208, 10 * 108_288)),
    # ZeRO-2: 2 + 14/2 = 9 bytes, plus one block's full 2-byte gradients before their
    # reduce-scatter: 2 x 49,984.
    (2, (9 * 110_208 + 2 * 49_984, 9 * 108_288 + 2 * 49_984)),
    # ZeRO-3: 16/2 = 8 bytes, plus one block's gathered weights and full gradients: 4 x 49,984.
    (3, (8 * 110_208 + 4 * 49_984, 8 * 108_288 + 4 * 49_984)),
])
def test_memory_per_gpu_by_hand(zero: int, expected: tuple[int, int]) -> None:
    """Bytes per GPU of weights, gradients and optimizer state in the built problem."""
    _, problem = _plan_and_problem(zero)
    assert problem.static_memory == pytest.approx(expected, rel=1e-15)
    assert expected[0] == {0: 1_763_328, 1: 1_102_080, 2: 1_091_840, 3: 1_081_600}[zero]


def test_collective_seconds_in_the_ops_by_hand() -> None:
    """ZeRO-3 adds to each F, per layer of the stage, a ring all-gather of its 2-byte weights
    over the 2 replicas, the same to each B, and a reduce-scatter of its gradients to each W;
    ZeRO-2 only the reduce-scatter in W. Stage 0 runs its whole backward in W (its input
    takes no gradient), so its W carries the B's gathers too. After the step: the all-reduce
    (ZeRO-0/1), the weights' all-gather (ZeRO-2), nothing (ZeRO-3)."""
    base_plan, base = _plan_and_problem(0)
    assert base_plan.dp_links == ()  # only ZeRO-2/3 time collectives per micro-batch
    for zero in (2, 3):
        plan, prob = _plan_and_problem(zero)
        assert len(plan.dp_links) == 2
        stage_layers = ([EMB, BLOCK, BLOCK], [BLOCK, BLOCK, HEAD])
        for k, layers in enumerate(stage_layers):
            lat, bw = plan.dp_links[k]
            gather = sum((1 / 2) * 2 * p / bw + lat for p in layers)    # (n-1)(a + 2P/n/B)
            scatter = sum((1 / 2) * 2 * p / bw + lat for p in layers)   # 2-byte gradients
            assert gather == pytest.approx(sum(all_gather_time(2, 2 * p, lat, bw)
                                               for p in layers))
            df = prob.forward[k] - base.forward[k]
            db = prob.backward_input[k] - base.backward_input[k]
            dw = prob.backward_weight[k] - base.backward_weight[k]
            if zero == 2:
                assert (df, db) == (0.0, 0.0)
                assert dw == pytest.approx(scatter, rel=1e-12)
                assert prob.grad_reduce[k] == pytest.approx(
                    all_gather_time(2, 2 * STAGE_PARAMS[k], lat, bw), rel=1e-12)
            else:
                assert df == pytest.approx(gather, rel=1e-12)
                if k == 0:
                    assert db == 0.0
                    assert dw == pytest.approx(gather + scatter, rel=1e-12)
                else:
                    assert db == pytest.approx(gather, rel=1e-12)
                    assert dw == pytest.approx(scatter, rel=1e-12)
                assert prob.grad_reduce[k] == 0.0
            assert reduce_scatter_time(2, 2 * BLOCK, lat, bw) > 0
    # ZeRO-0 and ZeRO-1 pay one all-reduce per stage after the step, nothing per op.
    one = parse_config(tiny_config(1)).problem
    assert one.forward == base.forward and one.backward_weight == base.backward_weight
    assert one.grad_reduce == base.grad_reduce
    x = base_plan.dp_ring_links([p * 2 / 2 for p in STAGE_PARAMS])
    for k in range(2):
        assert base.grad_reduce[k] == pytest.approx(
            all_reduce_time(2, 2 * STAGE_PARAMS[k], x[k].latency, x[k].bandwidth), rel=1e-12)


def test_model_form_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"training\.zero_stage"):
        parse_config(tiny_config(4))
    with pytest.raises(ConfigError, match=r"training\.bytes_per_param: must be >= 2 \(what "
                       r"ZeRO-2 keeps whole\), got 1 with training\.zero_stage: 2"):
        parse_config(tiny_config(2, bytes_per_param=1.0))
    with pytest.raises(ConfigError, match=r"training\.sequence_lengths: cannot be combined "
                       r"with training\.zero_stage: 2"):
        parse_config(tiny_config(2, sequence_lengths=[32, 16, 8, 4]))
    with pytest.raises(ConfigError, match=r"training\.zero_stage: 3 is modelled with "
                       r"training\.collectives: scalar only"):
        load_dataparallel(tiny_config(3, collectives="scheduled"))
