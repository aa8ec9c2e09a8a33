#!/usr/bin/env bash
# GPU check of the executor (issue 17): profile a GPT on the GPU, solve schedules on that
# profile, run them with nccl, and print predicted against measured step and op times, the
# gradient check and the Kendall tau of the two rankings.
#   >= 2 GPUs: one rank per GPU (up to 4), methods 1f1b, zb-h1, greedy.
#   1 GPU:     a single-GPU stage-timing check: two stages on the one GPU (a 1-device problem
#              with 2 virtual stages), op times measured with CUDA events against the profile.
# Needs CUDA GPUs and torch 2.13 (pip install 'pipeopt[torch]'); CI never runs it. The
# gradient check compares with one process on the CPU: expect differences of float32 sums in
# another order (grads_match may read False at rtol = atol = 1e-5; max_abs_grad_diff says
# by how much).
#   bash benchmarks/gpu_check.sh            # PYTHON=... to choose the interpreter
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # dry run of the same steps: CPU, gloo,
#                                                  # 2 ranks, a small model (no GPU needed)
set -euo pipefail

PY=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${GPU_CHECK_CPU:-}" ]; then
    device=cpu; backend=gloo; ngpu=2
    layers=2; hidden=32; heads=2; vocab=64; seq=16; mb=2; m=4; steps=3
else
    device=cuda; backend=nccl
    ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    if [ "$ngpu" -lt 1 ]; then
        echo "gpu_check: no CUDA GPU visible to torch $("$PY" -c 'import torch; print(torch.__version__)')" \
             "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); this check needs at least one" >&2
        exit 2
    fi
    "$PY" -c "import torch; print('gpu_check:', torch.__version__, torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
    layers=8; hidden=512; heads=8; vocab=8192; seq=256; mb=8; m=8; steps=6
fi
model_args=(--model tiny-gpt --model-arg layers=$layers --model-arg hidden=$hidden
            --model-arg heads=$heads --model-arg vocab=$vocab --model-arg seq_len=$seq)

echo "== profile: tiny-gpt, $layers blocks, hidden $hidden, seq $seq, micro-batch $mb ($device)"
"$PY" -m pipeopt profile --model tiny-gpt --layers $layers --hidden $hidden --heads $heads \
    --vocab $vocab --seq-len $seq --batch-size $mb --device $device --warmup 3 --repeats 10 \
    -o "$work/profile.json"

if [ "$ngpu" -ge 2 ]; then
    ranks=$(( ngpu < 4 ? ngpu : 4 ))
    pipeline="{devices: $ranks, microbatches: $m}"
    methods=(1f1b zb-h1 greedy)
    echo "== $ranks ranks, one per device, $backend"
else
    pipeline="{devices: 1, microbatches: $m, virtual_stages: 2}"
    methods=(interleaved-1f1b greedy)  # one device: the schedules for 2 stages on it
    echo "== 1 GPU: single-GPU stage-timing check (2 stages on GPU 0)"
fi
printf 'pipeline: %s\nmodel: {profile: profile.json}\n' "$pipeline" > "$work/cfg.yaml"

printf '%-17s %14s %14s %8s\n' method predicted_ms measured_ms error
for method in "${methods[@]}"; do
    "$PY" -m pipeopt solve "$work/cfg.yaml" --method "$method" -o "$work/$method.json" --quiet \
        > "$work/$method.solve.txt"
    rc=0  # exit 1 is a gradient mismatch (reported below) or a failed rank (its message)
    "$PY" -m pipeopt run "$work/$method.json" "${model_args[@]}" --backend $backend \
        --steps $steps --batch-size $(( mb * m )) --check --json > "$work/$method.out" || rc=$?
    if [ ! -s "$work/$method.out" ]; then
        echo "$method: pipeopt run failed (exit $rc)"; continue
    fi
    "$PY" - "$work/$method.json" "$work/$method.out" "$method" <<'EOF'
import json
import sys

from pipeopt.io import load_schedule

sched = load_schedule(sys.argv[1])
res = json.loads(open(sys.argv[2]).read())
pred, meas = res["predicted_step_time"], res["step_time"]
print(f"{sys.argv[3]:<17} {pred * 1e3:14.2f} {meas * 1e3:14.2f} {meas / pred - 1:+8.1%}"
      f"   grads_match={res['grads_match']} (max diff {res['max_abs_grad_diff']:.2g})"
      "  peak MiB/rank=" + ",".join(f"{x / 2**20:.0f}" for x in res["peak_memory"]))
prob = sched.problem
for k in range(prob.stages):
    got = "  ".join(f"{kind} {res['op_costs'].get(f'{k}{kind}', float('nan')) * 1e3:.3f}/"
                    f"{prob.durations[kind][k] * 1e3:.3f}" for kind in prob.kinds)
    print(f"    stage {k} op ms measured/predicted: {got}")
EOF
done

"$PY" - "$work" "${methods[@]}" <<'EOF'
import json
import sys
from pathlib import Path

from pipeopt.costs.profiler import kendall_tau_b

work, methods = Path(sys.argv[1]), sys.argv[2:]
pairs = {}
for m in methods:
    out = work / f"{m}.out"
    if out.stat().st_size:
        res = json.loads(out.read_text())
        pairs[m] = (res["predicted_step_time"], res["step_time"])
predicted, measured = ([v[i] for v in pairs.values()] for i in (0, 1))
tau = kendall_tau_b(predicted, measured)  # tau-b: methods that found one schedule tie
worst = max((abs(m / p - 1) for p, m in pairs.values()), default=float("nan"))
print(f"== ranking of {len(pairs)} methods: Kendall tau-b {tau:+.2f} (predicted vs measured); "
      f"worst step-time error {worst:.1%}")
EOF
