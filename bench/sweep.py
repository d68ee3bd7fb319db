"""``dspark bench``: our autoregressive baseline and DSpark side by side, same engine and kernels.

For each concurrency ``c`` of the sweep, ``c`` requests decode together and the engine's steps are timed
(host and device, what a client sees between tokens): ``ar_step_ms`` without a drafter, ``dspark_step_ms``
with one, their tokens/s, TTFT and TPOT, acceptance (mean and per position), and the decode step against the
bandwidth roofline (bytes the step must read: every weight once plus the cached keys and values, over the
device copy bandwidth measured in the same run). With CUDA graphs, the last step's graphs are also replayed
alone: the device time of the forward (``ar_forward_ms``; ``verify_step_ms`` with a drafter), of the drafter's
context append (``context_ms``) and of its draft block (``draft_ms``); the rest of a step is host work and eager
kernels (``ar_outside_forward_ms``). ``--model-shape qwen3-8b`` (or ``qwen3-30b-a3b``, an MoE target: each step
also counts the distinct experts its routers wake, ``moe_experts_woken``, and a K+1-token verify's against one
token's, ``verify_experts_vs_decode``; its roofline reads only the experts woken) builds random-weight models of
real shapes (``load_format="dummy"``): step times and roofline only, since random drafters accept nothing
(``--projected-tau`` adds a projected speedup from a trained pair's acceptance); a trained pair
(``--model``/``--speculative-model``) gives acceptance and end-to-end speedup. Peers: Hugging Face ``generate``
on the same target, eager and compiled (static cache).
``--tune-schedule FILE`` times every shorter draft length too, writes the fastest ``draft_len_schedule``
(``bench.schedule_tuning``) and sweeps an engine with it (``tuned_*`` fields). ``--confidence-scheduling`` sweeps
an engine whose verify lengths the confidence scheduler chooses (``confidence_*`` fields; its startup profile is
``confidence_cost_table``, ``--profile-steps FILE`` saves it, and ``confidence_cost_table_served`` is the table as
the sweep left it, ``confidence_mixed_step_costs_served`` the mixed steps' excess over it
(``runtime.spec.mixed_step_costs``), from the sweep's ramps and prefills): within the tuned schedule when both are
given (the schedule caps the block it drafts; ``--confidence-draft-len max``: up to max_draft_len, as its scheduler
chooses, beside the tuned schedule; ``both``: the two in the same rounds, the second's figures as
``confidence-max_*``; ``confidence_vs_tuned`` compares the two engines measured in this run, the median rounds'
tokens/s, and
``confidence_vs_tuned_paired`` the median of the per-round ratios, each round's two figures taken back to back, so
the host's drift between rounds cancels), else within ``max_draft_len``. Beside them: what any schedule could gain
there over whole blocks, priced on the startup table from the fixed engine's acceptance (``confidence_oracle_bound``,
``confidence_padded_bound``: ``runtime.spec.schedule_bounds``), what the scheduler's own model promised at the steps it
decided (``confidence_predicted_gain``), and the tuned engine against the fixed one
(``tuned_vs_dspark_paired``): where the two ran the same draft length (``tuned_same_as_fixed``) they are one
configuration built twice, and that ratio is the run's noise floor. ``confidence_drafting_off_steps``: the timed steps
on which the confidence-scheduled engine drafted nothing because no verify beat plain decoding (its drafting holds;
the mixed workload's ``drafting_off_step_share``).
``--e2e-prompts N`` decodes N prompts one at a time through ``LLM.generate`` with both engines: the end-to-end
speedup against what the step times allow at the measured tau, and the share of prompts whose greedy outputs
are identical (bf16 verify batches reorder sums, so near-ties may part).
``--tensor-parallel-size N`` (and ``--drafter separate``) run every engine as a Ray replica through
``cluster.LLM`` (N target shards, a separate drafter on a GPU of its own), the same sweep in the same format
(``tensor_parallel_size``, ``drafter``; the separate layout also measures the colocated replica:
``throughput_vs_colocated``; with ``--pipeline-drafter`` also the separate drafter without the pipeline:
``throughput_vs_serial``); a replica's models live on its actors, so its record has step times, tokens/s and
acceptance but no roofline, graph replays or host breakdown. ``--beside-single-process`` measures the AR and DSpark
replicas each beside the same engine in this process on the same GPU, in alternating rounds (``single_ar_*``,
``single_dspark_*``): ``ray_vs_single_process_{ar,dspark}_step`` (and ``_paired``, the median of the per-round
ratios) is what the process boundary and the step's dispatch cost, free of the host's drift between separate runs;
with ``--e2e-prompts`` also how the replica's greedy outputs agree with one process's
(``end_to_end.replica_vs_single_process``: the share identical, where each first differs).
``--profile`` profiles every engine's batch-1 decode steps (``--profile-batches``: other batch sizes too, each once
every request has its first token; a replica's on every rank: ``*_profile_batch1.ranks``) after all the figures are
taken, on the engine built again: a process the
profiler has run in launches CUDA graphs several times slower.
On one process every engine compared is alive at once and measured in alternating rounds (``--rounds``, three per
concurrency, the order flipped each round, the median round kept; the end-to-end prompts alternate per prompt;
the tuning candidates are timed against the DSpark engine and read in its terms; with ``--tune-schedule`` the AR and
DSpark engines are measured again in one set of rounds with the tuned and confidence-scheduled engines, and those
rows replace the sweep's): the host's speed drifts by tens of percent over tens of seconds on a shared machine, so
figures timed minutes apart do not compare.
``--sequential`` (and every replica) measures each engine alone, one after another.
``--device cpu`` runs the plumbing on a CPU.
"""

