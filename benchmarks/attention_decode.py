"""Which FlashInfer attention path a graphed decode/verify step should take (the Qwen3-8B shape: 32 query heads,
8 key/value heads, head_dim 128, bf16, page size 16), measured as the engine runs it: one CUDA graph of 36 calls,
each on its own layer's cache (so the caches stream from HBM, not L2), replayed and timed with CUDA events.

Variants, for ``Q`` query tokens per request (1: decode, 8: a K=7 verify):
  prefill-fa2        BatchPrefillWithPagedKVCacheWrapper, backend fa2 (what the engine uses today)
  decode-cuda-cores  BatchDecodeWithPagedKVCacheWrapper without tensor cores (Q = 1 only)
  decode-tc          BatchDecodeWithPagedKVCacheWrapper with tensor cores (q_len_per_req = Q), backend fa2
  decode-tc-auto     the same, backend auto (on SM90 it may pick XQA for Q > 1)
Every variant's output is checked against the first's (max abs difference printed).

usage: python3 benchmarks/attention_decode.py [--out FILE.json]   (prints one JSON line per point)
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import replay_ms  # noqa: E402

LAYERS, HQ, HKV, D, PAGE = 36, 32, 8, 128, 16


def wrappers(batch: int, q_len: int, max_pages: int, workspace: torch.Tensor) -> dict:
    import flashinfer

    dev = workspace.device

    def buf(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=dev)

    def decode(tensor_cores: bool, backend: str):
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=buf(batch + 1), paged_kv_indices_buffer=buf(max_pages),
            paged_kv_last_page_len_buffer=buf(batch), backend=backend)

    out = {"prefill-fa2": flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buf(batch + 1), paged_kv_indptr_buf=buf(batch + 1),
        paged_kv_indices_buf=buf(max_pages), paged_kv_last_page_len_buf=buf(batch), backend="fa2")}
    if q_len == 1:
        out["decode-cuda-cores"] = decode(False, "fa2")
    out["decode-tc"] = decode(True, "fa2")
    out["decode-tc-auto"] = decode(True, "auto")
    return out


def plan(name: str, wrapper, batch: int, q_len: int, context: int) -> None:
    pages = -(-context // PAGE)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, dtype=torch.int32)
    last = torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32)
    common = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
    if name == "prefill-fa2":
        qo = torch.arange(batch + 1, dtype=torch.int32) * q_len
        wrapper.plan(qo, kv_indptr, indices, last, HQ, HKV, D, PAGE, causal=True, **common)
    else:
        extra = {"q_len_per_req": q_len} if q_len > 1 else {}
        wrapper.plan(kv_indptr, indices, last, HQ, HKV, D, PAGE, **common, **extra)


def time_graph(fn, repeats: int = 20) -> float:
    """ms per replay of a CUDA graph of ``fn()`` (median of ``repeats``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, repeats)


def point(batch: int, q_len: int, context: int, workspace: torch.Tensor) -> dict:
    pages = -(-context // PAGE)
    caches = [(torch.randn(batch * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(batch * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    result, reference = {"batch": batch, "q_len": q_len, "context": context}, None
    for name, wrapper in wrappers(batch, q_len, batch * pages, workspace).items():
        try:
            plan(name, wrapper, batch, q_len, context)
            out = wrapper.run(q, caches[0])
            reference = out if reference is None else reference
            result[name] = {"ms_36_layers": time_graph(lambda: [wrapper.run(q, kv) for kv in caches]),
                            "max_abs_diff": float((out.float() - reference.float()).abs().max())}
        except Exception as exc:  # a variant this build cannot run is reported, not fatal
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    caches.clear()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    points = []
    for q_len in (1, 8):
        for batch in (1, 4, 16, 64):
            for context in (600, 2048):
                points.append(point(batch, q_len, context, workspace))
                print(json.dumps(points[-1]), flush=True)
    record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()),
              "command": "python3 benchmarks/attention_decode.py " + " ".join(sys.argv[1:]),
              "torch": torch.__version__, "points": points}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
