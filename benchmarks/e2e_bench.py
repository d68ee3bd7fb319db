"""End to end on real prompts: output tokens/s and TPOT of our autoregressive decoding, our DSpark and transformers
``generate``, side by side, at each concurrency.

Prompts are the evaluation sets' first turns (GSM8K, MT-Bench, HumanEval, MBPP, taken in turn) through the target's
chat template; every request stops at EOS or ``--max-tokens``, as a user's would (no ignore_eos, no random ids). At
concurrency c the engine keeps c requests in flight (a finished one is replaced by the next prompt) until
``--requests`` have finished; tokens/s is output tokens over that wall time; TPOT per request is (last token time -
first token time) / (tokens - 1), reported as the median. Our two engines run the same prompts in alternating rounds
(``--rounds``; the order flips each round), so their ratio is paired; transformers (``--hf eager``: its default
dynamic cache; ``--hf compile``: a static cache and ``CompileConfig(fullgraph=True, mode="reduce-overhead")`` as its
documentation recommends, compiled by an untimed warm-up call at each batch size) runs batches of c of the same
prompts (left-padded, greedy) once, at the ``--hf-concurrency`` levels, over the first ``--hf-requests`` prompts
(its decoding is slow: its tokens/s is over fewer prompts than ours). The record is rewritten after every level, so a
run cut short keeps what it measured.

``--undrafted`` adds DSpark that never drafts (``Engine.forced_draft_len`` 0, the guard off): its ratio to our AR is
the floor a DSpark engine's plain step sets, the least the speculation guard can cost. ``--fixed`` adds DSpark with
every block verified (``speculation_guard: false``): what the guard's choices win or lose against fixed K.

``--profile-steps N`` first profiles N decode steps of each of our engines at each ``--profile-concurrency`` level
(torch profiler over ``Engine.step``, host and device: kernels per step, GPU busy and idle time, the largest idle
gaps, host time per region, the top kernels; ``runtime.kernels.profiling.summarize``) into the record's ``profiles``,
with each step's wall time, and a Chrome trace beside the record (``--trace``).

usage: python benchmarks/e2e_bench.py --drafter smollm2-dspark --out benchmarks/results/e2e.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASETS = ("gsm8k", "mt-bench", "humaneval", "mbpp")


def real_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` first turns of the evaluation sets, taken from each set in turn, as chat-template token ids."""
    from runtime.engine.chat import chat_token_ids
    from runtime.training.prompt_sets import read_turns

    sets = [read_turns(ROOT / "benchmarks" / "data" / "eval" / f"{n}.jsonl") for n in DATASETS]
    prompts = []
    for i in range(count):
        turns = sets[i % len(sets)][(i // len(sets)) % len(sets[i % len(sets)])]
        prompts.append(chat_token_ids(tokenizer, [{"role": "user", "content": turns[0]}]))
    return prompts


GPU_KV_BUDGET_GIB = 40.0  # every engine alive at once holds its own cache: with weights and activations an 80 GB GPU


def default_kv_cache_gib(on_cpu: bool, engines: int) -> float:
    """Each engine's KV cache when ``--kv-cache-gib`` is not given: 1 GiB on the CPU; on a GPU ``GPU_KV_BUDGET_GIB``
    shared by the ``engines`` alive together, at most 16 GiB each (four engines of 16 GiB ran an 80 GB H100 out of
    memory at 256 requests; SmolLM2's 256 requests of ~700 tokens hold ~4 GiB)."""
    return 1.0 if on_cpu else min(16.0, GPU_KV_BUDGET_GIB / max(engines, 1))


def closed_loop(engine, prompts: list[list[int]], concurrency: int, params) -> dict:
    """Keep ``concurrency`` requests in flight until every prompt has finished; tokens/s and per-request TPOT."""
    import dataclasses

    params = dataclasses.replace(params, output_kind="delta")
    pending = list(range(len(prompts)))[::-1]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    running = 0
    start = time.perf_counter()
    while pending or running:
        while pending and running < concurrency:
            engine.add_request(prompts[pending.pop()], params)
            running += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            if out.finished:
                running -= 1
    seconds = time.perf_counter() - start
    tokens = sum(counts.values())
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds,
            "tpot_ms_median": 1000 * statistics.median(tpot) if tpot else None}


def profile_steps(engine, prompts: list[list[int]], concurrency: int, steps: int, trace: str | None) -> dict:
    """``steps`` decode steps of ``concurrency`` requests under the torch profiler (after their prompts are in and a few
    steps have warmed the step's shape) -> ``summarize``'s dict with the median wall time of a step; the requests are
    aborted after it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime import SamplingParams
    from runtime.kernels.profiling import summarize

    params = SamplingParams(max_tokens=4 * steps + 64, temperature=0, ignore_eos=True, output_kind="delta")
    for prompt in prompts[:concurrency]:
        engine.add_request(prompt, params)
    for _ in range(16):  # prompts in, then steady decode steps
        engine.step()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            walls.append(1000 * (time.perf_counter() - t0))
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return {"concurrency": concurrency, "steps": steps, "step_ms_median": statistics.median(walls),
            **summarize(prof, steps, trace)}


def left_padded(batch: list[list[int]], pad: int, device):
    """[B, W] token ids left-padded with ``pad`` to the longest prompt, and [B, W] their attention mask."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    return ids, mask


def hf_generate(model, tokenizer, prompts: list[list[int]], concurrency: int, max_tokens: int, compile_: bool) -> dict:
    """transformers ``generate`` over batches of ``concurrency`` prompts (left-padded, greedy, stop at EOS); with
    ``compile_`` a static cache and torch.compile, compiled by an untimed call on the first batch."""
    import torch

    eos = tokenizer.eos_token_id
    extra = {}
    if compile_:
        from transformers import CompileConfig

        extra = {"cache_implementation": "static",
                 "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}
        ids, mask = left_padded(prompts[:concurrency], eos, model.device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=eos,
                       eos_token_id=eos, **extra)
    tokens, tpots = 0, []
    start = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        batch = prompts[lo:lo + concurrency]
        ids, mask = left_padded(batch, eos, model.device)
        width = ids.shape[1]
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos, **extra)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        new = out[:, width:]
        lengths = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else len(row) for row in new]
        tokens += sum(lengths)
        tpots.append(1000 * elapsed / new.shape[1])  # every row waits for the batch's longest
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds,
            "tpot_ms_median": statistics.median(tpots)}


