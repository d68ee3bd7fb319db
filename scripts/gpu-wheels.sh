#!/usr/bin/env bash
# On the dev machine: make the wheel folders a GPU run carries (the GPU hosts are offline).
#   .whl-ray/  Ray 2.60 + Serve + pydantic          (runs through cluster.LLM or the Serve app)
#   .whl-fi/   FlashInfer 0.7.4 + tvm-ffi + pydantic + xgrammar (single-GPU runs: tests/gpu, dspark bench; xgrammar
#              for structured outputs: its cp312 wheel, the hosts' Python, with the hosts' triton and tvm-ffi's)
# usage: scripts/gpu-wheels.sh DIR   (DIR: the folder holding make-wheels.sh, the slimmed-wheel builder)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "${1:?give the gpu-host folder}/make-wheels.sh" "$root"
cp "$root"/.whl-ray/{pydantic,pydantic_core,annotated_types,typing_inspection}-*.whl "$root/.whl-fi/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$root/.whl-fi" "xgrammar==0.2.9"
du -sh "$root/.whl-ray" "$root/.whl-fi"
