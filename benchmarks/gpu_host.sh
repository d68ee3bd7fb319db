#!/usr/bin/env bash
# On an offline GPU host, from the checkout root (the wheel folders' install steps, committed here so
# every GPU figure is reproducible from this repository):
#   eval "$(bash benchmarks/gpu_host.sh install)"   install the carried wheel folders (.whl-ray, .whl-fi; made by
#                                                   scripts/gpu-wheels.sh) into ~/.cache/dspark-site, unpack a
#                                                   carried FlashInfer JIT cache (.fi-cache/*.part-*), print PYTHONPATH
#                                                   and the hosts' NVLink-multicast-off variables
#   bash benchmarks/gpu_host.sh save-cache DIR      pack ~/.cache/flashinfer into 15 MiB pieces under DIR (bring them
#                                                   back as .fi-cache/ so the next run skips the JIT compiles)
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
    if compgen -G ".fi-cache/*.part-*" >/dev/null; then
      mkdir -p ~/.cache && cat .fi-cache/*.part-* | tar xzf - -C ~/.cache
    fi
    echo "export PYTHONPATH=$site:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    # the hosts' rule: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM, also in
    # the processes our runs start (Ray's workers inherit the driver's environment)
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    ;;
  save-cache)
    dest=${2:?give a folder}
    tar czf - -C ~/.cache flashinfer | split -b 15m - "$dest/fi-cache.tgz.part-"
    ls -la "$dest" >&2
    ;;
  *) echo "usage: $0 install | save-cache DIR" >&2; exit 2 ;;
esac
