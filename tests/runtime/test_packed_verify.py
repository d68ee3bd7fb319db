"""Packed verification (``runtime.worker.packed_verify``): the device-side selection matches the host scheduler's, and a
packed verify of full blocks equals verifying each request's chosen drafts alone (fp32, the torch kernels)."""

import dataclasses

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.sampling.verify import accept_by_match
from runtime.scheduling.step_io import ScheduledRequest
from runtime.spec.confidence import ConfidenceScheduler
from runtime.spec.history import history_classes, next_history
from runtime.spec.packed_layout import top_drafts
from runtime.worker.packed_verify import (history_after, pack_index, packed_verify, select_lengths, survivals,
                                          verify_positions)
from runtime.worker.step_tensors import build_step_tensors, build_uniform_step_tensors
from tests.runtime.test_confidence_scheduling import flat_table


def falling_rows(rng, batch: int, k: int) -> np.ndarray:
    """[B, K] survivals, non-increasing along each row, with ties across rows and zeros (nothing proposed)."""
    rows = np.minimum.accumulate(rng.choice([0.0, 0.2, 0.5, 0.5, 0.7, 0.9], size=(batch, k)), axis=1)
    rows[rng.random(batch) < 0.2, -2:] = 0.0
    return rows


def packed_llm(tmp_path, target, make_drafter, packed_from: int | None = None) -> LLM:
    """A CPU engine (its steps eager) with confidence scheduling's packed layout forced (``packed_from``: the fewest
    requests it packs, as a graphed engine's packed graphs' smallest bucket; else every step), its drafter an oracle
    of K = 4, its steps priced by a table dear enough that about two columns of four pay."""
    from configs import DSparkDecodingConfig
    from tests.runtime.test_confidence_scheduling import ENGINE

    path = tmp_path / "table.json"
    flat_table(0.6).save(path)
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(target, 4, oracle=True)),
                                enable_confidence_scheduling=True, confidence_cost_table_path=str(path),
                                speculation_guard=False)
    llm = LLM(str(target), speculative_config=spec, **ENGINE)
    llm.engine.confidence.layout = "packed"
    if packed_from is not None:
        llm.engine.confidence.packed_from = packed_from
    return llm


def test_the_selection_is_the_host_schedulers_global_top_drafts():
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch, k = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        survival = falling_rows(rng, batch, k)
        for budget in range(batch * k + 1):
            lengths = select_lengths(torch.from_numpy(survival), budget)
            assert lengths.tolist() == top_drafts(survival, np.ones_like(survival, dtype=bool), budget).tolist()
            assert int(lengths.sum()) == budget


def test_survivals_match_the_schedulers_calibrated_and_corrected_ones():
    """The device's survivals are the host's: at the offline calibration (before any fit), and under a fit whose
    slope and per-class biases differ by position and verify-history class."""
    rng = np.random.default_rng(1)
    temperatures = [0.6, 1.0, 1.7, 3.0, 0.9]
    scheduler = ConfidenceScheduler(5, flat_table(0.001), temperatures)
    confidence = rng.uniform(0.01, 0.99, size=(6, 5))
    confidence[2, 3:] = 0.0  # a block cut short
    history = [0, 1, 7, 10, 6, 0]
    correction = scheduler.correction

    def on_device():
        return survivals(torch.from_numpy(confidence), torch.from_numpy(correction.slope),
                         torch.from_numpy(correction.bias), torch.tensor(history)).numpy()

    calibrated = scheduler.survival(confidence, history)
    assert on_device() == pytest.approx(calibrated, rel=1e-12, abs=1e-15)
    assert correction.slope.tolist() == pytest.approx([1 / t for t in temperatures])  # STS until evidence moves it
    correction.theta[:, 0] = [0.5, 1.2, 0.0, 2.0, 0.8]  # slopes
    correction.theta[:, 1] = [0.1, -0.3, 0.4, 0.0, 1.0]  # intercepts
    correction.theta[:, 2:] = rng.normal(0.0, 1.0, size=(5, 11))  # class offsets (2K + 1 classes)
    correction._set_parameters()
    fitted = scheduler.survival(confidence, history)
    assert on_device() == pytest.approx(fitted, rel=1e-12, abs=1e-15)
    assert (np.diff(fitted, axis=1) <= 0).all() and not np.allclose(fitted, scheduler.survival(confidence))


