#!/usr/bin/env bash
# The trained-pair figures of the GPU fast path on one H200. The pair lives in WORK on the GPU host (too large to
# bring back), so either one host command runs `all` (a shorter training, then the bench), or two commands follow
# each other within the machine's keep-alive (~30 s, easy to miss). Since the bench measures its engines in
# alternating rounds (three per point, the tuning candidates against the DSpark engine too) it takes ~2-3x longer
# than before (140 s): `train WORK OUT 50 220` (~165 s) then `bench` in one command may pass the 10-minute
# limit; split the two steps, or give the bench fewer rounds (`bench WORK OUT --rounds 1`):
#   bash benchmarks/trained_pair.sh all WORK OUT [HIDDEN LAYERS]
#                                                    train with target 100 s and a 300 s recipe budget, profile,
#                                                    then bench (the target 512 wide, 8 layers, 27M parameters,
#                                                    unless given: a wider one, e.g. 2048 16 (~0.8B), has a
#                                                    compute-bound 64 x 8 verify, where trimming drafts saves
#                                                    device time; untried: its quality in 100 s is unknown)
#   bash benchmarks/trained_pair.sh profile WORK OUT cProfile of AR, DSpark and confidence-scheduled steps at 1 and
#                                                    4 requests on the pair -> OUT/host-profile-b{1,4}.json
#                                                    (benchmarks/host_profile.py)
#   bash benchmarks/trained_pair.sh train WORK OUT [TARGET_S RUN_S [HIDDEN LAYERS [TARGET_BATCH [DRAFTER_S [PROMPTS
#                                                    [TARGET_STEPS DRAFTER_STEPS]]]]]]
#                                                    prepare the host, then the GPU recipe's target (150 s),
#                                                    self-distillation and DSpark drafter (the rest of ~9 minutes)
#                                                    -> OUT/gpu-recipe.json, WORK/{target,dspark,heldout-prompts.jsonl}
#                                                    (TARGET_BATCH: sequences per target step, default 48; a 2.7B
#                                                    target, `60 300 3072 24 20`, ~285 s: earlier runs, whose 64 x 8
#                                                    verify is compute-bound, so trimming can pay; one run's drafter
#                                                    got only 46 s of those 300 (distillation took 86): `60 480 3072
#                                                    24 20` gives it ~220 s in ~440 s, alone in its command;
#                                                    the recipe keeps 90 s for its eval: one run's `45 240 3072 24
#                                                    20` spent 179 s on target and distillation and refused, naming
#                                                    --run-seconds; the same WORK then `45 150` found both done and
#                                                    trained the drafter 95 s; DRAFTER_S caps the drafter's
#                                                    own training: one run's `60 122` on a WORK whose target and
#                                                    distillation were done gave it 65 s and a pair as strong
#                                                    as any (6.0 tokens a step at 64 requests), where the
#                                                    >= 1.10 needs one with something to trim; one run's `60 400
#                                                    3072 24 20 15` was too weak: 28 drafter steps, requests
#                                                    accepting all or nothing, the tuned schedule speculating at
#                                                    one request only; one run's 35 s drafter accepted 0.79 / 0.61
#                                                    / 0.58 ... at 64 requests, oracle 1.18x: `... 20 35`. One run's
#                                                    train (255 s) and measure did not fit one command (cut in
#                                                    the mixed workload at 600 s); the measure's first phase now
#                                                    runs no mixed workload (its rows are replaced unread), and
#                                                    the sweep's rows are saved before the mixed workload starts;
#                                                    PROMPTS, the distillation's, default 1536: 74-97 s of a
#                                                    3072 x 24 target's train, half as many ~half the time;
#                                                    TARGET_STEPS and DRAFTER_STEPS, default 6000 and 20000, so
#                                                    that the time caps stop each: the same recipe then made
#                                                    pairs far apart (`60 400 3072 24 20 35`:
#                                                    104 and 108 target steps, 80 and 90 drafter steps, 0.71 /
#                                                    0.29 / 0.24 ... and 0.92 / 0.76 / 0.76 ... at 64 requests;
#                                                    one run's 0.76 / 0.42 / 0.41 ..., the pair that met every
#                                                    of the confidence scheduler's goals in one run);
#                                                    with steps below the caps (the target's ~1.7 a second at
#                                                    3072 x 24 and 20 sequences, the drafter's ~2.2) a pair is
#                                                    the same pair again, up to the GPU's nondeterminism)
#   bash benchmarks/trained_pair.sh bench WORK OUT [BENCH FLAGS]
#                                                    dspark bench on that pair over the held-out prompts: the
#                                                    concurrency sweep, the tuned draft_len_schedule, the end-to-end
#                                                    speedup and greedy agreement of 64 prompts x 128 tokens,
#                                                    and the confidence scheduler's sweep beside the fixed K,
#                                                    a torch profile of each engine's steps at 1 and 64 requests
#                                                    -> OUT/bench.json (written as each engine finishes, marked
#                                                    partial until the end), OUT/tuned-schedule.json,
#                                                    OUT/step-costs.json (dspark bench-plot draws bench.json)
#   bash benchmarks/trained_pair.sh again WORK OUT [BENCH FLAGS]
#                                                    the bench again on the pair a `measure` (or `bench`) tuned a
#                                                    schedule for, with that schedule (`dspark bench --schedule`: no
#                                                    tuning, one phase; e.g. `--concurrency 256` for its mixed
#                                                    workload alone, ~1/3 of a measure's time, in a second command
#                                                    after `train` and `measure ... --mixed-rate 0` in the first)
#   bash benchmarks/trained_pair.sh measure WORK OUT [BENCH FLAGS]
#                                                    the bench as `bench` runs it without the torch profiles (each
#                                                    engine's profiled steps cost ~10-20 s of a command's 10 minutes)
#   bash benchmarks/trained_pair.sh check WORK OUT [BENCH FLAGS]
#                                                    the confidence scheduler's check (~7-8 minutes a pair): the
#                                                    bench at the concurrencies the goal is judged at (1, 4, 64,
#                                                    256), 32 end-to-end prompts, the mixed workload also with
#                                                    prefill apart, no torch profiles (later flags win), on the
#                                                    pair of a `train WORK OUT 60 430 2048 16` run just before it
#                                                    (~7 minutes; the next command must follow within the machine's
#                                                    keep-alive) -> OUT/bench.json; and, if a `snapshot WORK early`
#                                                    kept an earlier drafter, on that pair too (without the end-to-end
#                                                    prompts, ~3.5 minutes) -> OUT/early/bench.json.
#                                                    Training and bench do not fit one 10-minute command: one run tried
#                                                    (a 240 s recipe) and its drafter got 24 s, tau 1.9; another's got
#                                                    412 s, tau 6.8; a third's 229 s, tau 5.2.
#   bash benchmarks/trained_pair.sh quick WORK OUT [BENCH FLAGS]
#                                                    train and check in one command, where the host's time
#                                                    allows no second command (or a machine taken back between two):
#                                                    `train WORK OUT 60 300 3072 24 20` (~265 s, a drafter trained
#                                                    ~45 s: it accepts less, where a schedule has something to gain),
#                                                    then the bench at 1, 4 and 64 requests in one round (rounds
#                                                    must be odd; three do not fit), no end-to-end prompts, no
#                                                    prefill-apart workload -> OUT/gpu-recipe.json, OUT/bench.json
#                                                    (the train 258 s, then `check` with these flags, which
#                                                    adds prefill apart, 408 s: together near the 10-minute limit,
#                                                    not yet run whole as one command)
#   bash benchmarks/trained_pair.sh snapshot WORK NAME
#                                                    keep the drafter as it stands as WORK/dspark-NAME (a later
#                                                    `train` resumes WORK/dspark): a pair that accepts less, on which
#                                                    verifying only what pays can gain (a pair accepting ~0.8+ at every
#                                                    position leaves any schedule nothing: schedule_bounds.py). E.g.
#                                                    `train WORK OUT 60 300 2048 16; snapshot WORK early` (~100 s of
#                                                    drafter), then `train WORK OUT 60 260 2048 16` (resumes it for
#                                                    ~180 s more), then `check WORK OUT`: three commands, each within
#                                                    the keep-alive of the one before.
# The mixed workload arrives at 400 requests/s (1536 of 128 tokens, ~4 s of arrivals): faster than the engines
# finish them, so its tokens/s is the engines' under mixed prefill + decode load (one run's 100/s measured the arrival
# rate: every engine kept up, 11.4-11.8K tokens/s, and the comparison said nothing but TPOT; one run's 512 requests,
# ~1.3 s, spread its rounds by +-10%, too short to resolve the 1% the confidence scheduler is held to).
# Both steps run from the checkout root with .whl-fi (and .fi-cache, if any) carried; see benchmarks/gpu_host.sh.
set -euo pipefail
step=${1:?give a step: train, profile, bench, measure, again, check, quick, snapshot or all}; work=${2:?give a work folder}
out=${3:?give an output folder (snapshot: a name)}
[ "$step" = snapshot ] || eval "$(bash benchmarks/gpu_host.sh install)"
export PYTHONUNBUFFERED=1
train() {  # target seconds, the recipe's wall-time budget (the drafter trains for what is left), target width, layers,
           # the target's sequences per step, the drafter's own cap in seconds (a weaker drafter on purpose), the
           # distillation's prompts (1536 took 74-97 s of a 3072 x 24 target's train), the target's and the
           # drafter's steps (each learning rate anneals over its steps; a time cap reached first stops it)
  python3 benchmarks/gpu_recipe.py --work "$work" --out "$out/gpu-recipe.json" --stages target,distill,dspark \
    --target-seconds "$1" --drafter-seconds "$6" --run-seconds "$2" --target-hidden "$3" --target-layers "$4" \
    --target-batch "$5" --distill-prompts "$7" --target-steps "$8" --drafter-steps "$9"
}
bench() {  # [BENCH FLAGS]; the drafter and the output folder from $drafter and $dest (default: WORK/dspark, OUT);
           # the schedule tuned (kept in WORK too, for `again`), or with $given the one tuned before
    local model=${drafter:-$work/dspark} to=${dest:-$out}
    local tuned="$work/$(basename "$model")-tuned-schedule.json"
    local schedule=(--tune-schedule "$tuned")
    [ -z "${given:-}" ] || schedule=(--schedule "$given")
    mkdir -p "$to"
    python3 -m cluster.cli bench --model "$work/target" --speculative-model "$model" \
      --prompts "$work/heldout-prompts.jsonl" --prompt-len 64 --concurrency 1,4,16,64,256 --steps 30 \
      --kv-cache-memory 16GiB "${schedule[@]}" --e2e-prompts 64 --e2e-tokens 128 \
      --confidence-scheduling --profile-steps "$to/step-costs.json" --mixed-rate 400 --mixed-requests 1536 \
      "$@" --out "$to/bench.json"
    [ -n "${given:-}" ] || cp "$tuned" "$to/tuned-schedule.json"
}
profile() {  # where the host time of a step goes at 1 and 4 requests, AR, DSpark, confidence-scheduled (cProfile)
  for batch in 1 4; do
    python3 benchmarks/host_profile.py --model "$work/target" --speculative-model "$work/dspark" \
      --prompts "$work/heldout-prompts.jsonl" --batch "$batch" --confidence --out "$out/host-profile-b$batch.json"
  done
}
case "$step" in
  train) train "${4:-150}" "${5:-510}" "${6:-512}" "${7:-8}" "${8:-48}" "${9:-100000}" "${10:-1536}" "${11:-6000}" \
               "${12:-20000}" ;;
  bench) shift 3; bench --profile --profile-batches 1,64 "$@" ;;
  measure) shift 3; bench "$@" ;;
  again) shift 3; given="$work/dspark-tuned-schedule.json" bench "$@" ;;
  quick) shift 3; train 60 300 3072 24 20 100000 1536 6000 20000
         bench --concurrency 1,4,64 --e2e-prompts 0 --rounds 1 "$@" ;;
  check) shift 3; bench --concurrency 1,4,64,256 --e2e-prompts 32 --mixed-prefill-apart "$@"
         if [ -d "$work/dspark-early" ]; then
           # (no end-to-end prompts: the strong pair's say what they say of the engine; this pair is for the schedule)
           drafter="$work/dspark-early" dest="$out/early" bench --concurrency 1,4,64,256 --e2e-prompts 0 "$@"
         fi ;;
  snapshot) name=$out  # (the third argument is the snapshot's name here)
            rm -rf "$work/dspark-$name" && cp -r "$work/dspark" "$work/dspark-$name"
            echo "trained_pair.sh: $work/dspark-$name kept" >&2 ;;
  profile) profile ;;
  all) train 100 300 "${4:-512}" "${5:-8}" 48 100000 1536 6000 20000
       profile || echo "trained_pair.sh: the host profile failed (bench goes on)" >&2
       bench --profile --profile-batches 1,64 ;;
  *) echo "usage: $0 train|bench|measure|again|profile|check|quick|snapshot|all WORK OUT|NAME" >&2; exit 2 ;;
esac
