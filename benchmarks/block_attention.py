"""The drafter's block attention (``triton_ops.block_attention``) on the Qwen3-8B shape (32 query heads, 8 key/value
heads, head_dim 128, bf16, page size 16, a block of 7 draft slots): device time of one call per layer, 5 layers in
one CUDA graph over their own caches, replayed with a cold L2, for tiles of 16..128 keys and 1..8 context splits.
Each variant's output is checked against tiles of 16 in one split (the kernel as of run 34, where one call took
62 us at one request over 548 keys: 8 programs, one per key/value head, walking 35 tiles each).

usage: python3 benchmarks/block_attention.py [--out FILE.json]   (one JSON line per point)
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.kernels import triton_ops  # noqa: E402
from runtime.kernels.timing import graph_device_us  # noqa: E402

LAYERS, HQ, HKV, D, PAGE, BLOCK = 5, 32, 8, 128, 16, 7
VARIANTS = [(16, 1), (32, 1), (64, 1), (128, 1), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4)]


def point(batch: int, context: int, flush: torch.Tensor) -> dict:
    dev, dt = flush.device, torch.bfloat16
    pages = -(-context // PAGE)
    caches = [(torch.randn(batch * pages, PAGE, HKV, D, device=dev, dtype=dt),
               torch.randn(batch * pages, PAGE, HKV, D, device=dev, dtype=dt)) for _ in range(LAYERS)]
    table = torch.arange(batch * pages, device=dev).view(batch, pages)
    ctx = torch.full((batch,), context, device=dev)
    q = torch.randn(batch * BLOCK, HQ, D, device=dev, dtype=dt)
    xk, xv = (torch.randn(batch, BLOCK, HKV, D, device=dev, dtype=dt) for _ in range(2))
    row = {"batch": batch, "context": context, "us_per_call": {}, "max_abs_diff": {}}
    reference = None
    for block_n, splits in VARIANTS:
        def run(block_n=block_n, splits=splits):
            return [triton_ops.block_attention(q, k, v, table, ctx, xk, xv, D ** -0.5, None, block_n=block_n,
                                               splits=splits) for k, v in caches]
        name = f"n{block_n}s{splits}"
        out = run()[0]
        reference = out if reference is None else reference
        row["max_abs_diff"][name] = float((out.float() - reference.float()).abs().max())
        row["us_per_call"][name] = graph_device_us(run, flush) / LAYERS
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for batch in (1, 4, 16, 64):
        for context in (548, 2048, 8192):
            rows.append(point(batch, context, flush))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()), "torch": torch.__version__,
                  "command": "python3 " + " ".join(sys.argv), "points": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
