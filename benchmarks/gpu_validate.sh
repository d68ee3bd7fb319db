#!/usr/bin/env bash
# One device command that checks what CPU-only sessions built for the GPU, on one H200 (carry .whl-fi and .fi-cache;
# ~6-7 minutes, inside the 10-minute limit; the Qwen3-8B-shape bench is the next command, README "GPU machines"):
#   bash benchmarks/gpu_validate.sh OUT
# 1. tests/gpu (the graphed paths: in-graph verification, the packed read-back, the split-KV decode kernel);
# 2. benchmarks/graph_launch.py --readback (why the first run-ahead gained nothing) -> OUT/graph-launch-readback.json,
#    and the run-ahead with the pinned read-back against planning ahead only (benchmarks/plan_ahead.py --toggle
#    run_ahead, Qwen3-8B shape at 1 and 64 requests) -> OUT/run-ahead.json;
# 3. benchmarks/attention_decode.py (FlashInfer's decode paths against the split-KV Triton kernel)
#    -> OUT/attention-decode.json; benchmarks/pdl_chain.py (does programmatic dependent launch shorten a chain of
#    small kernels and GEMVs) -> OUT/pdl-chain.json;
# then the FlashInfer JIT cache packed into OUT (bring it back as .fi-cache/). A failing step is reported and the
# next one still runs; the exit status is the first failure's.
set -uo pipefail
out=${1:?give an output folder}
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
status=0
step() {  # name, command...
  local name=$1; shift
  echo "== $name" >&2
  if ! "$@"; then echo "== $name FAILED" >&2; [ "$status" -eq 0 ] && status=1; fi
}
step tests-gpu python3 -m pytest -q tests/gpu -p no:cacheprovider
step readback python3 benchmarks/graph_launch.py --readback --out "$out/graph-launch-readback.json"
step run-ahead python3 benchmarks/plan_ahead.py --toggle run_ahead --concurrency 1,64 --steps 30 \
  --out "$out/run-ahead.json"
step attention python3 benchmarks/attention_decode.py --out "$out/attention-decode.json"
step pdl python3 benchmarks/pdl_chain.py --out "$out/pdl-chain.json"
bash benchmarks/gpu_host.sh save-cache "$out" >/dev/null 2>&1 || true
exit "$status"
