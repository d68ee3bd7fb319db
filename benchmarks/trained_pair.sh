#!/usr/bin/env bash
# The trained-pair figures of the GPU fast path on one H200, in two device commands that follow each other within
# the machine's ~30 s keep-alive (the pair lives in WORK on the GPU host; it is too large to bring back):
#   bash benchmarks/trained_pair.sh train WORK OUT   prepare the host, then the GPU recipe's target (150 s),
#                                                    self-distillation and DSpark drafter (the rest of ~9 minutes)
#                                                    -> OUT/gpu-recipe.json, WORK/{target,dspark,heldout-prompts.jsonl}
#   bash benchmarks/trained_pair.sh bench WORK OUT   dspark bench on that pair over the held-out prompts: the
#                                                    concurrency sweep, the tuned draft_len_schedule, the end-to-end
#                                                    speedup and greedy agreement of 64 prompts x 128 tokens
#                                                    -> OUT/bench.json, OUT/tuned-schedule.json (dspark bench-plot draws it)
# Both steps run from the checkout root with .whl-fi (and .fi-cache, if any) carried; see benchmarks/gpu_host.sh.
set -euo pipefail
step=${1:?train or bench}; work=${2:?give a work folder}; out=${3:?give an output folder}
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
case "$step" in
  train)
    python3 benchmarks/gpu_recipe.py --work "$work" --out "$out/gpu-recipe.json" --stages target,distill,dspark \
      --target-seconds 150 --drafter-seconds 100000 --run-seconds 510
    ;;
  bench)
    python3 -m cluster.cli bench --model "$work/target" --speculative-model "$work/dspark" \
      --prompts "$work/heldout-prompts.jsonl" --prompt-len 64 --concurrency 1,4,16,64,256 --steps 30 \
      --kv-cache-gib 16 --tune-schedule "$out/tuned-schedule.json" --e2e-prompts 64 --e2e-tokens 128 \
      --hf-tokens 64 --out "$out/bench.json"
    ;;
  *) echo "usage: $0 train|bench WORK OUT" >&2; exit 2 ;;
esac
