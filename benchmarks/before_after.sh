#!/usr/bin/env bash
# `dspark bench` of an earlier tree and of this one on the same GPU host, alternating, so that a restructuring that
# should change no behaviour is checked on the figures it could move (AR and DSpark step times, their ratio).
#   git archive --format=tar.gz -o .before/tree.tar.gz REV -- . ':!benchmarks/results' ':!runtime/pretrained'
#                                                                here, once (.before/ is ignored; carry it with
#                                                                .whl-fi and .fi-cache)
#   bash benchmarks/before_after.sh run OUT [before|after ...]   on the host: one bench per name given, in order
#                                                                (default: before after), each to OUT/NAME-N.json
#   python3 benchmarks/before_after.py OUT/*.json --out FILE     the after / before ratios of each figure, paired
#                                                                by round
# The bench: the Qwen3-8B shape (random weights), 1 / 16 / 64 requests, every block verified (the speculation
# guard off: its policy is not what is compared). BENCH_ARGS overrides the arguments.
set -euo pipefail
cmd=${1:?usage: $0 run OUT [before|after ...]}
out=${2:?give an output folder}
shift 2
[ "$cmd" = run ] || { echo "usage: $0 run OUT [before|after ...]" >&2; exit 2; }
mkdir -p "$out"
eval "$(bash benchmarks/gpu_host.sh install)"
here=$PWD
before=${BEFORE_DIR:-/tmp/dspark-before}
if [ ! -d "$before" ]; then
  mkdir -p "$before" && tar xzf .before/tree.tar.gz -C "$before"
fi
args=${BENCH_ARGS:---model-shape qwen3-8b --concurrency 1,16,64 --steps 30 --no-speculation-guard --kv-cache-memory 6GiB}
site=$(python3 -c 'import sys; print(next(p for p in sys.path if p.endswith("dspark-site")))' 2>/dev/null \
  || echo "$HOME/.cache/dspark-site")
for name in "${@:-before after}"; do
  for one in $name; do
    n=$(ls "$out" | grep -c "^$one-" || true)
    tree=$here
    [ "$one" = before ] && tree=$before
    [ "$one" = before ] || [ "$one" = after ] || { echo "unknown tree: $one (before|after)" >&2; exit 2; }
    echo "== $one round $n ($tree)" >&2
    # shellcheck disable=SC2086
    (cd "$tree" && PYTHONPATH="$site:$tree" python3 -m cluster.cli bench $args --out "$out/$one-$n.json")
  done
done
