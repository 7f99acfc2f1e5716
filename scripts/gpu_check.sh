#!/usr/bin/env bash
# On a GPU machine (CUDA toolkit, CUDA torch, nanobind, scikit-build-core installed;
# kvlayout's other needs, lark and NIXL, installed or carried as wheels in .whl/): build
# kvlayout with its CUDA extension, run the transfer tests on the device (the block
# transfer's kernels and the run executor, copy_runs, each against the CPU or numpy; NIXL
# requests staged in VRAM, against the offset oracle), and print device bandwidth against
# a plain device-to-device copy of the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# lark and NIXL, where the machine has none and cannot download them: wheels carried in
# .whl/, made where pip can reach PyPI (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl lark nixl==1.5.1
# nixl-cu13==1.5.1; cu12 for a CUDA 12 torch). On an H200 image with a CUDA 13 torch that
# was all it lacked.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-deps .whl/*.whl
fi
"$PY" -m pip install -q --no-build-isolation --no-deps -e . \
  -Ccmake.define.KVLAYOUT_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=native
"$PY" -c "import kvlayout._cuda as c; print('kvlayout._cuda sees', c.device_count(), 'device(s)')"
# The device tests must run here, not skip: a skip on a GPU machine is a failure.
log=$(mktemp)
"$PY" -m pytest -q -p no:cacheprovider -rs tests/transfer/test_transfer_cuda.py tests/transfer/test_copy_runs.py \
  tests/transfer/test_nixl_device.py tests/transfer/test_block_maps_device.py \
  2>&1 | tee "$log"
if grep -q "SKIPPED" "$log"; then
  echo "gpu_check: a device test skipped on a GPU machine" >&2
  exit 1
fi
"$PY" -m pytest -q -p no:cacheprovider tests/transfer
"$PY" benchmarks/bench_transfer_cuda.py
# Prefill/decode with both caches on the GPU, staged in VRAM (the pairs that need a copy:
# TP 2 -> 1), each row against one descriptor of the same bytes; UCX picks its transports.
"$PY" benchmarks/bench_pd.py --device cuda --tls '' --only "TP 2->1" --repeats 3
