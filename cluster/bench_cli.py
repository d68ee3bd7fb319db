"""``dspark bench`` and ``dspark bench-plot``: their arguments and entry points (the measuring is the ``bench``
package's; a Ray replica's engine, ``cluster.LLM``, is handed to it from here)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from bench import plot as plot_module
from bench import sweep
from bench.drafter_kinds import KINDS, measure_kinds
from bench.plot import plot, require_matplotlib
from bench.report import summary
from bench.shapes import MODEL_SHAPES
from bench.stats import PAIRED_ROUNDS
from bench.sweep import run
from bench.tuning import read_schedule
from cluster.arg_types import SIZE_FORMS, device_name, gib, integer, memory_size, moe_backend, number


def batch_list(flag: str):
    """An argparse type: ``flag``'s comma-separated integers >= 1 -> sorted, distinct."""
    def parse(text: str) -> list[int]:
        import argparse

        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} wants integers >= 1 separated by commas, got {text!r}")
        return sorted(set(values))
    return parse


concurrency_list = batch_list("--concurrency")


def acceptance_list(text: str) -> list[float]:
    import argparse

    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 1.0 for v in values) or any(b > a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"--acceptance-per-position wants non-increasing rates in [0, 1] separated by "
                                         f"commas, got {text!r}")
    return values