def test_the_devices_history_rule_is_the_engines():
    """``history_after`` (a packed step launched ahead) applies ``next_history`` to every request at once: K = 5,
    classes none (0), rejected_at_0..4 (1-5), accepted_1..5 (6-10)."""
    before = [0, 7, 2, 0, 9, 3, 3, 10]
    verified = [3, 3, 3, 0, 0, 2, 5, 1]
    accepted = [3, 1, 0, 0, 0, 2, 4, 0]
    got = history_after(torch.tensor(before), torch.tensor(verified), torch.tensor(accepted), 5)
    want = [next_history(*case, 5) for case in zip(before, verified, accepted)]
    assert got.tolist() == want == [8, 2, 1, 0, 9, 7, 5, 1]
    assert history_classes(5)[8] == "accepted_3" and history_classes(5)[2] == "rejected_at_1"


def test_pack_index_and_verify_positions():
    lengths = torch.tensor([2, 0, 3])
    assert pack_index(lengths, 4, 8).tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    positions = torch.tensor([10, 11, 12, 13, 5, 6, 7, 8, 20, 21, 22, 23])
    assert verify_positions(positions, lengths, 4).tolist() == [10, 11, 12, 12, 5, 5, 5, 5, 20, 21, 22, 23]


def test_a_packed_verify_equals_verifying_each_requests_share_alone(near_bigram_target):
    """Three requests with contexts in the cache verify full blocks of K = 5 (greedy continuations, each broken at
    a different draft) under a budget of 2 columns: the packed step feeds each request its anchor and the drafts of
    highest survival, and its verdicts, hidden states and KV writes equal a ragged step fed exactly those."""
    k, page_size = 5, 4
    llm = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=64, page_size=page_size,
              max_num_seqs=4)
    runner = llm.engine.executor.worker.engine_part
    target, caches, kernels = runner.target, runner.caches, runner.kernels
    params = SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 90], [100, 3, 7, 7, 41, 9, 12, 60, 2], [20, 21, 22]]
    greedy = [o.token_ids for o in llm.generate(prompts, params)]
    pages = [list(range(1 + 8 * b, 9 + 8 * b)) for b in range(len(prompts))]
    prefill = [ScheduledRequest(str(b), p, 0, pages[b], 0, True, params, b) for b, p in enumerate(prompts)]
    t = build_step_tensors(prefill, page_size, torch.device("cpu"), kernels)
    target(t.input_ids, t.positions, caches, t.meta, t.slots)
    snapshot = [(kc.clone(), vc.clone()) for kc, vc in caches]
    broken_at = [1, 4, 2]  # the draft each block gets wrong (0-based)
    blocks = []
    for b, out in enumerate(greedy):
        drafts = list(out[1:k + 1])
        drafts[broken_at[b]] = (drafts[broken_at[b]] + 1) % 128
        blocks.append([out[0], *drafts])
    survival = torch.tensor([[0.9, 0.8, 0.3, 0.2, 0.1], [0.95, 0.9, 0.85, 0.8, 0.1], [0.5, 0.4, 0.3, 0.1, 0.0]],
                            dtype=torch.float64)
    budget = 2 * len(prompts)
    full = [ScheduledRequest(str(b), blocks[b], len(p), pages[b], k, True, params, b) for b, p in enumerate(prompts)]
    u = build_step_tensors(full, page_size, torch.device("cpu"), kernels)
    packed = packed_verify(target, caches, u.meta, u.input_ids, u.positions, u.slots, survival, budget,
                           target.compute_top_argmax)
    lengths = packed.lengths.tolist()
    assert lengths == top_drafts(survival.numpy(), np.ones((3, k), dtype=bool), budget).tolist() == [2, 4, 0]
    after_packed = [(kc.clone(), vc.clone()) for kc, vc in caches]
    for (kc, vc), (ks, vs) in zip(caches, snapshot):
        kc.copy_(ks)
        vc.copy_(vs)
    alone = [ScheduledRequest(str(b), blocks[b][:n + 1], len(p), pages[b], n, True, params, b)
             for b, (p, n) in enumerate(zip(prompts, lengths))]
    r = build_step_tensors(alone, page_size, torch.device("cpu"), kernels)
    hidden, _ = target(r.input_ids, r.positions, caches, r.meta, r.slots)
    top, argmax = target.compute_top_argmax(hidden)
    assert torch.allclose(packed.hidden, hidden, atol=1e-5)
    verdict = packed.block_verdict
    start = 0
    for b, n in enumerate(lengths):
        rows = argmax[start:start + n + 1]
        accepted = int(accept_by_match(torch.tensor([blocks[b][1:n + 1] + [0] * (k - n)]), torch.tensor([n]),
                                       torch.cat([rows, rows.new_zeros(k - n)])[None])[0])
        assert int(verdict[b, k + 1]) == accepted == min(n, broken_at[b])  # the accepted count
        assert verdict[b, :accepted + 1].tolist() == rows[:accepted + 1].tolist()  # the committed tokens
        assert int(verdict[b, k + 2]) == 0  # no fault
        start += n + 1
    slots = u.slots[packed.index]
    for (kp, vp), (kc, vc) in zip(after_packed, caches):  # the same keys and values written at the fed slots
        assert torch.allclose(kp.view(-1, *kp.shape[2:])[slots], kc.view(-1, *kc.shape[2:])[slots], atol=1e-5)
        assert torch.allclose(vp.view(-1, *vp.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots], atol=1e-5)


