"""Is a verify step's GEMM slower at some row counts than at more rows? Each weight shape of a target, timed at every
multiple of 64 rows (the rows a verify graph feeds: batch bucket x tokens a request), as cuBLAS runs it and with the
rows padded up to the next multiple of ``--pad-to`` (the pad copy included), under each of torch's BLAS libraries,
and with a zero bias (torch hands a bias-fused GEMM to cuBLASLt's epilogue kernels, another kernel family).

One run found the 2.7B trained pair's verify at 64
requests dearer at 7 tokens a request than at 8 (7.95 against 6.63 ms) and at 5 than at 6: 448 and 320 rows to every
GEMM against 512 and 384. This says which shapes, at which rows, and whether padding or the other BLAS library
removes it (``runtime.models.small_gemm`` would then choose it, measured, as it chooses its skinny GEMMs).

Each figure: the median device time of a CUDA graph over ``--copies`` weights of the shape (as a forward meets a
layer's weights: cold in L2, ``runtime.kernels.timing.graph_device_us``).

usage: python3 benchmarks/gemm_rows.py --out FILE.json [--shape 3072x24] [--rows 64..1024] [--pad-to 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.kernels.timing import graph_device_us  # noqa: E402
from runtime.models.small_gemm import padded_linear  # noqa: E402

# per model shape, its linears' [N, K] (bias-free, as runtime/models fuses them: q/k/v into one, gate/up into one)
SHAPES = {
    # the trained pair's target (benchmarks/gpu_recipe.py --target-hidden 3072 --target-layers 24): 48 heads of 64,
    # 24 KV heads, MLP 3x, vocab 4096
    "3072x24": {"qkv": (6144, 3072), "o": (3072, 3072), "gate_up": (18432, 3072), "down": (3072, 9216),
                "lm_head": (4096, 3072)},
    # Qwen3-8B: 32 heads of 128, 8 KV heads, MLP 12288, vocab 151936
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)},
}
FLUSH_BYTES = 256 << 20


def row_list(text: str) -> list[int]:
    if ".." in text:
        low, high = (int(x) for x in text.split(".."))
        return list(range(low, high + 1, 64))
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3072x24")
    parser.add_argument("--rows", type=row_list, default=row_list("64..1024"))
    parser.add_argument("--pad-to", type=int, default=128)
    parser.add_argument("--copies", type=int, default=8, help="weights of each shape in one timed graph")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    libraries = ["cublas", "cublaslt"]
    results = {}
    for name, (n, k) in SHAPES[args.shape].items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5 for _ in range(args.copies)]
        bias = torch.zeros(n, dtype=torch.bfloat16, device=device)
        per_rows = {}
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
            padded = -(-rows // args.pad_to) * args.pad_to
            entry = {}
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                entry[f"{library}_us"] = round(graph_device_us(lambda: [F.linear(x, w) for w in weights], flush,
                                                               args.reps), 1)
                if padded != rows:
                    entry[f"{library}_padded_us"] = round(graph_device_us(
                        lambda: [padded_linear(x, w, padded) for w in weights], flush, args.reps), 1)
            torch.backends.cuda.preferred_blas_library("cublas")
            entry["zero_bias_us"] = round(graph_device_us(lambda: [F.linear(x, w, bias) for w in weights], flush,
                                                          args.reps), 1)
            per_rows[str(rows)] = entry
            print(name, rows, entry, flush=True)
        results[name] = {"n": n, "k": k, "rows": per_rows}
    torch.backends.cuda.preferred_blas_library("cublas")
    record = {
        "benchmark": "gemm_rows", "date": date.today().isoformat(), "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "command": "python3 benchmarks/gemm_rows.py " + " ".join(sys.argv[1:]), "shape": args.shape,
        "copies": args.copies, "pad_to": args.pad_to, "dtype": "bfloat16", "shapes": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
