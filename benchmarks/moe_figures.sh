#!/usr/bin/env bash
# The MoE figures of one H200, from the checkout root with .whl-fi (and .fi-cache) carried (benchmarks/gpu_host.sh):
#   bash benchmarks/moe_figures.sh OUT
# 1. benchmarks/moe_layer.py: VANILLA, DENSEGEMM and TRITON on one Qwen3-30B-A3B-shaped MoE layer at 1, 8, 64 and
#    512 tokens, eager and graphed, each against VANILLA's output           -> OUT/moe-layer.json
# 2. dspark bench on a Qwen3-30B-A3B-shaped target (random bf16 weights, a 1-layer drafter, K=7) at batch 1 and 16
#    with each graph-safe backend: AR and verify step times, their ratio, experts woken by a verify against a
#    decode token                                                          -> OUT/bench-30b-a3b-<backend>.json
#    (--sequential: each engine holds 61 GB of weights, two do not fit on one H200 together)
set -euo pipefail
out=${1:?give an output folder}
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
python3 benchmarks/moe_layer.py --out "$out/moe-layer.json"
for backend in TRITON DENSEGEMM; do
  python3 -m cluster.cli bench --model-shape qwen3-30b-a3b --moe-backend "$backend" --draft-layers 1 \
    --concurrency 1,16 --prompt-len 512 --steps 20 --kv-cache-memory 16GiB --sequential --out "$out/bench-30b-a3b-$backend.json"
done
