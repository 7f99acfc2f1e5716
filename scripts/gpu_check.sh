#!/usr/bin/env bash
# On a GPU machine (CUDA toolkit, CUDA torch, nanobind and scikit-build-core installed):
# build kvlayout with its CUDA extension, run the transfer tests on the device, and print
# device bandwidth against a plain device-to-device copy of the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -m pip install -q --no-build-isolation --no-deps -e . \
  -Ccmake.define.KVLAYOUT_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=native
"$PY" -c "import kvlayout._cuda as c; print('kvlayout._cuda sees', c.device_count(), 'device(s)')"
"$PY" -m pytest -q -p no:cacheprovider tests/transfer
"$PY" benchmarks/bench_transfer_cuda.py
