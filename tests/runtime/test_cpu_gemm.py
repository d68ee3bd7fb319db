"""Few-row GEMMs on the CPU (``runtime.worker.cpu_gemm``): the transposed product is F.linear's, the measurement
chooses by time, the install keeps every parameter (a tied head too), and an engine whose linears all take the
transposed product decodes transformers' greedy tokens, with and without a drafter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime import LLM, SamplingParams
from runtime.worker import cpu_gemm
from runtime.worker.cpu_gemm import CpuGemmChoice, CpuLinear, install_cpu_gemms, transposed_linear
from tests import builders


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 16])
def test_the_transposed_product_is_f_linears(rows):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96), torch.randn(200, 96)
    out = transposed_linear(x, w)
    assert out.shape == (rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # a strided input (a view of a wider tensor) too
    wide = torch.randn(rows, 192)
    torch.testing.assert_close(transposed_linear(wide[:, ::2], w), F.linear(wide[:, ::2], w), rtol=1e-5, atol=1e-5)


def test_a_cpu_linear_takes_the_transposed_product_at_its_chosen_row_counts_only(monkeypatch):
    base = nn.Linear(64, 48, bias=False)
    linear = CpuLinear(base, CpuGemmChoice(frozenset({1, 7})))
    assert linear.weight is base.weight and list(linear.state_dict()) == ["weight"]
    taken = []
    monkeypatch.setattr(cpu_gemm, "transposed_linear", lambda x, w: (taken.append(x.shape[0]), F.linear(x, w))[1])
    for shape in [(1, 64), (1, 7, 64), (2, 64), (3, 3, 64)]:
        x = torch.randn(*shape)
        out = linear(x)
        assert out.shape == (*shape[:-1], 48)
        torch.testing.assert_close(out, F.linear(x, base.weight))
    assert taken == [1, 7]  # [2, 64] and [3, 3, 64] (9 rows) took F.linear


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.proj = nn.Linear(64, 1024, bias=False)
        self.small = nn.Linear(64, 64, bias=False)
        self.biased = nn.Linear(64, 1024)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight


def test_install_measures_each_large_shape_once_and_keeps_parameters_and_ties(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "MIN_WEIGHT_ELEMENTS", 1 << 15)
    monkeypatch.setattr(cpu_gemm, "MIN_GROUP_BYTES", 0)
    monkeypatch.setattr(cpu_gemm, "_MEASURED", {})
    measured = []

    def fake_measure(weights, flush):
        measured.append(tuple(weights[0].shape))
        return CpuGemmChoice(frozenset({1, 2})), {"1": {"chosen": "transposed"}, "2": {"chosen": "transposed"}}

    monkeypatch.setattr(cpu_gemm, "_measure", fake_measure)
    model = Tied()
    names = dict(model.named_parameters())
    report = install_cpu_gemms([model])
    assert sorted(measured) == [(512, 64), (1024, 64)]  # the biased one too (its rows take F.linear: a bias)
    assert isinstance(model.proj, CpuLinear) and isinstance(model.head, CpuLinear)
    assert type(model.small) is nn.Linear  # below MIN_WEIGHT_ELEMENTS
    assert model.head.weight is model.embed.weight and dict(model.named_parameters()).keys() == names.keys()
    assert set(report.as_dict()["shapes"]) == {"512x64", "1024x64"}
    x = torch.randn(2, 64)
    torch.testing.assert_close(model.biased(x), F.linear(x, model.biased.weight, model.biased.bias))
    install_cpu_gemms([Tied()])  # another model of the same shapes: measured once a process
    assert len(measured) == 2


def test_the_measurement_chooses_by_time(monkeypatch):
    """A fake clock where the transposed product takes half of F.linear's time at two rows and twice at the others:
    only two rows take it."""
    clock = {"now": 0.0}
    real_linear = F.linear

    def costing(cost):
        def product(x, w):
            clock["now"] += cost(x.shape[0])
            return real_linear(x, w)
        return product

    monkeypatch.setattr(cpu_gemm.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(cpu_gemm, "F", type("F", (), {"linear": staticmethod(costing(lambda rows: 1.0))}))
    monkeypatch.setattr(cpu_gemm, "transposed_linear", costing(lambda rows: 0.5 if rows == 2 else 2.0))
    choice, report = cpu_gemm._measure([torch.randn(32, 16)] * 3, torch.empty(8, dtype=torch.uint8))
    assert choice.transposed == frozenset({2})
    assert report["2"]["chosen"] == "transposed" and report["1"]["chosen"] == "linear"
    assert set(report) == {str(r) for r in cpu_gemm.ROWS}


@pytest.mark.parametrize("drafted", [False, True])
def test_an_engine_whose_linears_all_take_the_transposed_product_decodes_transformers_greedy_tokens(
        monkeypatch, near_bigram_target, make_drafter, drafted):
    monkeypatch.setattr(cpu_gemm, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(cpu_gemm, "MIN_GROUP_BYTES", 0)
    monkeypatch.setattr(cpu_gemm, "_MEASURED", {})
    monkeypatch.setattr(cpu_gemm, "_measure", lambda weights, flush: (CpuGemmChoice(frozenset(cpu_gemm.ROWS)), {}))
    spec = {"speculative_config": {"speculative_model": str(make_drafter(near_bigram_target, 4, oracle=True))}} \
        if drafted else {}
    llm = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=256, page_size=4, max_num_seqs=4,
              **spec)
    worker = llm.engine.executor.worker
    assert isinstance(worker.target.lm_head, CpuLinear) and worker.info()["cpu_gemms"]["shapes"]
    prompts = [[5, 17, 33, 2, 90], [100, 3], [7] * 6]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == builders.hf_greedy(near_bigram_target, prompts, 20)
    if drafted:
        assert llm.get_metrics()["mean_acceptance_length"] > 1.5  # the oracle's blocks, drafted through it too
