"""What a packed verify step costs the device (``runtime.worker.packed_verify``), beside the uniform verify graphs it
competes with: does running the target on ``B x (c + 1)`` packed rows cost what a uniform step of ``c + 1`` tokens a
request costs, or does the packing (the survivals, the step-wide top-k, the gather and scatter around attention,
which still runs in the full blocks' layout) eat what it saves?

On a random-weight target of the trained pair's shape (``benchmarks/gpu_recipe.py``: vocab 4096, ``--hidden`` wide,
``--layers`` deep, head_dim 64, MLP 3x; bf16, loaded with load_format='dummy') with a random DSpark drafter of K = 7
drafts and confidence scheduling on (so the worker captures its packed graphs), for each batch bucket asked: the
device time of one replay of each uniform verify graph (Q = 1 .. K + 1 tokens a request) and of each packed graph
(c = 1 .. K - 1 columns), medians of 20 replays. The graphs replay their capture-time inputs: every request a padding
row attending over its own block in the scratch page, so attention is at its cheapest and the figures are the
step's GEMM-bound floor (a served step adds its context's attention to both alike, the packed one in the uniform
layout). The engine is never stepped: its confidence_cost_table_path is a placeholder table (one value, only so
that it starts without profiling).

With ``--profile-columns c``, the torch profiler (CUPTI sees the kernels inside a replayed graph) over replays of
the first batch's packed graph of c columns, the uniform graph of c + 1 tokens and the whole block's: each graph's
device time per kernel name, so that what the packing adds over the uniform step of as many rows is named.

usage: python3 benchmarks/packed_verify_cost.py --out FILE.json [--hidden 2048] [--layers 16] [--batches 64,256]
                                                [--profile-columns C]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

K = 7  # drafts a block (the trained pair's: its drafter's block_size, slot j proposing draft j + 1)


def write_pair(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """config.json-only target and drafter of the trained pair's shape."""
    from transformers import Qwen3Config

    heads = hidden // 64
    target = root / "target"
    Qwen3Config(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                torch_dtype="bfloat16").save_pretrained(str(target))
    drafter = root / "drafter"
    drafter.mkdir()
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=layers, num_hidden_layers=2,
                  block_size=K, mask_token_id=4095, target_layer_ids=[1, layers // 2, layers - 2],
                  markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True, layer_types=["full_attention"] * 2)
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


PROFILE_REPLAYS = 5


def kernel_times(graph) -> dict:
    """The device time of one replay of ``graph`` per kernel name (the mean of ``PROFILE_REPLAYS`` replays, us),
    largest first, and their total."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for event in prof.key_averages():
        device_us = event.device_time_total
        if device_us > 0:
            per_name.setdefault(event.key[:160], [0.0, 0])
            per_name[event.key[:160]][0] += device_us / PROFILE_REPLAYS
            per_name[event.key[:160]][1] += event.count // PROFILE_REPLAYS
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"total_us": round(sum(us for us, _ in per_name.values()), 1),
            "kernels": [{"name": name, "us": round(us, 1), "calls": calls} for name, (us, calls) in ranked]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", default="64,256", help="batch buckets to time (each at least 16)")
    parser.add_argument("--profile-columns", type=int, default=None, metavar="C",
                        help=f"profile the first batch's packed graph of C columns (1..{K - 1}) beside the uniform "
                             "graphs of C + 1 tokens and of whole blocks: device time per kernel name")
    args = parser.parse_args()
    if args.profile_columns is not None and not 1 <= args.profile_columns < K:
        parser.error(f"--profile-columns: {args.profile_columns} is not in 1..{K - 1}")
    if not torch.cuda.is_available():
        print("packed_verify_cost.py: needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]

    from bench import local_worker, replay_ms
    from configs import DSparkDecodingConfig
    from runtime import LLM
    from runtime.spec.step_costs import StepCostTable

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, drafter = write_pair(root, args.hidden, args.layers)
        placeholder = root / "placeholder-costs.json"
        top = max(batches)
        StepCostTable([1, top], [1, top * (K + 1)], [[1.0, 1.0], [1.0, 1.0]]).save(placeholder)
        spec = DSparkDecodingConfig(speculative_model=str(drafter), max_draft_len=K, enable_confidence_scheduling=True,
                                    confidence_cost_table_path=str(placeholder), load_format="dummy")
        llm = LLM(str(target), speculative_config=spec, dtype="bfloat16", load_format="dummy",
                  kernel_backend="flashinfer", max_num_seqs=top, max_model_len=1024,
                  max_num_batched_tokens=max(2048, top * (K + 1)), kv_cache_memory=8 << 30)
        graphs = local_worker(llm).graphs
        info = llm.rank_info()[0]
        rows = []
        for batch in batches:
            bucket = next(b for b in graphs.buckets if b >= batch)
            uniform = {q: replay_ms(graphs.graphs[(bucket, q)].graph) for q in range(1, K + 2)
                       if (bucket, q) in graphs.graphs}
            packed = {c: replay_ms(graphs.packed_graphs[(bucket, c)].graph) for c in graphs.packed_columns
                      if (bucket, c) in graphs.packed_graphs}
            rows.append({"batch": bucket, "uniform_ms": uniform, "packed_ms": packed,
                         # packed c columns against the uniform step feeding as many rows, and against whole blocks
                         "packed_vs_uniform_same_rows": {c: packed[c] / uniform[c + 1] for c in packed
                                                         if c + 1 in uniform},
                         "packed_vs_whole_blocks": {c: packed[c] / uniform[K + 1] for c in packed
                                                    if K + 1 in uniform}})
            print(json.dumps(rows[-1]), flush=True)
        profiled = None
        if args.profile_columns is not None:
            bucket, c = rows[0]["batch"], args.profile_columns
            profiled = {"batch": bucket, "columns": c, "replays": PROFILE_REPLAYS,
                        "packed": kernel_times(graphs.packed_graphs[(bucket, c)].graph),
                        "uniform_same_rows": kernel_times(graphs.graphs[(bucket, c + 1)].graph),
                        "whole_blocks": kernel_times(graphs.graphs[(bucket, K + 1)].graph)}
            for name in ("packed", "uniform_same_rows", "whole_blocks"):
                print(name, json.dumps(profiled[name]["total_us"]), flush=True)
    record = {"benchmark": "packed_verify_cost", "date": date.today().isoformat(),
              "hardware": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": " ".join(["python3", *sys.argv]),
              "shape": {"vocab": 4096, "hidden": args.hidden, "layers": args.layers, "head_dim": 64, "drafts": K},
              "graph_packed_columns": info.get("graph_packed_columns"),
              "graph_packed_from": info.get("graph_packed_from"),
              "graphs": {k: v for k, v in info.items() if k.startswith("graph")},
              # per weight shape, the skinny GEMMs chosen and the graph row counts padded (runtime.models.small_gemm)
              "small_gemms": info.get("small_gemms"), "rows": rows, "profile": profiled}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
