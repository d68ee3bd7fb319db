"""The small-batch GEMM dispatch (runtime.models.small_gemm) on the CPU: which rows go where, what is swapped, what is
left alone. The Triton kernel itself is checked against cuBLAS on a GPU (tests/gpu/test_small_gemm.py) and, where
triton is installed, under Triton's CPU interpreter here."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import get_backend
from runtime.models import small_gemm
from runtime.models.loader import load_target
from runtime.models.parallel import ParallelContext, RowParallelLinear
from runtime.models.small_gemm import ROW_BUCKETS, GemmChoice, SmallBatchLinear, linear
from tests.runtime.interpreter import run_interpreted


class Recorder:
    """A stand-in kernel: records (rows, config) and computes what F.linear would."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, weight, config, swiglu=False):
        self.calls.append((x.shape[0], config) if not swiglu else (x.shape[0], config, "swiglu"))
        if swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return F.linear(x, weight)


def choice_for(configs, kernel):
    return GemmChoice(tuple(configs), kernel)


def test_rows_take_the_choice_of_the_smallest_bucket_at_or_above_them():
    kernel = Recorder()
    choice = choice_for(["c1", None, "c4", "c8", None], kernel)  # 2 rows and 16 rows stay cuBLAS
    w = torch.randn(24, 32)
    for rows, expected in ((1, "c1"), (2, None), (3, "c4"), (4, "c4"), (5, "c8"), (8, "c8"), (9, None), (16, None),
                           (17, None), (300, None)):
        kernel.calls.clear()
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x, w, None, choice), F.linear(x, w))
        assert kernel.calls == ([(rows, expected)] if expected else []), rows


def test_three_dimensional_inputs_count_rows_and_keep_their_shape():
    kernel = Recorder()
    choice = choice_for(["c"] * len(ROW_BUCKETS), kernel)
    x, w = torch.randn(2, 4, 32), torch.randn(24, 32)  # a drafter's [B, block, d]: 8 rows
    out = linear(x, w, None, choice)
    assert out.shape == (2, 4, 24) and kernel.calls == [(8, "c")]
    torch.testing.assert_close(out, F.linear(x, w))


def test_a_bias_or_no_choice_keeps_cublas():
    kernel = Recorder()
    choice = choice_for(["c"] * len(ROW_BUCKETS), kernel)
    x, w, b = torch.randn(1, 32), torch.randn(24, 32), torch.randn(24)
    torch.testing.assert_close(linear(x, w, b, choice), F.linear(x, w, b))
    torch.testing.assert_close(linear(x, w, None, None), F.linear(x, w))
    assert GemmChoice((None,) * len(ROW_BUCKETS)).for_rows(1) is None
    assert kernel.calls == []


def test_a_small_batch_linear_is_the_same_linear():
    base = nn.Linear(32, 24, bias=False)
    swapped = SmallBatchLinear(base, choice_for(["c"] * len(ROW_BUCKETS), Recorder()))
    assert isinstance(swapped, nn.Linear) and swapped.weight is base.weight and swapped.bias is None
    assert list(swapped.state_dict()) == list(base.state_dict())
    x = torch.randn(3, 32)
    torch.testing.assert_close(swapped(x), base(x))


def fake_measure(picks, swiglu_picks=None, seen=None, norm_picks=None):
    """A `_measure` that picks `picks` per bucket for every shape (no device timing), `swiglu_picks` for the
    shapes measured with an activation and `norm_picks` for those measured with a norm (``seen``: a list that gets
    each call's (shape, with activation) or, with a norm, (shape, with activation, "norm"))."""

    def measure(weights, flush, silu_and_mul=None, add_rms_norm=None):
        if seen is not None:
            seen.append((tuple(weights[0].shape), silu_and_mul is not None)
                        + (("norm",) if add_rms_norm is not None else ()))
        none = (None,) * len(ROW_BUCKETS)
        fused = tuple(swiglu_picks) if swiglu_picks is not None and silu_and_mul is not None else none
        normed = tuple(norm_picks) if norm_picks is not None and add_rms_norm is not None else none
        report = {str(r): {"chosen": str(p)} for r, p in zip(ROW_BUCKETS, picks)}
        used = any(p is not None for p in (*picks, *fused, *normed))
        norm_kernel = NormRecorder() if any(p is not None for p in normed) else None
        return GemmChoice(tuple(picks), Recorder() if used else None, fused, normed, norm_kernel), report

    return measure


