#!/usr/bin/env bash
# The device checks, as one short script for a machine with an NVIDIA GPU (the lent device):
# build, CUDA-vs-numpy bit-for-bit tests, the device bench, then transformers' FlashAttention
# in-place decode with and without kvblocks (results in $OUT if set).
# Usage: bash benchmarks/gpu_check.sh            (about 3-5 minutes including installs)
# Without a CUDA device it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: skipped (no CUDA device)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -m pip install -q ".[test]" "cupy-cuda12x>=13" 2>&1 | tail -2
cd /tmp
python3 -c "import cupy; print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'device(s)')"
python3 -m pytest -q -m gpu "$OLDPWD/tests/test_ops_gpu.py" -p no:cacheprovider
python3 "$OLDPWD/bench/bench_device.py" --device cuda
if [ -n "${OUT:-}" ]; then cp "$OLDPWD"/bench/results/device-*.json "$OUT"/ 2>/dev/null || true; fi
# transformers' continuous batching on the FlashAttention in-place decode path (needs flash-attn,
# a prebuilt wheel; skipped by the script itself when it cannot be installed or imported)
python3 -m pip install -q "transformers==5.24.*" 2>&1 | tail -1 || true
python3 -m pip install -q flash-attn --no-build-isolation 2>&1 | tail -1 || true
python3 "$OLDPWD/bench/bench_transformers_cb_gpu.py" --repeat 3 \
    ${OUT:+--json "$OUT/transformers_cb_gpu.json"}
