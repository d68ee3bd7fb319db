"""vLLM's ``bad_words``: the token sequences a word makes, the rows whose context ends with all of one but its last
token ban that token, and the engine's output never contains them, with or without a drafter (exact greedy)."""

import pytest
from transformers import AutoTokenizer

from runtime import LLM, SamplingParams
from runtime.sampling.bad_words import row_bans, token_sequences

ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)


def test_each_row_bans_the_last_token_of_a_sequence_its_context_ends_with_the_rest_of():
    sequences = ((7,), (3, 4), (1, 2, 5))
    # row j's context: the output, then the first j drafts
    assert row_bans([9, 1], [2, 3], sequences, 3) == ((7,), (5, 7), (4, 7))
    assert row_bans([], [], sequences, 1) == ((7,),)  # a one-token word: banned at every row, the first too
    assert row_bans([3], [], ((3, 4), (1, 2, 5)), 1) == ((4,),)
    assert row_bans([9], [1, 1], ((3, 4), (1, 2, 5)), 3) is None  # nothing banned anywhere
    assert row_bans([], [1, 2], ((1, 2, 5),), 3) == ((), (), (5,))  # a prefix made of drafts alone


def test_a_word_is_banned_as_written_and_after_a_space(near_bigram_target):
    tokenizer = AutoTokenizer.from_pretrained(str(near_bigram_target))
    vocab = len(tokenizer)
    plain = tuple(tokenizer.encode("ab", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" ab", add_special_tokens=False))
    got = token_sequences(tokenizer, ("ab",), vocab)
    assert got[0] == plain
    assert (spaced in got) == (spaced[0] != plain[0] and len(spaced) == len(plain))  # vLLM's rule for the second
    assert token_sequences(tokenizer, ("ab", "ab"), vocab) == got  # each sequence once
    with pytest.raises(ValueError, match="SamplingParams.bad_words: 'ab' tokenizes to ids outside"):
        token_sequences(tokenizer, ("ab",), 1)
    for bad in ([""], ["  "], [3], ["x"] * 129):
        with pytest.raises(ValueError, match=r"SamplingParams.bad_words must be at most 128 strings"):
            SamplingParams(bad_words=bad)


def banned_pair(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """The first position i of ``tokens`` whose two tokens are what their text tokenizes to: (i, that text)."""
    for i in range(1, len(tokens) - 1):
        word = tokenizer.decode(tokens[i:i + 2])
        if word.strip() and tokenizer.encode(word, add_special_tokens=False) == tokens[i:i + 2]:
            return i, word
    raise AssertionError(f"no two tokens of {tokens} round-trip through the tokenizer")


def contains(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(sequence)]) == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_the_output_never_contains_a_bad_word_and_drafts_change_nothing(near_bigram_target, make_drafter):
    """A word made of two tokens the free greedy output has: with it banned the output is the same up to where the
    word would end, differs there, and never contains it; a drafter (exact-match verification, rejection sampling)
    gives the same greedy tokens, and sampled outputs never contain it either."""
    tokenizer = AutoTokenizer.from_pretrained(str(near_bigram_target))
    prompt = [5, 6, 7]
    plain = LLM(str(near_bigram_target), **ENGINE)
    free = plain.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    at, word = banned_pair(tokenizer, free)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
    held = plain.generate([prompt], params)[0].token_ids
    sequences = token_sequences(tokenizer, (word,), len(tokenizer))
    assert held[:at + 1] == free[:at + 1] and held[at + 1] != free[at + 1]
    assert not any(contains(held, s) for s in sequences)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    for rejection in (False, True):
        spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter),
                                                                 "use_rejection_sampling": rejection}, **ENGINE)
        assert spark.generate([prompt], params)[0].token_ids == held
        sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, bad_words=[word])
        for out in spark.generate([prompt] * 6, sampled):
            assert not any(contains(out.token_ids, s) for s in sequences)


def test_bad_words_need_the_models_tokenizer(checkpoints):
    from tests import builders

    bare = LLM(str(builders.save_target(checkpoints / "no-tokenizer", "qwen3", seed=4, tokenizer=False)), **ENGINE)
    with pytest.raises(ValueError, match="SamplingParams.bad_words needs a tokenizer; the model directory has none"):
        bare.generate([[5, 6]], SamplingParams(max_tokens=2, bad_words=["ab"]))
