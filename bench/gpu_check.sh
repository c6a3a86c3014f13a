#!/usr/bin/env bash
# The device checks, as one short script for a machine with an NVIDIA GPU (the lent device):
# build, CUDA-vs-numpy bit-for-bit tests, then the device bench (results in $OUT if set).
# Usage: bash bench/gpu_check.sh            (about 3-5 minutes including installs)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -m pip install -q ".[test]" "cupy-cuda12x>=13" 2>&1 | tail -2
cd /tmp
python3 -c "import cupy; print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'device(s)')"
python3 -m pytest -q -m gpu "$OLDPWD/tests/test_ops_gpu.py" -p no:cacheprovider
python3 "$OLDPWD/bench/bench_device.py" --device cuda
if [ -n "${OUT:-}" ]; then cp "$OLDPWD"/bench/results/device-*.json "$OUT"/ 2>/dev/null || true; fi
