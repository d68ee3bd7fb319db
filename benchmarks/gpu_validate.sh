#!/usr/bin/env bash
# One host command that checks on the GPU what was built and tested on CPUs, on one H200 (carry .whl-fi and .fi-cache;
# ~7 minutes, inside the 10-minute limit):
#   bash benchmarks/gpu_validate.sh OUT
# 1. tests/gpu (the graphed paths: in-graph verification, the packed read-back, prefill graphs, run-ahead of decode
#    and of verify steps, PDL, the fused Markov step, the fused norm and SiLU-and-mul GEMMs, the block attention);
# 2. the residual add and RMSNorm fused into the q/k/v and gate/up GEMMs (where the engine measured that faster)
#    against the separate norm kernels, two Qwen3-8B-shape engines side by side at 1, 4 and 16 requests
#    (benchmarks/plan_ahead.py --toggle prenorm) -> OUT/prenorm.json; each engine's GEMM calibration in the
#    record says whether the fused prologues (norm, SiLU-and-mul) won anywhere (3-5x slower, never);
# 3. the Qwen3-8B-shape bench (AR roofline, DSpark / AR, transformers peers) -> OUT/bench-8b.json;
# then the FlashInfer JIT cache packed into OUT (bring it back as .fi-cache/). A failing step is reported and the
# next one still runs; the exit status is the first failure's. (Earlier experiments (the read-back, decode and
# DSpark run-ahead, split-KV attention, PDL chain and PDL engine runs, the block attention tiles and splits, the L2
# prefetch) are in benchmarks/results with the commit they ran at; `benchmarks/block_attention.py` alone re-runs
# the block attention comparison.)
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
step prenorm python3 benchmarks/plan_ahead.py --toggle prenorm --concurrency 1,4,16 --steps 30 \
  --out "$out/prenorm.json"
step bench-8b python3 -m cluster.cli bench --model-shape qwen3-8b --concurrency 1,4,16,64 --steps 30 \
  --kv-cache-memory 16GiB --hf-tokens 24 --out "$out/bench-8b.json"
bash benchmarks/gpu_host.sh save-cache "$out" >/dev/null 2>&1 || true
exit "$status"