from __future__ import annotations

import gc
import json
import platform
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from bench.figures import derive_figures, end_to_end_figures
from bench.measure import (copy_bandwidth, end_to_end, end_to_end_prompts, expert_bytes, hf_generate_tokens_per_s,
                           kv_bytes, mixed_workload, time_steps, weight_bytes)
from bench.profiling import local_worker, profile_step
from bench.shapes import write_shape
from bench.stats import (APART, BESIDE_SINGLE_PROCESS, CONFIDENCE_MAX, EAGER, SINGLE, alternating_rounds, median_round,
                         round_spread)
from bench.tuning import read_schedule, tune

# a confidence-scheduled engine's row: its field (after "confidence_") <- get_metrics()["confidence_scheduling"][metric]
CONFIDENCE_FIGURES = {
    "verify_budget_per_request": "mean_verify_budget_per_request",
    # the drafts each deciding request proposed: the block it drafted (padded and packed steps draft what the step
    # verifying them can use, Engine.drafts_follow_cap / _columns)
    "offered_per_request": "mean_offered_per_request",
    "predicted_step_ms": "mean_predicted_step_ms",
    "measured_step_ms": "mean_measured_step_ms",
    "measured_decided_step_ms": "mean_measured_decided_step_ms",  # the decided steps alone: what was predicted
    "expected_tokens_per_request": "mean_expected_tokens_per_request",
    "committed_tokens_per_request": "mean_committed_tokens_per_request",
    "cost_ms_per_context_token": "cost_table_ms_per_context_token",
    # what whole blocks were predicted at the same steps (the tuned engine measures them)
    "whole_block_expected_tokens_per_request": "mean_whole_block_expected_tokens_per_request",
    "whole_block_predicted_step_ms": "mean_whole_block_predicted_step_ms",
    "survival_correction": "survival_correction",
    "survival_fit": "survival_fit",  # the online fit the survivals were ranked by (slope a position, bias a class)
    # how much its survivals told this concurrency's drafts apart (Brier skill a position)
    "survival_skill_per_position": "survival_skill_per_position",
    # against the tuned engine's acceptance per position (whole blocks: the true survival)
    "predicted_survival_per_position": "mean_predicted_survival_per_position",
    "explored_decisions": "explored_decisions",
    "unpacked_steps": "unpacked_steps",
    "layout": "layout",
    "drafting_off_steps": "drafting_off_steps",  # steps that drafted nothing since drafting did not pay
    "drafting_holds": "drafting_holds",  # holds since startup
    # of the judgements that began them, those the refit after their step reversed
    "drafting_judgements_reversed": "drafting_judgements_reversed",
    # and the holds a mixed step began that the first decode step after them ended
    "drafting_mixed_holds_ended": "drafting_mixed_holds_ended",
    "serial_steps": "serial_steps",  # timed steps not launched ahead (priced and learned with the serial excess)
}


def trace_path(args, kind: str, batch: int) -> str | None:
    return str(Path(args.profile_trace) / f"{kind}-batch{batch}.trace.json.gz") if args.profile_trace else None


