"""Step time of one replica layout against the single-GPU engine, side by side in one run.

Builds a random-weight Qwen3-architecture target (about 0.9B parameters, bf16) and a 1-layer DSpark
drafter, then times the same greedy workload on: the single-GPU engine without a drafter (the
autoregressive baseline), the single-GPU engine with DSpark, and Ray replicas (TP=1 colocated,
TP=2 over NCCL, TP=1 with a separate drafter on a second GPU). Random weights make acceptance
meaningless here: this measures the cost of a step, not speedup. Writes one JSON file.

usage: python benchmarks/replica_step_time.py --out results.json [--layouts ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from tests import builders  # noqa: E402

TARGET = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=4096)


def build(root: Path, block: int) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    target = root / "target"
    config = Qwen3Config(**TARGET, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(target))
    del model
    dconfig = builders.drafter_config(target, block_size=block, layer_ids=(1, 7, 13), markov_rank=64)
    dconfig.update(head_dim=128, num_attention_heads=16, num_key_value_heads=8, intermediate_size=5632)
    tensors = {k: v.to(torch.bfloat16) for k, v in builders.drafter_tensors(dconfig, std=0.02).items()}
    return target, builders.save_drafter(root / "drafter", dconfig, tensors)


def time_generate(llm, prompts, params, repeats: int) -> dict:
    engine = llm.engine
    steps = 0
    real_step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = counted
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    torch.cuda.synchronize()
    steps, tokens, start = 0, 0, time.perf_counter()
    for _ in range(repeats):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts, params))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.step = real_step
    return {"seconds": elapsed, "steps": steps, "ms_per_step": 1000 * elapsed / steps, "tokens": tokens,
            "tokens_per_s": tokens / elapsed, "metrics": llm.get_metrics()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block", type=int, default=4, help="max_draft_len K")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", nargs="*", default=["tp1-colocated", "tp2-colocated", "tp1-separate"])
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, TARGET["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = dict(dtype="bfloat16", device="cuda", kv_cache_memory=8 << 30, page_size=16, max_num_seqs=64,
                  max_num_batched_tokens=4096)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp), args.block)
        spec = DSparkDecodingConfig(speculative_model=str(drafter))
        for name, kwargs in (("single-gpu autoregressive", {}), ("single-gpu dspark", {"speculative_config": spec})):
            llm = LLM(str(target), **kwargs, **engine)
            results[name] = time_generate(llm, prompts, params, args.repeats)
            reference = [o.token_ids for o in llm.generate(prompts[:4], params)]
            del llm
            torch.cuda.empty_cache()
        import ray

        from cluster import LLM as ClusterLLM

        ray.init(include_dashboard=False, log_to_driver=False)
        for layout in args.layouts:
            tp, mode = int(layout[2]), layout.split("-")[1]
            with ClusterLLM(str(target), speculative_config=spec, tensor_parallel_size=tp, drafter=mode,
                            **engine) as llm:
                results[f"ray {layout}"] = time_generate(llm, prompts, params, args.repeats)
                same = [o.token_ids for o in llm.generate(prompts[:4], params)] == reference
                results[f"ray {layout}"]["greedy_equals_single_gpu_dspark_bf16"] = same
        ray.shutdown()
    base = results["single-gpu dspark"]["ms_per_step"]
    for r in results.values():
        r["step_time_vs_single_gpu_dspark"] = r["ms_per_step"] / base
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    record = {"benchmark": "replica_step_time", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python", *sys.argv]), "hardware": {"gpus": gpu, "host": platform.node()},
              "software": {"torch": torch.__version__, "python": platform.python_version()},
              "model": TARGET, "workload": vars(args), "results": results}
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: {m: v[m] for m in ("ms_per_step", "tokens_per_s", "step_time_vs_single_gpu_dspark")}
                      for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
