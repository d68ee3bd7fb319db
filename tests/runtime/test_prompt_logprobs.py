"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's field): for every prompt token after the first, the
target's raw log-probability of it given the tokens before it, and the N most likely tokens', equal (fp32, 1e-4) to
transformers' log-softmax of the same rows, however the prompt is computed: chunked, beside decodes, with a
drafter, with its prefix in the cache (computed again: the cache holds no logits), after a preemption."""

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.worker import prompt_logprobs as prompt_logprobs_module

ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [9, 10], [11, 12, 13, 14, 15, 16, 17], [3]]


def reference(target, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the rows that predict the prompt's tokens 1.. : [len(prompt) - 1, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(target, prompt: list[int], entries, top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for token, row, entry in zip(prompt[1:], reference(target, prompt), entries[1:]):
        assert entry.token_id == token and entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(top).indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(row.topk(top).values.tolist(), abs=1e-4)
        # its place in the distribution (vLLM's rank): one more than the tokens more likely; a token within the
        # two computations' 1e-4 of it may fall on either side
        above = int((row > row[token] + 1e-4).sum())
        near = int(((row - row[token]).abs() <= 1e-4).sum())  # itself and any near-tie
        assert above + 1 <= entry.rank <= above + near


@pytest.mark.parametrize("drafted", [False, True])
def test_prompt_logprobs_are_the_models_log_softmax_in_chunks_and_beside_decodes(near_bigram_target, make_drafter,
                                                                                  drafted, monkeypatch):
    spec = {"speculative_model": str(make_drafter(near_bigram_target, 3, "vanilla", oracle=True))} if drafted \
        else None
    # chunks of at most 5 tokens: the long prompts are computed over several steps, beside the others' decodes
    llm = LLM(str(near_bigram_target), speculative_config=spec, max_num_batched_tokens=5, **ENGINE)
    if drafted:  # rows computed in slices of 3 (a long chunk's logits are never all in memory at once)
        monkeypatch.setattr(prompt_logprobs_module, "PROMPT_LOGPROB_ROWS", 3)
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        check(near_bigram_target, prompt, out.prompt_logprobs, 3)
        assert out.logprobs is None  # generated tokens' logprobs are a separate request
    plain = LLM(str(near_bigram_target), **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # asking for them changes no token
    assert plain[0].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_and_a_preempted_request_records_each_row_once(near_bigram_target):
    llm = LLM(str(near_bigram_target), enable_prefix_caching=True, **ENGINE)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    llm.generate([PROMPTS[0]], greedy)  # its pages are now in the prefix cache
    assert llm.generate([PROMPTS[0]], greedy)[0].prompt_logprobs is None
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert hits > 0  # (a plain request does start from the cached pages)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1))[0]
    check(near_bigram_target, PROMPTS[0], out.prompt_logprobs, 1)
    assert llm.get_metrics()["prefix_cache_hits"] == hits
    # too few pages for the batch: requests are preempted and recomputed, each prompt row still recorded once
    small = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=14, page_size=4,
                max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = [PROMPTS[0], PROMPTS[2], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    outs = small.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=2))
    assert small.get_metrics()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        check(near_bigram_target, prompt, out.prompt_logprobs, 2)


def test_delta_outputs_carry_the_prompt_logprobs_once_and_bad_values_are_refused(near_bigram_target):
    llm = LLM(str(near_bigram_target), **ENGINE)
    engine = llm.engine
    request = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                            prompt_logprobs=0, output_kind="delta"))
    outs = []
    while request in engine.sequences:
        outs.extend(o for o in engine.step() if o.request_id == request)
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outs[0]
    check(near_bigram_target, PROMPTS[0], carrying[0].prompt_logprobs, 0)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None or an integer in 0..20"):
        SamplingParams(prompt_logprobs=21)


def test_a_prompt_row_that_is_not_finite_fails_its_request_alone(near_bigram_target, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    shutil.copytree(near_bigram_target, poisoned)
    weights = load_file(str(poisoned / "model.safetensors"))
    weights["model.embed_tokens.weight"][7] = float("nan")
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(poisoned), max_num_batched_tokens=4, **ENGINE)  # the NaN row's chunk is not the last one
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    broken, fine = llm.generate([[5, 7, 8, 9, 10, 11, 12], PROMPTS[1]], params)
    assert broken.finish_reason == "error" and "non-finite" in broken.error and broken.prompt_logprobs is None
    check(near_bigram_target, PROMPTS[1], fine.prompt_logprobs, 1)
