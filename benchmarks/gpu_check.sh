#!/usr/bin/env bash
# GPU check of the executor (issue 17): profile a GPT on the GPU, solve schedules on that
# profile, run them with nccl, and print predicted against measured step and op times.
#   >= 2 GPUs: one rank per GPU (up to 4), methods 1f1b, zb-h1, greedy.
#   1 GPU:     a single-GPU stage-timing check: two stages on the one GPU (a 1-device problem
#              with 2 virtual stages), op times measured with CUDA events against the profile.
# Needs CUDA GPUs and torch 2.13 (pip install 'pipeopt[torch]'); CI never runs it.
#   bash benchmarks/gpu_check.sh            # PYTHON=... to choose the interpreter
set -euo pipefail

PY=${PYTHON:-python}
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$ngpu" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU visible to torch $("$PY" -c 'import torch; print(torch.__version__)')" \
         "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); this check needs at least one" >&2
    exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
layers=8; hidden=512; heads=8; vocab=8192; seq=256; mb=8; m=8
model_args=(--model tiny-gpt --model-arg layers=$layers --model-arg hidden=$hidden
            --model-arg heads=$heads --model-arg vocab=$vocab --model-arg seq_len=$seq)

echo "== profile: tiny-gpt, $layers blocks, hidden $hidden, seq $seq, micro-batch $mb (cuda)"
"$PY" -m pipeopt profile --model tiny-gpt --layers $layers --hidden $hidden --heads $heads \
    --vocab $vocab --seq-len $seq --batch-size $mb --device cuda --warmup 3 --repeats 10 \
    -o "$work/profile.json"

if [ "$ngpu" -ge 2 ]; then
    ranks=$(( ngpu < 4 ? ngpu : 4 ))
    pipeline="{devices: $ranks, microbatches: $m}"
    methods=(1f1b zb-h1 greedy)
    echo "== $ranks GPUs: one rank each, nccl"
else
    pipeline="{devices: 1, microbatches: $m, virtual_stages: 2}"
    methods=(interleaved-1f1b greedy)  # one device: the schedules for 2 stages on it
    echo "== 1 GPU: single-GPU stage-timing check (2 stages on GPU 0)"
fi
printf 'pipeline: %s\nmodel: {profile: profile.json}\n' "$pipeline" > "$work/cfg.yaml"

printf '%-8s %14s %14s %8s\n' method predicted_ms measured_ms error
for method in "${methods[@]}"; do
    "$PY" -m pipeopt solve "$work/cfg.yaml" --method "$method" -o "$work/$method.json" --quiet
    "$PY" -m pipeopt run "$work/$method.json" "${model_args[@]}" --backend nccl --steps 6 \
        --batch-size $(( mb * m )) --check --json > "$work/$method.out"
    "$PY" - "$work/$method.json" "$work/$method.out" "$method" <<'EOF'
import json
import sys

from pipeopt.io import load_schedule

sched = load_schedule(sys.argv[1])
res = json.loads(open(sys.argv[2]).read())
pred, meas = res["predicted_step_time"], res["step_time"]
print(f"{sys.argv[3]:<8} {pred * 1e3:14.2f} {meas * 1e3:14.2f} {meas / pred - 1:+8.1%}"
      f"   grads_match={res['grads_match']}  peak MiB/rank="
      + ",".join(f"{x / 2**20:.0f}" for x in res["peak_memory"]))
prob = sched.problem
for k in range(prob.stages):
    got = "  ".join(f"{kind} {res['op_costs'].get(f'{k}{kind}', float('nan')) * 1e3:.3f}/"
                    f"{prob.durations[kind][k] * 1e3:.3f}" for kind in prob.kinds)
    print(f"    stage {k} op ms measured/predicted: {got}")
EOF
done
