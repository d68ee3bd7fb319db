"""Stops inside accepted blocks, runtime knobs, penalties, seeds and string prompts."""

import json
import shutil

import pytest

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from tests import builders

PROMPT = [7, 8, 9]


def make_llm(target, drafter=None, **kwargs):
    spec = DSparkDecodingConfig(speculative_model=str(drafter), **kwargs.pop("spec", {})) if drafter else None
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu",
               **{"num_pages": 256, "page_size": 4, **kwargs})


@pytest.fixture(scope="module")
def oracle(bigram_target, make_drafter):
    return make_drafter(bigram_target, 5, "vanilla", oracle=True)


@pytest.fixture(scope="module")
def reference(bigram_target):
    return builders.hf_greedy(bigram_target, [PROMPT], 30)[0]


def first_new_index(tokens, start):
    """An index >= start whose token does not occur earlier (so a stop on it fires there first)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# ---- stops --------------------------------------------------------------------------------------

def test_each_output_carries_its_requests_draft_counts(near_bigram_target, make_drafter):
    """Per request: drafts verified and accepted so far; over a batch they add up to the engine's metrics."""
    llm = make_llm(near_bigram_target, make_drafter(near_bigram_target, 3, "vanilla", oracle=True))
    outs = llm.generate([PROMPT, [3, 4], [11, 12, 13, 14]], SamplingParams(max_tokens=20, temperature=0))
    m = llm.get_metrics()
    assert sum(o.num_draft_tokens for o in outs) == m["num_draft_tokens"] > 0
    assert sum(o.num_accepted_tokens for o in outs) == m["num_accepted_tokens"] > 0
    assert all(0 <= o.num_accepted_tokens <= o.num_draft_tokens for o in outs)
    plain = make_llm(near_bigram_target).generate([PROMPT], SamplingParams(max_tokens=5, temperature=0))[0]
    assert (plain.num_draft_tokens, plain.num_accepted_tokens) == (0, 0)


def test_stop_token_inside_an_accepted_block(bigram_target, oracle, reference):
    i = first_new_index(reference, 3)  # the first block commits tokens 1..6 after the prefill token 0
    assert i <= 5, "fixture: pick a target whose greedy output repeats less"
    llm = make_llm(bigram_target, oracle)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[reference[i]]))[0]
    assert out.token_ids == reference[:i + 1] and out.finish_reason == "stop"
    m = llm.get_metrics()
    assert m["num_drafts"] == 1 and m["num_draft_tokens"] == i and m["num_accepted_tokens"] == i


