"""``n`` samples of one prompt: n requests with their own seed streams that share the prompt's prefill."""

import pytest

from runtime import LLM, SamplingParams

PROMPT = list(range(40, 58))  # 18 tokens: four full pages of 4


def engine(target, drafter=None, **kw):
    spec = {"speculative_model": str(drafter)} if drafter is not None else None
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu",
               **{"num_pages": 128, "page_size": 4, **kw})


@pytest.mark.parametrize("speculative", [False, True])
def test_samples_are_seeded_streams_that_share_the_prefill(near_bigram_target, make_drafter, speculative):
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True) if speculative else None
    llm = engine(near_bigram_target, drafter)
    outs = llm.generate([PROMPT, [5, 6]], SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3))
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    alone = [engine(near_bigram_target, drafter, enable_prefix_caching=False).generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in outs[:3]] == alone  # sample i is the request seeded seed + i
    assert len({tuple(t) for t in alone}) > 1
    # the two later samples of PROMPT started from the first's pages: four pages (16 tokens) each
    assert llm.get_metrics()["prefix_cache_hits"] == 2 * 16


def test_greedy_samples_are_identical_and_n_is_bounded(near_bigram_target):
    outs = engine(near_bigram_target).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, n=4))
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) == 1
    with pytest.raises(ValueError, match="SamplingParams.n must be an integer in 1..128"):
        SamplingParams(n=129)
    llm = engine(near_bigram_target)
    with pytest.raises(ValueError, match="submit one request per sample"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))


def test_best_of_returns_the_most_likely_samples_best_first(near_bigram_target):
    llm = engine(near_bigram_target)
    params = SamplingParams(max_tokens=8, temperature=1.2, seed=21, n=2, best_of=5)
    outs = llm.generate([PROMPT, [5, 6]], params)
    assert [o.index for o in outs] == [0, 1, 0, 1] and all(o.logprobs is None for o in outs)
    for prompt, got in ((PROMPT, outs[:2]), ([5, 6], outs[2:])):
        drawn = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.2, seed=21 + i, logprobs=0))[0]
                 for i in range(5)]
        score = {tuple(o.token_ids): sum(e.logprob for e in o.logprobs) for o in drawn}
        best = sorted(score, key=lambda t: -score[t])[:2]
        assert [tuple(o.token_ids) for o in got] == best
    with pytest.raises(ValueError, match="best_of must be None or an integer in n..128"):
        SamplingParams(n=3, best_of=2)