class NormRecorder:
    """A stand-in for the fused norm GEMM: records (rows, config, with residual) and computes the reference."""

    def __init__(self):
        self.calls = []

    def __call__(self, h, residual, norm_weight, eps, weight, config):
        self.calls.append((h.shape[0], config, residual is not None))
        kernels = get_backend("torch")
        if residual is None:
            return F.linear(kernels.rms_norm(h, norm_weight, eps), weight), None
        x, summed = kernels.add_rms_norm(h, residual, norm_weight, eps)
        return F.linear(x, weight), summed


def test_an_mlp_down_projection_fuses_the_activation_where_measured_faster(patched, qwen3_target):
    """The down projection of a fused MLP is measured with SiLU-and-mul too; where the fused kernel won (here 1-4
    rows), the MLP hands it gate/up and no activation kernel runs; elsewhere the two kernels, same result."""
    seen = []
    patched.setattr(small_gemm, "_measure", fake_measure([None] * len(ROW_BUCKETS), ["f1", "f2", "f4", None, None],
                                                         seen))
    model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    model.fuse_projections()
    mlp = model.model.layers[0].mlp
    small_gemm.install_small_gemms([model], torch.device("cpu"), torch.float32)
    down_shape = tuple(mlp.down_proj.weight.shape)
    assert (down_shape, True) in seen and all(not entry[1] for entry in seen if entry[0] != down_shape)
    assert isinstance(mlp.down_proj, SmallBatchLinear)
    activations = []
    real = mlp.kernels.silu_and_mul
    patched.setattr(mlp.kernels, "silu_and_mul", lambda x: activations.append(x.shape[0]) or real(x))
    torch.manual_seed(0)
    for rows in (1, 3, 8):
        x = torch.randn(rows, mlp.gate_up_proj.in_features)
        mlp.down_proj.choice.matmul.calls.clear()
        gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        torch.testing.assert_close(mlp(x), F.linear(F.silu(gate) * up, mlp.down_proj.weight))
        fused = rows <= 4
        assert mlp.down_proj.choice.matmul.calls == ([(rows, f"f{1 if rows == 1 else 4}", "swiglu")] if fused else [])
        assert (rows in activations) == (not fused)


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT_ELEMENTS", 1)
    monkeypatch.setattr(small_gemm, "_MEASURED", {})
    monkeypatch.setattr(small_gemm, "_PADDED", {})
    monkeypatch.setattr(small_gemm, "FLUSH_BYTES", 8)
    return monkeypatch


def test_install_swaps_every_dense_linear_once_and_keeps_the_state_dict(patched, qwen3_target, moe_target):
    patched.setattr(small_gemm, "_measure", fake_measure(["c"] * len(ROW_BUCKETS)))
    for path in (qwen3_target, moe_target):
        model = load_target(str(path), get_backend("torch"), torch.float32, torch.device("cpu"),
                            moe_backend="VANILLA" if path == moe_target else None)
        model.fuse_projections()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ids = torch.tensor([3, 5, 7])
        report = small_gemm.install_small_gemms([model, model], torch.device("cpu"), torch.float32)  # twice: once
        swapped = [name for name, m in model.named_modules() if isinstance(m, SmallBatchLinear)]
        layer = model.model.layers[0]
        assert "lm_head" in swapped and {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"} \
            <= set(swapped)
        assert not any(".experts." in name or name.endswith(".gate") for name in swapped)  # MoE keeps its kernels
        assert model.state_dict().keys() == before.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert report.shapes and all(e["weights"] >= 1 for e in report.shapes.values())
        assert isinstance(layer.self_attn.qkv_proj, SmallBatchLinear)
        x = model.model.embed_tokens(ids)
        torch.testing.assert_close(layer.self_attn.qkv_proj(x), F.linear(x, layer.self_attn.qkv_proj.weight))


def test_install_leaves_cublas_shapes_alone_and_reports_them(patched, qwen3_target):
    patched.setattr(small_gemm, "_measure", fake_measure([None] * len(ROW_BUCKETS)))
    model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    model.fuse_projections()
    report = small_gemm.install_small_gemms([model], torch.device("cpu"), torch.float32)
    assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert all(set(r["chosen"] for r in e["rows"].values()) == {"None"} for e in report.shapes.values())


def test_tensor_parallel_linears_take_the_choice_as_an_attribute(patched):
    patched.setattr(small_gemm, "_measure", fake_measure(["c"] * len(ROW_BUCKETS)))
    row = RowParallelLinear(nn.Linear(32, 24, bias=False), ParallelContext(0, 1, None))
    holder = nn.Module()
    holder.proj = row
    small_gemm.install_small_gemms([holder], torch.device("cpu"), torch.float32)
    assert holder.proj is row and row.small_gemm is not None
    with torch.no_grad():
        row.weight.normal_()
    x = torch.randn(2, 32)
    torch.testing.assert_close(row(x), F.linear(x, row.weight))
    assert row.small_gemm.matmul.calls == [(2, "c")]
    gate_up = torch.randn(2, 64)  # no activation measured for it: the activation kernel, then the same GEMM
    act = get_backend("torch").silu_and_mul
    torch.testing.assert_close(row.swiglu_forward(gate_up, act), row(act(gate_up)))


def test_graph_row_counts_that_measured_faster_padded_compute_on_zero_rows_and_keep_their_own():
    """448 rows computed on 512 (``padded_rows``): the same product, the input's shape kept, the pad really taken;
    rows not listed (and few-row buckets) as before."""
    choice = GemmChoice((None,) * len(ROW_BUCKETS), padded_rows={448: 512})
    assert choice.used and not GemmChoice((None,) * len(ROW_BUCKETS)).used
    w = torch.randn(24, 32)
    padded = []
    real = F.pad
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(small_gemm.F, "pad", lambda x, pad: padded.append((x.shape[0], pad)) or real(x, pad))
        for shape in ((448, 32), (64, 7, 32), (384, 32), (8, 32)):
            x = torch.randn(*shape)
            out = linear(x, w, None, choice)
            assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, w))
    assert padded == [(448, (0, 0, 0, 64))] * 2  # 448 rows, flat or [64, 7]; 384 and 8 rows unpadded


