"""The q/k norm + RoPE + KV-write kernel (``triton_ops.rope_and_cache``) at the rows a step feeds, one layout against
another in one run: heads a program (``ROPE_HEADS``) and warps (``ROPE_WARPS``). ``--layouts 1x4,16`` times the
layout before 25931b2 (one program per (token, head), Triton's default 4 warps) beside the one after (16 heads a
program, warps by size). One run's profile of the 2.7B trained pair's 64 x 8 verify graph found the one-head layout at
52-60 us a layer.

Each figure: the median device time of a CUDA graph of one call (``runtime.kernels.timing.graph_device_us``, L2
flushed before each replay), q/k/v strided views of one fused projection's output, keys written to scattered slots.

usage: python3 benchmarks/rope_kernel.py --out FILE.json [--rows 1,64,448,512,2048] [--layouts 1x4,16]
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

# (q heads, kv heads, head_dim) of the targets measured
SHAPES = {"3072x24": (48, 24, 64), "qwen3-8b": (32, 8, 128)}
PAGE = 16


def layout(text: str) -> tuple[int, int | None]:
    """'HEADS' or 'HEADSxWARPS' -> (heads a program, warps or None)."""
    heads, _, warps = text.partition("x")
    return int(heads), int(warps) if warps else None


def time_call(hq: int, hkv: int, dim: int, rows: int, flush: torch.Tensor) -> float:
    device, dtype = flush.device, torch.bfloat16
    qkv = torch.randn(rows, (hq + 2 * hkv) * dim, device=device, dtype=dtype)
    q, k, v = (x.view(rows, -1, dim) for x in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    weights = [torch.randn(dim, device=device, dtype=dtype) for _ in range(2)]
    angles = torch.arange(rows, device=device).float()[:, None] * torch.rand(dim // 2, device=device)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    pages = -(-rows * 2 // PAGE)
    caches = [torch.zeros(pages, PAGE, hkv, dim, device=device, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(pages * PAGE, device=device)[:rows]
    return graph_device_us(lambda: triton_ops.rope_and_cache(q, k, v, *weights, 1e-6, cos, sin, *caches, slots),
                           flush, reps=21)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,64,448,512,2048")
    parser.add_argument("--layouts", default="1x4,16", help="comma-separated HEADS or HEADSxWARPS")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("rope_kernel.py: needs a CUDA device", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    layouts = [layout(text) for text in args.layouts.split(",")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for name, (hq, hkv, dim) in SHAPES.items():
        for n in rows:
            row = {"shape": name, "rows": n, "us": {}}
            for heads, warps in layouts:
                triton_ops.ROPE_HEADS, triton_ops.ROPE_WARPS = heads, warps
                row["us"][f"{heads}x{warps or 'auto'}"] = round(time_call(hq, hkv, dim, n, flush), 2)
            first, *rest = row["us"].values()
            row["vs_first"] = [round(us / first, 3) for us in rest]
            results.append(row)
            print(json.dumps(row), flush=True)
    record = {"benchmark": "rope_kernel", "date": date.today().isoformat(),
              "hardware": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": " ".join(["python3", *sys.argv]), "shapes": SHAPES, "results": results}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
