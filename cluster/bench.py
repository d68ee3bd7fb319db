"""``dspark bench``: our autoregressive baseline and DSpark side by side, same engine and kernels, one GPU.

For each concurrency ``c`` of the sweep, ``c`` requests decode together and the engine's steps are timed
(host and device, what a client sees between tokens): ``ar_step_ms`` without a drafter, ``dspark_step_ms``
with one, their tokens/s, and the decode step against the bandwidth roofline (bytes the step must read:
every weight once plus the cached keys and values, over the device copy bandwidth measured in the same run).
``--model-shape qwen3-8b`` builds random-weight models of real shapes (``load_format="dummy"``): step times and
roofline only, since random drafters accept nothing; a trained pair (``--model``/``--speculative-model``)
gives acceptance and end-to-end speedup. Peers: Hugging Face ``generate`` on the same target (eager).
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

MODEL_SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=False),
}
DRAFT_LAYER_IDS = {"qwen3-8b": [1, 17, 33], "tiny": [0]}


def write_shape(root: Path, shape: str, draft_layers: int, block_size: int) -> tuple[Path, Path]:
    """config.json-only target and drafter directories of ``shape`` (loaded with load_format='dummy')."""
    from transformers import Qwen3Config

    fields = MODEL_SHAPES[shape]
    target = root / f"{shape}-target"
    Qwen3Config(**fields, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16").save_pretrained(str(target))
    drafter = root / f"{shape}-drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=fields["num_hidden_layers"],
                  num_hidden_layers=draft_layers, block_size=block_size, mask_token_id=fields["vocab_size"] - 1,
                  target_layer_ids=DRAFT_LAYER_IDS[shape], markov_rank=256, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True,
                  layer_types=["full_attention"] * draft_layers)
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def copy_bandwidth(device, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 10."""
    import torch

    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def weight_bytes(llm) -> int:
    """Bytes of every weight matrix one decode step reads (the embedding reads only its rows: left out)."""
    target = llm.engine.executor.worker.target
    return sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n)


def kv_bytes(llm, batch: int, context: int) -> int:
    target = llm.engine.executor.worker.target
    layer = target.model.layers[0].self_attn
    itemsize = next(target.parameters()).element_size()
    return batch * context * 2 * layer.kv_width * itemsize * len(target.model.layers)


