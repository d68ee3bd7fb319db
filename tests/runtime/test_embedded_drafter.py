"""The embedded flavour: a target checkpoint that carries its drafter under ``mtp.<s>.*`` is probed, loaded under
the standalone drafter's module names, drafts, and keeps greedy outputs equal to transformers; a rolling window
limits the context the block sees."""

import pytest
import torch

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from tests import builders

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51))]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)


@pytest.fixture(scope="module")
def standalone(near_bigram_target, make_drafter):
    """A 2-layer standalone drafter of the near-bigram target."""
    return make_drafter(near_bigram_target, 3, num_hidden_layers=2, layer_types=("full_attention",) * 2)


def run(target, drafter, **spec):
    llm = LLM(str(target), speculative_config=DSparkDecodingConfig(speculative_model=str(drafter),
                                                                   **{"speculation_guard": False, **spec}), **ENGINE)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_the_embedded_copy_of_a_drafter_drafts_exactly_as_the_standalone_one(tmp_path, near_bigram_target, standalone):
    """Same weights, a window longer than any context: identical drafts, so identical outputs and counters."""
    embedded = builders.save_embedded_target(tmp_path / "embedded", near_bigram_target, standalone, window=512)
    spec = DSparkDecodingConfig(speculative_model=str(embedded))
    assert spec.draft_is_embedded_in_target and spec.max_draft_len == 3 and spec.target_layer_ids == [0, 2]
    alone, alone_out = run(near_bigram_target, standalone)
    inside, inside_out = run(embedded, embedded)  # speculative_model is the target itself
    assert inside_out == alone_out == builders.hf_greedy(near_bigram_target, PROMPTS, 16)
    assert inside.get_metrics() == alone.get_metrics() and inside.get_metrics()["num_drafts"] > 0
    assert [i["draft_flavour"] for i in (inside.rank_info()[0], alone.rank_info()[0])] == ["embedded", "standalone"]
    drafter = inside.engine.executor.worker.drafter
    assert drafter.spec.embedded and drafter.spec.context_window == 512 and len(drafter.layers) == 2


def test_a_short_window_changes_the_drafts_not_the_output(tmp_path, near_bigram_target, standalone):
    embedded = builders.save_embedded_target(tmp_path / "windowed", near_bigram_target, standalone, window=2)
    llm, out = run(embedded, embedded)
    assert out == builders.hf_greedy(near_bigram_target, PROMPTS, 16)
    assert llm.engine.executor.worker.drafter.spec.context_window == 2
    full = builders.save_embedded_target(tmp_path / "default", near_bigram_target, standalone)  # window 128
    wide, wide_out = run(full, full)
    assert wide.engine.executor.worker.drafter.spec.context_window == 128 and wide_out == out
    assert wide.get_metrics()["num_accepted_tokens_per_pos"] != llm.get_metrics()["num_accepted_tokens_per_pos"]


def test_an_moe_target_drafts_with_its_own_moe_blocks(tmp_path, moe_target, make_drafter):
    """Stage 0 is the target's layer-0 MoE block; its experts run on the inherited backend, or the spec's."""
    drafter = make_drafter(moe_target, 4)
    embedded = builders.save_embedded_target(tmp_path / "moe", moe_target, drafter, stage_layers={0: 0})
    for spec, backend in (({}, "DENSEGEMM"), ({"moe_backend": "VANILLA"}, "VANILLA")):
        llm, out = run(embedded, embedded, **spec)
        assert out == builders.hf_greedy(moe_target, PROMPTS, 16)
        info = llm.rank_info()[0]
        assert (info["moe_backend"], info["draft_moe_backend"]) == ("DENSEGEMM", backend)
        assert type(llm.engine.executor.worker.drafter.layers[0].mlp).__name__ == "SparseMoeBlock"
        assert llm.get_metrics()["num_drafts"] > 0


def test_missing_stages_and_a_bad_window_are_named(tmp_path, near_bigram_target, standalone):
    import json

    from runtime.models.loader import CheckpointError

    embedded = builders.save_embedded_target(tmp_path / "bad", near_bigram_target, standalone)
    config = json.loads((embedded / "config.json").read_text())
    (embedded / "config.json").write_text(json.dumps({**config, "dspark_window_size": 0}))
    with pytest.raises(CheckpointError, match="dspark_window_size must be a positive integer, got 0"):
        run(embedded, embedded)
    (embedded / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(embedded / "model.safetensors")).items() if not k.startswith("mtp.0.")}
    save_file(tensors, str(embedded / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"embedded stages \[1\] are not 0..1"):
        run(embedded, embedded)


def test_the_window_masks_all_but_the_last_context_keys():
    from runtime.kernels import PagedAttentionMeta, torch_ref

    torch.manual_seed(0)
    page, ctx, block, heads, dim = 4, 11, 3, 2, 8
    k_cache, v_cache = torch.randn(8, page, heads, dim), torch.randn(8, page, heads, dim)
    table = torch.tensor([[5, 2, 7, 0]])
    q, xk, xv = torch.randn(block, heads, dim), torch.randn(1, block, heads, dim), torch.randn(1, block, heads, dim)

    def attend(window):
        meta = PagedAttentionMeta(torch.tensor([0, block]), torch.tensor([ctx]), table, block, 16, causal=False,
                                  num_tokens=block, page_size=page, num_extra_keys=block, context_window=window)
        return torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), 0.3, xk, xv)

    # the last 4 context keys
    slots = torch.tensor([int(table[0, p // page]) * page + p % page for p in range(ctx - 4, ctx)])
    keys = torch.cat([k_cache.view(-1, heads, dim)[slots], xk[0]])  # [4 + block, H, D]
    values = torch.cat([v_cache.view(-1, heads, dim)[slots], xv[0]])
    weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) * 0.3, dim=-1)
    torch.testing.assert_close(attend(4), torch.einsum("hqk,khd->qhd", weights, values))
    torch.testing.assert_close(attend(ctx), attend(None))
