"""What planning the next decode step's attention ahead buys an autoregressive engine: the same engine (one
``runtime.LLM`` on a random-weight shape, CUDA graphs, FlashInfer) timed with its graphs' ``plan_ahead`` off and
on, in alternating rounds of ``bench.time_steps`` at each concurrency; the median round of each is kept
with every round's step time. ``plans_made_ahead``: the steps of the last round that skipped their plan.
``--toggle run_ahead``: planning ahead in both modes, launching steady greedy decode steps ahead
(``GraphedTargetForward.run_ahead``) off and on; ``steps_run_ahead`` / ``steps_ahead_dropped`` of the last round.
``--speculative``: DSpark engines (a 1-layer random drafter, K=7); ``--toggle run_ahead`` then launches the next
greedy verify of full blocks ahead (``GraphedTargetForward.launch_verify_ahead``) or not.
``--toggle pdl``: two engines side by side (both planning and running ahead), the "off" one built with its
Triton kernels launched plainly (``runtime.kernels.pdl.supported`` patched to False while its graphs are
captured), the "on" one with programmatic dependent launch; only decode steps are timed, all of them replays.
``--toggle prenorm``: likewise, the "off" engine built without the norm fused into the q/k/v and gate/up GEMMs
(``runtime.models.small_gemm.PRENORM_LINEARS`` emptied while it measures its GEMMs), the "on" one where that measured
faster; each engine's choice is in the record (``small_gemms``).

``--profile``: each mode's GPU idle time per step and its largest gaps (``runtime.kernels.profiling.gpu_gaps``).

usage: python3 benchmarks/plan_ahead.py [--model-shape qwen3-8b] [--concurrency 1,16,64] [--steps 30]
                                        [--rounds 3] [--toggle plan_ahead|run_ahead|pdl|prenorm] [--speculative] [--profile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

from bench import MODEL_SHAPES, copy_bandwidth, profile_step, time_steps, write_shape
from runtime import LLM


def set_mode(graphs, toggle: str, on: bool) -> None:
    """plan_ahead: planning (and so launching) ahead off or on; run_ahead: planning ahead, launching ahead off or on;
    pdl, prenorm: both ahead (the modes are two engines)."""
    graphs.plan_ahead = on or toggle in ("run_ahead", "pdl", "prenorm")
    graphs.run_ahead = on or toggle in ("pdl", "prenorm")


def build(target: Path, args, concurrency: list[int], pdl: bool = True, drafter: Path | None = None,
          prenorm: bool = True) -> LLM:
    """The engine under test; ``pdl=False``: its graphs captured with every Triton kernel launched plainly;
    ``prenorm=False``: no projection measured (so none run) with the norm before it fused in."""
    from runtime.kernels import pdl as pdl_module
    from runtime.models import small_gemm

    supported, prenorm_linears = pdl_module.supported, small_gemm.PRENORM_LINEARS
    if not pdl:
        pdl_module.supported = lambda device: False
    if not prenorm:
        small_gemm.PRENORM_LINEARS = ()
    try:
        spec = {"speculative_model": str(drafter), "max_draft_len": 7, "load_format": "dummy"} if drafter else None
        return LLM(str(target), speculative_config=spec, dtype="bfloat16", device="cuda", kernel_backend="flashinfer",
                   load_format="dummy",
                   max_num_seqs=max(concurrency), max_model_len=args.prompt_len + 2048,
                   kv_cache_memory=int(args.kv_cache_gib * 2**30),
                   max_num_batched_tokens=max(2048, 2 * args.prompt_len))
    finally:
        pdl_module.supported, small_gemm.PRENORM_LINEARS = supported, prenorm_linears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=float, default=16.0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile 5 steps of each mode (torch.profiler): the GPU's idle time per step and "
                             "its largest gaps, with the activities either side")
    parser.add_argument("--toggle", choices=("plan_ahead", "run_ahead", "pdl", "prenorm"), default="plan_ahead",
                        help="what the off and on modes differ in (run_ahead: both plan ahead; pdl, prenorm: two "
                             "engines, both running ahead)")
    parser.add_argument("--speculative", action="store_true", help="DSpark engines (a 1-layer random drafter, K=7)")
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    target, drafter = write_shape(Path(tempfile.mkdtemp(prefix="plan-ahead-")), args.model_shape, 1, 7)
    drafter = drafter if args.speculative else None
    llm = build(target, args, concurrency, drafter=drafter)
    off = {"pdl": {"pdl": False}, "prenorm": {"prenorm": False}}.get(args.toggle)
    engines = {"off": build(target, args, concurrency, drafter=drafter, **off) if off is not None else llm, "on": llm}
    for engine in engines.values():
        graphs = engine.engine.executor.worker.graphs
        if graphs is None or not graphs.plan_ahead:
            raise SystemExit("plan_ahead: the engine runs no CUDA graphs that plan ahead (needs CUDA and flashinfer)")
    vocab = MODEL_SHAPES[args.model_shape]["vocab_size"]
    runs = []
    for c in concurrency:
        rounds = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on"):
                graphs = engines[mode].engine.executor.worker.graphs
                set_mode(graphs, args.toggle, mode == "on")
                skipped, ahead, dropped = graphs.plans_skipped, graphs.steps_run_ahead, graphs.steps_ahead_dropped
                row = time_steps(engines[mode], c, args.prompt_len, args.steps, warmup=3, vocab=vocab, seed=r)
                row["plans_made_ahead"] = graphs.plans_skipped - skipped
                row["steps_run_ahead"] = graphs.steps_run_ahead - ahead
                row["steps_ahead_dropped"] = graphs.steps_ahead_dropped - dropped
                rounds[mode].append(row)
        median = {mode: sorted(rows, key=lambda row: row["step_ms"])[len(rows) // 2] for mode, rows in rounds.items()}
        run = {"concurrency": c, "step_ms_off": median["off"]["step_ms"], "step_ms_on": median["on"]["step_ms"],
               "on_vs_off": median["on"]["step_ms"] / median["off"]["step_ms"],
               "step_ms_rounds": {mode: [row["step_ms"] for row in rows] for mode, rows in rounds.items()},
               "host_attention_plan_ms": {m: median[m].get("host_attention_plan_ms") for m in median},
               "plans_made_ahead_last_round": rounds["on"][-1]["plans_made_ahead"],
               "steps_run_ahead_last_round": rounds["on"][-1]["steps_run_ahead"],
               "steps_ahead_dropped_last_round": rounds["on"][-1]["steps_ahead_dropped"],
               "forward_ms": median["off"].get("forward_ms"), "forward_ms_on": median["on"].get("forward_ms")}
        if args.profile:
            run["profile"] = {}
            for mode in ("off", "on"):
                set_mode(engines[mode].engine.executor.worker.graphs, args.toggle, mode == "on")
                prof = profile_step(engines[mode], c, args.prompt_len, vocab)
                run["profile"][mode] = {k: prof[k] for k in ("kernels_per_step", "gpu_idle_ms_per_step",
                                                             "largest_gpu_gaps")}
        print(json.dumps(run), flush=True)
        runs.append(run)
    record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()), "torch": torch.__version__,
              "command": "python3 benchmarks/plan_ahead.py " + shlex.join(sys.argv[1:]), "model": args.model_shape,
              "toggle": args.toggle, "speculative": args.speculative,
              "copy_bandwidth_gbs": copy_bandwidth(torch.device("cuda")) / 1e9, "runs": runs,
              "small_gemms": {mode: engine.rank_info()[0].get("small_gemms") for mode, engine in engines.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
