"""Prefix caching: full KV pages keyed by their tokens and everything before them, shared by reference count,
evicted least recently used; outputs with a cache hit equal outputs without one (fp32, greedy and seeded), with
and without a drafter, across preemption."""

import pytest

from runtime import LLM, SamplingParams
from runtime.scheduling.pages import PageAllocator, page_key

PS = 4
SYSTEM = list(range(40, 58))  # 18 tokens: four full pages of 4 shared by every prompt below
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [9, 10], SYSTEM + [11, 12, 13, 14, 15]]


def engine(target, drafter=None, **kw):
    spec = {"speculative_model": str(drafter)} if drafter is not None else None
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu",
               **{"num_pages": 128, "page_size": PS, **kw})


def test_pages_are_shared_by_key_and_evicted_least_recently_used():
    pages = PageAllocator(4, PS, caching=True)
    first = []
    pages.grow(first, 8)
    keys = [page_key(None, [1, 2, 3, 4]), None]
    keys[1] = page_key(keys[0], [5, 6, 7, 8])
    for page, key in zip(first, keys):
        pages.register(page, key)
    assert pages.match(keys) == first and pages.match([page_key(None, [1, 2, 3, 5])]) == []
    second = pages.match(keys[:1])
    pages.take(second)  # a second holder: the page is shared, and only the first page
    assert pages.exclusive(first) == [first[1]] and pages.num_free == 2
    held = list(first)
    pages.release(first)
    assert pages.num_free == 3 and pages.num_cached == 2  # the released page stays cached, now evictable
    pages.release(second)
    assert pages.num_free == 4 and pages.match(keys) == held
    grabbed = []
    pages.grow(grabbed, 12)  # two free pages, then the least recently used cached one
    assert pages.num_free == 1 and pages.match(keys) == [held[0]]  # the tail page (released first) was evicted
    pages.forget([held[0]])
    assert pages.match(keys) == [] and pages.num_cached == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_cache_hits_change_no_output(near_bigram_target, make_drafter, speculative):
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True) if speculative else None
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    cold = engine(near_bigram_target, drafter, enable_prefix_caching=False)
    want = [cold.generate(PROMPTS, p) for p in (greedy, seeded)]
    assert cold.get_metrics()["prefix_cache_hits"] == 0
    warm = engine(near_bigram_target, drafter)
    first = [o.token_ids for o in warm.generate(PROMPTS[:1], greedy)]  # computes and registers the system prompt
    assert first == [want[0][0].token_ids]
    hits = warm.get_metrics()["prefix_cache_hits"]
    for params, expected in zip((greedy, seeded), want):
        assert [o.token_ids for o in warm.generate(PROMPTS, params)] == [o.token_ids for o in expected]
    m = warm.get_metrics()
    assert m["prefix_cache_hits"] - hits >= 2 * len(PROMPTS) * 16  # every prompt found the system prompt's pages
    assert m["prefix_cache_queries"] >= m["prefix_cache_hits"] and m["num_kv_pages_used"] == 0


def test_a_fully_cached_prompt_still_computes_its_last_token(near_bigram_target):
    llm = engine(near_bigram_target)
    prompt = SYSTEM[:16]  # exactly four pages
    params = SamplingParams(max_tokens=6, temperature=0)
    once = llm.generate([prompt], params)[0].token_ids
    before = llm.get_metrics()["prefix_cache_hits"]
    assert llm.generate([prompt], params)[0].token_ids == once
    assert llm.get_metrics()["prefix_cache_hits"] - before == 12  # three pages: the fourth holds the last token


def test_preempted_requests_resume_from_their_cached_pages_exactly(near_bigram_target, make_drafter):
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    want = engine(near_bigram_target, drafter, num_pages=256, enable_prefix_caching=False).generate(PROMPTS, params)
    tight = engine(near_bigram_target, drafter, num_pages=36)  # too few pages for three: preemption and eviction
    got = tight.generate(PROMPTS, params)
    assert tight.get_metrics()["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
