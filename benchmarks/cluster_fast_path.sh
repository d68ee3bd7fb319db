#!/usr/bin/env bash
# The cluster fast path's figures on the 2-GPU host, one step per host command (each fits the 10-minute
# limit), from the checkout root. The two wheel folders together pass the 64 MiB carry: run `prepare` with .whl-ray
# carried, then, within the machine's ~30 s keep-alive, each step with .whl-fi and .fi-cache carried (each installs
# what it carries into the same site folder, benchmarks/gpu_host.sh):
#   bash benchmarks/cluster_fast_path.sh prepare OUT    install what is carried, nothing else
#   bash benchmarks/cluster_fast_path.sh tp OUT         Qwen3-8B shape at 1 and 64 requests: Ray TP=1 beside one
#                                                       process (paired), TP=2 with NCCL's and with the one-shot
#                                                       all-reduce: tp2*_vs_tp1_ar_step (goal <= 0.60 at 1 request)
#                                                                                              -> OUT/tp.json
#   bash benchmarks/cluster_fast_path.sh agree OUT      TP=2 (NCCL, ONESHOT) beside one process with 8 greedy prompts
#                                                       (bf16 agreement)                       -> OUT/tp-agree.json
#   bash benchmarks/cluster_fast_path.sh profile OUT    TP=2 (NCCL, ONESHOT): a torch profile of batch-1 steps on each
#                                                       rank (where the step's time goes)     -> OUT/tp-profile.json
#   bash benchmarks/cluster_fast_path.sh separate OUT   the pipelined separate drafter against the colocated replica
#                                                       (measured in the same bench) at 1, 64 and 128 requests with
#                                                       DeepSpec's 5-layer drafter depth (goals: step <= 1.05x at 1,
#                                                       throughput >= 1.15x from 64), a batch-1 profile on each rank
#                                                                                              -> OUT/separate.json
#   bash benchmarks/cluster_fast_path.sh tests OUT      tests/gpu, the 2-GPU replica tests among them -> OUT/tests.txt
#   bash benchmarks/cluster_fast_path.sh nodes OUT      the two-node rehearsal on one host (TP=2, a shard a node)
set -euo pipefail
step=${1:?give a step: prepare, tp, agree, profile, separate, tests or nodes}; out=${2:?give an output folder}
case "$step" in
  prepare|tp|agree|profile|separate|tests|nodes) ;;
  *) echo "usage: $0 prepare|tp|agree|profile|separate|tests|nodes OUT" >&2; exit 2 ;;
esac
mkdir -p "$out"
case "$step" in
  prepare) bash benchmarks/gpu_host.sh install >/dev/null; exit 0 ;;
  nodes) exec bash benchmarks/two_node_rehearsal.sh "$out" cuda 2 ;;
esac
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
case "$step" in
  tp) python3 benchmarks/tp_scaling.py --tensor-parallel-sizes 1,2 --concurrency 1,64 --no-separate \
        --layouts ray-tp1,ray-tp2,ray-tp2-oneshot --out "$out/tp.json" ;;
  agree) python3 benchmarks/tp_scaling.py --tensor-parallel-sizes 2 --concurrency 1 --steps 10 --no-separate \
           --e2e-prompts 8 --layouts ray-tp2,ray-tp2-oneshot --out "$out/tp-agree.json" ;;
  profile) python3 benchmarks/tp_scaling.py --tensor-parallel-sizes 2 --concurrency 1 --steps 10 --no-separate \
             --profile --layouts ray-tp2,ray-tp2-oneshot --out "$out/tp-profile.json" ;;
  separate) python3 benchmarks/tp_scaling.py --tensor-parallel-sizes 1 --concurrency 1,64,128 --draft-layers 5 \
              --kv-cache-memory 24GiB --profile --layouts ray-tp1-separate --out "$out/separate.json" ;;
  tests) python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests.txt" | tail -15 ;;
esac
