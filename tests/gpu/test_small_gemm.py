"""The Triton skinny GEMM against cuBLAS, its measured installation, and engines whose every linear runs it:
graphed steps equal eager steps and a request decodes alone as in a batch. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.models import small_gemm
from tests import builders
from tests.gpu.test_flashinfer import ENGINE, PROMPTS  # the flashinfer engine tests' prompts and settings

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

DEV = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1000, 512)])
def test_every_candidate_matches_cublas(n, k):
    from runtime.kernels.skinny_gemm import CANDIDATES, skinny_matmul

    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k ** 0.5
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        want = F.linear(x.float(), w.float())
        for config in CANDIDATES:
            if not config.fits(n, k):
                continue
            got = skinny_matmul(x, w, config)
            err = (got.float() - want).norm() / want.norm()
            assert err < 1e-2, (config, m, float(err))
            assert torch.equal(skinny_matmul(x, w, config), got)  # deterministic
            assert torch.equal(skinny_matmul(x[:1].contiguous(), w, config)[0], got[0])  # rows independent


@pytest.mark.parametrize("n,k", [(4096, 12288), (1024, 4096)])
def test_the_fused_activation_equals_the_activation_kernel_then_the_gemm(n, k):
    """The down projection's fused SiLU-and-mul reads gate/up and rounds the activation as the separate kernel
    stores it: bit for bit the separate kernel followed by the same config."""
    from runtime.kernels import triton_ops
    from runtime.kernels.skinny_gemm import CANDIDATES, skinny_matmul

    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k ** 0.5
    for m in (1, 3, 8, 16):
        gate_up = torch.randn(m, 2 * k, device=DEV, dtype=BF16)
        for config in CANDIDATES:
            if config.fits(n, k):
                fused = skinny_matmul(gate_up, w, config, swiglu=True)
                assert torch.equal(fused, skinny_matmul(triton_ops.silu_and_mul(gate_up), w, config)), (config, m)


@pytest.mark.parametrize("n,k", [(6144, 4096), (24576, 4096)])  # the Qwen3-8B shape's q/k/v and gate/up
def test_the_fused_norm_equals_the_norm_kernel_then_the_gemm(n, k):
    """The q/k/v and gate/up projections' fused residual add and RMSNorm round as the separate kernel stores them,
    each row's statistics reduced whole as that kernel reduces them: the same summed stream and the same product
    as the norm kernel followed by the same config (bit for bit: the interpreter's check, here on the device)."""
    from runtime.kernels import triton_ops
    from runtime.kernels.skinny_gemm import CANDIDATES, skinny_matmul, skinny_norm_matmul

    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k ** 0.5
    norm_w = torch.rand(k, device=DEV, dtype=BF16) + 0.5
    for m in (1, 3, 8, 16):
        h, residual = (torch.randn(m, k, device=DEV, dtype=BF16) for _ in range(2))
        normed, summed = triton_ops.add_rms_norm(h, residual, norm_w, 1e-6)
        plain = triton_ops.rms_norm(h, norm_w, 1e-6)
        for config in CANDIDATES:
            if config.fits(n, k):
                out, fused_sum = skinny_norm_matmul(h, residual, norm_w, 1e-6, w, config)
                assert torch.equal(fused_sum, summed), (config, m)
                assert torch.equal(out, skinny_matmul(normed, w, config)), (config, m)
                out, _ = skinny_norm_matmul(h, None, norm_w, 1e-6, w, config)
                assert torch.equal(out, skinny_matmul(plain, w, config)), (config, m)


@pytest.fixture(scope="module")
def mid_target(checkpoints):
    """Linears large enough for the dispatch (gate_up 8192 x 1024), head_dim 128, bf16."""
    return builders.save_target(checkpoints / "mid-qwen3", "qwen3", seed=5, residual_scale=0.6, hidden_size=1024,
                                intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=128)


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_the_measurement_is_reported_in_rank_info(mid_target):
    llm = LLM(str(mid_target), **ENGINE)
    gemms = llm.rank_info()[0]["small_gemms"]
    assert gemms["calibration_s"] >= 0 and "8192x1024" in gemms["shapes"]
    rows = gemms["shapes"]["8192x1024"]["rows"]
    from bench import local_worker

    padded = small_gemm.pad_candidates(local_worker(llm).graph_gemm_rows())  # the graphs' off-tile row counts
    assert padded and set(rows) == {str(r) for r in (*small_gemm.ROW_BUCKETS, *padded)}
    assert all(r["cublas_us"] > 0 and r["chosen"] for r in rows.values())
    for count in padded:
        to = -(-count // small_gemm.PAD_ROWS_TO) * small_gemm.PAD_ROWS_TO
        entry = rows[str(count)]
        assert entry[f"padded_to_{to}_us"] > 0 and entry["chosen"] in ("cublas", f"padded_to_{to}")

    def few(shape):  # the skinny GEMM's row buckets
        return {k: v for k, v in gemms["shapes"][shape]["rows"].items() if int(k) <= small_gemm.ROW_BUCKETS[-1]}

    rows, down = few("8192x1024"), few("1024x4096")  # down: the MLP's down projection, the fused activation too
    assert all(r["swiglu_separate_us"] > 0 and r["swiglu_chosen"] for r in down.values())
    assert "swiglu_chosen" not in rows["1"]
    assert all(r["norm_separate_us"] > 0 and r["norm_chosen"] for r in rows.values())  # gate/up reads a norm


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Every linear of the model on one skinny GEMM config at every row count, whatever it measures (the q/k/v and
    gate/up projections with the norm before them fused in): a row's result is then the same at any M, so a padded
    graph, the eager step and a request alone all compute the same rows, and token equality checks the graphs'
    plumbing with the Triton kernels inside."""
    from runtime.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "CANDIDATES", (skinny_gemm.SkinnyConfig(16, 256, 1, 4, 4),))
    monkeypatch.setattr(small_gemm.GemmChoice, "for_rows",
                        lambda self, rows: self.configs[0] if self.matmul is not None and rows > 0 else None)
    monkeypatch.setattr(small_gemm.GemmChoice, "norm_for_rows",  # and the q/k/v, gate/up norm fused at any M
                        lambda self, rows: self.norm_configs[0] if self.norm_matmul is not None and rows > 0
                        else None)
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(small_gemm, "MARGIN", 1e9)
    monkeypatch.setattr(small_gemm, "_MEASURED", {})
    monkeypatch.setattr(small_gemm, "_PADDED", {})


@pytest.mark.parametrize("speculative", [False, True])
def test_graphed_steps_on_the_skinny_gemm_equal_eager_steps(triton_everywhere, mid_target, make_drafter, speculative):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(mid_target, 4))) if speculative else None
    runs = {}
    for eager in (False, True):
        llm = LLM(str(mid_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        linears = [m for m in llm.engine.executor.worker.target.modules() if isinstance(m, small_gemm.SmallBatchLinear)]
        assert linears and any(m.choice.norm_matmul is not None for m in linears)  # the fused norm is in the graphs
        runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        if not eager:
            alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
            assert alone == runs[False]
    assert runs[False] == runs[True]