def time_steps(llm, batch: int, prompt_len: int, steps: int, warmup: int, vocab: int, seed: int) -> dict:
    """Decode ``batch`` requests together; time ``steps`` engine steps after prefill and ``warmup`` steps."""
    import torch

    from runtime import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    per_step = engine.spec.max_draft_len + 1 if engine.spec else 1
    chunks = -(-batch * prompt_len // engine.config.max_num_batched_tokens)  # prefill steps others decode through
    params = SamplingParams(max_tokens=(chunks + warmup + steps + 4) * per_step, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(3, vocab - 1, (prompt_len,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(not engine.sequences[i].is_decoding for i in ids if i in engine.sequences):
        engine.step()
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    before = sum(len(engine.sequences[i].output_token_ids) for i in ids)
    metrics_before = engine.metrics.as_dict()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    committed = sum(len(engine.sequences[i].output_token_ids) for i in ids) - before
    metrics = engine.metrics.as_dict()
    drafts = metrics["num_drafts"] - metrics_before["num_drafts"]
    accepted = metrics["num_accepted_tokens"] - metrics_before["num_accepted_tokens"]
    context = prompt_len + (before + committed) // batch
    engine.abort_all()
    return {"step_ms": 1e3 * elapsed / steps, "tokens_per_s": committed / elapsed,
            "mean_acceptance_length": (1 + accepted / drafts) if drafts else None, "context": context}


def hf_generate_tokens_per_s(target_dir: Path, shape: bool, tokens: int, device) -> float:
    """transformers ``generate`` (eager, dynamic cache), batch 1, greedy, on the same target."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(target_dir))
    if shape:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.bfloat16).to(device)
    model.eval()
    ids = torch.randint(3, config.vocab_size - 1, (1, 128), device=device)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()
    rate = tokens / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    return rate


def profile_step(llm, batch: int, prompt_len: int, vocab: int) -> dict:
    """torch.profiler over 5 steps: CUDA kernels launched per step, GPU busy time per step, the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab - 1, (prompt_len,)).tolist(), params)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_all()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 5 / 1e3
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:12]
    host = {e.key: round(e.cpu_time_total / 5 / 1e3, 3) for e in prof.key_averages()
            if e.key.startswith(("dspark.", "cuda")) and e.cpu_time_total > 0}
    return {"kernels_per_step": len(kernels) / 5, "gpu_busy_ms_per_step": busy, "host_ms_per_step": host,
            "top_kernels": [{"name": e.key[:80], "ms_per_step": e.device_time_total / 5 / 1e3, "calls": e.count / 5}
                            for e in top]}


def run(args) -> dict:
    import torch
    from tqdm.auto import tqdm

    from runtime import LLM

    device = torch.device("cuda")
    work = Path(tempfile.mkdtemp(prefix="dspark-bench-"))
    shape = args.model_shape is not None
    if shape:
        target, drafter = write_shape(work, args.model_shape, args.draft_layers, args.max_draft_len)
    else:
        target, drafter = Path(args.model), Path(args.speculative_model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(target)).vocab_size
    bandwidth = copy_bandwidth(device)
    common = dict(dtype="bfloat16", device="cuda", kernel_backend=args.kernel_backend, enforce_eager=args.enforce_eager,
                  max_num_seqs=max(args.concurrency), max_model_len=args.prompt_len + 2048,
                  kv_cache_memory=args.kv_cache_gib << 30, max_num_batched_tokens=max(2048, args.prompt_len * 2),
                  load_format="dummy" if shape else "auto")
    spec = {"speculative_model": str(drafter), "max_draft_len": args.max_draft_len,
            **({"load_format": "dummy"} if shape else {})}
    rows = {c: {"concurrency": c} for c in args.concurrency}
    record = {"hardware": torch.cuda.get_device_name(device), "command": "dspark bench " + shlex.join(sys.argv[2:])
              if len(sys.argv) > 1 and sys.argv[1] == "bench" else shlex.join(sys.argv), "date": str(date.today()),
              "host": platform.node(), "torch": torch.__version__, "model": args.model_shape or str(target),
              "kind": "random-shape" if shape else "trained", "tensor_parallel_size": 1,
              "copy_bandwidth_gbs": bandwidth / 1e9, "runs": []}
    for kind, speculative in (("ar", None), ("dspark", spec)):
        start = time.perf_counter()
        llm = LLM(str(target), speculative_config=speculative, **common)
        record[f"{kind}_startup_s"] = time.perf_counter() - start
        record[f"{kind}_rank_info"] = llm.rank_info()
        if kind == "ar":
            record["weight_bytes"] = weight_bytes(llm)
        if args.profile and kind == "ar":
            record["ar_profile_batch1"] = profile_step(llm, 1, args.prompt_len, vocab)
            print(f"dspark bench: AR batch-1 profile: {json.dumps(record['ar_profile_batch1'])}", file=sys.stderr)
        for c in tqdm(args.concurrency, desc=f"{kind} sweep", disable=None):
            timing = time_steps(llm, c, args.prompt_len, args.steps, args.warmup, vocab, seed=c)
            rows[c].update({f"{kind}_step_ms": timing["step_ms"], f"{kind}_tokens_per_s": timing["tokens_per_s"]})
            if kind == "ar":
                floor = (record["weight_bytes"] + kv_bytes(llm, c, timing["context"])) / bandwidth
                rows[c].update(roofline_ms=1e3 * floor, roofline_fraction=1e3 * floor / timing["step_ms"])
            else:
                rows[c]["mean_acceptance_length"] = timing["mean_acceptance_length"]
            print(f"dspark bench: {kind} concurrency {c}: {timing}", file=sys.stderr, flush=True)
        if args.profile and kind == "dspark":
            record["dspark_profile_batch1"] = profile_step(llm, 1, args.prompt_len, vocab)
            print(f"dspark bench: DSpark batch-1 profile: {json.dumps(record['dspark_profile_batch1'])}",
                  file=sys.stderr)
        llm.engine.executor.shutdown()
        del llm
        torch.cuda.empty_cache()
    for row in rows.values():
        row["dspark_step_vs_ar"] = row["dspark_step_ms"] / row["ar_step_ms"]
        row["speedup"] = row["dspark_tokens_per_s"] / row["ar_tokens_per_s"]
    if args.hf_tokens:
        rate = hf_generate_tokens_per_s(target, shape, args.hf_tokens, device)
        rows[min(rows)]["hf_generate_tokens_per_s"] = rate
        rows[min(rows)]["ar_vs_hf_generate"] = rows[min(rows)]["ar_tokens_per_s"] / rate
    record["runs"] = list(rows.values())
    return record


def summary(record: dict) -> str:
    lines = [f"{record['hardware']}  {record['model']} ({record['kind']})  copy bandwidth "
             f"{record['copy_bandwidth_gbs']:.0f} GB/s",
             f"{'conc':>5} {'AR ms':>8} {'roofline':>8} {'DSpark ms':>10} {'ratio':>6} {'AR tok/s':>9} "
             f"{'DSp tok/s':>9} {'speedup':>8}"]
    for r in record["runs"]:
        lines.append(f"{r['concurrency']:>5} {r['ar_step_ms']:>8.2f} {r['roofline_fraction']:>8.3f} "
                     f"{r['dspark_step_ms']:>10.2f} {r['dspark_step_vs_ar']:>6.2f} {r['ar_tokens_per_s']:>9.1f} "
                     f"{r['dspark_tokens_per_s']:>9.1f} {r['speedup']:>8.2f}")
    return "\n".join(lines)


def concurrency_list(text: str) -> list[int]:
    import argparse

    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency wants integers >= 1 separated by commas, got {text!r}")
    return sorted(set(values))


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="our AR baseline and DSpark side by side on one GPU (JSON record)",
                                description=__doc__)
    which = bench.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), help="random weights of this shape")
    which.add_argument("--model", help="a trained target (needs --speculative-model)")
    bench.add_argument("--speculative-model", help="the trained drafter of --model")
    bench.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16, 64],
                       help="comma-separated request counts, each >= 1 (default 1,4,16,64)")
    bench.add_argument("--max-draft-len", type=int, default=7, help="K (default 7)")
    bench.add_argument("--draft-layers", type=int, default=1, help="draft layers of a --model-shape drafter")
    bench.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default 512)")
    bench.add_argument("--steps", type=int, default=30, help="timed steps per point (default 30)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    bench.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                       help="kernels of both engines (default auto: flashinfer on a GPU where it imports)")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    bench.add_argument("--kv-cache-gib", type=int, default=24, help="KV cache per engine (default 24 GiB)")
    bench.add_argument("--hf-tokens", type=int, default=0, help="also time transformers generate for N tokens")
    bench.add_argument("--profile", action="store_true", help="torch.profiler summary of batch-1 steps")
    bench.add_argument("--out", help="write the JSON record here (default: print it)")
    bench.set_defaults(handler=main)


def main(args) -> int:
    if args.model is not None and args.speculative_model is None:
        print("dspark bench: --model needs --speculative-model", file=sys.stderr)
        return 2
    record = run(args)
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(summary(record), file=sys.stderr)
    return 0