def test_a_block_cut_short_in_a_packed_step_never_accepts_its_padding(near_bigram_target):
    """A packed step of K = 4 blocks where one request's block was cut to 2 drafts (its token limit): fed in the
    graphs' uniform layout (``build_uniform_step_tensors``), its padding rows repeat its last position and write the
    scratch page. Even with padding tokens that are the target's own continuation and a budget of every slot (the
    selection takes the padding too), it accepts its 2 drafts and no more, and its pages past them are untouched."""
    k, page_size, num_pages = 4, 4, 64
    llm = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=num_pages, page_size=page_size,
              max_num_seqs=4)
    runner = llm.engine.executor.worker.engine_part
    target, caches, kernels = runner.target, runner.caches, runner.kernels
    assert caches[0][0].shape[0] == num_pages + 1  # the scratch page, one past the allocator's
    params = SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 90], [100, 3, 7, 7, 41, 9]]
    greedy = [o.token_ids for o in llm.generate(prompts, params)]
    pages = [list(range(1 + 8 * b, 9 + 8 * b)) for b in range(len(prompts))]
    prefill = [ScheduledRequest(str(b), p, 0, pages[b], 0, True, params, b) for b, p in enumerate(prompts)]
    t = build_step_tensors(prefill, page_size, torch.device("cpu"), kernels)
    target(t.input_ids, t.positions, caches, t.meta, t.slots)
    before = [kc.clone() for kc, _ in caches]
    cut = 2
    reqs = [ScheduledRequest("0", greedy[0][:cut + 1], len(prompts[0]), pages[0], cut, True, params, 0),
            ScheduledRequest("1", greedy[1][:k + 1], len(prompts[1]), pages[1], k, True, params, 1)]
    u = build_uniform_step_tensors(reqs, k + 1, page_size, num_pages, torch.device("cpu"), kernels)
    ids = u.input_ids.clone()
    ids[cut + 1:k + 1] = torch.tensor(greedy[0][cut + 1:k + 1])  # padding that would match, were it counted
    assert u.positions[:k + 1].tolist() == [5, 6, 7, 7, 7] and (u.slots[cut + 1:k + 1] // page_size == num_pages).all()
    survival = torch.tensor([[0.9, 0.9, 0.0, 0.0], [0.9, 0.8, 0.7, 0.6]], dtype=torch.float64)
    packed = packed_verify(target, caches, u.meta, ids, u.positions, u.slots, survival, 2 * k,
                           target.compute_top_argmax)
    assert packed.lengths.tolist() == [k, k]  # the budget took the padding slots too
    assert packed.block_verdict[:, k + 1].tolist() == [cut, k]  # every real draft accepted, no padding
    assert packed.block_verdict[0, :cut + 1].tolist() == greedy[0][1:cut + 2]
    past = [pages[0][p // page_size] * page_size + p % page_size for p in range(len(prompts[0]) + cut + 1, 16)]
    for (kc, _), kb in zip(caches, before):  # request 0's slots past its block: not written
        assert torch.equal(kc.view(-1, *kc.shape[2:])[past], kb.view(-1, *kb.shape[2:])[past])


def test_the_packed_budget_lags_a_step_and_prices_the_global_top_drafts():
    """Packed steps verify ``columns`` x requests drafts, the columns chosen from the previous step; the expected
    tokens of a budget are the requests plus the top survivals over the step (a ragged choice), priced as a step of
    requests x (columns + 1) tokens. Dear tokens: few columns; cheap ones: whole blocks."""
    confidences = [[0.99, 0.99, 0.99, 0.99], [0.3, 0.3, 0.3, 0.3], [0.9, 0.2, 0.2, 0.2]]
    cheap = ConfidenceScheduler(4, flat_table(0.0001), layout="packed")
    assert cheap.allot_packed(confidences) == 12 and cheap.columns == 4  # whole blocks first, and next
    dear = ConfidenceScheduler(4, flat_table(2.0), layout="packed")
    assert dear.allot_packed(confidences) == 12  # the first step: whole blocks (nothing earlier to go by)
    ranked = sorted((s for row in [dear.survival_row(c, 4) for c in confidences] for s in row), reverse=True)
    rates = [(3 + sum(ranked[:3 * c])) / (10.0 + 2.0 * 3 * (c + 1)) for c in range(5)]
    assert dear.columns == int(np.argmax(rates)) < 4
    budget = dear.allot_packed(confidences)
    assert budget == 3 * rates.index(max(rates))  # the lag: this step's budget is the last decision's
    assert dear.last.expected_tokens == pytest.approx(3 + sum(ranked[:budget]))
    dear.learn([min(4, budget)] * 3, [1, 0, 1])  # the device's verified counts, bounded by what was proposed
    dear.correction.fold()
    assert dear.correction.verified[0] == 3 and dear.correction._filled.tolist() == [3, 2, 0, 0]  # reached drafts


def test_the_packed_layout_keeps_greedy_outputs_and_learns_what_the_device_verified(tmp_path, near_bigram_target,
                                                                                   make_drafter):
    """The packed layout, forced on a CPU engine (its steps eager): the blocks stay whole, the budget decides how
    many drafts the step verifies and the device which (here from confidences that differ by request), never the
    tokens: greedy outputs are transformers'. The correction learns from the counts the device verified."""
    from tests import builders
    from tests.runtime.test_confidence_scheduling import PROMPTS

    llm = packed_llm(tmp_path, near_bigram_target, make_drafter)
    plan_of = llm.engine._packed_plan

    def spread(scheduled):  # the random drafter is as confident for every request: make odd requests doubt
        plan = plan_of(scheduled)
        return plan if plan is None else dataclasses.replace(plan, confidences=[
            [c * (0.4 if i % 2 else 1.0) for c in row] for i, row in enumerate(plan.confidences)])

    llm.engine._packed_plan = spread
    verified = builders.record_packed_steps(llm)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == builders.hf_greedy(near_bigram_target, PROMPTS, 24)
    assert verified and all(sum(counts) == budget for budget, counts in verified)  # the device spent the budget
    assert any(len(set(counts)) > 1 for _, counts in verified)  # ragged: requests verified different counts
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["layout"] == "packed" and stats["mean_verify_budget_per_request"] < stats["mean_offered_per_request"]
    assert stats["survival_correction"] != [1.0] * 4  # learned from the verified counts


def test_a_packed_step_drafts_only_what_its_columns_let_a_request_take_and_keeps_greedy_outputs(
        tmp_path, near_bigram_target, make_drafter):
    """The packed layout, forced on a CPU engine, its decisions held at one column: each block is drafted one past
    the longest share a request took of the last one (``packed_draft_len``), so the packed steps verify blocks
    shorter than K, and greedy outputs are still transformers'."""
    from tests import builders
    from tests.runtime.test_confidence_scheduling import PROMPTS

    llm = packed_llm(tmp_path, near_bigram_target, make_drafter)
    scheduler = llm.engine.confidence
    scheduler._best = lambda expected, predicted: 1  # one column (and a cap of one) every decision
    fed = []
    execute = llm.engine.executor.execute

    def recorded(batch):
        if batch.packed is not None:
            fed.append(batch.requests[0].num_drafts)
        return execute(batch)

    llm.engine.executor.execute = recorded
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == builders.hf_greedy(near_bigram_target, PROMPTS, 24)
    assert fed and min(fed) < 4  # packed steps of blocks drafted shorter than the drafter's 4


def test_packed_steps_of_any_drafted_length_beside_arrivals_and_sampled_requests_keep_greedy_outputs(
        tmp_path, near_bigram_target, make_drafter):
    """The packed layout forced on a CPU engine whose every decision (columns, cap) is drawn at random, requests
    arriving while others decode, one in five sampled: packed steps verify blocks drafted 2, 3 and 4 long, steps an
    arrival or a sampled request joins are not packed, and every greedy request's tokens are transformers' (up to
    its end of sequence, which it was told to ignore)."""
    import random

    from tests import builders

    engine = packed_llm(tmp_path, near_bigram_target, make_drafter, packed_from=2).engine
    rng = random.Random(3)
    engine.confidence._best = lambda expected, predicted: rng.randrange(len(predicted))
    fed, execute = [], engine.executor.execute

    def recorded(batch):
        if batch.packed is not None:
            fed.append(batch.requests[0].num_drafts)
        return execute(batch)

    engine.executor.execute = recorded
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 12))] for _ in range(14)]
    pending, greedy, outputs = list(enumerate(prompts)), {}, {}
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.15:  # an arrival, this step
            i, prompt = pending.pop(0)
            tokens = rng.randrange(20, 60)
            sampled = i % 5 == 4
            params = SamplingParams(max_tokens=tokens, temperature=0.8 if sampled else 0.0, seed=i,
                                    ignore_eos=not sampled)
            engine.add_request(prompt, params, request_id=str(i))
            if not sampled:
                greedy[i] = tokens
        for out in engine.step() if engine.has_unfinished() else []:
            if out.finish_reason is not None:
                outputs[int(out.request_id)] = out.token_ids
    assert {2, 3, 4} <= set(fed)  # packed steps of blocks drafted 2, 3 and 4 long
    eos = engine._eos_token_ids()  # (transformers stops there; the engine was told to go on)
    for i, tokens in greedy.items():
        expected = builders.hf_greedy(near_bigram_target, [prompts[i]], tokens)[0]
        assert outputs[i][:len(expected)] == expected and (len(expected) == tokens or expected[-1] in eos), i


