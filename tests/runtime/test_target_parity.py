"""Our qwen3 / llama targets match transformers' logits (fp32, CPU), through the paged cache."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.kernels import PagedAttentionMeta, get_backend
from runtime.models.loader import CheckpointError, load_target
from runtime.scheduling.kv_cache import allocate_caches
from tests import builders


def run_paged(model, prompts, page_size=4):
    """Prefill every prompt in one batch, pages allocated in scrambled order."""
    caches = allocate_caches(model.model.layers, 64, page_size, torch.float32, torch.device("cpu"))
    pages = iter(torch.randperm(64).tolist())
    lens = [len(p) for p in prompts]
    tables = [[next(pages) for _ in range(-(-n // page_size))] for n in lens]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = torch.cat([torch.arange(n) for n in lens])
    req = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lens))
    slots = table[req, positions // page_size] * page_size + positions % page_size
    qsl = torch.tensor([0] + lens).cumsum(0)
    meta = PagedAttentionMeta(qsl, torch.tensor(lens), table, max(lens), max(lens), causal=True,
                              num_tokens=sum(lens), page_size=page_size)
    hidden, captured = model(torch.tensor(sum(prompts, [])), positions, caches, meta, slots)
    return model.compute_logits(hidden), captured, qsl


@pytest.mark.parametrize("fixture", ["qwen3_target", "llama_target"])
def test_logits_and_captures_match_transformers(request, fixture):
    path = request.getfixturevalue(fixture)
    ours = load_target(str(path), get_backend("torch"), torch.float32, torch.device("cpu"))
    ours.set_capture([-1, 0, 2])
    hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    prompts = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51))]
    logits, captured, qsl = run_paged(ours, prompts)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        rows = slice(qsl[i].item(), qsl[i + 1].item())
        torch.testing.assert_close(logits[rows], out.logits[0], atol=2e-5, rtol=1e-4)
        expected = torch.cat([out.hidden_states[0][0], out.hidden_states[1][0], out.hidden_states[3][0]], dim=-1)
        torch.testing.assert_close(captured[rows], expected, atol=2e-5, rtol=1e-4)


def test_llama3_rope_scaling_matches(checkpoints):
    path = builders.save_target(checkpoints / "llama-rope", "llama", seed=5, tokenizer=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})
    ours = load_target(str(path), get_backend("torch"), torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    prompt = list(range(3, 80))
    logits, _, _ = run_paged(ours, [prompt])
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0], atol=2e-5, rtol=1e-4)


def test_sharded_checkpoint_loads(checkpoints, qwen3_target):
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_target))
    sharded = checkpoints / "qwen3-sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_target(str(sharded), get_backend("torch"), torch.float32, torch.device("cpu"))
    b = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_capture_refuses_the_last_layer(qwen3_target):
    model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="last layer 3"):
        model.set_capture([0, 3])
    with pytest.raises(ValueError, match="out of range"):
        model.set_capture([-2, 1])


def test_unsupported_family_is_named(checkpoints):
    import json

    path = checkpoints / "gpt2ish"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 1}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load_target(str(path), get_backend("torch"), torch.float32, torch.device("cpu"))


def test_cached_rope_tables_give_the_computed_rows_and_the_same_logits(checkpoints):
    """``RotaryEmbedding.cache`` (serving on a GPU: the worker gathers RoPE rows from tables instead of computing
    them each forward): the rows are bit for bit the computed ones, for plain and scaled RoPE, and a forward with
    them gives the same logits; a forward in another dtype than the tables' computes its rows as before."""
    path = builders.save_target(checkpoints / "llama-rope-cached", "llama", seed=5, tokenizer=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})
    ours = load_target(str(path), get_backend("torch"), torch.float32, torch.device("cpu"))
    prompt = list(range(3, 80))
    computed, _, _ = run_paged(ours, [prompt])
    positions = torch.tensor([0, 1, 79, 31, 32, 500])
    want = ours.rotary(positions, torch.float32)
    ours.rotary.cache(512, torch.device("cpu"), torch.float32)
    got = ours.rotary(positions, torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].is_contiguous() and got[1].is_contiguous()  # as the rope kernels read them
    cached, _, _ = run_paged(ours, [prompt])
    assert torch.equal(cached, computed)
    other = ours.rotary(positions, torch.bfloat16)  # not the tables' dtype: computed
    assert torch.equal(other[0], ours.rotary._compute(positions, torch.bfloat16)[0])
