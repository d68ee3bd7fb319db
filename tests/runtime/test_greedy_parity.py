"""Greedy output with speculation equals transformers' greedy output, token for token (fp32, CPU)."""

import pytest

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from tests import builders

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [250, 251, 252, 253, 9]]
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_llm(target, drafter=None, **kwargs):
    spec = DSparkDecodingConfig(speculative_model=str(drafter), **kwargs.pop("spec", {})) if drafter else None
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu",
               **{"num_pages": 128, "page_size": 4, **kwargs})


@pytest.fixture(scope="module")
def hf_reference(near_bigram_target):
    return builders.hf_greedy(near_bigram_target, PROMPTS, MAX_TOKENS)


def test_plain_decoding_matches_transformers(near_bigram_target, hf_reference):
    outs = make_llm(near_bigram_target).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_reference


@pytest.mark.parametrize("block,head,rank,confidence,oracle", [
    (1, "vanilla", 16, False, False),
    (3, "vanilla", 16, True, True),
    (7, "vanilla", 16, False, True),
    (3, "gated", 16, True, False),
    (7, "gated", 16, False, True),
    (3, "rnn", 16, False, True),
    (7, "rnn", 16, True, False),
    (1, "vanilla", 0, False, False),
    (7, "vanilla", 0, False, False),
])
def test_speculative_greedy_matches_transformers(near_bigram_target, hf_reference, make_drafter,
                                                 block, head, rank, confidence, oracle):
    drafter = make_drafter(near_bigram_target, block, head, rank, confidence=confidence, oracle=oracle)
    llm = make_llm(near_bigram_target, drafter)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_reference
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] >= metrics["num_drafts"]
    if oracle:  # the drafter knows the bigram part: most drafts survive
        assert metrics["mean_acceptance_length"] > 1 + 0.5 * block


@pytest.mark.parametrize("threshold", [0.45, 0.55])
def test_confidence_truncation_keeps_parity_and_shortens_blocks(near_bigram_target, hf_reference, make_drafter,
                                                                threshold):
    drafter = make_drafter(near_bigram_target, 7, "vanilla", 16, confidence=True, oracle=True)
    full = make_llm(near_bigram_target, drafter)
    cut = make_llm(near_bigram_target, drafter, spec={"confidence_threshold": threshold})
    assert [o.token_ids for o in cut.generate(PROMPTS, GREEDY)] == hf_reference
    full.generate(PROMPTS, GREEDY)
    full_m, cut_m = full.get_metrics(), cut.get_metrics()
    assert cut_m["num_draft_tokens"] / max(cut_m["num_drafts"], 1) < full_m["num_draft_tokens"] / full_m["num_drafts"]


def test_forced_preemption_keeps_output(near_bigram_target, hf_reference, make_drafter):
    drafter = make_drafter(near_bigram_target, 3, "vanilla", 16, oracle=True)
    llm = make_llm(near_bigram_target, drafter, num_pages=14, page_size=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == hf_reference


def test_chunked_prefill_keeps_output(near_bigram_target, hf_reference, make_drafter):
    drafter = make_drafter(near_bigram_target, 3, "gated", 16)
    llm = make_llm(near_bigram_target, drafter, max_num_batched_tokens=9, max_num_seqs=2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_reference


def test_random_target_llama_with_speculation(llama_target, make_drafter):
    prompts = PROMPTS[:3]
    reference = builders.hf_greedy(llama_target, prompts, MAX_TOKENS)
    drafter = make_drafter(llama_target, 3, "rnn", 16)
    assert [o.token_ids for o in make_llm(llama_target, drafter).generate(prompts, GREEDY)] == reference


def test_oracle_drafter_is_accepted_at_every_position(bigram_target, make_drafter):
    """A pure bigram target and a drafter holding its table: every draft survives until max_tokens cuts."""
    block, max_tokens = 4, 23
    drafter = make_drafter(bigram_target, block, "vanilla", oracle=True)
    llm = make_llm(bigram_target, drafter)
    prompt = [7, 8, 9]
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == builders.hf_greedy(bigram_target, [prompt], max_tokens)[0]
    m = llm.get_metrics()
    # Prefill commits 1 token; blocks of 4 drafts commit 5 each (1 -> 21); the last block is cut to the 1 draft
    # that max_tokens leaves room for. Every proposed draft is accepted.
    assert m["num_drafts"] == 5 and m["num_draft_tokens"] == 17 and m["num_accepted_tokens"] == 17
    assert m["num_accepted_tokens_per_pos"] == [5, 4, 4, 4]


def test_oracle_acceptance_length_is_k_plus_one(bigram_target, make_drafter):
    block, max_tokens = 5, 1 + 6 * 6
    llm = make_llm(bigram_target, make_drafter(bigram_target, block, "gated", oracle=True),
                   spec={"speculation_guard": False})  # (every block verified: no plain step timed)
    llm.generate([[11, 12]], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    m = llm.get_metrics()
    assert m["mean_acceptance_length"] == block + 1
    assert m["num_accepted_tokens_per_pos"] == [6] * block