def add_parser(commands) -> None:
    import argparse

    bench = commands.add_parser("bench", help="our AR baseline and DSpark side by side (JSON record)",
                                description=sweep.__doc__)
    which = bench.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), help="random weights of this shape")
    which.add_argument("--model", help="a trained target (needs --speculative-model)")
    which.add_argument("--drafter-kinds", type=kind_list, metavar="KINDS",
                       help=f"pairs whose worth is known by construction, comma-separated from {','.join(KINDS)}: "
                       "DSpark with the engine's defaults against our AR per kind and --concurrency, in --rounds "
                       "alternating rounds (bench.drafter_kinds; with --kind-seconds, --kind-tokens, "
                       "--device, --out)")
    bench.add_argument("--speculative-model", help="the trained drafter of --model")
    bench.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16, 64, 256],
                       help="comma-separated request counts, each >= 1 (default 1,4,16,64,256)")
    bench.add_argument("--max-draft-len", type=integer(1), default=7, help="K (default 7)")
    bench.add_argument("--draft-layers", type=integer(1), default=1, help="draft layers of a --model-shape drafter")
    bench.add_argument("--prompt-len", type=integer(1), default=512, help="prompt tokens per request (default 512)")
    bench.add_argument("--steps", type=integer(1), default=30, help="timed steps per point (default 30)")
    bench.add_argument("--warmup", type=integer(0), default=5, help="untimed steps first (default 5)")
    bench.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                       help="kernels of both engines (default auto: flashinfer on a GPU where it imports)")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    bench.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="the engines' piecewise graphs of the steps no whole-step graph serves (default on; "
                       "LLMConfig.piecewise_cuda_graphs)")
    bench.add_argument("--speculation-guard", action=argparse.BooleanOptionalAction, default=True,
                       help="the DSpark engines' speculation guard (default on, the engine's default: drafting only "
                       "where it pays, learned online); --no-speculation-guard measures the schedules as set")
    bench.add_argument("--confidence-scheduling", action="store_true", help="also sweep DSpark with "
                       "enable_confidence_scheduling (its step-time table profiled at startup, in the record): "
                       "confidence_tokens_per_s beside the fixed schedule's dspark_tokens_per_s; with "
                       "--tune-schedule it runs within the tuned schedule, beside a sweep of that schedule alone "
                       "(confidence_vs_tuned)")
    bench.add_argument("--confidence-draft-len", choices=("tuned", "max", "both"), default="tuned",
                       help="with --confidence-scheduling and --tune-schedule: the block the confidence-scheduled "
                       "engine drafts: the tuned schedule's length at each concurrency (tuned, the default), or "
                       "up to max_draft_len everywhere (max: the scheduler alone chooses how much to draft and "
                       "verify: a graphed step drafts one past the cap or the packed columns it chose, and where "
                       "the tuned schedule drafts fewer it may still verify a whole block for a request whose "
                       "drafts it trusts); either way it is compared with the tuned schedule; both: the two "
                       "engines in the same rounds, the second's figures as confidence-max_* (one engine more alive "
                       "at once: a smaller --kv-cache-memory may be needed)")
    bench.add_argument("--profile-steps", metavar="FILE", help="with --confidence-scheduling: also write the "
                       "profiled step-time table to FILE (a confidence_cost_table_path)")
    bench.add_argument("--moe-backend", default="AUTO", type=moe_backend, metavar="{AUTO,VANILLA,DENSEGEMM,TRITON}",
                       help="expert kernels of an MoE target (default AUTO; recorded as moe_backend)")
    budget = bench.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=memory_size, metavar="SIZE", default=40 << 30,
                        help=f"KV cache per engine: {SIZE_FORMS} (default 40GiB)")
    budget.add_argument("--kv-cache-gib", type=gib, dest="kv_cache_memory", help=argparse.SUPPRESS)  # older spelling
    bench.add_argument("--device", default="cuda", type=device_name, help="cuda (default; the figures), cuda:N, "
                       "auto, or cpu: float32 torch kernels, a run of the plumbing whose times mean nothing (no "
                       "roofline, peers or profiles)")
    bench.add_argument("--tensor-parallel-size", type=integer(1), help="run every engine as a Ray replica "
                       "(cluster.LLM) of this many target shards, one GPU each; the record says tensor_parallel_size "
                       "and drafter (default: one process, runtime.LLM, with its CUDA graphs and host breakdowns)")
    bench.add_argument("--allreduce-strategy", choices=["NCCL", "ONESHOT", "AUTO"], default="NCCL", help="with "
                       "--tensor-parallel-size: how the target ranks sum (parallel.allreduce_strategy; default NCCL); "
                       "each rank's choice is in *_rank_info")
    bench.add_argument("--beside-single-process", action="store_true", help="with --tensor-parallel-size: measure "
                       "the AR and DSpark replicas each beside the same engine in this process on the same GPU, in "
                       "alternating rounds (single_ar_*, single_dspark_*; ray_vs_single_process_{ar,dspark}_step and "
                       "its _paired median of per-round ratios: what the process boundary and the dispatch cost)")
    bench.add_argument("--ray-address", help="with --tensor-parallel-size: the Ray cluster the replicas join "
                       "(default: a running one, else a new local one; 'local' always starts a new one)")
    bench.add_argument("--drafter", default="colocated", choices=["colocated", "separate"], help="where a "
                       "replica's drafter runs: colocated (TP rank 0's process) or separate (its own actor and GPU, "
                       "implies a replica); separate also measures the colocated replica in the same run "
                       "(throughput_vs_colocated, step_vs_colocated)")
    bench.add_argument("--pipeline-drafter", action="store_true", help="with --drafter separate: the separate "
                       "drafter drafts one request group while the target verifies the other (pipeline_drafter); "
                       "the run also measures the separate drafter without the pipeline (throughput_vs_serial)")
    bench.add_argument("--pipeline-drafter-min-batch", type=integer(1), metavar="N", help="with --pipeline-drafter: "
                       "parallel.pipeline_drafter_min_batch, the requests from which steps are pipelined (default "
                       "64; 1: always)")
    bench.add_argument("--pipeline-min-batch", type=integer(1), dest="pipeline_drafter_min_batch",
                       help=argparse.SUPPRESS)  # (the older spelling)
    bench.add_argument("--hf-tokens", type=integer(0), default=0, help="also time transformers generate for N "
                       "tokens at batch 1, eager and compiled with a static cache (peers)")
    bench.add_argument("--projected-tau", type=float, help="a trained pair's mean acceptance length: adds "
                       "projected_speedup = tau x AR step / DSpark step to every point (for --model-shape)")
    bench.add_argument("--projected-tau-source", default="", help="where --projected-tau was measured (recorded)")
    bench.add_argument("--schedule", metavar="FILE", help="a draft_len_schedule tuned before on this pair (the "
                       "FILE an earlier --tune-schedule wrote): the tuned engine runs it, no tuning, in one phase "
                       "beside the sweep's engines (and with --confidence-scheduling the confidence engine, as after "
                       "--tune-schedule): a second measurement of a pair, e.g. its mixed workload, in less time")
    bench.add_argument("--tune-schedule", metavar="FILE", help="also time every shorter draft length and write the "
                       "draft_len_schedule with the most tokens/s at each concurrency to FILE (a config fragment for "
                       "dspark serve --config; a length other than max_draft_len only where it measured more than "
                       "2%% faster; at the smallest concurrency max_draft_len, as the engine requires, "
                       "the record saying what that costs where a shorter length is faster); the sweep must "
                       "include concurrency 1")
    bench.add_argument("--acceptance-per-position", type=acceptance_list, help="a trained pair's acceptance per "
                       "draft position (comma-separated, max_draft_len values): --tune-schedule on a --model-shape "
                       "projects tau from it")
    bench.add_argument("--e2e-prompts", type=integer(0), default=0, help="also decode N prompts one at a time through "
                       "LLM.generate with each engine: end-to-end speedup and the share of identical greedy outputs")
    bench.add_argument("--e2e-tokens", type=integer(1), default=128, help="tokens per --e2e-prompts (and --mixed-rate) "
                       "request (default 128)")
    bench.add_argument("--mixed-rate", type=number(0), help="also run a mixed workload with every "
                       "engine: requests arriving at this Poisson rate per second while others decode (steps mix "
                       "prefill and decode); each engine's record says where its steps' time went (0: none, as "
                       "without the flag: a later --mixed-rate 0 takes back an earlier one, e.g. a script's default)")
    bench.add_argument("--mixed-requests", type=integer(1), default=256, help="requests of --mixed-rate (default 256)")
    bench.add_argument("--mixed-warmup", type=integer(0), default=64, help="requests of an untimed mixed workload "
                       "each engine runs first (its eager mixed steps' first shapes; default 64, at most "
                       "--mixed-requests; 0: none)")
    bench.add_argument("--mixed-prefill-apart", action="store_true", help="with --mixed-rate: run the mixed workload "
                       "on every engine twice, as built (a step may feed prompt chunks beside decodes) and with "
                       "prefill apart (enable_mixed_prefill=False: prefill steps and decode steps, each graphed), in "
                       "the same alternating rounds; records mixed_workload[KIND-apart] and mixed_apart_vs_mixed")
    bench.add_argument("--mixed-eager", action="store_true", help="with --mixed-rate: run the mixed workload on every "
                       "engine twice, through its piecewise CUDA graphs (as built) and with the steps no whole-step "
                       "graph serves eager, in the same alternating rounds; records mixed_workload[KIND-eager] and "
                       "mixed_piecewise_vs_eager (one process on a GPU)")
    bench.add_argument("--profile-mixed", type=integer(0), default=0, metavar="STEPS", help="with --mixed-rate: "
                       "after the timed rounds, each engine's mixed workload once more, untimed, with a torch profile "
                       "of STEPS steps from the middle of its timed run on -> mixed_workload[KIND].profile (default "
                       "0: none)")
    bench.add_argument("--prompts", help="JSONL prompts (prompt, messages or prompt_ids rows) for the sweep (cut "
                       "to --prompt-len; a trained pair's acceptance needs its kind of text) and --e2e-prompts; "
                       "default: random token ids")
    bench.add_argument("--plot", help="also draw speedup and tokens/s against concurrency into this PNG "
                       "(needs matplotlib: pip install 'dspark[bench]')")
    bench.add_argument("--sequential", action="store_true", help="measure each engine alone, one after another, "
                       "instead of all of them alive together in alternating rounds (the default on one process: "
                       "the host's speed drifts between engines timed apart); for targets too large to hold two "
                       "engines at once. A replica's engines are always measured one after another")
    bench.add_argument("--rounds", type=integer(1), default=PAIRED_ROUNDS, help="alternating rounds per concurrency "
                       f"(and per tuning candidate) when engines are measured side by side; the median round is "
                       f"kept (default {PAIRED_ROUNDS}; odd)")
    bench.add_argument("--mixed-rounds", type=integer(1), help="alternating rounds of the mixed workload (default: "
                       "--rounds; odd): its rounds spread far more than the sweep's (the same engine 7.2K to "
                       "12.3K tokens/s), so it may need more of them than the sweep does")
    bench.add_argument("--profile", action="store_true", help="torch.profiler summary of batch-1 decode steps of "
                       "each engine (AR, DSpark, and the tuned and confidence-scheduled ones where swept): kernels "
                       "per step, GPU busy and idle time per step, the largest GPU gaps, host time per region; a "
                       "replica's on every rank (its record's *_profile_batch1.ranks); taken after every figure of the "
                       "run, on the engines built again (a profiled process launches CUDA graphs slower)")
    bench.add_argument("--profile-batches", type=batch_list("--profile-batches"), default=[1],
                       help="with --profile: the batch sizes profiled (default 1; each at most the largest "
                       "--concurrency), one record field *_profile_batch{N} each")
    bench.add_argument("--profile-trace", help="with --profile: also write each profile's timeline (Chrome trace, "
                       "gzip) into this folder")
    kinds = bench.add_argument_group("drafter kinds (--drafter-kinds)")
    kinds.add_argument("--kind-seconds", type=number(0.1), default=1.0, help="wall time of each engine's run in a "
                       "round, and of its warmup (default 1)")
    kinds.add_argument("--kind-tokens", type=integer(1), default=64, help="tokens each request generates before a new "
                       "one of its class replaces it (default 64)")
    bench.add_argument("--out", help="write the JSON record here (default: print it)")
    bench.set_defaults(handler=main)


