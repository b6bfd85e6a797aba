#!/usr/bin/env bash
# One prepared GPU check (H200-class, under 8 minutes): bf16, flash SDPA, torch.compile.
#  1. training-step MFU of vitkit and timm, side by side, for ViT-B/16 and ViT-L/16 at 224;
#  2. `vitkit bench`: inference images/s at 224 and 384 (plain and vitkit.optimize, bf16), FLOP/s against the
#     GPU's own bf16 matmul rate, peak memory and the largest batch in 130 GB.
# Run from the repository root: `bash benchmarks/gpu.sh [OUT_DIR]`; results go to OUT_DIR (default gpu-results).
set -euo pipefail
OUT=${1:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}"
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flash sdpa', torch.backends.cuda.flash_sdp_enabled())" | tee -a "$OUT/gpu.txt"

timeout 200 $PY benchmarks/gpu_train.py --model ViT-B/16 --batch 256 --device cuda | tee "$OUT/train_b16.txt"
timeout 200 $PY benchmarks/gpu_train.py --model ViT-L/16 --batch 128 --device cuda | tee "$OUT/train_l16.txt"
timeout 120 $PY -m vitkit bench --device cuda --model ViT-B/16 --image-size 224 384 --batch-size 64 256 \
    --precision bf16 --no-train --memory-budget-gb 130 --rounds 3 --out "$OUT/bench_b16.json" | tee "$OUT/bench_b16.txt"
