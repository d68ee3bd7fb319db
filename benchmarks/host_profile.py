"""Where the host time of an engine step goes: cProfile over decode steps of our AR and DSpark engines (and with
``--confidence`` DSpark under confidence scheduling).

On a host-bound target (the tiny shape, or the GPU recipe's 27M pair) a step's wall time is mostly Python; the
torch profiler's labels say which phase, this says which functions. For each engine, ``--batch`` requests of
``--prompt-len`` random tokens are prefilled, ``--warmup`` steps run, then ``--steps`` steps run under cProfile
(and, apart, timed without it). Writes the wall ms per step and the top functions by own and cumulative time.

On a machine without a GPU, ``--device cpu`` profiles the same engines in float32 on the CPU: the host code is the
same apart from the kernels and graphs, so the scheduler's, the verifier's and the engine's own Python show up there.

usage: python3 benchmarks/host_profile.py --out FILE.json [--model-shape tiny | --model DIR --speculative-model DIR
       --prompts FILE.jsonl] [--batch 1] [--steps 200] [--confidence] [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import write_shape  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


def top(stats: pstats.Stats, key: str, steps: int, count: int = 30) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:count]:
        calls, _, own, cumulative, _ = stats.stats[func]
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}:{func[2]}", "calls_per_step": calls / steps,
                     "own_ms_per_step": 1e3 * own / steps, "cumulative_ms_per_step": 1e3 * cumulative / steps})
    return rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_engine(llm, batch: int, prompt_len: int, steps: int, warmup: int, vocab: int,
                   prompts: list[list[int]] | None) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=10 * (steps + warmup) + 64, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for b in range(batch):
        prompt = prompts[b % len(prompts)][:prompt_len] if prompts else \
            torch.randint(3, vocab - 1, (prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, params)
    for _ in range(warmup):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = (time.perf_counter() - start) / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync()
    profiler.disable()
    engine.abort_all()
    stats = pstats.Stats(profiler)
    return {"step_ms": 1e3 * wall, "profiled_step_ms": 1e3 * stats.total_tt / steps,
            "by_own_time": top(stats, "tottime", steps), "by_cumulative_time": top(stats, "cumulative", steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-shape", default="tiny")
    parser.add_argument("--model")
    parser.add_argument("--speculative-model")
    parser.add_argument("--prompts", help="a JSONL of prompts (a trained pair's held-out text), else random ids")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-draft-len", type=int, default=7)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (bfloat16, the figures) or cpu (float32: the host code without a GPU)")
    parser.add_argument("--confidence", action="store_true", help="also profile DSpark with confidence scheduling "
                        "(the drafter needs a confidence head; its step-time table is profiled at startup)")
    args = parser.parse_args()
    if args.model:
        target, drafter, dummy = Path(args.model), Path(args.speculative_model), {}
    else:
        target, drafter = write_shape(Path(tempfile.mkdtemp()), args.model_shape, 1, args.max_draft_len)
        dummy = {"load_format": "dummy"}
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(target)).vocab_size
    prompts = None
    if args.prompts:
        from transformers import AutoTokenizer

        from runtime.training.distill import dataset_prompts

        prompts = dataset_prompts(args.prompts, AutoTokenizer.from_pretrained(str(target)))
    gpu = args.device == "cuda"
    common = dict(dtype="bfloat16" if gpu else "float32", device=args.device, max_num_seqs=max(args.batch, 1), kv_cache_memory=(4 << 30) if gpu else (64 << 20),
                  max_model_len=args.prompt_len + 12 * (args.steps * 2 + args.warmup) + 128, **dummy)
    record = {"benchmark": "host_profile", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "hardware": torch.cuda.get_device_name() if gpu else f"cpu ({os.cpu_count()} cores)", "torch": torch.__version__, "model": str(target),
              "batch": args.batch, "engines": {}}
    dspark = {"speculative_model": str(drafter), "max_draft_len": args.max_draft_len, **dummy}
    engines = [("ar", None), ("dspark", dspark)]
    if args.confidence:
        engines.append(("confidence", {**dspark, "enable_confidence_scheduling": True}))
    for kind, spec in engines:
        llm = LLM(str(target), speculative_config=spec, **common)
        record["engines"][kind] = profile_engine(llm, args.batch, args.prompt_len, args.steps, args.warmup, vocab,
                                                    prompts)
        print(f"{kind}: {record['engines'][kind]['step_ms']:.3f} ms per step", flush=True)
        for row in record["engines"][kind]["by_own_time"][:15]:
            print(f"  {row['own_ms_per_step']:.4f} own  {row['cumulative_ms_per_step']:.4f} cum  "
                  f"{row['calls_per_step']:.1f}x  {row['function']}", flush=True)
        llm.engine.executor.shutdown()
        del llm
        if gpu:
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