def test_padding_is_tried_past_one_tile_at_row_counts_off_the_tile():
    assert small_gemm.pad_candidates([8, 64, 120, 128, 144, 192, 256, 320, 448, 512, 1344, 2048]) == \
        [144, 192, 320, 448, 1344]


def test_install_pads_the_rows_measured_faster_even_where_no_skinny_gemm_won(patched, qwen3_target):
    asked = []

    def measure_padding(weights, flush, rows):
        asked.append((tuple(weights[0].shape), rows))
        return {448: 512}, {str(r): {"chosen": "padded_to_512" if r == 448 else "cublas"} for r in rows}

    patched.setattr(small_gemm, "_measure", fake_measure([None] * len(ROW_BUCKETS)))
    patched.setattr(small_gemm, "_measure_padding", measure_padding)
    model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    model.fuse_projections()
    report = small_gemm.install_small_gemms([model], torch.device("cpu"), torch.float32, rows={64, 448, 512, 100})
    assert asked and all(rows == [448] for _, rows in asked)  # only the off-tile count past one tile
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, SmallBatchLinear) and qkv.choice.padded_rows == {448: 512}
    assert all(e["rows"]["448"]["chosen"] == "padded_to_512" for e in report.shapes.values())
    x = torch.randn(448, qkv.in_features)
    torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight))
    asked.clear()
    again = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    again.fuse_projections()  # another engine in the process: its rows measured once, what it adds measured then
    small_gemm.install_small_gemms([again], torch.device("cpu"), torch.float32, rows={448, 320})
    assert asked and all(rows == [320] for _, rows in asked)
    assert again.model.layers[0].self_attn.qkv_proj.choice.padded_rows == {448: 512}
    asked.clear()
    bare = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    bare.fuse_projections()
    small_gemm.install_small_gemms([bare], torch.device("cpu"), torch.float32)  # no graph rows: nothing padded
    assert asked == [] and not any(isinstance(m, SmallBatchLinear) for m in bare.modules())


