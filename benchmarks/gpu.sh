#!/usr/bin/env bash
# One prepared GPU check (H200-class, under 8 minutes): bf16, flash SDPA, torch.compile.
#  1. training-step MFU of vitkit and timm, side by side, for ViT-B/16 and ViT-L/16 at 224;
#  2. `vitkit bench`: inference images/s at 224 and 384 (plain and vitkit.optimize, bf16), FLOP/s against the
#     GPU's own bf16 matmul rate, peak memory and the largest batch in 130 GB.
# Run from the repository root: `bash benchmarks/gpu.sh [OUT_DIR]`; results go to OUT_DIR (default gpu-results).
# Each part runs under its own time limit (together 7.6 minutes) and writes OUT_DIR/<part>.txt as it goes; a part
# that fails or runs out of time is reported and the next one still runs; the exit status says whether all passed.
# The Python is $PYTHON, else python3 (on the lent H200 the image's python3 holds torch, timm and the rest).
# `bash benchmarks/gpu.sh --cpu-dry-run [OUT_DIR]`: every part's command as above, on the CPU, with tiny models and
# one short round appended to it (the last of an option wins): a broken script or option shows in seconds, here,
# not in a lent GPU's minutes (tests/test_benchmark_scripts.py runs it).
set -uo pipefail
NVIDIA_SMI="nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv &&"
TRAIN_DRY=() BENCH_DRY=()  # what the dry run appends to the parts' commands
if [ "${1:-}" = "--cpu-dry-run" ]; then
    shift
    NVIDIA_SMI=""
    TINY=(--device cpu --image-size 32
          --model-args '{"hidden_size": 16, "num_layers": 1, "mlp_dim": 32, "num_heads": 2}')
    TRAIN_DRY=("${TINY[@]}" --batch 2 --steps 1 --rounds 1 --no-compile --peak-tflops 0.001)
    # two batches, as on the GPU: the largest batch is the line through their peaks
    BENCH_DRY=("${TINY[@]}" --batch-size 1 2 --rounds 1 --min-seconds 0.001)
fi
OUT=${1:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "== $name: out of its $limit s" || echo "== $name: failed (exit $rc)"
        failed+=("$name")
    fi
}

part gpu 30 bash -c "$NVIDIA_SMI $PY -c \"import torch; \
 print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flash sdpa', torch.backends.cuda.flash_sdp_enabled())\""
part train_b16 150 "$PY" benchmarks/gpu_train.py --model ViT-B/16 --batch 256 --device cuda "${TRAIN_DRY[@]}" \
    --out "$OUT/train_b16.json"
part train_l16 180 "$PY" benchmarks/gpu_train.py --model ViT-L/16 --batch 128 --device cuda "${TRAIN_DRY[@]}" \
    --out "$OUT/train_l16.json"
part bench_b16 100 "$PY" -m vitkit bench --device cuda --model ViT-B/16 --image-size 224 384 --batch-size 64 256 \
    --precision bf16 --no-train --memory-budget-gb 130 --rounds 3 "${BENCH_DRY[@]}" --out "$OUT/bench_b16.json"

if [ ${#failed[@]} -gt 0 ]; then
    echo "== not all passed: ${failed[*]} (see $OUT)"
    exit 1
fi
echo "== all parts passed; results in $OUT"