def test_small_steps_of_the_packed_layout_are_padded(tmp_path, near_bigram_target, make_drafter):
    """A graphed engine packs only the steps its packed graphs' buckets serve (``packed_from`` requests on); the
    smaller ones verify under the padded layout's cap. Both kinds in one run keep greedy outputs."""
    from tests import builders

    llm = packed_llm(tmp_path, near_bigram_target, make_drafter, packed_from=3)
    kinds, whole = [], []
    execute = llm.engine.executor.execute

    def spy(batch):
        if any(r.num_drafts for r in batch.requests):
            kinds.append(("packed" if batch.packed is not None else "padded", len(batch.requests)))
            whole.append(llm.engine.confidence.step_columns >= 4)  # the budget was whole blocks: a uniform step
        return execute(batch)

    llm.engine.executor.execute = spy
    prompts = [[5, 17, 33], [100, 3], [7] * 5, [20, 21]]
    lengths = [40, 40, 24, 24]  # two requests finish early: the last steps have two
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs == [builders.hf_greedy(near_bigram_target, [p], n)[0] for p, n in zip(prompts, lengths)]
    big = [kind for kind, num in kinds if num >= 3]
    assert "packed" in big and {kind for kind, num in kinds if num < 3} == {"padded"}
    # a big step that verified whole blocks was one whose budget was whole blocks (a uniform step's graph serves it)
    # or one the engine could not pack (a request joining, a step other than the one decided for), and says so
    padded_by_choice = sum(1 for (kind, num), w in zip(kinds, whole) if num >= 3 and kind == "padded" and w)
    assert big.count("padded") - padded_by_choice == llm.get_metrics()["confidence_scheduling"]["unpacked_steps"]


