"""Does prefetching a GEMM's weight into L2 during a window that leaves HBM idle make the GEMM cheaper?

The Qwen3-8B shape's decode layer at batch 1 (H200, one run's profile): four weight-streaming GEMMs take ~4 us a
launch more than their bytes at the copy bandwidth (o 12 us for 7.9, qkv 15.5 for 11.8, down 28.3 for 23.6), and
between them kernels that read almost nothing run ~19 us a layer (attention 11.4, norms, RoPE, SiLU) with HBM
idle. ``prefetch_rows`` (below: ``cp.async.bulk.prefetch.L2``, sm_90+, a hint that changes no value) queues bulk
L2 prefetches of a weight's rows (or of the head of each row) before such a window.

For each of the layer's weight shapes, 36 weights (as a forward meets them, cold), a CUDA graph of 36 x
[window, GEMM] against 36 x [prefetch, window, GEMM], the window a spin kernel of W us (``torch.cuda._sleep``:
busy, no memory traffic, like attention over 548 keys), per rows (1: decode; 8: a K=7 verify) and prefetched
head of each row (a fraction of K). Reported per layer: the GEMM's time past the window without and with the
prefetch (the prefetch kernel's own launch included: what a step would see), and the bytes' floor.

usage: python3 benchmarks/l2_prefetch.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench import copy_bandwidth  # noqa: E402

BLOCK = 128  # rows one program prefetches
ALIGN = 16  # cp.async.bulk needs 16-byte aligned addresses and sizes


@triton.jit
def _prefetch_rows_kernel(base_ptr, n_rows, row_bytes, HEAD_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.where(rows < n_rows, rows, 0)  # spare lanes repeat row 0 (a hint; harmless)
    addr = base_ptr + rows.to(tl.int64) * row_bytes
    tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {HEAD_BYTES}; mov.u32 $0, 0;",
                              "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_rows(weight: torch.Tensor, head_bytes: int | None = None) -> None:
    """Queue an L2 prefetch of the first ``head_bytes`` (None: all) of every row of ``weight`` [N, K] (unit stride
    along K, rows 16-byte aligned) on the current stream."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"prefetch_rows: a row-major 2-D weight, got shape {tuple(weight.shape)} strides "
                         f"{weight.stride()}")
    row_bytes = weight.stride(0) * weight.element_size()
    head = min(head_bytes or row_bytes, weight.shape[1] * weight.element_size())
    head -= head % ALIGN
    if head == 0 or row_bytes % ALIGN or weight.data_ptr() % ALIGN:
        raise ValueError(f"prefetch_rows: rows of {row_bytes} bytes at {weight.data_ptr():#x}, head {head_bytes}: "
                         f"bulk prefetches need {ALIGN}-byte alignment")
    base = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    n = weight.shape[0]
    _prefetch_rows_kernel[(triton.cdiv(n, BLOCK),)](base, n, row_bytes, HEAD_BYTES=head, BLOCK=BLOCK)


LAYERS = 36
SHAPES = {  # name: (N, K, window before it in a decode layer, us)
    "o_proj": (4096, 4096, 11.0),  # after attention
    "qkv_proj": (6144, 4096, 2.5),  # after the input norm
    "gate_up_proj": (24576, 4096, 2.5),  # after the post-attention norm
    "down_proj": (4096, 12288, 1.5),  # after SiLU-and-mul
}


def spin_cycles_per_us() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (1e3 * start.elapsed_time(end))


def graph_us(body, flush: torch.Tensor, repeats: int = 9) -> float:
    """Median device microseconds of a CUDA graph of ``body()``, each replay after L2 is flushed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--heads", default="0.0625,0.125,0.25,0.5,1.0", help="prefetched fractions of each row")
    args = parser.parse_args()

    from runtime.kernels.skinny_gemm import SkinnyConfig, skinny_matmul

    skinny = SkinnyConfig(32, 256, 1, 4, 4)  # what runtime.models.small_gemm chose for o and down in one run
    gemms = {"o_proj": "skinny", "qkv_proj": "cublas", "gate_up_proj": "cublas", "down_proj": "skinny"}
    bandwidth = copy_bandwidth("cuda") / 1e9
    cycles = spin_cycles_per_us()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    record = {"hardware": torch.cuda.get_device_name(), "date": date.today().isoformat(), "torch": torch.__version__,
              "command": "python3 benchmarks/l2_prefetch.py " + " ".join(sys.argv[1:]),
              "copy_bandwidth_gbs": bandwidth, "spin_cycles_per_us": cycles, "points": []}
    heads = [float(h) for h in args.heads.split(",")]
    for name, (n, k, window) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64 for _ in range(LAYERS)]
        spin = int(window * cycles)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            gemm = (lambda w: skinny_matmul(x, w, skinny)) if gemms[name] == "skinny" else (lambda w: F.linear(x, w))
            windows = graph_us(lambda: [torch.cuda._sleep(spin) for _ in weights], flush)

            def chain(head: float | None):
                def body():
                    for w in weights:
                        if head is not None:
                            prefetch_rows(w, int(head * k * 2))
                        torch.cuda._sleep(spin)
                        gemm(w)
                return body

            base = graph_us(chain(None), flush) - windows
            point = {"weight": name, "shape": [n, k], "gemm": gemms[name], "rows": rows, "window_us": window,
                     "floor_us_per_layer": n * k * 2 / bandwidth / 1e3,
                     "gemm_us_per_layer": base / LAYERS, "prefetched": {}}
            for head in heads:
                point["prefetched"][str(head)] = (graph_us(chain(head), flush) - windows) / LAYERS
            print(json.dumps(point), flush=True)
            record["points"].append(point)
        weights.clear()
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
