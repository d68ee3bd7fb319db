"""One request's fault fails that request alone: the others in the step keep exactly their outputs.

Faults are injected inside a step: a target whose embedding row of one token is NaN (every request that
feeds that token gets non-finite logits, on the device, mid-batch), and a host-side error while one
request's tokens are committed. Parameter bounds are checked at admission.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.engine.core import Engine
from runtime.sampling.stops import StopCriteria
from runtime.scheduling.pages import page_key

POISON = 7  # the token whose embedding is NaN in the poisoned target
CLEAN = [[5, 9, 11, 13], [20, 21, 22, 23, 24, 25], [40, 41, 42]]
POISONED = [3, 4, POISON, 6]


@pytest.fixture(scope="module")
def poisoned_target(checkpoints, qwen3_target):
    path = checkpoints / "poisoned-qwen3"
    if not path.exists():
        shutil.copytree(qwen3_target, path)
        weights = load_file(str(path / "model.safetensors"))
        weights["model.embed_tokens.weight"][POISON] = float("nan")
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def make_llm(target, drafter=None, **kwargs):
    spec = {"speculative_model": str(drafter)} if drafter is not None else None
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu", num_pages=48, page_size=4,
               **kwargs)


def outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_with_non_finite_logits_fails_alone(poisoned_target, make_drafter, speculative, temperature):
    drafter = make_drafter(poisoned_target, 3) if speculative else None
    llm = make_llm(poisoned_target, drafter)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    expected = outputs(llm, CLEAN, params)
    outs = llm.generate([CLEAN[0], POISONED, CLEAN[1], CLEAN[2]], params)
    bad = outs[1]
    assert bad.finish_reason == "error" and "non-finite" in bad.error and bad.token_ids == []
    assert [(o.token_ids, o.finish_reason) for o in (outs[0], outs[2], outs[3])] == expected
    assert llm.engine.pages.num_used == 0 and not llm.engine.sequences
    # its full page (NaN keys at the poisoned position) left the prefix cache: nobody starts from it
    assert llm.engine.pages.match([page_key(None, POISONED)]) == []
    # the faulted request's pages were scrubbed: requests that reuse them (the allocator hands out the most
    # recently freed pages first) decode exactly as before
    assert outputs(llm, CLEAN, params) == expected


def test_faulted_pages_are_scrubbed_before_reuse(poisoned_target, monkeypatch):
    """The scrub is what protects the next user of the pages: without it, masked-out NaN slots poison attention.

    The poisoned request fills pages a (positions 0-3) and b (4-5); the next short request gets a and b and
    writes only slot 0 of b, and batched with a longer one its attention spans b's stale, masked slots."""
    llm = make_llm(poisoned_target)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = [[5, 9, 11, 13, 15], list(range(100, 112))]
    expected = outputs(llm, batch, params)
    poisoned = [[3, 4, POISON, 6, 8, 10]]
    assert llm.generate(poisoned, params)[0].finish_reason == "error"
    assert outputs(llm, batch, params) == expected
    monkeypatch.setattr("runtime.worker.runner.scrub_pages", lambda *args: None)
    assert llm.generate(poisoned, params)[0].finish_reason == "error"
    assert outputs(llm, batch, params) != expected