def test_a_step_with_blocks_cut_at_their_token_limits_is_still_packed(tmp_path, near_bigram_target, make_drafter,
                                                                      monkeypatch):
    """Requests of different token limits: near its limit a request's block is cut shorter (to none at its last
    token) while the others' stay whole. Such a step is packed all the same (the short blocks padded with drafts that
    propose nothing: before, it verified whole blocks, so in a mixed workload, where some request nears its limit
    almost every step, the budget was spent on nothing), each request verifies at most the drafts it fed, and greedy
    outputs are transformers'."""
    from runtime.engine import core as engine_module
    from tests import builders

    # a mixed step's deferred decision is recorded by host work within a budget of the step's time: on a loaded
    # host it can run out, and the decision lands in a later step's trace row (no budget runs out here)
    monkeypatch.setattr(engine_module, "HOST_WORK_SHARE", 1e3)
    llm = packed_llm(tmp_path, near_bigram_target, make_drafter, packed_from=2)
    engine = llm.engine
    steps, fed, execute = [], [], engine.executor.execute

    def spy(batch):  # (a step's device waits passed on to the engine)
        results = yield from execute(batch)
        if batch.packed is not None:
            steps.append([(r.num_drafts, res.num_verified) for r, res in zip(batch.requests, results)])
        if any(r.num_drafts for r in batch.requests):
            fed.append(sum(r.num_drafts for r in batch.requests))
        return results

    engine.executor.execute = spy
    prompts = [[5, 17, 33], [100, 3], [7] * 5, [20, 21], [9, 8, 7, 6]]
    lengths = [29, 41, 34, 46, 37]  # each nears its limit at a different step
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs == [builders.hf_greedy(near_bigram_target, [p], n)[0] for p, n in zip(prompts, lengths)]
    ragged = [step for step in steps if len({drafts for drafts, _ in step}) > 1]
    assert ragged, "no packed step mixed a block cut at its token limit with longer ones"
    assert all(verified <= drafts for step in steps for drafts, verified in step)
    assert llm.get_metrics()["confidence_scheduling"]["unpacked_steps"] == 0
    # the trace says what each decided step verified: never more than its budget (the trim was spent)
    trace = engine.confidence_stats.trace_since()
    at = {name: i for i, name in enumerate(trace["fields"])}
    decided = [row for row in trace["steps"] if row[at["budget"]] is not None]
    assert decided and all(row[at["verified"]] <= row[at["budget"]] for row in decided)
    assert any(row[at["verified"]] < row[at["offered"]] for row in decided)
    # each decision was offered what its step could feed: blocks cut at their token limits, not their drafts past it
    assert [row[at["offered"]] for row in decided] == fed