class Bench:
    """One ``dspark bench`` run: the engines it builds, measures side by side and releases, and the record they fill
    (``rows``: one per concurrency, each engine's figures under its kind's prefix). ``run`` drives the phases (the
    sweep in alternating rounds or one engine after another, a tuned schedule beside it, the profiles last) and
    derives the ratios; the other methods are its steps."""

    def __init__(self, args, replica_engine=None):
        import torch
        from transformers import AutoConfig, AutoTokenizer

        from runtime.training.distill import dataset_prompts

        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.args = args
        self.device = device = torch.device(args.device)
        self.replica = replica = on_replica(args)
        if replica and replica_engine is None:
            raise ValueError("--tensor-parallel-size / --drafter separate: this run was given no replica engine class "
                             "(the dspark command passes cluster.LLM)")
        self.replica_engine = replica_engine  # (model, speculative_config, **kwargs) -> an LLM of a Ray replica
        self.tp = tp = args.tensor_parallel_size or 1
        self.shape = shape = args.model_shape is not None
        if shape:
            self.target, self.drafter = write_shape(Path(tempfile.mkdtemp(prefix="dspark-bench-")), args.model_shape,
                                                    args.draft_layers, args.max_draft_len)
        else:
            self.target, self.drafter = Path(args.model), Path(args.speculative_model)
        self.vocab = AutoConfig.from_pretrained(str(self.target)).vocab_size
        self.bandwidth = bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
        self.common = dict(dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device,
                           kernel_backend=args.kernel_backend, enforce_eager=args.enforce_eager,
                           moe_backend=args.moe_backend, piecewise_cuda_graphs=args.piecewise_cuda_graphs,
                           max_num_seqs=max(args.concurrency), max_model_len=args.prompt_len + 2048,
                           kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=max(2048, args.prompt_len * 2),
                           load_format="dummy" if shape else "auto")
        self.spec = spec = {"speculative_model": str(self.drafter), "max_draft_len": args.max_draft_len,
                            "speculation_guard": args.speculation_guard, **({"load_format": "dummy"} if shape else {})}
        self.rows = {c: {"concurrency": c} for c in args.concurrency}
        command = "dspark bench " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "bench" \
            else shlex.join(sys.argv)
        self.record = record = {
            "hardware": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "command": command, "date": str(date.today()),
            "host": platform.node(), "torch": torch.__version__, "model": args.model_shape or str(self.target),
            "kind": "random-shape" if shape else "trained", "tensor_parallel_size": tp,
            "drafter": args.drafter, "pipeline_drafter": bool(args.pipeline_drafter) and args.drafter == "separate",
            "pipeline_min_batch": (args.pipeline_drafter_min_batch or _default_pipeline_min_batch())
            if args.pipeline_drafter else None,
            "allreduce_strategy": args.allreduce_strategy if replica else None,
            "replica": "ray" if replica else "single-process", "speculation_guard": args.speculation_guard,
            "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
            "step_outputs": "delta",  # the sweep's requests' output_kind (as the server streams; since 2026-12-01)
            "runs": []}
        # the sweep's prompts too: a trained pair's acceptance on its own kind of text
        self.sweep_prompts = dataset_prompts(args.prompts, AutoTokenizer.from_pretrained(str(self.target))) \
            if args.prompts else None
        self.e2e_prompts = end_to_end_prompts(args, self.sweep_prompts, self.vocab) if args.e2e_prompts else None
        self.e2e = {}
        self.engines = engines = [("ar", None, {}), ("dspark", spec, {})]
        if replica and args.drafter == "separate":  # the same replica with its drafter colocated: what a GPU more buys
            engines.append(("colocated", spec, {"drafter": "colocated"}))
            if args.pipeline_drafter:  # and the separate drafter without the pipeline: what the overlap buys
                engines.append(("serial", spec, {"pipeline": False}))
        # with --tune-schedule the scheduler runs within the tuned schedule (its draft length cap), after it, beside a
        # sweep of that schedule alone: both measured in this run; without, within the fixed max_draft_len
        self.confidence_after_tuning = args.confidence_scheduling and bool(args.tune_schedule or args.schedule)
        if args.confidence_scheduling and not self.confidence_after_tuning:
            engines.append(("confidence", {**spec, "enable_confidence_scheduling": True}, {}))
        # single-process engines are measured side by side in alternating rounds (a host's speed drifts: on the H200
        # hosts measured by up to 1.6x over tens of seconds, benchmarks/draft_len_steps.py);
        # a replica's engines one after another (two replicas would need twice the GPUs), as with --sequential
        self.alternate = alternate = not replica and not args.sequential
        record["measurement"] = "alternating rounds" if alternate else "sequential"
        if args.beside_single_process:
            record["measurement"] = ("sequential; the AR and DSpark replicas each beside the same engine in one "
                                     "process (single_*), in alternating rounds")
        record["rounds"] = args.rounds  # also the paired tuned / confidence engines' under --sequential
        self.mixed_rounds = args.mixed_rounds or args.rounds  # the mixed workload's, in alternating rounds
        if args.mixed_rate and alternate:
            record["mixed_rounds"] = self.mixed_rounds
        record["schedules"] = {"dspark": "fixed" if spec.get("draft_len_schedule") is None else "tuned",
                               **({"confidence": "confidence"} if args.confidence_scheduling else {})}
        # --profile: each engine's batch-1 steps, profiled once every figure of the run is taken, on the engine
        # rebuilt. torch.profiler leaves CUPTI attached to the process (and to a replica's actors) once it has run,
        # and from then on every CUDA graph launch costs the host several times more (Qwen3-8B shape on an H200, AR
        # batch 1: 0.13 ms of replay() a step in the run profiled first, 0.02 ms without), so a profile taken before
        # a sweep slows every figure after it.
        self.profiled: dict[str, tuple[dict | None, dict]] = {}  # kind -> how to build it again (each kind once)

    def engine_class(self, model, speculative_config=None, drafter: str | None = None, pipeline: bool | None = None,
                     single_process: bool = False, **kwargs):
        """One engine of the run: in this process, or (``--tensor-parallel-size``, ``--drafter separate``) a Ray
        replica through ``replica_engine`` (``cluster.LLM``: the target's shards and a separate drafter on actors). ``drafter``,
        ``pipeline``: a replica's drafter placement and pipelining (default: the run's); ``single_process``: the
        same engine in this process, beside the replica's (``--beside-single-process``)."""
        from runtime import LLM

        args = self.args
        if not self.replica or single_process:
            return LLM(model, speculative_config=speculative_config, **kwargs)
        place = (drafter or args.drafter) if speculative_config is not None else "colocated"  # AR: no drafter
        pipelined = bool(args.pipeline_drafter if pipeline is None else pipeline) and place == "separate"
        return self.replica_engine(model, speculative_config, tensor_parallel_size=self.tp, drafter=place,
                          pipeline_drafter=pipelined, allreduce_strategy=args.allreduce_strategy,
                          ray_address=args.ray_address,
                          **({"pipeline_drafter_min_batch": args.pipeline_drafter_min_batch}
                             if pipelined and args.pipeline_drafter_min_batch else {}), **kwargs)

    def run(self) -> dict:
        """The run's phases, then the ratios derived from their rows -> the record."""
        args = self.args
        kept = {}  # with --tune-schedule in alternating rounds: the sweep's engines, alive for the tuned ones' rounds
        if not self.alternate:
            for kind, speculative, layout in self.engines:
                if args.beside_single_process and kind in BESIDE_SINGLE_PROCESS:  # beside its one-process twin
                    self.paired([(kind, speculative, layout), (SINGLE + kind, speculative, {"single_process": True})],
                                with_e2e=True)
                else:
                    self.sweep(kind, speculative, layout)
        elif not args.schedule:  # every engine of the sweep alive at once, in alternating rounds (with --schedule, a
            # schedule tuned before: no first phase, the sweep's engines measured beside the schedule's below)
            # (with --tune-schedule the second phase measures every engine's mixed workload again, beside the tuned
            # ones: this phase's would be replaced unread, ~1.5 minutes of one run's ten)
            kept = self.paired(self.engines, with_e2e=True, keep=frozenset(kind for kind, _, _ in self.engines)
                               if args.tune_schedule else frozenset(), with_mixed=not args.tune_schedule)
        if args.tune_schedule or args.schedule:
            self.schedule_phase(kept)
        self.profile_all()
        derive_figures(self.record, self.rows, args, self.alternate)
        if self.e2e:
            self.record["end_to_end"] = end_to_end_figures(self.rows, args, self.e2e, len(self.e2e_prompts))
        if args.hf_tokens:
            first = self.rows[min(self.rows)]
            for peer, compiled in (("hf_generate", False), ("hf_compiled", True)):
                result = hf_generate_tokens_per_s(self.target, self.shape, args.hf_tokens, self.device, compiled)
                first[f"{peer}_tokens_per_s"] = result["tokens_per_s"]
                first[f"ar_vs_{peer}"] = first["ar_tokens_per_s"] / result["tokens_per_s"]
                self.record[f"{peer}_warmup_s"] = result["warmup_s"]
                print(f"dspark bench: {peer}: {result}", file=sys.stderr, flush=True)
        self.record["runs"] = list(self.rows.values())
        return self.record

    def schedule_phase(self, kept: dict) -> None:
        """``--tune-schedule`` / ``--schedule``: the schedule (tuned now against the sweep's DSpark engine, ``kept``
        alive, or read) as an engine, and with ``--confidence-scheduling`` the scheduler within it (or beside it),
        measured with the sweep's engines again in alternating rounds (or one after another)."""
        args, record, spec = self.args, self.record, self.spec
        if args.schedule:
            tuned = {"schedule": read_schedule(args.schedule, args.max_draft_len), "from": args.schedule}
        else:
            tuned = tune(args, self.engine_class, self.target, spec, self.common, self.rows, self.vocab, self.shape,
                         self.sweep_prompts, kept.get("dspark"))
        record["tuned_schedule"] = tuned
        capped = {"draft_len_schedule": tuned["schedule"]}
        after = [("tuned", {**spec, **capped}, {})]  # the tuned schedule as an engine
        record["schedules"]["tuned"] = "tuned"
        if self.confidence_after_tuning:  # beside the scheduler within it (or, asked, drafting max_draft_len; or both)
            within = {} if args.confidence_draft_len == "max" else capped
            record["confidence_draft_len"] = args.confidence_draft_len
            after.append(("confidence", {**spec, **within, "enable_confidence_scheduling": True}, {}))
            record["schedules"]["confidence"] = ("confidence within the tuned schedule" if within else
                                                 "confidence within max_draft_len, beside the tuned schedule")
            if args.confidence_draft_len == "both":  # the scheduler alone choosing how much to draft, beside
                after.append((CONFIDENCE_MAX, {**spec, "enable_confidence_scheduling": True}, {}))
                record["schedules"][CONFIDENCE_MAX] = "confidence within max_draft_len, beside the tuned schedule"
        if self.alternate and args.schedule:  # one phase: every engine of the sweep beside the schedule's
            self.paired(self.engines + after, with_e2e=True)
            record["measurement"] = "alternating rounds; the sweep beside a schedule tuned before (--schedule)"
            record["measured_together"] = [kind for kind, _, _ in self.engines + after]
        elif self.alternate:  # in alternating rounds with the sweep's engines again: every schedule and the AR
            # baseline measured together (the sweep's figures, minutes earlier, are replaced; the host's speed drifts)
            again = [(kind, speculative, layout) for kind, speculative, layout in self.engines if kind in kept]
            self.paired(again + after, alive=kept)
            record["measurement"] = "alternating rounds; the sweep measured again beside the tuned engines"
            record["measured_together"] = [kind for kind, _, _ in again + after]
        else:  # one at a time: two replicas would need twice the GPUs, and --sequential said two do not fit
            for kind, speculative, layout in after:
                self.sweep(kind, speculative, layout)

    def build(self, kind: str, speculative: dict | None, layout: dict):
        """One engine of the run, its startup time and rank info recorded, first-call costs paid."""
        from runtime.engine.heap import freeze_long_lived

        start = time.perf_counter()
        llm = self.engine_class(str(self.target), speculative_config=speculative, **self.common, **layout)
        self.record[f"{kind}_startup_s"] = time.perf_counter() - start
        self.record[f"{kind}_rank_info"] = llm.rank_info()
        if kind == "confidence":  # the step-time table it profiled at startup
            self.record["confidence_cost_table"] = llm.engine.confidence_tables()["costs"]
            if self.args.profile_steps:
                Path(self.args.profile_steps).write_text(json.dumps(self.record["confidence_cost_table"], indent=1)
                                                         + "\n")
        if kind == "ar":
            if local_worker(llm) is not None:  # a replica's weights are on its actors
                self.record["weight_bytes"] = weight_bytes(llm)
                self.record["expert_bytes"] = expert_bytes(llm)
            self.record["moe_backend"] = next(info.get("moe_backend") for info in llm.rank_info()
                                              if info.get("role") == "target")  # rank 0's (every target rank's alike)
        # untimed: first-call costs stay out of TTFT. On the sweep's prompts where it has them: a confidence-scheduled
        # engine learns from these steps (its survival fit, its drafting holds), and random tokens, which no drafter
        # predicts, teach a fit where nothing survives, which can start a hold (16 plain steps) that outlasts the
        # warm-up: the likely cause of one run's one-request sweep running a third of its steps plain while it
        # accepted every draft it verified (its step trace was not recorded yet)
        time_steps(llm, 1, self.args.prompt_len, 2, 1, self.vocab, seed=0, prompts=self.sweep_prompts)
        freeze_long_lived(f"bench engine {kind}")  # as a server does once started (runtime.engine.heap)
        return llm

    def reset_stats(self, kind: str, llm) -> None:
        if kind in ("confidence", CONFIDENCE_MAX):  # its figures per concurrency
            llm.engine.reset_speculation_stats()

    def measure(self, llm, c: int) -> dict:
        return time_steps(llm, c, self.args.prompt_len, self.args.steps, self.args.warmup, self.vocab, seed=c,
                          prompts=self.sweep_prompts)

    def record_row(self, kind: str, llm, c: int, timing: dict) -> None:
        self.rows[c].update({f"{kind}_{name}": timing[name]
                             for name in ("step_ms", "tokens_per_s", "ttft_ms", "tpot_ms")})
        self.rows[c].update({f"{kind}_{name}": value for name, value in timing.items() if name.startswith("host_")})
        self.rows[c].update({f"{kind}_{name}": value for name, value in timing.items() if name.startswith("moe_")})
        for name in ("pipelined_step_fraction", "steps_run_ahead_fraction"):  # (steps launched ahead hide host work)
            if name in timing:
                self.rows[c][f"{kind}_{name}"] = timing[name]
        metrics = llm.get_metrics()  # (once: on a Ray replica each call is a round trip)
        guard = metrics.get("speculation_guard")
        if guard is not None:  # its decisions over the engine's life so far: plain and drafting steps, probes
            self.rows[c][f"{kind}_speculation_guard"] = {k: v for k, v in guard.items()
                                                         if k not in ("buckets", "prompt_buckets")}
        if kind == "ar" and self.bandwidth and "weight_bytes" in self.record:
            woken = timing.get("moe_experts_woken", 0.0) * self.record["expert_bytes"]  # MoE: the experts read
            floor = (self.record["weight_bytes"] + woken + kv_bytes(llm, c, timing["context"])) / self.bandwidth
            self.rows[c].update(roofline_ms=1e3 * floor, roofline_fraction=1e3 * floor / timing["step_ms"])
            if "forward_ms" in timing:  # the device time of the graphed forward; the rest is outside it
                self.rows[c].update(ar_forward_ms=timing["forward_ms"],
                                    ar_outside_forward_ms=timing["step_ms"] - timing["forward_ms"])
        elif kind == "confidence":
            stats = metrics["confidence_scheduling"]
            self.rows[c].update(confidence_mean_acceptance_length=timing["mean_acceptance_length"],
                                confidence_acceptance_per_position=timing["acceptance_per_position"],
                                # the timed steps one by one (what each chose, predicted and measured), and by kind
                                confidence_trace=timing["confidence_trace"],
                                # the untimed steps before them (prefill, warm-up): where a hold the window shows began
                                confidence_trace_untimed=timing["confidence_trace_untimed"])
            self.rows[c].update({f"confidence_{field}": stats[metric] for field, metric in CONFIDENCE_FIGURES.items()})
        elif kind == CONFIDENCE_MAX:  # (--confidence-draft-len both) what it chose, beside the engine above
            stats = metrics["confidence_scheduling"]
            self.rows[c].update({f"{kind}_{name}": value for name, value in (
                ("mean_acceptance_length", timing["mean_acceptance_length"]),
                ("verify_budget_per_request", stats["mean_verify_budget_per_request"]),
                ("offered_per_request", stats["mean_offered_per_request"]),
                ("expected_tokens_per_request", stats["mean_expected_tokens_per_request"]),
                ("committed_tokens_per_request", stats["mean_committed_tokens_per_request"]),
                ("predicted_step_ms", stats["mean_predicted_step_ms"]),
                ("measured_decided_step_ms", stats["mean_measured_decided_step_ms"]),
                ("drafting_off_steps", stats["drafting_off_steps"]))})
        elif kind == "tuned":
            self.rows[c].update(tuned_mean_acceptance_length=timing["mean_acceptance_length"])
        elif kind == "dspark":
            self.rows[c].update(mean_acceptance_length=timing["mean_acceptance_length"],
                                acceptance_per_position=timing["acceptance_per_position"])
            if "forward_ms" in timing:
                self.rows[c].update(verify_step_ms=timing["forward_ms"], draft_ms=timing.get("draft_ms"),
                                    context_ms=timing.get("context_ms"))
        print(f"dspark bench: {kind} concurrency {c}: {timing}", file=sys.stderr, flush=True)

    def mixed(self, llm, mixed_prefill: bool = True, piecewise: bool = True, requests: int | None = None,
              profile: tuple[int, int] | None = None) -> dict:
        requests = requests or self.args.mixed_requests
        mixed_prompts = self.sweep_prompts or end_to_end_prompts(self.args, None, self.vocab, requests)
        return mixed_workload(llm, [mixed_prompts[i % len(mixed_prompts)][:self.args.prompt_len]
                                    for i in range(requests)], self.args.mixed_rate, self.args.e2e_tokens,
                              mixed_prefill=mixed_prefill, piecewise=piecewise, profile=profile)

    def profile_mixed(self, variants: dict) -> None:
        """--profile-mixed N: each variant's mixed workload once more, untimed, with a torch profile of N steps from
        the middle of its timed run's steps on (where the batch has ramped up) -> ``mixed_workload[NAME]["profile"]``
        (the kernels, the device's busy and idle time, the host's regions per step)."""
        if not self.args.profile_mixed:
            return
        for name, variant in variants.items():
            middle = self.record["mixed_workload"][name]["steps"] // 2
            profiled_run = self.mixed(*variant, profile=(middle, self.args.profile_mixed))
            self.record["mixed_workload"][name]["profile"] = profiled_run.get("profile")

    def warm_mixed(self, variants: dict) -> None:
        """``--mixed-warmup`` requests through each variant's mixed workload, untimed: the first run of an engine's
        eager mixed steps meets shapes the sweep never fed (kernel variants compiled or chosen for them, memory the
        allocator has not cached), first-use costs the first timed round would otherwise pay alone."""
        requests = min(self.args.mixed_warmup, self.args.mixed_requests)
        if requests:
            self.record["mixed_warmup_requests"] = requests
            for variant in variants.values():
                self.mixed(*variant, requests=requests)

    def mixed_variants(self, llms: dict) -> dict:
        """name -> (engine, mixed_prefill, piecewise): each engine as built, with --mixed-prefill-apart each one again
        with prefill apart (``KIND-apart``), with --mixed-eager each one again with the steps no whole-step graph
        serves eager (``KIND-eager``)."""
        variants = {kind: (llm, True, True) for kind, llm in llms.items()}
        if self.args.mixed_prefill_apart:
            variants.update({f"{kind}{APART}": (llm, False, True) for kind, llm in llms.items()})
        if self.args.mixed_eager:
            variants.update({f"{kind}{EAGER}": (llm, True, False) for kind, llm in llms.items()})
        return variants

    def report_e2e(self, results: dict) -> None:
        for kind, result in results.items():
            self.e2e[kind] = result
            print(f"dspark bench: {kind} end to end: {result['tokens']} tokens in {result['seconds']:.2f} s",
                  file=sys.stderr, flush=True)

    def finish(self, kind: str, llm, with_mixed: bool = True, with_e2e: bool = True) -> None:
        """The mixed workload and end to end where asked for, then the engine's memory freed (a confidence-
        scheduled engine's step-time table, as serving left it, recorded first)."""
        if kind == "confidence":  # the startup profile is confidence_cost_table; this one learned from the sweep
            tables = llm.engine.confidence_tables()
            self.record["confidence_cost_table_served"] = tables["costs"]
            # the mixed steps' excess over that table (prefill chunks beside the verifies), learned from them
            self.record["confidence_mixed_step_costs_served"] = tables["mixed"]
        if self.args.mixed_rate and with_mixed:
            variants = self.mixed_variants({kind: llm})
            self.warm_mixed(variants)
            for name, variant in variants.items():
                self.record.setdefault("mixed_workload", {})[name] = self.mixed(*variant)
                tables = variant[0].engine.confidence_tables()
                if tables:  # what its mixed steps and their plain alternative cost, as learned
                    self.record["mixed_workload"][name]["mixed_step_costs"] = tables["mixed"]
                    if tables["plain_mixed"] is not None:
                        self.record["mixed_workload"][name]["plain_mixed_step_costs"] = tables["plain_mixed"]
                print(f"dspark bench: {name} mixed workload: {self.record['mixed_workload'][name]}", file=sys.stderr,
                      flush=True)
            self.profile_mixed(variants)
        if self.e2e_prompts is not None and with_e2e:
            self.report_e2e(end_to_end({kind: llm}, self.e2e_prompts, self.args.e2e_tokens))
        self.release(llm)

    def release(self, llm) -> None:
        """Shut an engine down and free its memory before the next one is built."""
        import torch

        from runtime.engine.heap import unfreeze_long_lived

        llm.shutdown()
        del llm
        unfreeze_long_lived()
        gc.collect()  # engines hold reference cycles (graphs, caches): free their memory before the next
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        save_partial(self.args, self.record, self.rows)



    def profile_later(self, kind: str, speculative: dict | None, layout: dict) -> None:
        if self.args.profile and kind in ("ar", "dspark", "tuned", "confidence", CONFIDENCE_MAX):
            self.profiled[kind] = (speculative, layout)

    def profile_all(self) -> None:
        for kind, (speculative, layout) in self.profiled.items():
            llm = self.engine_class(str(self.target), speculative_config=speculative, **self.common, **layout)
            # first-call costs stay out of the profile (on the sweep's prompts, as the engines' builds warm up)
            time_steps(llm, 1, self.args.prompt_len, 2, 1, self.vocab, seed=0, prompts=self.sweep_prompts)
            for batch in self.args.profile_batches:
                self.record[f"{kind}_profile_batch{batch}"] = summary_ = profile_step(
                    llm, batch, self.args.prompt_len, self.vocab, trace_path(self.args, kind, batch))
                print(f"dspark bench: {kind} batch-{batch} profile: {json.dumps(summary_)}", file=sys.stderr,
                      flush=True)
            self.release(llm)

    def sweep(self, kind: str, speculative: dict | None, layout: dict) -> None:
        """Build one engine, run the concurrency sweep (and the mixed workload, end to end) on it."""
        from tqdm.auto import tqdm

        llm = self.build(kind, speculative, layout)
        for c in tqdm(self.args.concurrency, desc=f"{kind} sweep", disable=None):
            self.reset_stats(kind, llm)
            self.record_row(kind, llm, c, self.measure(llm, c))
        self.finish(kind, llm)
        self.profile_later(kind, speculative, layout)

    def build_together(self, kind: str, speculative: dict | None, layout: dict):
        import torch

        try:
            return self.build(kind, speculative, layout)
        except torch.cuda.OutOfMemoryError as exc:
            raise SystemExit(f"dspark bench: the {kind} engine does not fit beside the engines it is measured "
                             f"against ({exc}); pass --sequential to measure each engine alone, one after "
                             "another, or lower --kv-cache-memory") from None

    def paired(self, engines_: list[tuple[str, dict | None, dict]], with_e2e: bool = False,
               keep: frozenset = frozenset(), alive: dict | None = None, with_mixed: bool = True) -> dict:
        """Engines alive together, measured in alternating rounds (``--rounds`` per concurrency, the order
        flipped each round; the mixed workload too, and with ``with_e2e`` the end-to-end prompts, alternating per
        prompt): each figure is the round with the median tokens/s, so host drift and jitter fall on all alike.
        The record keeps every round's tokens/s. ``alive``: engines of ``engines_`` already built (kind -> engine;
        measured again, their rows replaced). ``with_mixed`` False: no mixed workload in this phase (a later one
        measures every engine's again). -> the engines named in ``keep``, still alive (the rest freed)."""
        from tqdm.auto import tqdm

        alive = alive or {}
        llms = {kind: alive[kind] if kind in alive else self.build_together(kind, speculative, layout)
                for kind, speculative, layout in engines_}
        for c in tqdm(self.args.concurrency, desc="paired sweep", disable=None):
            timings = {kind: [] for kind in llms}
            for kind, llm in llms.items():
                self.reset_stats(kind, llm)
            for kind, result in alternating_rounds(llms, lambda llm: self.measure(llm, c), self.args.rounds):
                timings[kind].append(result)
            for kind, llm in llms.items():
                self.record_row(kind, llm, c, median_round(timings[kind]))
                self.rows[c][f"{kind}_tokens_per_s_rounds"] = [t["tokens_per_s"] for t in timings[kind]]
            # the sweep's rows so far, and before the mixed workload (a run cut there keeps them)
            save_partial(self.args, self.record, self.rows)
        if self.args.mixed_rate and with_mixed:
            variants = self.mixed_variants(llms)
            self.warm_mixed(variants)
            runs = {name: [] for name in variants}
            for name, result in alternating_rounds(variants, lambda variant: self.mixed(*variant), self.mixed_rounds):
                runs[name].append(result)
            for kind, results in runs.items():
                self.record.setdefault("mixed_workload", {})[kind] = {
                    **median_round(results), "tokens_per_s_rounds": [m["tokens_per_s"] for m in results],
                    "rounds_spread": [round_spread(m) for m in results]}
                print(f"dspark bench: {kind} mixed workload: {self.record['mixed_workload'][kind]}", file=sys.stderr,
                      flush=True)
            self.profile_mixed(variants)
        if with_e2e and self.e2e_prompts is not None:
            self.report_e2e(end_to_end(llms, self.e2e_prompts, self.args.e2e_tokens))
        kept = {}
        for kind, speculative, layout in engines_:
            self.profile_later(kind, speculative, layout)
            if kind in keep:
                kept[kind] = llms.pop(kind)
            else:
                self.finish(kind, llms.pop(kind), with_mixed=False, with_e2e=False)
        # engines kept alive write nothing yet: a later phase may not fit beside them
        save_partial(self.args, self.record, self.rows)
        return kept


def on_replica(args) -> bool:
    """Whether the run's engines are Ray replicas (``--tensor-parallel-size``, ``--drafter separate``): it then needs a
    replica engine class."""
    return args.tensor_parallel_size is not None or args.drafter == "separate"


def run(args, replica_engine=None) -> dict:
    """``dspark bench`` with parsed ``args`` (``cluster.bench_cli``) -> the record (see the module docstring).
    ``replica_engine``: the LLM class of a Ray replica (``cluster.LLM``), which ``--tensor-parallel-size`` and
    ``--drafter separate`` need; this package imports no Ray."""
    return Bench(args, replica_engine).run()


def _default_pipeline_min_batch() -> int:
    from configs.cluster import ParallelConfig

    return ParallelConfig.model_fields["pipeline_drafter_min_batch"].default


def save_partial(args, record: dict, rows: dict) -> None:
    """Write what is measured so far to ``--out`` (marked ``partial``), so a run cut short keeps its figures; the
    finished record replaces it."""
    if args.out:
        Path(args.out).write_text(json.dumps({**record, "runs": list(rows.values()), "partial": True}, indent=1) + "\n")
