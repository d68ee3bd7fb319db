"""Does programmatic dependent launch (PDL) shorten a decode layer's chain of small kernels and weight-streaming GEMVs?

The Qwen3-8B shape's batch-1 decode step spends ~2.5-4 us a launch beyond their bytes in each of a layer's four GEMMs
(a single-wave weight stream's ramp and tail: o_proj 12.0 us for 7.9, down 28.3 for 23.7 in one run) between
kernels that read almost nothing. With PDL (sm_90+) a kernel launched with the programmatic-serialization attribute
may start while the kernel before it finishes: it waits (``griddepcontrol.wait``) only before it reads what that
kernel wrote, and a kernel that signals early (``griddepcontrol.launch_dependents``) lets the next one launch
sooner. A GEMV's weights are no earlier kernel's output, so it may even load its first weight tile before waiting.

36 layers of [RMSNorm of one row -> GEMV 4096 x 4096 -> RMSNorm -> GEMV 12288 x 4096], the kernels written here
(the same shapes and strides as the engine's Triton kernels, simplified), captured in one CUDA graph and replayed
with a cold L2, three ways: plain launches; PDL, each kernel waiting first thing (the launch overlaps the previous
kernel's tail); PDL with each GEMV loading its first weight tile before it waits. Reports us per layer and the
bytes' floor at the copy bandwidth.

usage: python3 benchmarks/pdl_chain.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import copy_bandwidth  # noqa: E402

LAYERS, HIDDEN, WIDE = 36, 4096, 12288
BLOCK_N, BLOCK_K = 32, 256


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # x is the previous kernel's output
        gdc_launch_dependents()
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + cols).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + 1e-6)
    tl.store(out_ptr + cols, (x * inv * tl.load(w_ptr + cols).to(tl.float32)).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, EARLY_TILE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None] * K + ks[None, :]
    first = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    if EARLY_TILE:  # weights are nobody's output: the first tile streams while the previous kernel finishes
        first = tl.load(w_ptrs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if EARLY_TILE:
        acc += tl.sum(first.to(tl.float32) * tl.load(x_ptr + ks).to(tl.float32)[None, :], axis=1)
        start = BLOCK_K
    else:
        start = 0
    for k in range(start, K, BLOCK_K):
        w = tl.load(w_ptrs + k).to(tl.float32)
        acc += tl.sum(w * tl.load(x_ptr + k + ks).to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty))


def chain(weights, norm_w, x, buf, pdl: bool, early: bool):
    def body():
        h = x
        for w_a, w_b in weights:
            _norm_kernel[(1,)](h, norm_w, buf[0], D=HIDDEN, PDL=pdl, launch_pdl=pdl)
            _gemv_kernel[(HIDDEN // BLOCK_N,)](buf[0], w_a, buf[1], K=HIDDEN, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                              PDL=pdl, EARLY_TILE=early, launch_pdl=pdl)
            _norm_kernel[(1,)](buf[1], norm_w, buf[2], D=HIDDEN, PDL=pdl, launch_pdl=pdl)
            _gemv_kernel[(WIDE // BLOCK_N,)](buf[2], w_b, buf[3], K=HIDDEN, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                            PDL=pdl, EARLY_TILE=early, launch_pdl=pdl)
            h = buf[3]
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from runtime.kernels.timing import graph_device_us

    dev = torch.device("cuda")
    weights = [(torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) / 64,
                torch.randn(WIDE, HIDDEN, device=dev, dtype=torch.bfloat16) / 64) for _ in range(LAYERS)]
    norm_w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    x = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    buf = [torch.empty(WIDE, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    bandwidth = copy_bandwidth(dev) / 1e9
    floor = (HIDDEN * HIDDEN + WIDE * HIDDEN) * 2 / bandwidth / 1e3  # us a layer: its weights' bytes
    results = {}
    outputs = {}
    for name, pdl, early in (("plain", False, False), ("pdl", True, False), ("pdl_early_tile", True, True)):
        body = chain(weights, norm_w, x, buf, pdl, early)
        results[name] = graph_device_us(body, flush, reps=9) / LAYERS
        body()
        outputs[name] = buf[3].float().clone()
        print(name, f"{results[name]:.2f} us a layer", flush=True)
    record = {"hardware": torch.cuda.get_device_name(), "date": date.today().isoformat(), "torch": torch.__version__,
              "triton": triton.__version__, "command": "python3 benchmarks/pdl_chain.py " + " ".join(sys.argv[1:]),
              "copy_bandwidth_gbs": bandwidth, "floor_us_per_layer": floor, "us_per_layer": results,
              "same_output": {name: bool(torch.equal(out, outputs["plain"])) for name, out in outputs.items()}}
    print(json.dumps(record), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