def test_a_step_an_arrival_joins_verifies_under_the_cap_and_is_not_packed(tmp_path, near_bigram_target, make_drafter):
    """The packed layout decides a step that will feed a prefill chunk beside the verifies (an arrival, a request
    still prefilling) under the padded layout's cap: such a step cannot be packed, and before it verified whole
    blocks whatever the budget said (an unpacked step). Greedy outputs stay transformers'."""
    from tests import builders

    llm = packed_llm(tmp_path, near_bigram_target, make_drafter, packed_from=2)
    eng = llm.engine
    steps = []
    execute = eng.executor.execute

    def spy(batch):
        mixed = any(len(r.token_ids) != r.num_drafts + 1 for r in batch.requests)  # a prefill chunk in it
        steps.append((batch.packed is not None, mixed, [r.num_drafts for r in batch.requests if r.num_drafts]))
        return execute(batch)

    eng.executor.execute = spy
    prompts = [[5, 17, 33], [100, 3], [7] * 5, [20, 21, 22, 23]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts[:3]]
    outputs = {}
    for _ in range(6):
        outputs.update({o.request_id: o for o in eng.step()})
    ids.append(eng.add_request(prompts[3], params))
    while eng.has_unfinished():
        outputs.update({o.request_id: o for o in eng.step() if o.finished})
    expected = [builders.hf_greedy(near_bigram_target, [p], 32)[0] for p in prompts]
    assert [outputs[i].token_ids for i in ids] == expected
    assert any(packed for packed, _, _ in steps)
    joined = [drafts for packed, mixed, drafts in steps if mixed and drafts]
    assert joined and not any(packed for packed, mixed, _ in steps if mixed)
    # the cap chosen for mixed steps trims the blocks (dear tokens): not whole blocks, not unpacked
    assert any(max(drafts) < 4 for drafts in joined)
    assert llm.get_metrics()["confidence_scheduling"]["unpacked_steps"] == 0
