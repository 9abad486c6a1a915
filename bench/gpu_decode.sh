#!/usr/bin/env bash
# Decode efficiency of the dense sampler on a GPU machine, in one command of ~5 minutes:
#   bash bench/gpu_decode.sh            (from the project root; extra arguments go to bench.bench_gpu)
#
# It runs bench.bench_gpu --decode-only on the Llama-3.2-1B shape (bf16, 64-token prompts, 128 new tokens,
# temperature 1, no stop token): the measured HBM bandwidth, then tokens/s and share of the weight-bandwidth
# roofline of the legacy decode loop, the fast one and continuous batching at batch 128, the bf16/f32 logprob
# mismatch against float32 teacher-forced logprobs, the same variants at batches 256, 64 and 1, and one-change
# ablations at batch 128; cases still pending after --time-budget seconds are listed as skipped. The table is
# printed; the JSON goes to $OUT/decode.json when OUT is set.
#
# The machine's python (PYTHON, default python3) brings JAX with CUDA; levanter/haliax come from the wheels in
# .whl/ (installed with --target /tmp/site) and, when .device/device_compat.py exists, its shim is installed
# first (--device-compat; see bench/bench_gpu.py's docstring and the Makefile's bench-gpu target).
# NO_WHEELS=1: use the python's own levanter/haliax (e.g. a CPU smoke run: JAX_PLATFORMS=cpu NO_WHEELS=1 PYTHON=.venv/bin/python
# bash bench/gpu_decode.sh --tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=()
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.device:${PYTHONPATH:-}
  if [ -f .device/device_compat.py ]; then
    extra+=(--device-compat)
  fi
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  extra+=(--json "$OUT/decode.json")
fi
export HF_HUB_OFFLINE=1
JAX_PLATFORMS=${JAX_PLATFORMS:-} timeout "${GPU_DECODE_TIMEOUT:-420}" "$PY" -m bench.bench_gpu --decode-only --shapes 1b \
  --prompt-len 64 --new-tokens 128 --repeats 2 --bandwidth-mb 2048 --decode-batches 1,64,128,256 \
  --ablation-batch 128 --time-budget "${GPU_DECODE_BUDGET:-240}" "${extra[@]}" "$@"
