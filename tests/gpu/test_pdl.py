"""Programmatic dependent launch of the engine's Triton kernels (``runtime.kernels.pdl``) on a GPU: a decode
layer's chain of them captured in a CUDA graph computes bit for bit what plain launches compute. Skipped without
a GPU and triton."""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

DEV = torch.device("cuda")


def chain(x: torch.Tensor, weights: dict) -> torch.Tensor:
    """norm -> skinny GEMM (qkv) -> q/k norm + RoPE -> skinny GEMM (o) -> residual add + norm -> fused SwiGLU down."""
    from runtime.kernels import skinny_gemm, triton_ops

    config = skinny_gemm.SkinnyConfig(32, 256, 1, 4, 4)
    h = triton_ops.rms_norm(x, weights["norm"], 1e-6)
    qkv = skinny_gemm.skinny_matmul(h, weights["qkv"], config)
    q, k = qkv[:, :1024].view(-1, 8, 128), qkv[:, 1024:1536].view(-1, 4, 128)
    q, k = triton_ops.qk_norm_rope(q, k, weights["qn"], weights["kn"], 1e-6, weights["cos"], weights["sin"])
    o = skinny_gemm.skinny_matmul(q.reshape(len(x), -1), weights["o"], config)
    h, summed = triton_ops.add_rms_norm(o, x, weights["norm"], 1e-6)
    gate_up = skinny_gemm.skinny_matmul(h, weights["gate_up"], config)
    down = skinny_gemm.skinny_matmul(gate_up, weights["down"], config, swiglu=True)
    return torch.cat([down, summed, k.reshape(len(x), -1)], dim=-1)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_graphed_chain_launched_with_pdl_equals_plain_launches(monkeypatch, rows):
    from runtime.kernels import pdl

    assert pdl.supported(DEV) == (torch.cuda.get_device_capability(DEV)[0] >= 9)
    if not pdl.supported(DEV):
        pytest.skip("programmatic dependent launch needs compute capability 9")
    torch.manual_seed(0)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    weights = {"norm": torch.randn(1024, **bf), "qkv": torch.randn(2048, 1024, **bf) / 32,
               "qn": torch.randn(128, **bf), "kn": torch.randn(128, **bf), "o": torch.randn(1024, 1024, **bf) / 32,
               "gate_up": torch.randn(4096, 1024, **bf) / 32, "down": torch.randn(1024, 2048, **bf) / 32}
    angles = torch.arange(rows, device=DEV).float()[:, None] * torch.rand(64, device=DEV)
    weights["cos"] = torch.cat([angles, angles], -1).cos().to(torch.bfloat16)
    weights["sin"] = torch.cat([angles, angles], -1).sin().to(torch.bfloat16)
    x = torch.randn(rows, 1024, **bf)
    outputs = {}
    for on in (False, True):
        if not on:
            monkeypatch.setattr(pdl, "supported", lambda device: False)
        else:
            monkeypatch.undo()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager = chain(x, weights)  # warm-up (compiles) and the eager result
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x, weights)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        outputs[on] = out.clone()
    assert torch.equal(outputs[True], outputs[False])
