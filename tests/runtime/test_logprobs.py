"""Logprobs of generated tokens: equal with and without speculation (fp32, 1e-5), equal to transformers'
log-softmax of the same positions, raw by default and the sampled distribution in ``processed`` mode."""

import pytest
import torch

from runtime import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def run(target, drafter=None, params=None, **engine):
    spec = {"speculative_model": str(drafter)} if drafter is not None else None
    return LLM(str(target), speculative_config=spec, **{**ENGINE, **engine}).generate(PROMPTS, params)


def assert_same_logprobs(first, second, tol=1e-5):
    for a, b in zip(first, second):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=tol)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [lp for _, lp in x.top] == pytest.approx([lp for _, lp in y.top], abs=tol)


def model_logprobs(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the rows that predict ``tokens`` after ``prompt``: [len(tokens), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize("rejection", [False, True])
def test_speculation_gives_every_token_plain_decodings_logprobs(near_bigram_target, make_drafter, rejection):
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    plain = run(near_bigram_target, params=greedy)
    spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter),
                                                             "use_rejection_sampling": rejection}, **ENGINE)
    assert_same_logprobs(plain, spark.generate(PROMPTS, greedy))
    assert spark.get_metrics()["num_accepted_tokens"] > 0
    # sampled (rejection sampling draws other tokens than plain sampling): each committed token, accepted draft
    # or resampled, reports the target's log-probability of it after its own prefix
    sampled = spark.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=2))
    for prompt, out in zip(PROMPTS, sampled):
        rows = model_logprobs(near_bigram_target, prompt, out.token_ids)
        for row, entry in zip(rows, out.logprobs):
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


def test_raw_logprobs_are_the_models_log_softmax(qwen3_target):
    out = run(qwen3_target, params=SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    rows = model_logprobs(qwen3_target, PROMPTS[0], out.token_ids)
    for i, (row, entry) in enumerate(zip(rows, out.logprobs)):
        assert entry.token_id == out.token_ids[i] and entry.logprob == pytest.approx(row[entry.token_id].item(),
                                                                                     abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token ranks first


def test_processed_logprobs_are_the_distribution_sampled_from(near_bigram_target):
    params = SamplingParams(max_tokens=8, temperature=0.5, top_k=3, seed=1, logprobs=4)
    raw = run(near_bigram_target, params=params)
    processed = run(near_bigram_target, params=params, logprobs_mode="processed")
    for r, p in zip(raw, processed):
        assert r.token_ids == p.token_ids  # the mode changes what is reported, never what is sampled
        for x, y in zip(r.logprobs, p.logprobs):
            # raw log-probs differ by logit differences: processed = log_softmax over the top 3 of logits / 0.5
            top3 = torch.tensor([lp for _, lp in x.top[:3]]) / 0.5
            expected = dict(zip([t for t, _ in x.top[:3]], (top3 - torch.logsumexp(top3, 0)).tolist()))
            assert y.logprob == pytest.approx(expected[y.token_id], abs=1e-5)
            assert [t for t, _ in y.top[:3]] == [t for t, _ in x.top[:3]]
            assert y.top[3][1] == float("-inf")  # outside the top-3 filter: impossible


def test_without_logprobs_outputs_have_none_and_bad_values_are_refused(near_bigram_target):
    assert run(near_bigram_target, params=SamplingParams(max_tokens=3, temperature=0))[0].logprobs is None
    zero = run(near_bigram_target, params=SamplingParams(max_tokens=3, temperature=0, logprobs=0))[0]
    assert len(zero.logprobs) == 3 and all(e.top == () for e in zero.logprobs)
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be None or an integer in 0..20"):
        SamplingParams(logprobs=21)


def test_logit_bias_moves_greedy_and_sampled_tokens_with_and_without_a_drafter(near_bigram_target, make_drafter):
    """``logit_bias`` is added to the target's logits before anything else: -100 bans the greedy token everywhere, a
    bias of +100 forces a token even when sampling, and a drafter changes nothing (exact with and without)."""
    plain = run(near_bigram_target, params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    banned_tokens = sorted({t for o in plain for t in o.token_ids})[:3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                            logit_bias={t: -100.0 for t in banned_tokens}, logprobs=1)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    biased = run(near_bigram_target, params=params)
    assert all(t not in banned_tokens for o in biased for t in o.token_ids)
    assert [o.token_ids for o in run(near_bigram_target, drafter, params=params)] == [o.token_ids for o in biased]
    # raw logprobs (the default) are the model's, before the bias: the banned tokens keep their probability
    model = model_logprobs(near_bigram_target, PROMPTS[0], biased[0].token_ids)
    assert biased[0].logprobs[0].logprob == pytest.approx(model[0][biased[0].token_ids[0]].item(), abs=1e-4)
    forced = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True, logit_bias={42: 100})
    for rejection in (False, True):
        spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter),
                                                                 "use_rejection_sampling": rejection}, **ENGINE)
        assert all(o.token_ids == [42] * 5 for o in spark.generate(PROMPTS, forced))
    with pytest.raises(ValueError, match="SamplingParams.logit_bias must be a mapping"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in 0\.\.319"):
        LLM(str(near_bigram_target), **ENGINE).generate(PROMPTS[:1], SamplingParams(logit_bias={320: 1.0}))


def test_allowed_token_ids_limit_every_drawn_token_with_and_without_a_drafter(near_bigram_target, make_drafter):
    allowed = (40, 41, 42)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=2, ignore_eos=True,
                                allowed_token_ids=list(allowed))
        outs = run(near_bigram_target, params=params)
        assert all(set(o.token_ids) <= set(allowed) and len(o.token_ids) == 10 for o in outs)
        spark = run(near_bigram_target, drafter, params=params)
        if temperature == 0.0:
            assert [o.token_ids for o in spark] == [o.token_ids for o in outs]
        assert all(set(o.token_ids) <= set(allowed) for o in spark)
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids must be None or 1..1024 token ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in 0\.\.319"):
        run(near_bigram_target, params=SamplingParams(allowed_token_ids=[400]))