def cpu_name() -> str:
    """This host's CPU as a record names it: its model (Linux), its cores and its bfloat16 instructions."""
    import os
    import platform

    from runtime.worker.devices import cpu_bfloat16_flag, read_cpuinfo

    cpuinfo = read_cpuinfo()
    model = next((line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {os.cpu_count()} cores, bfloat16 instructions: {cpu_bfloat16_flag(cpuinfo) or 'none'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--drafter", required=True, help="the DSpark drafter; none: our AR (and transformers) alone")
    parser.add_argument("--concurrency", default="1,4,16,64,256")
    parser.add_argument("--requests", type=int, help="requests per concurrency (default max(2c, 16))")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-draft-len", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of our two engines (default 2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="our engines' dtype (default auto: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="KV cache of each engine (default: on a GPU 40 GiB shared by the engines alive at once, "
                             "at most 16 each; 1 on the CPU)")
    parser.add_argument("--hf", choices=("none", "eager", "compile"), default="none",
                        help="also time transformers generate: eager (dynamic cache) or compile (static cache + "
                        "torch.compile); default none")
    parser.add_argument("--hf-concurrency", help="levels at which transformers runs (default every level)")
    parser.add_argument("--hf-requests", type=int, default=8, help="prompts transformers answers at each level "
                        "(at least c; default 8)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many decode steps of each engine first (default 0: none)")
    parser.add_argument("--profile-concurrency", default="1", help="levels profiled (default 1)")
    parser.add_argument("--trace", action="store_true", help="with --profile-steps: Chrome traces beside --out")
    parser.add_argument("--undrafted", action="store_true", help="also DSpark that never drafts (the plain-step floor)")
    parser.add_argument("--fixed", action="store_true", help="also DSpark with every block verified (the guard off)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch

    from runtime import LLM, SamplingParams
    from runtime.engine.heap import freeze_long_lived

    levels = [int(c) for c in args.concurrency.split(",")]
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    engines_alive = 1 + (args.drafter != "none") * (1 + args.fixed + args.undrafted)
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else default_kv_cache_gib(on_cpu, engines_alive)
    engine = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(levels), kv_cache_memory=int(kv_gib * 2**30),
                  max_model_len=4096)
    ar = LLM(args.model, **engine)
    drafting = {"speculative_model": args.drafter, "max_draft_len": args.max_draft_len}
    spec = None if args.drafter == "none" else LLM(args.model, speculative_config=drafting, **engine)
    engines = [("ar", ar)] + ([] if spec is None else [("dspark", spec)])
    unguarded = {**drafting, "speculation_guard": False}
    if args.fixed and spec is not None:
        engines.append(("fixed", LLM(args.model, speculative_config=unguarded, **engine)))
    if args.undrafted and spec is not None:
        undrafted = LLM(args.model, speculative_config=unguarded, **engine)
        undrafted.engine.forced_draft_len = 0  # (the profiling knob: a block of 0 every step, the context kept)
        engines.append(("undrafted", undrafted))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    warm = real_prompts(ar.tokenizer, max(levels))
    for _, llm in engines:  # graphs captured, kernels compiled, caches warm
        closed_loop(llm.engine, warm, max(levels), SamplingParams(max_tokens=32, temperature=0))
    # as a server does once started: the collector's full scans skip the engines' long-lived objects, so no timed
    # window holds a pause that walks them (runtime.engine.heap)
    freeze_long_lived("the benchmark's engines")
    hf_levels = set(levels) if args.hf_concurrency is None else {int(c) for c in args.hf_concurrency.split(",")}
    hf_model = None
    if args.hf != "none":
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(ar.config.model, dtype=torch.bfloat16 if
                                                        torch.cuda.is_available() else torch.float32)
        hf_model = hf_model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else cpu_name()
    rows = []
    record = {"kind": "e2e", "model": args.model, "drafter": args.drafter, "max_draft_len": args.max_draft_len,
              "max_tokens": args.max_tokens, "dtype": args.dtype, "kv_cache_gib_each": kv_gib, "hardware": device,
              "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/e2e_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "hf_peer": {"none": None, "eager": "dynamic cache, eager",
                          "compile": "static cache + torch.compile (reduce-overhead, fullgraph)"}[args.hf],
              "engine_rank_info": ar.rank_info(), "dspark_rank_info": None if spec is None else spec.rank_info(),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.profile_steps:
        record["profiles"] = profiles = []
        for c in (int(x) for x in args.profile_concurrency.split(",")):
            for name, llm in engines:
                trace = str(Path(args.out).with_suffix(f".{name}-c{c}.trace.json.gz")) if args.trace else None
                profiles.append({"engine": name, **profile_steps(llm.engine, real_prompts(ar.tokenizer, c), c,
                                                                 args.profile_steps, trace)})
                print(json.dumps({k: v for k, v in profiles[-1].items() if k not in ("top_kernels",
                                                                                     "largest_gpu_gaps")}), flush=True)
                Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    for c in levels:
        prompts = real_prompts(ar.tokenizer, args.requests or max(2 * c, 16))
        rounds = []
        for r in range(args.rounds):
            order = engines[:: 1 if r % 2 == 0 else -1]
            before = spec.get_metrics() if spec is not None else None
            result = {name: closed_loop(llm.engine, prompts, c, params) for name, llm in order}
            if spec is not None:
                after = spec.get_metrics()
                drafts = after["num_drafts"] - before["num_drafts"]
                result["tau"] = 1 + (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / max(drafts, 1)
                result["ratio"] = result["dspark"]["tokens_per_s"] / result["ar"]["tokens_per_s"]
            for other in ("fixed", "undrafted"):
                if other in result:
                    result[f"{other}_ratio"] = result[other]["tokens_per_s"] / result["ar"]["tokens_per_s"]
            rounds.append(result)
        row = {"concurrency": c, "requests": len(prompts),
               "ar_tokens_per_s": statistics.median(x["ar"]["tokens_per_s"] for x in rounds),
               "ar_tpot_ms": statistics.median(x["ar"]["tpot_ms_median"] for x in rounds), "rounds": rounds}
        if spec is not None:
            row.update(dspark_tokens_per_s=statistics.median(x["dspark"]["tokens_per_s"] for x in rounds),
                       dspark_over_ar_paired=statistics.median(x["ratio"] for x in rounds),
                       dspark_tpot_ms=statistics.median(x["dspark"]["tpot_ms_median"] for x in rounds),
                       tau=statistics.median(x["tau"] for x in rounds),
                       # the guard's counters and per-batch-size prices so far: why it drafted or not at this level
                       speculation_guard=spec.get_metrics().get("speculation_guard"))
        for other in ("fixed", "undrafted"):
            if any(f"{other}_ratio" in x for x in rounds):
                row[f"{other}_over_ar_paired"] = statistics.median(x[f"{other}_ratio"] for x in rounds)
        if hf_model is not None and c in hf_levels:
            hf = hf_generate(hf_model, ar.tokenizer, prompts[:max(c, args.hf_requests)], c, args.max_tokens,
                             args.hf == "compile")
            row.update(hf_tokens_per_s=hf["tokens_per_s"], hf_tpot_ms=hf["tpot_ms_median"],
                       ar_over_hf=row["ar_tokens_per_s"] / hf["tokens_per_s"], hf=hf)
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in
                          ("rounds", "hf", "speculation_guard")}), flush=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
