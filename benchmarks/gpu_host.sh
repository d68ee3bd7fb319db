#!/usr/bin/env bash
# On an offline GPU host, from the checkout root (the wheel folders' install steps, committed here so
# every GPU figure is reproducible from this repository):
#   eval "$(bash benchmarks/gpu_host.sh install)"   install the carried wheel folders (.whl-ray, .whl-fi; made by
#                                                   scripts/gpu-wheels.sh) into ~/.cache/dspark-site, unpack a
#                                                   carried FlashInfer JIT cache (.fi-cache/fi-cache.tgz.part-*) and
#                                                   Triton kernel cache (.triton-cache/triton-cache.tgz.part-*), print
#                                                   PYTHONPATH and the hosts' NVLink-multicast-off variables
#   bash benchmarks/gpu_host.sh save-cache DIR      pack ~/.cache/flashinfer (fi-cache.tgz.part-*) and ~/.triton/cache
#                                                   (triton-cache.tgz.part-*, the engine's Triton kernels compiled for
#                                                   this GPU) into 15 MiB pieces under DIR (bring them back as
#                                                   .fi-cache/ and .triton-cache/, each carried where it fits, so the
#                                                   next run's engines skip those compiles at startup)
#   bash benchmarks/gpu_host.sh save-cache-unless-carried DIR
#                                                   save-cache, unless both caches were carried
#   bash benchmarks/gpu_host.sh bench OUT NAME ARGS...
#                                                   install, then `dspark bench ARGS --out OUT/NAME.json` (its log
#                                                   OUT/NAME.log), and pack the JIT cache into OUT unless one was
#                                                   carried; e.g. the speculation guard on the Qwen3-8B shape:
#                                                   bench OUT guard --model-shape qwen3-8b --concurrency 1,16,64,256
#                                                   --prompt-len 128 --steps 60 --warmup 20 --kv-cache-memory 12GiB
set -euo pipefail
site=${SITE:-$HOME/.cache/dspark-site}
case "${1:-install}" in
  install)
    for d in .whl-ray .whl-fi; do
      if compgen -G "$d/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
          "$d"/*.whl >&2
      fi
    done
    if compgen -G ".fi-cache/fi-cache.tgz.part-*" >/dev/null; then
      mkdir -p ~/.cache && cat .fi-cache/fi-cache.tgz.part-* | tar xzf - -C ~/.cache
    fi
    if compgen -G ".triton-cache/triton-cache.tgz.part-*" >/dev/null; then
      mkdir -p ~/.triton && cat .triton-cache/triton-cache.tgz.part-* | tar xzf - -C ~/.triton
    fi
    echo "export PYTHONPATH=$site:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    # the hosts' rule: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM, also in
    # the processes our runs start (Ray's workers inherit the driver's environment)
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    ;;
  save-cache-unless-carried)
    dest=${2:?give a folder}
    { compgen -G ".fi-cache/fi-cache.tgz.part-*" && compgen -G ".triton-cache/triton-cache.tgz.part-*"; } >/dev/null ||
      bash "$0" save-cache "$dest"
    ;;
  save-cache)
    dest=${2:?give a folder}
    tar czf - -C ~/.cache flashinfer | split -b 15m - "$dest/fi-cache.tgz.part-"
    if [ -d ~/.triton/cache ]; then tar czf - -C ~/.triton cache | split -b 15m - "$dest/triton-cache.tgz.part-"; fi
    ls -la "$dest" >&2
    ;;
  bench)
    out=${2:?give an output folder} name=${3:?give a name for the record}
    shift 3
    mkdir -p "$out"
    eval "$(bash "$0" install)"
    python3 -m cluster.cli bench "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1 || echo "bench: exit $?" >&2
    bash "$0" save-cache-unless-carried "$out"
    grep -A6 "^ conc " "$out/$name.log" >&2 || tail -c 2000 "$out/$name.log" >&2
    ;;
  *) echo "usage: $0 install | save-cache DIR | save-cache-unless-carried DIR | bench OUT NAME ARGS..." >&2; exit 2 ;;
esac
