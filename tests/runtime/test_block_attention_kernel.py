"""The drafter's block attention kernel (``triton_ops.block_attention``) under Triton's CPU interpreter, against the
torch reference: contexts of 0, 1, a tile's worth and several tiles, a rolling window, tiles of 16 and 64 keys, a
request's context in one program or split over several (a split per so many tiles, capped, splits left without
keys included) merged by their log-sum-exp; a request's result the same alone as in its batch."""

from tests.runtime.interpreter import run_interpreted

CHECK = """
import torch
from runtime.kernels import torch_ref, triton_ops
from runtime.kernels.interface import PagedAttentionMeta
torch.manual_seed(0)
page, hq, hkv, dim, block = 16, 4, 2, 16, 3
k_cache, v_cache = (torch.randn(24, page, hkv, dim) for _ in range(2))
ctx = torch.tensor([0, 1, 16, 80, 150])
batch = ctx.numel()
table = torch.stack([torch.randperm(24)[:11] for _ in range(batch)])
q = torch.randn(batch * block, hq, dim)
xk, xv = (torch.randn(batch, block, hkv, dim) for _ in range(2))
for window in (None, 40):
    meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1) * block, seq_lens=ctx, page_table=table,
                              max_query_len=block, max_seq_len=150, causal=False, num_tokens=batch * block,
                              page_size=page, num_extra_keys=block, context_window=window)
    want = torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), dim ** -0.5, xk, xv)
    # (tile, tiles per split, most splits): one split; 150 keys in 10 tiles of 16 -> 4 splits of 3, 3, 3, 1;
    # capped at 3; 1-tile splits capped at 4: 10 tiles -> 3, 3, 3, 1, 5 tiles -> 2, 2, 1, 0 (the empty last split
    # has the block's keys), the 3-tile window -> 1, 1, 1; capped at 8: 10 tiles -> 2, 2, 2, 2, 2, 0, 0, 0 (empty
    # splits before the last); tiles of 64 in splits of 1 tile
    for block_n, tiles, most in ((16, 16, 8), (16, 3, 8), (16, 3, 3), (16, 1, 4), (16, 1, 8), (64, 1, 8),
                                 (128, 16, 8)):
        for max_context in (None, 176):
            got = triton_ops.block_attention(q, k_cache, v_cache, table, ctx, xk, xv, dim ** -0.5, window,
                                             max_context=max_context, block_n=block_n, split_tiles=tiles,
                                             max_splits=most)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (window, block_n, tiles, most, max_context,
                                                                     (got - want).abs().max())
    alone = triton_ops.block_attention(q[-block:], k_cache, v_cache, table[-1:], ctx[-1:], xk[-1:], xv[-1:],
                                       dim ** -0.5, window, block_n=16, split_tiles=3)
    batched = triton_ops.block_attention(q, k_cache, v_cache, table, ctx, xk, xv, dim ** -0.5, window, block_n=16,
                                         split_tiles=3)
    assert torch.equal(alone, batched[-block:])  # its splits are its own, whatever the batch
print("block attention ok")
"""


def test_the_block_attention_kernel_under_the_interpreter():
    run_interpreted(CHECK, "block attention ok")
