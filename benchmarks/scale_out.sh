#!/usr/bin/env bash
# The 4- and 8-GPU runs, one step per host command (each fits the 10-minute limit), from the checkout
# root. The two wheel folders together pass the 64 MiB carry: run `prepare` with .whl-ray carried, then, within the
# machine's ~30 s keep-alive, each step with .whl-fi (and .fi-cache) carried (every step installs what it carries
# into the same site folder, benchmarks/gpu_host.sh):
#   bash benchmarks/scale_out.sh prepare OUT            install what is carried, nothing else
#   bash benchmarks/scale_out.sh dense OUT [SIZES]      the Qwen3-8B shape: single process, Ray TP=1, 2, 4 (8 where the
#                                                       host has them), a separate drafter; decode and verify steps at
#                                                       batch 1 and 64 and each size's ratio to TP=1 (goal: TP=4 AR
#                                                       step at batch 1 <= 0.35x TP=1)   -> OUT/tp-scaling-8b.json
#   bash benchmarks/scale_out.sh oneshot OUT [SIZES]    the Qwen3-8B shape's TP layouts again with the one-shot
#                                                       all-reduce (allreduce_strategy ONESHOT) beside Ray TP=1
#                                                                                  -> OUT/tp-scaling-8b-oneshot.json
#   bash benchmarks/scale_out.sh moe OUT [SIZES]        the same on the Qwen3-30B-A3B shape (MoE; its engines one at a
#                                                       time: two do not fit on one GPU): each target rank's MoE
#                                                       backend is in every layout's rank info
#                                                                                         -> OUT/tp-scaling-moe.json
#   bash benchmarks/scale_out.sh sweep OUT TP [colocated|separate]
#                                                       the dspark bench sweep (1 .. 256) on the largest replica,
#                                                       against our autoregressive baseline at the same TP
#                                                                                         -> OUT/sweep-tpTP.json
#   bash benchmarks/scale_out.sh nodes OUT [TP]         the one-host two-node emulation with TP shards across the two
#                                                       Ray nodes (default 4): output against the single-process
#                                                       engine, the step-time cost of crossing  -> OUT/two-node-check.json
# SIZES: comma-separated tensor parallel sizes (default: 1,2,4 and 8 where the host has 8 GPUs).
set -euo pipefail
step=${1:?give a step: prepare, dense, oneshot, moe, sweep or nodes}
out=${2:?give an output folder}
mkdir -p "$out"
case "$step" in
  prepare) bash benchmarks/gpu_host.sh install >/dev/null; exit 0 ;;
esac
gpus=$(nvidia-smi -L | wc -l)
default_sizes=$([ "$gpus" -ge 8 ] && echo 1,2,4,8 || echo 1,2,4)
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
case "$step" in
  dense) python3 benchmarks/tp_scaling.py --model-shape qwen3-8b --tensor-parallel-sizes "${3:-$default_sizes}" \
           --concurrency 1,64 --profile --no-oneshot --out "$out/tp-scaling-8b.json" ;;
  oneshot) sizes=${3:-$default_sizes}
           oneshot=$(echo "$sizes" | tr ',' '\n' | grep -v '^1$' | sed 's/.*/ray-tp&-oneshot/' | paste -sd,)
           python3 benchmarks/tp_scaling.py --model-shape qwen3-8b --tensor-parallel-sizes "$sizes" \
             --concurrency 1,64 --no-separate --layouts "ray-tp1,$oneshot" --out "$out/tp-scaling-8b-oneshot.json" ;;
  moe) python3 benchmarks/tp_scaling.py --model-shape qwen3-30b-a3b --tensor-parallel-sizes "${3:-$default_sizes}" \
         --concurrency 1,64 --sequential --no-oneshot --out "$out/tp-scaling-moe.json" ;;
  sweep) tp=${3:?give the tensor parallel size}; drafter=${4:-colocated}
         python3 -m cluster.cli bench --model-shape qwen3-8b --tensor-parallel-size "$tp" --drafter "$drafter" \
           --concurrency 1,4,16,64,256 --steps 30 --kv-cache-memory 16GiB --out "$out/sweep-tp$tp.json" ;;
  nodes) bash benchmarks/two_node_rehearsal.sh "$out" cuda "${3:-4}" ;;
  *) echo "usage: $0 prepare|dense|oneshot|moe|sweep|nodes OUT ..." >&2; exit 2 ;;
esac
