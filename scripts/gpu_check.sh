#!/usr/bin/env bash
# One prepared run on a single-GPU machine (the device tool), within about 6 minutes: the
# gpu-marked tests, the delta codec on the device against the host, the stream-ordered snapshot
# of 14 GB, then the fast CPU suites on that machine's torch (pinned slots, another torch version).
# The machine has torch, numpy and cupy but not weightsync's other declared dependencies nor the
# test tools: carry their wheels in wheels/ (ignored by git), for the Pythons it may have:
#   for v in 310 311 312 313; do pip download --only-binary=:all: --python-version $v \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d wheels msgspec crc32c xxhash zstandard; done
#   pip download --no-deps -d wheels pytest pluggy iniconfig packaging pytest-asyncio pytest-timeout
# and pass carry=["wheels"]. weightsync runs from the checkout (PYTHONPATH): installing it would
# need setuptools' build isolation, which has no index there.
# `weightsync bench` is not run there: NCCL takes one GPU per rank, and that machine has one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -m pip install --quiet --no-index --find-links wheels msgspec crc32c xxhash zstandard pytest \
  pytest-asyncio pytest-timeout 2>&1 | tail -2
python -c "import msgspec, crc32c, xxhash, zstandard" || { echo "a declared dependency is missing: carry its wheel in wheels/"; exit 1; }
# everything printed goes to one log (the device tool brings back only a few files): the two
# benchmarks' JSON and figure beside it
exec > >(tee "$OUT/gpu_check.log") 2>&1
date -u; python --version; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; df -h /dev/shm
python -m weightsync.cli doctor
step() { local limit=$1 name=$2; shift 2; echo "== $name"; timeout "$limit" "$@"; echo "== $name: rc $?"; }
step 120 gpu-tests python -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -o addopts="-ra"
step 60 gpu-delta python -m benchmarks.gpu_delta --mib 1024 --reps 3 --out "$OUT"
step 80 gpu-snapshot python -m benchmarks.gpu_snapshot --gb 14 --reps 3 --out "$OUT"
step 100 cpu-suites python -m pytest tests/test_unit.py tests/test_delta.py tests/test_inprocess.py \
  tests/test_encoding.py -q -p no:cacheprovider -o addopts="-ra" --timeout 30
