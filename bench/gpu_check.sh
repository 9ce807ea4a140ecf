#!/usr/bin/env bash
# One FSDP2 GRPO step of SmolLM2-135M-Instruct on CUDA with NCCL (after one warm-up step), under torchrun.
#
#   bash bench/gpu_check.sh                 # 1 rank on GPU 0
#   NPROC=2 bash bench/gpu_check.sh         # 2 ranks, GPUs 0 and 1
#   DTYPE=float32 STEPS=3 bash bench/gpu_check.sh
#
# Prints the step time and each rank's peak GPU memory (torch.cuda.max_memory_allocated), and the
# param+grad+optimizer bytes each rank holds. Exits 0 with a message, running nothing, where no CUDA
# GPU is present (CI does not need it). Environment: NPROC (1), DTYPE (bfloat16: FSDP2's bf16
# mixed-precision policy; float32 also works), STEPS (1), WARMUP (1), OUT (a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
NPROC=${NPROC:-1}
DTYPE=${DTYPE:-bfloat16}
STEPS=${STEPS:-1}
WARMUP=${WARMUP:-1}

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "$gpus" -eq 0 ]; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing run."
    exit 0
fi
if [ "$gpus" -lt "$NPROC" ]; then
    echo "gpu_check: NPROC=$NPROC but only $gpus CUDA GPU(s) are visible; lower NPROC." >&2
    exit 2
fi

OUT=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
echo "gpu_check: $NPROC rank(s), FSDP2, NCCL, $DTYPE, $WARMUP warm-up + $STEPS measured step(s); rank files in $OUT"
"$PYTHON" -c 'import torch; [print(f"  GPU {i}: {torch.cuda.get_device_name(i)}") for i in range(torch.cuda.device_count())]'

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
echo "gpu_check: OK"
