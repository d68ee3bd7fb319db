"""What prefix caching saves on a chat workload: every request repeats one long system prompt, then its own short
user turn. Requests arrive one after another (each finishes before the next); time to first token (TTFT) and
the prefix-cache hit rate, with caching on and off, in the same run on the same random-weight model.

usage: python benchmarks/prefix_cache.py [--device cpu|cuda] [--system-tokens 1024] [--requests 16]
                                         [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


def run(llm, prompts: list[list[int]]) -> dict:
    """Each prompt alone: seconds from submission to its first token, then to its end."""
    import torch

    from runtime import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ttfts = []
    for prompt in prompts:
        start = time.perf_counter()
        request = engine.add_request(prompt, params)
        while not engine.sequences[request].output_token_ids:
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ttfts.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    m = engine.get_metrics()
    return {"ttft_ms_mean": 1e3 * sum(ttfts[1:]) / (len(ttfts) - 1), "ttft_ms_first": 1e3 * ttfts[0],
            "prefix_cache_queries": m["prefix_cache_queries"], "prefix_cache_hits": m["prefix_cache_hits"],
            "hit_rate": m["prefix_cache_hits"] / m["prefix_cache_queries"] if m["prefix_cache_queries"] else 0.0}


def main() -> None:
    import torch
    from transformers import Qwen3Config

    from runtime import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    target = Path(tempfile.mkdtemp()) / "target"
    Qwen3Config(**SHAPE, bos_token_id=1, eos_token_id=2).save_pretrained(str(target))
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, SHAPE["vocab_size"], (args.system_tokens,), generator=g).tolist()
    prompts = [system + torch.randint(3, SHAPE["vocab_size"], (args.user_tokens,), generator=g).tolist()
               for _ in range(args.requests)]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    results = {}
    for name, caching in (("caching_off", False), ("caching_on", True)):
        llm = LLM(str(target), load_format="dummy", dtype=dtype, device=args.device, num_pages=1024, page_size=16,
                  max_num_batched_tokens=2048, enable_prefix_caching=caching)
        results[name] = run(llm, prompts)
        print(name, json.dumps(results[name]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    record = {"benchmark": "prefix_cache", "date": str(date.today()), "host": platform.node(), "device": device,
              "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
              "model": {"shape": SHAPE, "weights": "random (load_format=dummy)", "dtype": dtype},
              "workload": {"system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
                           "requests": args.requests, "max_tokens": 8, "arrival": "one after another"},
              "results": results,
              "ttft_saved_fraction": 1 - results["caching_on"]["ttft_ms_mean"] / results["caching_off"]["ttft_ms_mean"]}
    print(json.dumps({k: record[k] for k in ("ttft_saved_fraction",)}))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