KERNEL_CHECK = """
import torch
from runtime.kernels.skinny_gemm import CANDIDATES, skinny_matmul
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-2)):
    for n, k in ((48, 512), (40, 1024)):
        w = torch.randn(n, k, dtype=dtype)
        for m in (1, 5, 16):
            x = torch.randn(m, k, dtype=dtype)
            want = x.float() @ w.float().T
            for config in CANDIDATES:
                if config.fits(n, k):
                    got = skinny_matmul(x, w, config)
                    assert got.dtype == dtype and got.shape == (m, n)
                    assert (got.float() - want).abs().max() < tol * k ** 0.5, (config, m)
                    assert torch.equal(skinny_matmul(x[:1].clone(), w, config)[0], got[0])  # rows independent
from runtime.kernels import triton_ops
for dtype in (torch.float32, torch.float16):
    n, k = 48, 512
    w = torch.randn(n, k, dtype=dtype)
    for m in (1, 5, 16):
        gate_up = torch.randn(m, 2 * k, dtype=dtype)
        for config in CANDIDATES:
            if config.fits(n, k):
                fused = skinny_matmul(gate_up, w, config, swiglu=True)
                separate = skinny_matmul(triton_ops.silu_and_mul(gate_up), w, config)
                assert torch.equal(fused, separate), (config, m, dtype)  # bit for bit: the same operand
from runtime.kernels.skinny_gemm import SkinnyConfig, skinny_norm_matmul
for dtype in (torch.float32, torch.float16):
    n, k = 48, 512
    w, norm_w = torch.randn(n, k, dtype=dtype), torch.rand(k, dtype=dtype) + 0.5
    for m in (1, 5, 17):  # 17: two blocks of rows
        h, residual = torch.randn(m, k, dtype=dtype), torch.randn(m, k, dtype=dtype)
        for config in CANDIDATES[:2] + (SkinnyConfig(16, 128, 2, 4, 2),):
            out, summed = skinny_norm_matmul(h, residual, norm_w, 1e-6, w, config)
            normed, want_summed = triton_ops.add_rms_norm(h, residual, norm_w, 1e-6)
            assert torch.equal(summed, want_summed), (config, m, dtype)
            assert torch.equal(out, skinny_matmul(normed, w, config)), (config, m, dtype)
            out, summed = skinny_norm_matmul(h, None, norm_w, 1e-6, w, config)
            assert summed is None and torch.equal(out, skinny_matmul(triton_ops.rms_norm(h, norm_w, 1e-6), w, config))
print("kernel ok")
"""


def test_the_triton_kernel_under_the_interpreter():
    """Every candidate config against a float32 product, and a row's result independent of the rows beside it."""
    run_interpreted(KERNEL_CHECK, "kernel ok")


def test_kernels_launch_with_pdl_only_on_hopper_and_later():
    """``runtime.kernels.pdl``: no programmatic dependent launch off CUDA (the interpreter, CPU tensors)."""
    pytest.importorskip("triton")
    from runtime.kernels import pdl

    x = torch.zeros(2)
    assert not pdl.supported(x.device) and pdl.launch_options(x) == {"PDL": False}


def test_the_projections_after_a_norm_take_it_into_their_gemm_where_measured_faster(patched, qwen3_target):
    """The fused q/k/v and gate/up projections are measured with the residual add and RMSNorm before them fused in
    (no other shape is); where that won (here 1-4 rows) the decoder layer hands them the un-normed stream and no
    norm kernel runs for them, the first layer's plain norm included; a whole forward equals the unfused model's,
    its captured hidden states too."""
    from tests.runtime.test_target_parity import run_paged

    seen = []
    patched.setattr(small_gemm, "_measure", fake_measure([None] * len(ROW_BUCKETS), seen=seen,
                                                         norm_picks=["n1", "n2", "n4", None, None]))
    plain = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    plain.fuse_projections()
    plain.set_capture([-1, 0, 1])
    fused = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    fused.fuse_projections()
    fused.set_capture([-1, 0, 1])
    small_gemm.install_small_gemms([fused], torch.device("cpu"), torch.float32)
    layer = fused.model.layers[0]
    normed_shapes = {entry[0] for entry in seen if entry[-1] == "norm"}
    assert normed_shapes == {tuple(layer.self_attn.qkv_proj.weight.shape), tuple(layer.mlp.gate_up_proj.weight.shape)}
    qkv_calls = layer.self_attn.qkv_proj.choice.norm_matmul.calls
    gate_up_calls = layer.mlp.gate_up_proj.choice.norm_matmul.calls
    layers = len(fused.model.layers)
    for prompts in ([[5, 17, 33]], [[5, 17, 33, 2, 90, 41, 7], [100, 3]]):  # 3 rows: fused; 9 rows: separate
        qkv_calls.clear()
        gate_up_calls.clear()
        want, want_captured, _ = run_paged(plain, prompts)
        got, got_captured, _ = run_paged(fused, prompts)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_captured, want_captured)
        rows = sum(map(len, prompts))
        if rows <= 4:  # the first layer's input norm has no residual to add
            assert qkv_calls == [(rows, "n4", i > 0) for i in range(layers)]
            assert gate_up_calls == [(rows, "n4", True)] * layers
        else:
            assert qkv_calls == gate_up_calls == []
