"""The split-KV decode attention kernel (runtime.kernels.triton_decode) under Triton's CPU interpreter: against a
plain softmax attention over each request's paged keys, for one-token decodes and K+1-token verifies (causal
within the block), ragged lengths, slices that get no keys, and a second launch (the merge tickets reset). The
GPU checks it against FlashInfer (tests/gpu/test_flashinfer.py)."""

import os
import subprocess
import sys

import pytest

KERNEL_CHECK = r"""
import torch
from runtime.kernels.triton_decode import SplitKVDecode


def reference(q, k_cache, v_cache, indptr, indices, last, q_len, scale):
    hq, hkv, page = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(len(last)):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        length = (len(pages) - 1) * page + int(last[b])
        k = k_cache[pages].reshape(-1, hkv, q.shape[2])[:length]
        v = v_cache[pages].reshape(-1, hkv, q.shape[2])[:length]
        for i in range(q_len):
            t, visible = b * q_len + i, length - q_len + i + 1
            for h in range(hq):
                kv = h // (hq // hkv)
                out[t, h] = torch.softmax((k[:visible, kv] @ q[t, h]) * scale, 0) @ v[:visible, kv]
    return out


torch.manual_seed(0)
page, hq, hkv, d = 4, 8, 2, 16
lens = [13, 37, 5]
for q_len in (1, 4):
    npages = [-(-n // page) for n in lens]
    indices = torch.randperm(sum(npages) + 3).to(torch.int32)[:sum(npages)]  # pages anywhere in the cache
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, npages)], dtype=torch.int32)
    k_cache, v_cache = (torch.randn(sum(npages) + 3, page, hkv, d) for _ in range(2))
    q = torch.randn(len(lens) * q_len, hq, d)
    expected = reference(q, k_cache, v_cache, indptr, indices, last, q_len, d ** -0.5)
    for splits in (1, 3, 8):  # 8 slices of 5 keys: some get none
        kernel = SplitKVDecode(len(lens), q_len, hq, hkv, d, splits, torch.device("cpu"))
        for launch in range(2):
            got = kernel.run(q, k_cache, v_cache, indptr, indices, last, d ** -0.5)
            assert (got - expected).abs().max().item() < 1e-4, (q_len, splits, launch)
        assert kernel.tickets.eq(0).all()
print("kernel ok")
"""


WRAPPER_CHECK = r"""
from types import SimpleNamespace

import torch
from runtime.kernels import AttentionGeometry, torch_ref
from runtime.kernels.flashinfer_backend import DecodeGraphWrapper, host_indptrs
from runtime.kernels.interface import PagedAttentionMeta
from runtime.kernels.triton_decode import SplitKVDecode

# a graph's decode wrapper with the split-KV kernel: plan() only copies the page table into the buffers the kernel
# reads (no FlashInfer planner: the inner wrapper here has buffers and nothing else), run() takes the kernel
page, hq, hkv, d, batch, q_len, pages = 4, 8, 2, 16, 2, 3, 40
buf = lambda n: torch.zeros(n, dtype=torch.int32)
inner = SimpleNamespace(_paged_kv_indptr_buf=buf(batch + 1), _paged_kv_indices_buf=buf(pages),
                        _paged_kv_last_page_len_buf=buf(batch))
pinned = lambda n: torch.zeros(n, dtype=torch.int32)
wrapper = DecodeGraphWrapper(inner, q_len, pinned(batch + 1), pinned(batch), pinned(pages), buf(pages),
                             torch.arange(batch + 1, dtype=torch.int32) * q_len)
wrapper.split_kv = SplitKVDecode(batch, q_len, hq, hkv, d, 4, torch.device("cpu"))
geometry = AttentionGeometry(hq, hkv, d, torch.float32, d ** -0.5)
k_cache, v_cache = (torch.randn(pages, page, hkv, d) for _ in range(2))
q = torch.randn(batch * q_len, hq, d)
for kv_lens, page_ids in (([9, 30], [[3, 1, 7], [20, 21, 22, 23, 24, 25, 26, 27]]),
                          ([17, 5], [[9, 8, 30, 31, 32], [0, 2]])):
    wrapper.plan(host_indptrs([q_len] * batch, kv_lens, page_ids, page), geometry, page)
    got = wrapper.run(q, k_cache, v_cache, geometry.scale)
    width = max(len(p) for p in page_ids)
    meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1) * q_len, seq_lens=torch.tensor(kv_lens),
                              page_table=torch.tensor([p + [0] * (width - len(p)) for p in page_ids]),
                              max_query_len=q_len, max_seq_len=max(kv_lens), causal=True, num_tokens=batch * q_len,
                              page_size=page)
    want = torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), geometry.scale)
    assert (got - want).abs().max().item() < 1e-4, kv_lens
assert wrapper.planned_geometry is None and wrapper.fast_plans == 0  # FlashInfer's planner never ran
print("wrapper ok")
"""


def run_interpreted(script: str, marker: str) -> None:
    """Run ``script`` in a fresh Python under Triton's CPU interpreter (it must be set before triton is imported)
    and expect it to print ``marker``."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0 and marker in run.stdout, run.stderr[-3000:]


def test_the_split_kv_kernel_under_the_interpreter():
    run_interpreted(KERNEL_CHECK, "kernel ok")


def test_a_graphs_decode_wrapper_runs_the_split_kv_kernel_on_its_own_page_table():
    run_interpreted(WRAPPER_CHECK, "wrapper ok")


def test_the_kernel_refuses_shapes_it_cannot_serve():
    pytest.importorskip("triton")
    import torch

    from runtime.kernels.triton_decode import SplitKVDecode, default_splits

    with pytest.raises(ValueError, match="head_dim"):
        SplitKVDecode(1, 1, 8, 2, 24, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        SplitKVDecode(1, 1, 6, 4, 16, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="splits"):
        SplitKVDecode(1, 1, 8, 2, 16, 0, torch.device("cpu"))
    assert default_splits(1, 8, 132) == 32 and default_splits(64, 8, 132) == 1 and default_splits(4, 8, 132) == 9
