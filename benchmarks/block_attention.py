"""The drafter's block attention (``triton_ops.block_attention``) on the Qwen3-8B shape (32 query heads, 8 key/value
heads, head_dim 128, bf16, page size 16, a block of 7 draft slots): device time of one call per layer, 5 layers in
one CUDA graph over their own caches, replayed with a cold L2. Variants (tile keys, tiles per context split, most
splits): tiles of 16 in one program per kv head (the kernel as of one run, where one call took 62 us at one
request over 548 keys), tiles of 128 in one program (2026-12-01's first change), and tiles of 128 with a context
split per 16, 8 or 4 tiles of each request's own context (at most 8; the default: 16). Each variant's output is
checked against the first's.

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
VARIANTS = [(16, 1, 1), (128, 1, 1), (128, 16, 8), (128, 8, 8), (128, 4, 8)]  # (tile keys, tiles a split, most)


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
    for block_n, tiles, most in VARIANTS:
        def run(block_n=block_n, tiles=tiles, most=most):
            return [triton_ops.block_attention(q, k, v, table, ctx, xk, xv, D ** -0.5, None, max_context=context,
                                               block_n=block_n, split_tiles=tiles, max_splits=most)
                    for k, v in caches]
        name = f"n{block_n}t{tiles}m{most}"
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
        for context in (548, 2048, 8192) + ((16384,) if batch <= 4 else ()):
            rows.append(point(batch, context, flush))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()), "torch": torch.__version__,
                  "command": "python3 " + " ".join(sys.argv), "points": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
