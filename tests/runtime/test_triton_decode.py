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


def test_the_split_kv_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0 and "kernel ok" in run.stdout, run.stderr[-3000:]


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