def test_eos_inside_an_accepted_block_matches_transformers(checkpoints, bigram_target, oracle, reference):
    i = first_new_index(reference, 4)
    eos_target = checkpoints / "bigram-eos"
    shutil.copytree(bigram_target, eos_target, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((eos_target / name).read_text())
        data["eos_token_id"] = reference[i]
        (eos_target / name).write_text(json.dumps(data))
    out = make_llm(eos_target, oracle).generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == builders.hf_greedy(eos_target, [PROMPT], 30)[0] == reference[:i + 1]
    assert out.finish_reason == "stop"
    ignored = make_llm(eos_target, oracle).generate([PROMPT], SamplingParams(max_tokens=30, temperature=0,
                                                                            ignore_eos=True))[0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


def test_stop_string_inside_an_accepted_block(bigram_target, oracle, reference):
    llm = make_llm(bigram_target, oracle)
    tok = llm.tokenizer
    i = next(i for i in range(3, 30) if (s := tok.decode([reference[i]]).strip())
             and s not in tok.decode(reference[:i]))
    stop = tok.decode([reference[i]]).strip()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert out.token_ids == reference[:i + 1] and out.finish_reason == "stop"
    full = tok.decode(reference[:i + 1])
    assert out.text == full[:full.index(stop)] and stop not in out.text


def test_max_tokens_and_max_model_len_cut_with_length(bigram_target, oracle, reference):
    out = make_llm(bigram_target, oracle).generate([PROMPT], SamplingParams(max_tokens=9, temperature=0))[0]
    assert out.token_ids == reference[:9] and out.finish_reason == "length"
    short = make_llm(bigram_target, oracle, max_model_len=12)
    out = short.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == reference[:12 - len(PROMPT)] and out.finish_reason == "length"


# ---- runtime knobs ------------------------------------------------------------------------------

def drafts_per_step(llm):
    m = llm.get_metrics()
    return m["num_draft_tokens"] / m["num_drafts"] if m["num_drafts"] else 0.0


@pytest.mark.parametrize("num_prompts,expected", [(1, 5.0), (2, 5.0), (3, 2.0), (4, 2.0), (5, 0.0)])
def test_draft_len_schedule_follows_the_batch_size(bigram_target, oracle, num_prompts, expected):
    llm = make_llm(bigram_target, oracle, spec={"draft_len_schedule": {2: 5, 4: 2}})
    prompts = [PROMPT] * num_prompts
    params = SamplingParams(max_tokens=1 + 6 * 4, temperature=0, ignore_eos=True)  # no cut by max_tokens
    outs = llm.generate(prompts, params)
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    assert drafts_per_step(llm) == expected


@pytest.mark.parametrize("num_prompts,speculates", [(2, True), (3, False)])
def test_max_concurrency_turns_speculation_off_above_it(bigram_target, oracle, num_prompts, speculates):
    llm = make_llm(bigram_target, oracle, spec={"max_concurrency": 2})
    llm.generate([PROMPT] * num_prompts, SamplingParams(max_tokens=12, temperature=0))
    assert (llm.get_metrics()["num_drafts"] > 0) is speculates


def test_acceptance_gate_disables_speculation_for_good(near_bigram_target, make_drafter):
    random_drafter = make_drafter(near_bigram_target, 4, "vanilla", seed=7)
    prompts = [[5, 17, 33], [9, 8]]
    reference = builders.hf_greedy(near_bigram_target, prompts, 24)
    gated = make_llm(near_bigram_target, random_drafter,
                     spec={"acceptance_rate_window_size": 3, "acceptance_rate_threshold": 0.9})
    outs = gated.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    m = gated.get_metrics()
    assert m["speculation_disabled"] and m["num_drafts"] == 2 * 3  # 3 speculating steps of 2 requests
    gated.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert gated.get_metrics()["num_drafts"] == 6  # never reopens
    open_gate = make_llm(near_bigram_target, random_drafter,
                         spec={"acceptance_rate_window_size": 3, "acceptance_rate_threshold": 0.0})
    open_gate.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert not open_gate.get_metrics()["speculation_disabled"]


# ---- penalties ----------------------------------------------------------------------------------

def test_penalties_are_rejected_unless_enabled(bigram_target, oracle):
    llm = make_llm(bigram_target, oracle)
    for field in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.3}):
        with pytest.raises(ValueError, match="enable_penalty"):
            llm.generate([PROMPT], SamplingParams(max_tokens=4, **field))
    assert not llm.engine.has_unfinished()


def test_repetition_penalty_greedy_matches_transformers(near_bigram_target, make_drafter):
    from transformers import AutoModelForCausalLM
    import torch

    drafter = make_drafter(near_bigram_target, 4, "vanilla", oracle=True)
    llm = make_llm(near_bigram_target, drafter, spec={"enable_penalty": True})
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.8,
                                                ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(near_bigram_target)).float()
    ids = torch.tensor([PROMPT])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           repetition_penalty=1.8, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.token_ids == expected
    assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("rejection", [False, True])
def test_presence_and_frequency_penalties_match_plain_decoding(near_bigram_target, make_drafter, rejection):
    params = [SamplingParams(max_tokens=16, temperature=t, seed=s, presence_penalty=0.8, frequency_penalty=0.6,
                             repetition_penalty=1.3, ignore_eos=True) for s, t in ((1, 0.0), (2, 0.0), (3, 1.0))]
    prompts = [PROMPT, [40, 41], [100, 3, 5, 9]]
    plain = make_llm(near_bigram_target).generate(prompts, params)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    spec = make_llm(near_bigram_target, drafter, spec={"enable_penalty": True, "use_rejection_sampling": rejection})
    outs = spec.generate(prompts, params)
    greedy_or_exact = range(3) if not rejection else range(2)
    assert [outs[i].token_ids for i in greedy_or_exact] == [plain[i].token_ids for i in greedy_or_exact]


# ---- sampling modes and seeds -------------------------------------------------------------------

