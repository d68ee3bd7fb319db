"""The q/k norm + RoPE kernel (``triton_ops.qk_norm_rope``, ``rope_and_cache`` and ``rope_and_cache_kv``) under Triton's
CPU interpreter, against the torch reference: strided q/k/v views of one fused projection, heads past one program's
block (20 q heads in blocks of 16, a partial block after) and fewer (3 kv heads), with and without the q/k norm, the
rotated keys and the values written to their cache slots and nothing else of the cache touched; q written to given rows
of a larger zeroed layout (a packed verify's); with no queries (a drafter's context append), k and v written as with
them."""

from tests.runtime.interpreter import run_interpreted

CHECK = """
import torch
from runtime.kernels import torch_ref, triton_ops
torch.manual_seed(0)
t, hq, hkv, d, page = 7, 20, 3, 16, 4
assert hq > triton_ops.ROPE_HEADS == 16  # two blocks of q heads, the second partial
qkv = torch.randn(t, (hq + 2 * hkv) * d)
q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
angles = torch.arange(t).float()[:, None] * torch.rand(d // 2)
cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
cases = [(w, heads) for w in ((torch.randn(d), torch.randn(d)), (None, None)) for heads in (16, 1)]
for (qw, kw), heads in cases:  # 16 heads a program (the engine's), 1 (benchmarks/rope_kernel.py's other layout)
    triton_ops.ROPE_HEADS = heads
    for got, want in zip(triton_ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin),
                         torch_ref.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)):
        assert got.is_contiguous() and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    slots = torch.randperm(6 * page)[:t]
    caches = [[torch.randn(6, page, hkv, d) for _ in range(2)]]
    caches.append([c.clone() for c in caches[0]])
    got_q = triton_ops.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[0], slots)
    want_q = torch_ref.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[1], slots)
    assert torch.allclose(got_q, want_q, atol=1e-5, rtol=1e-5)
    assert torch.allclose(caches[0][0], caches[1][0], atol=1e-5, rtol=1e-5)  # rotated keys at their slots
    assert torch.equal(caches[0][1], caches[1][1])  # values copied as they are; every other row untouched
    index = torch.randperm(2 * t)[:t]  # a packed verify's rows in its uniform layout of 2t rows
    got = triton_ops.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[0], slots, index, 2 * t)
    want = torch_ref.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[1], slots, index, 2 * t)
    assert got.shape == (2 * t, hq, d) and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[index], got_q, atol=1e-6) and not got[torch.ones(2 * t, dtype=torch.bool).index_fill_(
        0, index, False)].any()  # every other row zero
    kv_only = [[torch.randn(6, page, hkv, d) for _ in range(2)]]
    kv_only.append([c.clone() for c in kv_only[0]])
    triton_ops.rope_and_cache_kv(k, v, kw, 1e-6, cos, sin, *kv_only[0], slots)
    torch_ref.rope_and_cache_kv(k, v, kw, 1e-6, cos, sin, *kv_only[1], slots)
    assert torch.allclose(kv_only[0][0], kv_only[1][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_only[0][1], kv_only[1][1])
    assert torch.allclose(kv_only[0][0][slots // page, slots % page], caches[0][0][slots // page, slots % page],
                          atol=1e-6)  # the keys rope_and_cache wrote with its queries
print("rope ok")
"""


def test_the_rope_kernel_under_the_interpreter():
    run_interpreted(CHECK, "rope ok")
