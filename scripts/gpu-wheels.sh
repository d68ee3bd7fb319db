#!/usr/bin/env bash
# On the dev machine: make the wheel folders a GPU run carries (the GPU hosts are offline).
#   .whl-ray/  Ray 2.60 + Serve + pydantic          (runs through cluster.LLM or the Serve app)
#   .whl-fi/   FlashInfer 0.7.4 + tvm-ffi + pydantic (single-GPU runs: tests/gpu, dspark bench)
# usage: scripts/gpu-wheels.sh SHARED_GPU_HOST_DIR   (the folder holding make-wheels.sh, e.g. ../shared/gpu-host)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "${1:?give the gpu-host folder}/make-wheels.sh" "$root"
cp "$root"/.whl-ray/{pydantic,pydantic_core,annotated_types,typing_inspection}-*.whl "$root/.whl-fi/"
du -sh "$root/.whl-ray" "$root/.whl-fi"
