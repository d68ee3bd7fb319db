"""The drafter's block attention kernel (``triton_ops.block_attention``) under Triton's CPU interpreter, against the
torch reference: contexts of 0, 1, a tile's worth and several tiles, a rolling window, tiles of 16 and 64 keys, the
context in one program or split over several merged by their log-sum-exp (splits left without keys included)."""

from tests.runtime.interpreter import run_interpreted

CHECK = """
import torch
from runtime.kernels import torch_ref, triton_ops
from runtime.kernels.interface import PagedAttentionMeta
torch.manual_seed(0)
page, hq, hkv, dim, block = 16, 4, 2, 16, 3
k_cache, v_cache = (torch.randn(24, page, hkv, dim) for _ in range(2))
ctx = torch.tensor([0, 1, 16, 150])
batch = ctx.numel()
table = torch.stack([torch.randperm(24)[:11] for _ in range(batch)])
q = torch.randn(batch * block, hq, dim)
xk, xv = (torch.randn(batch, block, hkv, dim) for _ in range(2))
for window in (None, 40):
    meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1) * block, seq_lens=ctx, page_table=table,
                              max_query_len=block, max_seq_len=150, causal=False, num_tokens=batch * block,
                              page_size=page, num_extra_keys=block, context_window=window)
    want = torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), dim ** -0.5, xk, xv)
    for block_n, splits in ((16, 1), (64, 1), (16, 3), (64, 4), (16, 16)):
        got = triton_ops.block_attention(q, k_cache, v_cache, table, ctx, xk, xv, dim ** -0.5, window,
                                         block_n=block_n, splits=splits)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (window, block_n, splits, (got - want).abs().max())
print("block attention ok")
"""


def test_the_block_attention_kernel_under_the_interpreter():
    run_interpreted(CHECK, "block attention ok")