def test_advanced_sampling_mode_rejects_disabled_filters(bigram_target, oracle):
    llm = make_llm(bigram_target, oracle, spec={"advanced_sampling_mode": "NO_TOPK_NO_TOPP"})
    with pytest.raises(ValueError, match="top_k"):
        llm.generate([PROMPT], SamplingParams(top_k=5))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([PROMPT], SamplingParams(top_p=0.5))
    with pytest.raises(ValueError, match="min_p"):
        llm.generate([PROMPT], SamplingParams(min_p=0.1))
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_seeded_rejection_sampling_is_reproducible_whatever_else_is_in_the_batch(near_bigram_target, make_drafter):
    drafter = make_drafter(near_bigram_target, 3, "gated", oracle=True)
    llm = make_llm(near_bigram_target, drafter, spec={"use_rejection_sampling": True})
    mine = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], mine)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.7, seed=n, ignore_eos=True) for n in (5, 30, 11)]
    crowd = llm.generate([[1, 2, 3, 4], PROMPT, [50] * 9, [60, 61]], [others[0], mine, others[1], others[2]])
    assert crowd[1].token_ids == alone
    reseeded = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert reseeded[0].token_ids != alone


def test_mixed_greedy_and_sampled_batch_keeps_greedy_exact(near_bigram_target, make_drafter):
    prompts = [PROMPT, [40, 41, 42]]
    reference = builders.hf_greedy(near_bigram_target, prompts, 16)
    llm = make_llm(near_bigram_target, make_drafter(near_bigram_target, 3, "rnn", oracle=True),
                   spec={"use_rejection_sampling": True})
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 2
    sampled = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    outs = llm.generate(prompts + prompts * 2, params + sampled)
    assert [outs[0].token_ids, outs[1].token_ids] == reference


def test_string_prompts_and_text(qwen3_target, make_drafter):
    llm = make_llm(qwen3_target, make_drafter(qwen3_target, 2))
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer("def add(a, b):")["input_ids"]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


# ---- output kinds -------------------------------------------------------------------------------


def outputs_by_step(llm, prompts, params) -> dict[str, list]:
    """Every output engine.step() returns, per request, in order."""
    engine, seen = llm.engine, {}
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return {i: seen[i] for i in ids}


def test_delta_outputs_concatenate_to_the_cumulative_ones(bigram_target, oracle):
    """output_kind (vLLM's RequestOutputKind): "delta" outputs hold each step's new tokens and logprobs, and
    concatenated they are the cumulative output; "final_only" gives one output, the finished one."""
    prompts = [PROMPT, [3, 4, 5, 6]]
    base = dict(max_tokens=17, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {kind: outputs_by_step(make_llm(bigram_target, oracle), prompts, SamplingParams(**base, output_kind=kind))
            for kind in ("cumulative", "delta", "final_only")}
    for rid, cumulative in runs["cumulative"].items():
        delta, final = runs["delta"][rid], runs["final_only"][rid]
        assert len(delta) == len(cumulative) > 1 and len(final) == 1 and final[0].finished
        assert [o.token_ids for o in delta] == [o.new_token_ids for o in cumulative]
        assert sum((o.token_ids for o in delta), []) == cumulative[-1].token_ids == final[0].token_ids
        assert sum((o.logprobs for o in delta), []) == cumulative[-1].logprobs == final[0].logprobs
        assert [o.text for o in delta[:-1]] == [""] * (len(delta) - 1)
        assert delta[-1].text == cumulative[-1].text == final[0].text
        # when the engine committed the request's first token (time.monotonic), the same in every output
        assert len({o.first_token_time for o in cumulative}) == 1 and final[0].first_token_time is not None


def test_output_kind_is_validated_and_generate_returns_whole_outputs(bigram_target):
    with pytest.raises(ValueError, match=r"SamplingParams.output_kind must be one of \['cumulative', 'delta', "
                                         r"'final_only'\], got 'partial'"):
        SamplingParams(output_kind="partial")
    llm = make_llm(bigram_target)
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))[0]
    for kind in ("delta", "final_only"):  # generate asks for the finished output whatever the params say
        out = llm.generate([PROMPT], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                                                    output_kind=kind))[0]
        assert out.token_ids == whole.token_ids and len(out.token_ids) == 9


