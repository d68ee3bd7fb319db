#!/usr/bin/env bash
# The multi-node rehearsal on one host: two Ray nodes with disjoint GPU sets (or CPUs), a replica spanning both,
# its output checked against the single-process engine, and its ms per token against the same replica on one node
# where one node holds it (benchmarks/two_node_check.py). From the checkout root with
# .whl-ray and .whl-fi carried (benchmarks/gpu_host.sh installs them):
#   bash benchmarks/two_node_rehearsal.sh OUT [cuda|cpu] [TP] [colocated|separate]
# cuda (default): the head node gets the first half of the GPUs, the second node the rest, each `ray start` with
# its own CUDA_VISIBLE_DEVICES, so a TP=2 replica on a 2-GPU host has one shard per node. cpu: 2 + 1 CPUs.
# Real multi-node runs are the same two `ray start` lines on two machines (the worker's --address the head's IP;
# KubeRay: k8s/ray-cluster.yaml names the layout), then two_node_check.py (or any cluster.LLM) on the head.
set -euo pipefail
out=${1:?give an output folder}; device=${2:-cuda}; tp=${3:-2}; drafter=${4:-colocated}
eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1 RAY_ADDRESS=
export RAY_AUTH_MODE=disabled  # a loopback rehearsal: no token to share between the two `ray start` processes
ray() { python3 -m ray.scripts.scripts "$@"; }
port=${RAY_PORT:-6390}
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
if [ "$device" = cuda ]; then
  gpus=$(nvidia-smi -L | wc -l); half=$((gpus / 2))
  [ "$half" -ge 1 ] || { echo "two_node_rehearsal.sh: needs at least 2 GPUs, found $gpus" >&2; exit 2; }
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1))) ray start --head --port "$port" --num-gpus "$half" \
    --num-cpus 4 --include-dashboard=false --disable-usage-stats
  CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $((gpus - 1))) ray start --address "127.0.0.1:$port" \
    --num-gpus $((gpus - half)) --num-cpus 4
else
  ray start --head --port "$port" --num-cpus 2 --include-dashboard=false --disable-usage-stats
  ray start --address "127.0.0.1:$port" --num-cpus 1
fi
python3 benchmarks/two_node_check.py --ray-address "127.0.0.1:$port" --device "$device" --tensor-parallel-size "$tp" \
  --drafter "$drafter" --out "$out/two-node-check.json"
