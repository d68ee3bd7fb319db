"""qwen3_moe targets: routing and experts equal transformers (fp32, CPU) on every backend that runs here, greedy
outputs (with and without DSpark) equal transformers, and backend resolution names what cannot run."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.kernels import get_backend
from runtime.kernels.moe import experts_grouped_gemm, experts_vanilla, tile_pairs_by_expert
from runtime.models.loader import load_target
from runtime.models.moe import SparseMoeBlock, sparse_layer_ids
from runtime.worker.devices import resolve_moe_backend
from tests import builders
from tests.runtime.test_target_parity import run_paged

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51))]


def test_sparse_layers_follow_the_config(moe_target):
    model = load_target(str(moe_target), get_backend("torch"), torch.float32, CPU, moe_backend="VANILLA")
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock", "SparseMoeBlock"] and model.has_moe_layers
    config = builders.target_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert sparse_layer_ids(config) == [1, 5]
    assert sparse_layer_ids(builders.target_config("qwen3")) == []


@pytest.mark.parametrize("backend", ["VANILLA", "DENSEGEMM"])
def test_logits_match_transformers(moe_target, backend):
    ours = load_target(str(moe_target), get_backend("torch"), torch.float32, CPU, moe_backend=backend)
    ours.fuse_projections()
    hf = AutoModelForCausalLM.from_pretrained(str(moe_target)).float().eval()
    logits, _, qsl = run_paged(ours, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[qsl[i]:qsl[i + 1]], want, atol=2e-5, rtol=1e-4)


def test_the_experts_matter_and_the_backends_agree_on_every_routing():
    """Both expert kernels against a per-pair computation, on a random routing with an expert nobody chose."""
    torch.manual_seed(0)
    tokens, hidden, inter, experts, k = 37, 24, 16, 6, 3
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden) / 5, torch.randn(experts, hidden, inter) / 4
    chosen = torch.tensor([0, 1, 2, 3, 5])  # expert 4 is chosen by nobody
    ids = torch.stack([chosen[torch.randperm(len(chosen))[:k]] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(experts_vanilla(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_grouped_gemm(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_routing_normalizes_the_top_k_only_when_asked():
    config = builders.target_config("qwen3_moe")
    x = torch.randn(5, config.hidden_size)
    for norm in (True, False):
        config.norm_topk_prob = norm
        block = SparseMoeBlock(config, "VANILLA")
        weights, ids = block.route(x)
        probs = torch.softmax(block.gate(x), dim=-1)
        assert torch.equal(ids, probs.topk(2, dim=-1).indices)
        total = weights.sum(dim=-1)
        assert torch.allclose(total, torch.ones(5)) if norm else bool((total < 1).all())


@pytest.mark.parametrize("backend", ["VANILLA", "DENSEGEMM", "AUTO"])
@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_outputs_equal_transformers(moe_target, make_drafter, backend, speculative):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(moe_target, 4))) if speculative else None
    llm = LLM(str(moe_target), speculative_config=spec, moe_backend=backend, dtype="float32", device="cpu",
              num_pages=128, page_size=4)
    info = llm.rank_info()[0]
    assert info["moe_backend"] == ("DENSEGEMM" if backend == "AUTO" else backend)
    assert info["draft_moe_backend"] == ("none" if speculative else None)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == builders.hf_greedy(moe_target, PROMPTS, 12)
    if speculative:
        assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("backend,reason", [
    ("TRITON", "needs a CUDA device"), ("CUTLASS", "needs a CUDA device"), ("TRTLLM", "Blackwell"),
    ("DEEPGEMM", "FP8"), ("MARLIN", "int4"), ("CUTEDSL", "NVFP4"), ("MEGAMOE_DEEPGEMM", "MegaMoE")])
def test_a_backend_this_rank_cannot_run_is_an_error_naming_rank_backend_and_reason(moe_target, backend, reason):
    with pytest.raises(ValueError, match=rf"moe_backend='{backend}' cannot run on target rank 0 \(cpu\): .*{reason}"):
        LLM(str(moe_target), moe_backend=backend, dtype="float32", device="cpu", num_pages=64, page_size=4)


def test_resolution_by_device_and_dtype():
    assert resolve_moe_backend("AUTO", CPU, torch.float32, True, "moe_backend", "rank 0") == "DENSEGEMM"
    assert resolve_moe_backend(None, CPU, torch.float32, False, "moe_backend", "rank 0") == "none"
    with pytest.raises(ValueError, match="no MoE layers"):
        resolve_moe_backend("VANILLA", CPU, torch.float32, False, "speculative_config.moe_backend", "rank 0")


def test_a_draft_moe_backend_for_a_dense_drafter_is_refused(moe_target, make_drafter):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(moe_target, 4)), moe_backend="VANILLA")
    with pytest.raises(ValueError, match="speculative_config.moe_backend='VANILLA': the model has no MoE layers"):
        LLM(str(moe_target), speculative_config=spec, dtype="float32", device="cpu", num_pages=64, page_size=4)


@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 8, 128, 16), (3, 2, 4, 16), (64, 8, 16, 16),
                                                      (40, 4, 8, 64), (5, 1, 1, 4)])
def test_tiles_group_every_pair_by_expert(tokens, k, experts, block_m):
    """The TRITON backend's layout: every pair once, each expert's pairs in whole tiles of its own, in token order,
    padding marked by the sentinel, unused tiles marked E; sized by the shapes alone."""
    gen = torch.Generator().manual_seed(tokens * 7 + k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])  # [T, k] distinct per row
    tiles = tile_pairs_by_expert(ids, experts, block_m)
    n = tokens * k
    assert tiles.tile_expert.numel() == -(-n // block_m) + min(n, experts)
    pairs = tiles.pairs.view(-1, block_m)
    real = tiles.pairs[tiles.pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (tiles.pairs[tiles.pairs >= n] == n).all()
    flat = ids.reshape(-1)
    for tile, expert in zip(pairs, tiles.tile_expert.tolist()):
        members = tile[tile < n]
        if expert == experts:
            assert members.numel() == 0
            continue
        assert (flat[members.long()] == expert).all() and members.numel() > 0
        assert members.tolist() == sorted(members.tolist())
    used = tiles.tile_expert[tiles.tile_expert < experts].tolist()
    assert used == sorted(used)  # an expert's tiles are consecutive
    expected_tiles = sum(-(-int((flat == e).sum()) // block_m) for e in range(experts))
    assert len(used) == expected_tiles
