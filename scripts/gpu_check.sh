#!/usr/bin/env bash
# One prepared run on a single-GPU machine (the device tool): the gpu-marked tests and the
# doctor report, then the 14 GB stream-ordered snapshot benchmark, within about 8 minutes. The machine
# has torch and cupy but not weightsync's other declared dependencies (msgspec, crc32c, xxhash, zstandard) nor the test
# tools: carry their wheels in wheels/
#   pip download msgspec crc32c xxhash zstandard pytest-asyncio pytest-timeout -d wheels
# `weightsync bench` is not run there: NCCL takes one GPU per rank, and that machine has one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
python -m pip install --quiet --no-index --find-links wheels msgspec crc32c xxhash zstandard pytest-asyncio pytest-timeout 2>&1 | tail -2
python -c "import msgspec, crc32c, xxhash, zstandard" || { echo "a declared dependency is missing: carry its wheel in wheels/"; exit 1; }
python -m pip install --quiet --no-deps -e . 2>&1 | tail -2
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/hardware.txt" 2>&1
python -m weightsync.cli doctor | tee "$OUT/doctor.txt"
timeout 240 python -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
  2>&1 | tee "$OUT/gpu-tests.txt"
timeout 150 python -m benchmarks.gpu_snapshot --gb 14 --reps 3 --out "$OUT" 2>&1 | tee "$OUT/gpu-snapshot.txt"
