"""``StopCriteria.cut`` (a step's tokens at once) gives what appending them one by one with ``check`` gives."""

import random

import pytest

from runtime import LLM
from runtime.sampling.sampling_params import SamplingParams
from runtime.sampling.stops import StopCriteria
from runtime.scheduling.sequence import Sequence


def one_by_one(stops: StopCriteria, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
    appended = []
    for token in tokens:
        seq.output_token_ids.append(token)
        appended.append(token)
        reason = stops.check(seq)
        if reason is not None:
            break
    else:
        reason = None
    del seq.output_token_ids[len(seq.output_token_ids) - len(appended):]
    return len(appended), reason


def test_cut_equals_checking_each_token():
    rng = random.Random(0)
    for _ in range(3000):
        eos = frozenset(rng.sample(range(12), rng.randint(0, 2)))
        stops = StopCriteria(eos, None, max_model_len=rng.randint(20, 40))
        max_tokens = rng.randint(1, 20)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                                stop_token_ids=tuple(rng.sample(range(12), rng.randint(0, 2))),
                                min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]))
        prompt = [rng.randrange(12) for _ in range(rng.randint(1, 15))]
        seq = Sequence("r", prompt, params, 0, arrival=0)
        room = min(params.max_tokens, stops.max_model_len - len(prompt)) - 1  # a running request has room left
        if room < 0:
            continue
        seq.output_token_ids = [rng.randrange(12, 20) for _ in range(rng.randint(0, room))]  # no stop so far
        tokens = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
        assert stops.cut(seq, tokens) == one_by_one(stops, seq, tokens), (prompt, seq.output_token_ids, tokens)


def test_min_tokens_holds_off_the_stop_tokens_with_and_without_a_drafter(near_bigram_target, make_drafter):
    """vLLM's ``min_tokens``: until that many tokens are out the stop tokens are never drawn (greedy picks the next
    best, sampling renormalizes without them) and nothing stops the output; after, they stop it as usual. A drafter
    changes no token (its drafts of a banned token are rejected)."""
    engine = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    plain = LLM(str(near_bigram_target), **engine)
    free = plain.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_ids = tuple(sorted({o.token_ids[1] for o in free}))  # each output's second token stops it early
    early = plain.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   stop_token_ids=stop_ids))
    assert all(len(o.token_ids) <= 2 and o.finish_reason == "stop" for o in early)
    held = SamplingParams(max_tokens=12, min_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=stop_ids)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter)}, **engine)
    outs = plain.generate(prompts, held)
    assert [o.token_ids for o in spark.generate(prompts, held)] == [o.token_ids for o in outs]
    for out in outs:
        assert len(out.token_ids) >= 8 and not set(out.token_ids[:7]) & set(stop_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] in stop_ids else "length")
    sampled = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=5, ignore_eos=True,
                             stop_token_ids=stop_ids)
    for rejection in (False, True):
        llm = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter),
                                                               "use_rejection_sampling": rejection}, **engine)
        assert all(len(o.token_ids) == 8 and not set(o.token_ids) & set(stop_ids)
                   for o in llm.generate(prompts * 4, sampled))
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens must be an integer in 0..max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_stop_string_counts_only_where_it_ends_past_the_min_tokens_hold(near_bigram_target):
    """With ``min_tokens`` N a stop string ends the output only where it ends past the text of the first N - 1
    tokens: one complete before does not end it (``check``) and does not cut its text (``text``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(near_bigram_target))
    stops = StopCriteria(frozenset(), tokenizer, max_model_len=100)
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "abXcdXe"]  # single-byte tokens
    for min_tokens, stopped_at, text in ((0, 3, "ab"), (3, 3, "ab"), (4, 6, "abXcd"), (7, None, "abXcdXe")):
        params = SamplingParams(max_tokens=20, min_tokens=min_tokens, stop=("X",))
        seq = Sequence("r", [5], params, 0, arrival=0)
        first = None
        for i, token in enumerate(ids):
            seq.output_token_ids.append(token)
            if first is None and stops.check(seq) is not None:
                first = i + 1
        assert first == stopped_at and stops.text(seq) == text, min_tokens


def test_the_stop_string_and_special_tokens_stay_in_the_text_when_asked(near_bigram_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(near_bigram_target))
    stops = StopCriteria(frozenset(), tokenizer, max_model_len=100)
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "ab"] + [tokenizer.eos_token_id] + \
        [tokenizer.convert_tokens_to_ids(c) for c in "cXd"]
    for include, skip, text in ((False, True, "abc"), (True, True, "abcX"), (True, False, "ab<eos>cX"),
                                (False, False, "ab<eos>c")):
        params = SamplingParams(max_tokens=20, stop=("X",), include_stop_str_in_output=include,
                                skip_special_tokens=skip, ignore_eos=True)
        seq = Sequence("r", [5], params, 0, arrival=0)
        seq.output_token_ids = list(ids)
        assert stops.text(seq) == text, (include, skip)
    with pytest.raises(ValueError, match="SamplingParams.skip_special_tokens must be a boolean"):
        SamplingParams(skip_special_tokens=1)