def test_pages_are_allotted_a_token_ahead_only_where_every_target_rank_plans_ahead(tmp_path):
    """A graphed AR rank plans the next decode step's attention while the GPU runs this one, which needs the next
    key's page already allotted: the engine allots a token ahead for an executor (local or a Ray replica) whose
    target ranks all plan ahead, and not otherwise."""
    from benchmarks.engine_host import CannedExecutor, model_dir
    from configs import LLMConfig
    from runtime.engine.core import Engine
    from runtime.engine.executor import plans_ahead

    ranks = [{"role": "target", "plan_ahead": True}, {"role": "target", "plan_ahead": True}]
    assert plans_ahead(ranks) and plans_ahead([*ranks, {"role": "drafter", "plan_ahead": False}])
    assert not plans_ahead([ranks[0], {"role": "target", "plan_ahead": False}]) and not plans_ahead([])
    config = LLMConfig(model=str(model_dir(tmp_path)), num_pages=64, page_size=4, device="cpu", dtype="float32")
    lookahead = {}
    for ahead in (True, False):
        executor = CannedExecutor(config.num_pages, 0, 0)
        executor.plans_ahead = ahead
        engine = Engine(config, executor)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.step()  # prefill: 3 tokens in the first page
        engine.step()  # decode: its key fills the page; the next one's needs a second
        lookahead[ahead] = len(engine.scheduler.running[0].page_ids)
    assert lookahead == {True: 2, False: 1}


def test_prefill_apart_never_mixes_a_step_and_keeps_greedy_outputs(near_bigram_target, make_drafter):
    """``enable_mixed_prefill=False``: arrivals while others decode (and a prompt longer than the token budget, in
    chunks) are computed in prefill steps of their own, each followed by a decode step while requests decode;
    every step is one kind or the other, and greedy outputs are transformers' token for token."""
    drafter = make_drafter(near_bigram_target, 3)
    llm = make_llm(near_bigram_target, drafter, enable_mixed_prefill=False, max_num_seqs=4,
                   max_num_batched_tokens=16)
    engine, kinds, passed_over = llm.engine, [], []
    execute = engine.executor.execute

    def spy(batch):
        fed = {e.request_id for e in batch.requests}
        decoding = {engine.sequences[i].is_decoding for i in fed}
        kinds.append("decode" if decoding == {True} else "prefill" if decoding == {False} else "mixed")
        passed_over.append(any(s.is_decoding and s.request_id not in fed for s in engine.scheduler.running))
        return execute(batch)

    engine.executor.execute = spy
    prompts = [[5, 17, 33, 2, 90], [100, 3], list(range(20, 60)), [7] * 12, [9, 8, 7]]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids, outputs = [engine.add_request(prompts[0], greedy)], {}
    while engine.has_unfinished():
        if len(ids) < len(prompts) and len(kinds) % 3 == 2:  # an arrival every third step
            ids.append(engine.add_request(prompts[len(ids)], greedy))
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert "mixed" not in kinds and "decode" in kinds and kinds.count("prefill") >= 4  # the 40-token prompt: chunks
    # decoding requests wait out one prefill step at most
    assert not any(a == b == "prefill" and skipped for a, b, skipped in zip(kinds, kinds[1:], passed_over[1:]))
    assert any(passed_over)  # (some did wait one)
    assert [outputs[i] for i in ids] == builders.hf_greedy(near_bigram_target, prompts, 10)


def test_vllm_shaped_outputs_and_a_with_block_that_shuts_down(qwen3_target):
    """``outputs[0].text`` / ``.token_ids`` as vLLM's ``RequestOutput`` has them, beside the flat fields; ``with``
    shuts the engine down (what was in flight aborted) and ``shutdown()`` may be called again."""
    with make_llm(qwen3_target) as llm:
        out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        (sample,) = out.outputs
        assert (sample.index, sample.text, sample.token_ids, sample.finish_reason) == \
            (0, out.text, out.token_ids, "length")
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=50))
    assert not llm.engine.has_unfinished()
    llm.shutdown()


def test_constraints_that_leave_no_token_fail_the_request_as_the_clients_error(qwen3_target):
    """``allowed_token_ids`` [5] while ``min_tokens`` bans stop token 5: no token is left; the request fails alone
    with a message naming its constraints (not "non-finite logits"), the others finish."""
    llm = make_llm(qwen3_target)
    impossible = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=4)
    fine = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed, other = llm.generate([PROMPT, PROMPT], [impossible, fine])
    assert failed.finish_reason == "error" and failed.error_code == "unsatisfiable_constraints"
    assert "allowed_token_ids, min_tokens" in failed.error and "non-finite" not in failed.error
    assert other.finish_reason == "length" and len(other.token_ids) == 8
