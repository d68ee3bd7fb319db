"""The torch reference kernels against dense attention, and the registry's explicit failures."""

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import KernelBackendUnavailable, PagedAttentionMeta, available_backends, get_backend

ref = get_backend("torch")


def dense_attention(q, k, v, causal_offset=None):
    # q: [Lq, H, D], k/v: [Lk, Hkv, D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = None
    if causal_offset is not None:
        mask = torch.arange(k.shape[0])[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_matches_dense(causal):
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache, v_cache = torch.randn(16, page, kv_heads, dim), torch.randn(16, page, kv_heads, dim)
    seq_lens, q_lens = [9, 3, 13], [2, 3, 1]
    tables = [[5, 0, 11], [7], [1, 2, 3, 4]]
    width = max(map(len, tables))
    meta = ref.plan_attention(PagedAttentionMeta(
        torch.tensor([0, 2, 5, 6]), torch.tensor(seq_lens), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        3, 13, causal, num_tokens=6, page_size=page, num_extra_keys=0 if causal else 2))
    q = torch.randn(6, heads, dim)
    extra_k, extra_v = torch.randn(3, 2, kv_heads, dim), torch.randn(3, 2, kv_heads, dim)
    got = ref.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5, *(() if causal else (extra_k, extra_v)))
    starts = [0, 2, 5]
    for b, (n, ql, table) in enumerate(zip(seq_lens, q_lens, tables)):
        slots = torch.tensor([table[i // page] * page + i % page for i in range(n)])
        k = k_cache.view(-1, kv_heads, dim)[slots]
        v = v_cache.view(-1, kv_heads, dim)[slots]
        if not causal:
            k, v = torch.cat([k, extra_k[b]]), torch.cat([v, extra_v[b]])
        want = dense_attention(q[starts[b]:starts[b] + ql], k, v, n - ql if causal else None)
        torch.testing.assert_close(got[starts[b]:starts[b] + ql], want, atol=1e-5, rtol=1e-5)


def test_write_kv_and_rms_norm():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    ref.write_kv(k_cache, v_cache, torch.tensor([5, 0]), torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2))
    assert k_cache[1, 1].sum() == 2 and k_cache[0, 0].sum() == 2 and v_cache[1, 1].sum() == 4
    x = torch.randn(3, 8)
    want = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * 2
    torch.testing.assert_close(ref.rms_norm(x, torch.full((8,), 2.0), 1e-6), want)


def test_registry_fails_loudly():
    assert "torch" in available_backends()
    with pytest.raises(KernelBackendUnavailable, match="unknown kernel backend 'cuda-magic'"):
        get_backend("cuda-magic")
    if not torch.cuda.is_available():  # the flashinfer backend itself is tested in tests/gpu
        with pytest.raises(KernelBackendUnavailable, match="flashinfer"):
            get_backend("flashinfer")


def test_flashinfer_plan_inputs_are_the_csr_of_each_requests_used_pages():
    """The host side of FlashInfer's plan (no flashinfer needed): query and page indptrs, the pages each request's
    keys use (not the spare ones it holds), the fill of its last page, the keys per request (the graph wrapper's
    replan hands them to FlashInfer's planner); a layout short of pages is refused."""
    from runtime.kernels.flashinfer_backend import host_indptrs

    got = host_indptrs([3, 1], [9, 4], [[7, 2, 5], [4, 6]], page_size=4)
    assert got.qo_indptr.tolist() == [0, 3, 4] and got.kv_indptr.tolist() == [0, 3, 4]
    assert got.kv_indices.tolist() == [7, 2, 5, 4] and got.last_page_len.tolist() == [1, 4]
    assert got.kv_lens.tolist() == [9, 4]
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in (got.qo_indptr, got.kv_indices, got.kv_lens))
    with pytest.raises(ValueError, match="9 keys need 3 pages, the request holds 2"):
        host_indptrs([1], [9], [[1, 2]], page_size=4)