def kind_list(text: str) -> list[str]:
    import argparse

    kinds = [k for k in text.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"wants drafter kinds from {', '.join(KINDS)} separated by commas, got "
                                         f"{text!r}")
    return kinds


def main(args) -> int:
    if args.model is not None and args.speculative_model is None:
        print("dspark bench: --model needs --speculative-model", file=sys.stderr)
        return 2
    if args.profile_steps and not args.confidence_scheduling:
        print("dspark bench: --profile-steps needs --confidence-scheduling (it writes that engine's table)",
              file=sys.stderr)
        return 2
    if args.ray_address is not None and args.tensor_parallel_size is None:
        print("dspark bench: --ray-address needs --tensor-parallel-size (one process joins no Ray cluster)",
              file=sys.stderr)
        return 2
    if args.confidence_draft_len != "tuned" and not (args.confidence_scheduling
                                                     and (args.tune_schedule or args.schedule)):
        print("dspark bench: --confidence-draft-len needs --confidence-scheduling and --tune-schedule or --schedule "
              "(without a tuned schedule the confidence engine drafts max_draft_len already)", file=sys.stderr)
        return 2
    if args.schedule:
        problem = "--schedule and --tune-schedule: give one (a schedule tuned before, or one tuned now)" \
            if args.tune_schedule else None
        try:
            problem = problem or (read_schedule(args.schedule, args.max_draft_len) and None)
        except ValueError as error:
            problem = str(error)
        if problem:
            print(f"dspark bench: {problem}", file=sys.stderr)
            return 2
    if args.projected_tau is not None and not 1.0 <= args.projected_tau <= args.max_draft_len + 1:
        print(f"dspark bench: --projected-tau must be in [1, max_draft_len + 1 = {args.max_draft_len + 1}], got "
              f"{args.projected_tau}", file=sys.stderr)
        return 2
    if args.allreduce_strategy != "NCCL" and (args.tensor_parallel_size or 1) < 2:
        print(f"dspark bench: --allreduce-strategy {args.allreduce_strategy} needs --tensor-parallel-size 2 or more "
              "(one rank sums nothing)", file=sys.stderr)
        return 2
    if args.beside_single_process and args.tensor_parallel_size is None:
        print("dspark bench: --beside-single-process needs --tensor-parallel-size (it pairs a replica with one "
              "process)", file=sys.stderr)
        return 2
    if args.pipeline_drafter_min_batch is not None and not args.pipeline_drafter:
        print("dspark bench: --pipeline-drafter-min-batch needs --pipeline-drafter (it says when the pipeline runs)",
              file=sys.stderr)
        return 2
    if args.pipeline_drafter and args.drafter != "separate":
        print("dspark bench: --pipeline-drafter needs --drafter separate", file=sys.stderr)
        return 2
    replica = args.tensor_parallel_size is not None or args.drafter == "separate"
    if replica and args.hf_tokens:
        print("dspark bench: --hf-tokens times transformers on one GPU; leave it out with --tensor-parallel-size or "
              "--drafter separate", file=sys.stderr)
        return 2
    for flag, rounds in (("--rounds", args.rounds), ("--mixed-rounds", args.mixed_rounds)):
        if rounds is not None and (rounds < 1 or rounds % 2 == 0):
            print(f"dspark bench: {flag} must be an odd number >= 1 (the median round is kept), got {rounds}",
                  file=sys.stderr)
            return 2
    if args.drafter_kinds is not None:
        return drafter_kinds_main(args)
    mixed_flags = (("--mixed-prefill-apart", args.mixed_prefill_apart), ("--mixed-eager", args.mixed_eager),
                   ("--profile-mixed", args.profile_mixed))
    needs_mixed = [flag for flag, given in mixed_flags if given]
    if needs_mixed and not args.mixed_rate:
        print(f"dspark bench: {', '.join(needs_mixed)} needs --mixed-rate (the mixed workload they run)",
              file=sys.stderr)
        return 2
    if args.profile and max(args.profile_batches) > max(args.concurrency):
        print(f"dspark bench: --profile-batches {max(args.profile_batches)} exceeds the largest --concurrency "
              f"{max(args.concurrency)} (the engines hold that many requests)", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.hf_tokens:
        print("dspark bench: --hf-tokens needs --device cuda (the peers' figures are GPU figures)", file=sys.stderr)
        return 2
    if args.plot:
        require_matplotlib("--plot")
    if args.tune_schedule:
        problem = None
        if 1 not in args.concurrency:
            problem = "--tune-schedule needs concurrency 1 in the sweep (the schedule starts at max_draft_len there)"
        elif args.model_shape is not None and (args.acceptance_per_position is None
                                               or len(args.acceptance_per_position) != args.max_draft_len):
            problem = (f"--tune-schedule on a --model-shape needs --acceptance-per-position with max_draft_len = "
                       f"{args.max_draft_len} values (random drafters accept nothing)")
        if problem:
            print(f"dspark bench: {problem}", file=sys.stderr)
            return 2
    replica_engine = None
    if sweep.on_replica(args):  # (Ray imported only then)
        from cluster.llm import LLM as replica_engine
    record = run(args, replica_engine=replica_engine)
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(summary(record), file=sys.stderr)
    if args.plot:
        print(f"dspark bench: plot {plot(record, args.plot)}", file=sys.stderr)
    return 0


def drafter_kinds_main(args) -> int:
    """``--drafter-kinds``: the record of ``bench.drafter_kinds`` (the sweep's other flags do not apply)."""
    record = measure_kinds(args.drafter_kinds, args.concurrency, args.kind_tokens, args.rounds, args.kind_seconds,
                           args.device, "dspark bench " + shlex.join(sys.argv[2:]), args.out)
    if not args.out:
        print(json.dumps(record, indent=1))
    return 0


def add_plot_parser(commands) -> None:
    cmd = commands.add_parser("bench-plot", help="draw a dspark bench record as a PNG",
                              description=plot_module.__doc__)
    cmd.add_argument("record", help="a dspark bench JSON record")
    cmd.add_argument("--out", help="the PNG to write (default: the record's path with .png)")
    cmd.set_defaults(handler=plot_main)


def plot_main(args) -> int:
    require_matplotlib("bench-plot")
    source = Path(args.record)
    try:
        record = json.loads(source.read_text())
        runs = record["runs"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"dspark bench-plot: {source} is not a dspark bench record: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print(f"dspark bench-plot: {source} has no runs", file=sys.stderr)
        return 2
    print(plot(record, args.out or source.with_suffix(".png")))
    return 0
