"""MoE expert kernels side by side on one Qwen3-30B-A3B-shaped MoE layer (random bf16 weights): hidden 2048, 128
experts of intermediate 768, 8 per token, softmax routing renormalized over the top 8.

For each token count (1: a decode at batch 1; 8: a K=7 verify; 64, 512: batches) the block's forward (router +
experts) runs on each backend of ``--backends``; its output is checked against VANILLA's (max abs difference),
and its device time is the median of CUDA-event-timed repeats: eagerly, and replayed from a CUDA graph for the
backends a graph can capture (``runtime.kernels.moe.GRAPH_SAFE``). Also recorded: how many distinct experts the
tokens wake (what a step must read). Writes a JSON record (``moe_backend`` per run, hardware, command, date).

usage: python3 benchmarks/moe_layer.py --out FILE.json [--tokens 1,8,64,512] [--backends VANILLA,DENSEGEMM,TRITON]
       python3 benchmarks/moe_layer.py --smoke   (tiny shapes on the CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.kernels.moe import GRAPH_SAFE  # noqa: E402
from runtime.models.moe import SparseMoeBlock  # noqa: E402

SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             norm_topk_prob=True)
SMOKE_SHAPE = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True)


def build(shape: dict, backend: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> SparseMoeBlock:
    """The block with random weights (the same for every backend: same seed), experts stacked (serving layout)."""
    torch.manual_seed(seed)
    with torch.device(device):
        block = SparseMoeBlock(SimpleNamespace(**shape), backend).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    block.fuse()
    return block.eval()


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, wall time on the CPU)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def graphed(block: SparseMoeBlock, x: torch.Tensor):
    """A CUDA graph of ``block(x)`` -> (replay, output buffer)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    return graph.replay, out


@torch.inference_mode()
def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    blocks = {name: build(shape, name, device, dtype) for name in args.backends}
    record = {"benchmark": "moe_layer", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "hardware": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "runs": []}
    generator = torch.Generator(device=device).manual_seed(1)
    for tokens in args.tokens:
        x = torch.randn(tokens, shape["hidden_size"], device=device, dtype=dtype, generator=generator)
        reference = blocks["VANILLA"](x) if "VANILLA" in blocks else None
        woken = int(next(iter(blocks.values())).expert_ids(x).unique().numel())
        for name, block in blocks.items():
            out = block(x)
            row = {"tokens": tokens, "moe_backend": name, "experts_woken": woken,
                   "eager_ms": time_ms(lambda b=block: b(x), device, args.repeats),
                   "max_abs_diff_vs_vanilla": (out.float() - reference.float()).abs().max().item()
                   if reference is not None else None}
            if device.type == "cuda" and name in GRAPH_SAFE:
                replay, graph_out = graphed(block, x)
                replay()
                row["graph_ms"] = time_ms(replay, device, args.repeats)
                row["graph_max_abs_diff_vs_eager"] = (graph_out.float() - out.float()).abs().max().item()
            record["runs"].append(row)
            print(json.dumps(row), flush=True)
    base = {r["tokens"]: r for r in record["runs"] if r["moe_backend"] == "DENSEGEMM"}
    for row in record["runs"]:
        if row["tokens"] in base and row["moe_backend"] != "DENSEGEMM":
            row["eager_vs_densegemm"] = row["eager_ms"] / base[row["tokens"]]["eager_ms"]
            if "graph_ms" in row and "graph_ms" in base[row["tokens"]]:
                row["graph_vs_densegemm"] = row["graph_ms"] / base[row["tokens"]]["graph_ms"]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the JSON record here")
    parser.add_argument("--tokens", default="1,8,64,512", type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--backends", type=lambda s: s.split(","),
                        help="default VANILLA,DENSEGEMM,TRITON (VANILLA,DENSEGEMM with --smoke: TRITON needs CUDA)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, float32")
    args = parser.parse_args()
    args.backends = args.backends or (["VANILLA", "DENSEGEMM"] if args.smoke else ["VANILLA", "DENSEGEMM", "TRITON"])
    record = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