def test_a_host_side_fault_while_committing_fails_that_request_alone(qwen3_target, make_drafter, monkeypatch):
    llm = make_llm(qwen3_target, make_drafter(qwen3_target, 3))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = outputs(llm, CLEAN, params)
    engine: Engine = llm.engine
    cut = StopCriteria.cut  # the stop check of requests without stop strings

    def failing_cut(self, seq, tokens):
        if seq.request_id == "faulty" and len(seq.output_token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected tokenizer fault")
        return cut(self, seq, tokens)

    monkeypatch.setattr(StopCriteria, "cut", failing_cut)
    ids = [engine.add_request(p, params) for p in CLEAN[:2]]
    engine.add_request([50, 51, 52], params, request_id="faulty")
    ids.append(engine.add_request(CLEAN[2], params))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["faulty"].finish_reason == "error" and "injected tokenizer fault" in finished["faulty"].error
    assert [(finished[i].token_ids, finished[i].finish_reason) for i in ids] == expected
    assert engine.pages.num_used == 0


@pytest.mark.parametrize("field,value", [("top_k", 10**20), ("max_tokens", 10**20), ("max_tokens", True),
                                         ("temperature", float("inf")), ("temperature", 10**400),
                                         ("top_p", float("nan")), ("repetition_penalty", 1e-45),
                                         ("stop", ("",)), ("stop", ("x\ud800y",)), ("stop_token_ids", (2**40,)),
                                         ("seed", 1.5)])
def test_out_of_bounds_parameters_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_a_huge_top_k_keeps_every_token(qwen3_target):
    llm = make_llm(qwen3_target)
    unbounded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert outputs(llm, CLEAN, SamplingParams(max_tokens=8, temperature=1.0, top_k=2**31 - 1, seed=5,
                                              ignore_eos=True)) == outputs(llm, CLEAN, unbounded)


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-6])
def test_tiny_temperatures_decode_greedily(qwen3_target, make_drafter, temperature):
    llm = make_llm(qwen3_target, make_drafter(qwen3_target, 3))
    greedy = outputs(llm, CLEAN, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tiny = outputs(llm, CLEAN, SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True))
    assert tiny == greedy and all(len(tokens) == 12 for tokens, _ in tiny)
    assert torch.tensor(greedy[0][0]).unique().numel() > 1  # real tokens, not a degenerate row


def test_a_fault_in_a_plain_greedy_decode_step_fails_that_request_alone(qwen3_target, monkeypatch):
    """Plain greedy decoding reads back one verdict a request (its argmax, or -1 for a broken row): a row whose max
    logit turns NaN mid-decode fails its request with what it had committed; the others decode on unchanged."""
    from runtime.models.target import TargetModel

    llm = make_llm(qwen3_target)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = outputs(llm, CLEAN, params)
    real, calls = TargetModel.compute_top_argmax, []

    def broken_on_the_fourth_step(self, hidden):
        top, argmax = real(self, hidden)
        calls.append(top.shape[0])
        if len(calls) == 4:  # step 1 prefilled the three, steps 2-4 decode them: break the second's row
            top = top.clone()
            top[1] = float("nan")
        return top, argmax

    monkeypatch.setattr(TargetModel, "compute_top_argmax", broken_on_the_fourth_step)
    outs = llm.generate(CLEAN, params)
    assert calls[:4] == [3, 3, 3, 3]
    assert outs[1].finish_reason == "error" and "non-finite" in outs[1].error
    assert outs[1].token_ids == expected[1][0][:3]  # what it committed before the broken step
    assert [(o.token_ids, o.finish_reason) for o in (outs[0], outs[2])] == [expected[0], expected[2]]
    assert llm.engine.pages.num_used == 0 and not llm.engine.sequences


def test_greedy_verdicts_mark_every_broken_row():
    from runtime.sampling.verify import greedy_verdicts

    top = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -3.0])
    argmax = torch.tensor([4, 5, 6, 7, 8])
    assert greedy_verdicts(top, argmax).tolist() == [4, -1, -1, -1, 8]


def test_a_fault_has_every_rank_zero_the_graphs_scratch_page_next_step(poisoned_target):
    """A faulted request's padding rows may have written NaN into the graphs' scratch page (the page past the
    allocator's) on every tensor-parallel rank, so the fault is not the leader's alone to clean: the next step's
    batch, which every rank applies first, names the scratch page beside the request's own pages."""
    llm = make_llm(poisoned_target)
    batches = []
    execute = llm.engine.executor.execute

    def recorded(batch):
        batches.append(batch)
        return execute(batch)

    llm.engine.executor.execute = recorded
    outs = llm.generate([CLEAN[0], POISONED], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert outs[1].finish_reason == "error"
    scratch = llm.engine.pages.num_pages
    scrubbed = [i for i, b in enumerate(batches) if scratch in b.scrub_page_ids]
    assert scrubbed == [1]  # the step right after the fault (the prefill step), once
