#!/usr/bin/env bash
# The prepared GPU check (device tool: one H200, PyTorch preinstalled, no network).
# Run it from the repository root in ONE call, e.g.:  bash bench/gpu_check.sh
#
# That image has torch, numpy, pyarrow, tqdm and matplotlib but not pydantic nor fbgemm-gpu.
# Carry pydantic as wheels (here, before the call; see the device tool's README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.2
# and name .whl in the call's carry. Without fbgemm the CPU tables use the PyTorch kernel (said
# in the output). Bounded: at most 9 minutes. Writes gpu.{json,md} to --out (default
# bench/results; on the device machine pass --out "$OUT" so they come back).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 540 $PY bench/gpu_check.py "$@"
