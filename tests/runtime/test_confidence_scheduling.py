"""Confidence scheduling: the step-time table, the budget and allocation rules, and the engine with it on
(greedy outputs unchanged, sampled outputs still the target's distribution, its files and refusals)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.scheduling.pages import PageAllocator
from runtime.scheduling.scheduler import Scheduler, SchedulerLimits
from runtime.scheduling.sequence import Sequence
from runtime.spec.confidence import ConfidenceScheduler
from runtime.spec.history import HISTORY_NONE, history_classes, next_history
from runtime.spec.hold import DraftingHold
from runtime.spec.mixed_step_costs import MixedStepCosts
from runtime.spec.packed_layout import packed_draft_len, top_drafts
from runtime.spec.stats import TRACE_FIELDS, ConfidenceStats
from runtime.spec.step_costs import StepCostTable
from runtime.spec.survival import SurvivalCorrection, SurvivalSkill, read_calibration
from runtime.spec.tuning import TUNING
from runtime.engine.host_work import HostWork
from tests import builders
from tests.runtime.test_sampling_distribution import FILTERS, N, empirical_tv, exact_joint, tv_bound

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12]
ENGINE = dict(dtype="float32", device="cpu", num_pages=512, page_size=4, max_num_seqs=8)


def flat_table(ms_per_token: float, base: float = 10.0) -> StepCostTable:
    """A step costs ``base`` ms plus ``ms_per_token`` per token fed, at any batch size."""
    tokens = [1, 64, 512]
    return StepCostTable([1, 64], tokens, [[base + ms_per_token * t for t in tokens]] * 2)


def trace_agrees_with_the_stats(stats: ConfidenceStats) -> list[dict]:
    """The engine's step trace (``ConfidenceStats.trace``), every step of it held, against the stats' sums: each
    decision is attributed to exactly the step it chose the verifies of (a decision counted twice, or another's,
    moves a sum). -> the steps as dicts."""
    steps = [dict(zip(TRACE_FIELDS, row)) for row in stats.trace_since()["steps"]]
    assert len(steps) == stats.steps < TUNING.trace_steps and [s["step"] for s in steps] == list(range(1, stats.steps + 1))
    decided = [s for s in steps if s["budget"] is not None]
    assert len(decided) == stats.decided_steps == stats.decisions
    assert sum(s["budget"] for s in decided) == stats.budget and sum(s["offered"] for s in decided) == stats.offered
    assert sum(s["committed_tokens"] for s in decided) == stats.committed_tokens
    assert sum(s["expected_tokens"] for s in decided) == pytest.approx(stats.expected_tokens, abs=1e-3 * len(decided))
    assert sum(s["ms"] for s in steps) == pytest.approx(stats.measured_ms, abs=1e-3 * len(steps))
    assert sum(s["held"] for s in steps) == stats.drafting_off_steps
    assert sum(s["serial"] for s in steps) == stats.serial_steps
    for s in decided:
        assert 0 <= s["budget"] <= s["offered"] and s["predicted_ms"] > 0 and s["whole_predicted_ms"] > 0
    return steps


# ---- the table --------------------------------------------------------------------------------------------


def test_the_table_interpolates_extrapolates_learns_and_round_trips(tmp_path):
    table = StepCostTable([1, 4], [1, 8, 16], [[2.0, 4.0, math.nan], [3.0, math.nan, 7.0]])
    assert table.predict_ms(1, 4) == pytest.approx(2.0 + 2.0 * 3 / 7)  # within the batch-1 row
    assert table.predict_ms(1, 24) == pytest.approx(4.0 + 2.0 * 16 / 7)  # the row's last slope, extended
    assert table.predict_ms(2, 16) == pytest.approx((2 / 3) * table.predict_ms(1, 16) + (1 / 3) * 7.0)
    many = table.predict_ms_many(2, torch.tensor([1, 8, 16]))
    assert many.tolist() == pytest.approx([table.predict_ms(2, t) for t in (1, 8, 16)])
    assert table.predict_ms_many(2, [1, 8, 16]) is many and not many.flags.writeable  # cached, read-only
    table.observe(4, 15, 0.009)  # 9 ms, nearest cell (4, 16) moves a tenth of the way
    assert table.step_ms[1][2] == 7.0 and table.observations == 1  # gathered, learned OBSERVE_EVERY at a time
    table.flush()
    assert table.step_ms[1][2] == pytest.approx(7.2) and table.observations == 1
    assert table.predict_ms(4, 16) == pytest.approx(7.2)  # learned values reach the (cached) predictions at once
    assert table.predict_ms_many(2, [1, 8, 16]) is not many
    table.record(4, 8, 3.0)  # an empty cell filled: the row gains a point
    assert table.predict_ms(4, 8) == pytest.approx(3.0) and table.predict_ms(4, 12) == pytest.approx(5.1)
    path = tmp_path / "table.json"
    table.save(path)
    again = StepCostTable.load(path)
    assert again.to_json() == table.to_json()
    path.write_text(json.dumps({"batch_sizes": [1]}))
    with pytest.raises(ValueError, match=r"confidence_cost_table_path .*table.json: expected"):
        StepCostTable.load(path)


# ---- the rules --------------------------------------------------------------------------------------------


def test_the_top_drafts_are_prefixes_ranked_by_survival_ties_to_the_earlier_position():
    survival = torch.tensor([[0.9, 0.5, 0.5, 0.1], [0.8, 0.8, 0.3, 0.0]])
    proposed = torch.tensor([[True, True, True, True], [True, True, True, False]])
    assert top_drafts(survival, proposed, 0).tolist() == [0, 0]
    assert top_drafts(survival, proposed, 3).tolist() == [1, 2]
    assert top_drafts(survival, proposed, 4).tolist() == [2, 2]  # 0.5 at position 1 before 0.5 at position 2
    assert top_drafts(survival, proposed, 7).tolist() == [4, 3]


def test_the_budget_follows_the_cost_of_a_token_and_lags_one_step():
    confident = [[0.95, 0.9, 0.9, 0.9]] * 4
    cheap = ConfidenceScheduler(4, flat_table(0.001))
    assert cheap.allot(confident) == [4] * 4  # first step: whole blocks (nothing earlier to size the budget)
    assert cheap.budget_per_request == 4.0  # verifying is nearly free: everything
    dear = ConfidenceScheduler(4, flat_table(50.0))
    dear.allot(confident)
    assert dear.budget_per_request == 0.0  # a token costs 5x a step: nothing pays
    assert dear.allot(confident) == [0] * 4 and dear.last.budget == 0
    middle = ConfidenceScheduler(4, flat_table(1.0))
    middle.allot([[0.99, 0.99, 0.2, 0.2]] * 4)
    assert middle.budget_per_request == 2.0  # the two likely drafts pay, the unlikely ones do not
    assert middle.allot([[0.99, 0.99, 0.99, 0.99], [0.1, 0.1, 0.1, 0.1]] * 2) == [4, 0, 4, 0]  # the same 8, re-spread


def test_a_mixed_step_prices_verify_tokens_where_its_prefill_puts_it():
    """Flat up to 512 tokens, then steep: alone, 8 requests' drafts are nearly free; behind a 480-token prefill
    chunk they cross the knee, each costs real compute, and the scheduler verifies fewer."""
    table = StepCostTable([1, 64], [1, 512, 4096], [[10.0, 10.5, 1000.0]] * 2)
    confident = [[0.9, 0.8, 0.6, 0.4]] * 8
    alone, mixed = ConfidenceScheduler(4, table), ConfidenceScheduler(4, table)
    alone.allot(confident)
    mixed.allot(confident, other_requests=1, other_tokens=480)
    assert alone.budget_per_request == 4.0 and mixed.budget_per_request == 3.0
    assert mixed.last.predicted_ms > alone.last.predicted_ms


def test_padded_steps_verify_every_request_under_one_cap_chosen_a_step_ahead():
    """Graphed steps pad every request to the longest verify, so a step of cap Q costs batch x (Q + 1) tokens
    whatever each request verifies: the scheduler picks the cap (from the previous step's survivals) and verifies
    min(proposed, Q) drafts of every block, never a ragged top-k."""
    # 10 ms a step plus 1 ms per column of 4 requests: a draft column pays where its survivals sum past ~0.4 x
    # the tokens a step already commits
    table = StepCostTable([1, 64], [4, 8, 12, 16, 20], [[10.0, 11.0, 12.0, 13.0, 14.0]] * 2)
    scheduler = ConfidenceScheduler(4, table, layout="padded")
    mixed = [[0.99, 0.99, 0.99, 0.99], [0.9, 0.9, 0.1, 0.1], [0.9, 0.9, 0.1, 0.1], [0.9, 0.9, 0.1, 0.1]]
    assert scheduler.allot(mixed) == [4, 4, 4, 4]  # first step: whole blocks
    # columns of survival 3.69, 3.41, 1.21, 0.98: rates 4 / 10, 7.69 / 11, 11.10 / 12, 12.31 / 13, 13.30 / 14
    # = 0.40, 0.70, 0.93, 0.95, 0.95: whole blocks
    assert scheduler.cap == 4
    doubtful = [[0.9, 0.9, 0.05, 0.05]] * 4
    assert scheduler.allot(doubtful) == [4] * 4  # this step's tokens never choose this step's cap
    assert scheduler.cap == 2  # columns 3.6, 3.24, 0.16, 0.01: two columns pay, the rest do not
    assert scheduler.allot([[0.9, 0.9, 0.9], [0.99]] + [[0.9, 0.9, 0.9, 0.9]] * 2) == [2, 1, 2, 2]
    assert scheduler.last.budget == 7 and scheduler.last.offered == 12
    assert scheduler.last.predicted_ms == pytest.approx(table.predict_ms(4, 12))  # 4 requests x (2 + 1) tokens
    dear = ConfidenceScheduler(4, flat_table(50.0), layout="padded")
    dear.allot([[0.95, 0.9, 0.9, 0.9]] * 4)
    assert dear.cap == 0 and dear.allot([[0.95, 0.9, 0.9, 0.9]] * 4) == [0] * 4
    with pytest.raises(ValueError, match=r"layout: one of \('ragged', 'padded', 'packed'\), got 'tiled'"):
        ConfidenceScheduler(4, table, layout="tiled")


def test_min_gain_and_calibration(tmp_path):
    lukewarm = [[0.3, 0.2, 0.1, 0.1]] * 4
    eager = ConfidenceScheduler(4, flat_table(0.01), min_gain=0.0)
    eager.allot(lukewarm)
    assert eager.budget_per_request > 0
    strict = ConfidenceScheduler(4, flat_table(0.01), min_gain=1.0)  # must double the rate
    strict.allot(lukewarm)
    assert strict.budget_per_request == 0.0
    # verifying costs the same at any length (but for noise): a trim that beats whole blocks by less than min_gain
    # is not worth a ragged step
    noisy = StepCostTable([1, 64], [4, 8, 12, 16, 20], [[10.0, 10.3, 10.0, 10.4, 10.6]] * 2)
    steady = ConfidenceScheduler(4, noisy)
    steady.allot([[0.9, 0.6, 0.3, 0.05]] * 4)
    assert steady.budget_per_request == 4.0
    trimming = ConfidenceScheduler(4, noisy, min_gain=0.0)
    trimming.allot([[0.9, 0.6, 0.3, 0.05]] * 4)
    assert trimming.budget_per_request == 3.0  # without the margin it trims on the table's noise
    hot = ConfidenceScheduler(2, flat_table(1.0), temperatures=[0.5, 0.5])
    assert hot.survival(torch.tensor([[0.8, 0.8]]))[0, 0].item() == pytest.approx(16 / 17)  # sigmoid(2 logit(.8))
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"temperatures": [1.2, 0.9]}))
    assert read_calibration(path, "confidence_calibration_path") == [1.2, 0.9]
    path.write_text(json.dumps({"temperatures": [1.0, -1.0]}))
    with pytest.raises(ValueError, match="confidence_calibration_path: temperatures must be positive"):
        read_calibration(path, "confidence_calibration_path")


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_the_survivals_learn_what_the_target_accepts(layout):
    """Confidences that under-predict the late drafts (as earlier runs measured on a trained pair): the raw
    survivals trim to 3 of 4 drafts, where the target's true survivals pay for whole blocks. The online correction
    learns each position's ratio from the steps committed (the first three's lift the cap; the whole blocks then
    show it position 4), and the scheduler settles on whole blocks, its expected tokens now what the target
    commits. (Where one draft more never pays on its own, exploration lifts the cap: the test below.)"""
    table = StepCostTable([1, 64], [4, 8, 12, 16, 20], [[10.0, 11.0, 12.0, 13.0, 14.5]] * 2)
    truth = np.array([0.95, 0.9, 0.8, 0.75])  # each draft's chance to be accepted, given its prefix was
    confidence = [[0.9, 0.8, 0.6, 0.5]] * 4
    rng = np.random.default_rng(0)
    scheduler = ConfidenceScheduler(4, table, layout=layout)
    # decided once (its first step, whole blocks, left out of the evidence: -1): the fit, made at its first fold,
    # would otherwise see every position in that step's whole blocks
    scheduler.allot(confidence)
    scheduler.learn([-1] * 4, [-1] * 4)
    verified, expected, committed = [], 0.0, 0
    for step in range(300):
        lengths = scheduler.allot(confidence)
        accepted = []
        for length in lengths:
            n = 0
            while n < length and rng.random() < truth[n]:
                n += 1
            accepted.append(n)
        scheduler.learn(lengths, accepted)
        verified.append(max(lengths))
        if step >= 200:
            expected, committed = expected + scheduler.last.expected_tokens, committed + len(lengths) + sum(accepted)
    assert verified[:2] == [3, 3]  # the raw survivals' trim
    assert sum(v == 4 for v in verified[-50:]) >= 45
    want = np.cumprod(truth) / np.cumprod([0.9, 0.8, 0.6, 0.5])  # true over predicted survival, per position
    assert scheduler.correction.ratio == pytest.approx(want, rel=0.1)
    assert expected / committed == pytest.approx(1.0, abs=0.05)


def simulate(scheduler: ConfidenceScheduler, confidence: list[list[float]], truth: np.ndarray, steps: int,
             seed: int = 0) -> list[int]:
    """Serve ``steps`` steps whose drafts survive with the conditional chances ``truth``; the longest verify of
    each step."""
    rng = np.random.default_rng(seed)
    longest = []
    for _ in range(steps):
        lengths = scheduler.allot(confidence)
        accepted = [int(np.argmin(np.append(rng.random(n) < truth[:n], False))) for n in lengths]
        scheduler.learn(lengths, accepted)
        longest.append(max(lengths))
    return longest


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_exploration_learns_every_position_past_a_cost_step(layout):
    """A cost curve with a step right past the cap (a GEMM tile, a graph bucket: 3 drafts cost as much as 6) and
    confidences far too low from position 3 on: verifying one draft more never pays on its own, so only evidence
    on every position lifts the cap. The exploring steps verify whole blocks, so the scheduler learns that the
    whole block pays (true rate 5.4 / 14 against 2.8 / 10 at the cap of 2)."""
    table = StepCostTable([1, 64], [4, 8, 12, 16, 28], [[10.0, 10.0, 10.0, 14.0, 14.0]] * 2)
    truth = np.array([0.95, 0.9, 0.9, 0.9, 0.9, 0.9])
    confidence = [[0.9, 0.8, 0.5, 0.3, 0.3, 0.3]] * 4
    scheduler = ConfidenceScheduler(6, table, layout=layout)
    scheduler.allot(confidence)  # decided once: its whole-block step left out of the evidence (as above)
    scheduler.learn([-1] * 4, [-1] * 4)
    longest = simulate(scheduler, confidence, truth, 200)
    assert longest[:2] == [2, 2]  # the raw survivals' choice
    assert sum(v == 6 for v in longest[-50:]) == 50 and scheduler.explored >= 1
    assert scheduler.correction.ratio[3:] == pytest.approx(
        np.cumprod(truth)[3:] / np.cumprod([0.9, 0.8, 0.5, 0.3, 0.3, 0.3])[3:], rel=0.15)


def test_a_deferred_fold_waits_for_the_host_work_and_runs_once():
    """With ``defer_learning`` (the engine, where its executor offers host work) a due fold is one task queued on
    the host work (run while the device computes the next step), not done in ``learn``; the same evidence gives
    the same fit. Past ``TUNING.fold_deferred_most`` gathered steps (no step waited on the device) ``learn`` folds itself;
    ``refit_now`` folds whatever is gathered at once."""
    work = HostWork()
    deferred, direct = ConfidenceScheduler(3, flat_table(0.001)), ConfidenceScheduler(3, flat_table(0.001))
    deferred.defer_learning(work)
    for step in range(TUNING.fold_every):
        for scheduler in (deferred, direct):
            scheduler.allot([[0.9, 0.6, 0.3]] * 4)
            scheduler.learn([3, 3, 3, 3], [step % 4, 3, 1, 0])
    assert direct.correction.verified.sum() > 0 and deferred.correction.verified.sum() == 0 and len(work) == 1
    work.run()
    assert len(work) == 0 and deferred.correction.verified.tolist() == direct.correction.verified.tolist()
    assert deferred.correction.ratio.tolist() == direct.correction.ratio.tolist()
    for step in range(TUNING.fold_deferred_most):  # nothing runs the host work: learn folds once it gathered that many
        deferred.allot([[0.9, 0.6, 0.3]] * 4)
        deferred.learn([3, 3, 3, 3], [0, 0, 0, 0])
        assert len(deferred.correction._evidence) < TUNING.fold_deferred_most
    assert len(work) == 2  # one fold queued (whatever came due after it), and the refit the inline fold started
    deferred.allot([[0.9, 0.6, 0.3]] * 4)
    deferred.learn([3, 3, 3, 3], [0, 0, 0, 0])
    deferred.correction.refit_now()
    assert not deferred.correction._evidence
    work.run()  # the queued fold finds nothing left: harmless
    assert not deferred.correction._evidence and len(work) == 0


def test_a_deferred_refit_runs_in_slices_within_the_host_works_budget():
    """A refit is ~10 slices of numpy (a Newton step's gradient, each loss it evaluates): deferred, it runs a slice
    at a time where the host work's budget is spent (here: none, one task a run), on a copy of the window taken at
    its start, and ends at the fit a refit at once makes of that window. Folds coming in between do not change it."""
    work = HostWork()
    work.budget_s = 0.0  # one task a run
    deferred, direct = ConfidenceScheduler(3, flat_table(0.001)), ConfidenceScheduler(3, flat_table(0.001))
    deferred.defer_learning(work)
    rng = np.random.default_rng(0)
    steps = [(rng.uniform(0.2, 0.95, (4, 3)).tolist(), rng.integers(0, 4, 4).tolist()) for _ in range(TUNING.fold_every)]
    for confidences, accepted in steps:
        for scheduler in (deferred, direct):
            scheduler.allot(confidences)
            scheduler.learn([3, 3, 3, 3], accepted)
    assert direct.correction.learned and len(work) == 1  # the direct one folded and fitted in learn
    work.run()  # the fold: it starts the refit
    assert not deferred.correction.learned and len(work) == 1
    slices = 0
    while len(work):
        if slices == 2:  # more evidence arrives mid-refit, its fold queued between two slices: the refit goes on
            for _ in range(TUNING.fold_every):
                deferred.allot([[0.9, 0.9, 0.9]] * 4)
                deferred.learn([3, 3, 3, 3], [3, 3, 3, 3])
        work.run()
        slices += 1
    assert deferred.correction.learned and slices >= 4
    assert deferred.correction.verified.sum() > direct.correction.verified.sum()  # (the fold ran in between)
    np.testing.assert_allclose(deferred.correction.theta, direct.correction.theta, rtol=1e-12)


def test_one_request_is_fitted_at_its_first_fold_then_as_its_evidence_grows():
    """A drafter that accepts nothing, one request: the fit leaves the calibration at the first fold (TUNING.fold_every
    steps), not after TUNING.refit_folds folds, and believes the first draft's survival low from then on; it is refitted
    each time its evidence grew by a quarter (folds ever further apart, never more than TUNING.refit_folds), not only every
    TUNING.refit_folds folds, so that after a few dozen rejections it believes the first draft all but dead."""
    scheduler = ConfidenceScheduler(4, flat_table(0.001))
    for step in range(TUNING.fold_every):
        assert not scheduler.correction.learned
        scheduler.allot([[0.9, 0.9, 0.9, 0.9]])
        scheduler.learn([4], [0])
    assert scheduler.correction.learned
    assert scheduler.survival(np.array([[0.9, 0.9, 0.9, 0.9]]))[0, 0] < 0.5  # 0.9 believed before
    refits, folds = [], [0]
    refit, fold = scheduler.correction.refit, scheduler.correction._fold
    scheduler.correction.refit = lambda: (refits.append(folds[0]), refit())
    scheduler.correction._fold = lambda: (folds.__setitem__(0, folds[0] + 1), fold())
    for step in range(TUNING.fold_every * 3 * TUNING.refit_folds):
        scheduler.allot([[0.9, 0.9, 0.9, 0.9]])
        scheduler.learn([4], [0])
    gaps = np.diff([0] + refits)
    assert refits[:3] == [1, 2, 3] and (np.diff(gaps) >= 0).all() and gaps.max() <= TUNING.refit_folds
    assert len(refits) < 3 * TUNING.refit_folds  # not every fold
    assert scheduler.survival(np.array([[0.9, 0.9, 0.9, 0.9]]))[0, 0] < 0.05


def test_a_drafter_that_accepts_nothing_is_believed_so_and_drafting_stops():
    """One run at one request (a drafter trained 18 s, calibrated at temperature 10: every confidence read as ~0.55):
    it accepted nothing, the engine drafted on for 0.97 of the tuned throughput, the fit's first refits left the
    first draft believed at 0.21 (the slope's bound clipped away most of each Newton step) and the ridge held it at
    0.07 after 80 rejections, so drafting looked as if it paid. The plain steps here are 12% cheaper than drafting
    ones (one run's batch-1 row): within a few folds drafting stops."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    table = StepCostTable([1], tokens, [[2.92, 2.72, 2.68, 2.70, 2.74, 2.74, 2.73, 2.73]])
    table.plain = StepCostTable([1], [1], [[2.41]])
    scheduler = ConfidenceScheduler(7, table, temperatures=[10.0] * 5 + [2.98, 0.71], layout="padded",
                                    graph_batches=[1, 2, 4])
    pays = []
    for step in range(6 * TUNING.fold_every):
        lengths = scheduler.allot([[0.9, 0.85, 0.8, 0.8, 0.7, 0.6, 0.5]])
        scheduler.learn(lengths, [0])
        pays.append(scheduler.drafting_pays)
    assert pays[0] is True and pays[-1] is False


def test_the_correction_learns_only_what_was_verified_and_keeps_survivals_ordered():
    scheduler = ConfidenceScheduler(3, flat_table(0.001))
    assert scheduler.allot([[0.5, 0.5, 0.5]] * 3) == [3, 3, 3]
    # the first request left the step; the second verified 2 of its 3 (a token limit), accepting both
    scheduler.learn([-1, 2, 3], [-1, 2, 0])
    correction = scheduler.correction
    assert not correction.learned  # gathered, folded in every TUNING.fold_every steps
    correction.fold()
    assert correction.verified.tolist() == pytest.approx([2.0, 2.0, 1.0])
    assert correction.survived.tolist() == pytest.approx([1.0, 1.0, 0.0])
    assert correction.predicted.tolist() == pytest.approx([1.0, 0.5, 0.125])  # survivals 0.5 and 0.25 twice, 0.125
    # the prior: 32 drafts at each position's mean prediction (0.5, 0.25, 0.125), surviving as predicted
    assert correction.ratio.tolist() == pytest.approx([17.0 / 17.0, 9.0 / 8.5, 4.0 / 4.125])
    believed = correction.survival(np.array([[0.9, 0.85, 0.8], [0.3, 0.99, 0.99]]), [1, 2])
    assert (np.diff(believed) <= 0).all() and believed.max() <= 1.0
    scheduler.learn([1], [1])  # nothing pending: ignored
    scheduler.allot([[0.5, 0.5, 0.5]] * 3)
    with pytest.raises(ValueError, match="2 verified and 2 accepted counts for a step of 3 verifying requests"):
        scheduler.learn([1, 1], [0, 0])


def serve_packed(scheduler: ConfidenceScheduler, good: np.ndarray, steps: int, use_history: bool,
                 seed: int = 0) -> tuple[float, list[int]]:
    """Packed steps of ``len(good)`` requests whose head says the same of every draft (0.6): a good request accepts
    each draft with chance 0.97 (a stretch its drafter predicts well), the others 0.15, for the whole run. The
    device's selection (top survivals over the step) verified, the scheduler learning what was accepted and each
    request's class following ``next_history``. -> (committed tokens per predicted ms after the first half, the
    drafts each request verified at the last step)."""
    rng = np.random.default_rng(seed)
    num, k = len(good), scheduler.max_draft_len
    history, tokens, ms, lengths = [HISTORY_NONE] * num, 0.0, 0.0, []
    for step in range(steps):
        classes = history if use_history else None
        budget = scheduler.allot_packed([[0.6] * k] * num, history=classes)
        survival = scheduler.survival(np.full((num, k), 0.6), classes)
        lengths = top_drafts(survival, np.ones_like(survival, dtype=bool), budget)
        chance = np.where(good, 0.97, 0.15)[:, None]
        run = np.cumprod(rng.random((num, k)) < chance, axis=1)
        accepted = [int(run[i, :lengths[i]].sum()) for i in range(num)]
        scheduler.learn(lengths.tolist(), accepted)
        history = [next_history(h, int(n), a, k) for h, n, a in zip(history, lengths, accepted)]
        if step >= steps // 2:
            tokens += num + sum(accepted)
            ms += scheduler.last.predicted_ms
    return tokens / ms, lengths.tolist()


def test_the_fit_tells_requests_apart_by_their_verify_history():
    """A head that says the same of every draft (a drafter trained briefly: one run) cannot tell a request in a
    stretch it predicts well from one it does not; the request's last verify can. Without it the scheduler can only
    give every request the same share; with it, the fit learns each class's survival (the slope falls to what the
    head tells: nothing) and the packed step gives whole blocks to the good requests and little to the others, for
    more tokens per second at a dear per-token cost."""
    good = np.arange(16) % 2 == 0
    with_history = ConfidenceScheduler(6, flat_table(0.4), layout="packed")
    rate, lengths = serve_packed(with_history, good, 400, use_history=True)
    alone = ConfidenceScheduler(6, flat_table(0.4), layout="packed")
    rate_alone, lengths_alone = serve_packed(alone, good, 400, use_history=False)
    fit = with_history.correction
    names = history_classes(6)
    accepted_all, rejected_first = names.index("accepted_6"), names.index("rejected_at_0")
    assert fit.learned and fit.bias[accepted_all, 0] > fit.bias[rejected_first, 0] + 2.0
    survival = fit.survival(np.full((2, 6), 0.6), [accepted_all, rejected_first])
    assert survival[0, 0] > 0.8 and survival[1, 0] < 0.4  # near 0.97 and 0.15 (the classes are nearly the kinds)
    assert np.mean(np.asarray(lengths)[good]) > 3 * np.mean(np.asarray(lengths)[~good])  # (one may have rejected)
    assert len(set(lengths_alone)) <= 2  # without the history: the same share for all (ties split by position)
    assert rate > 1.15 * rate_alone
    skill = fit.skill.per_position()[0]
    assert skill is not None and skill > 0.2 > (alone.correction.skill.per_position()[0] or 0.0)


def test_the_skill_scores_the_believed_survivals_of_the_verified_drafts():
    """Brier skill per position against the position's observed rate: the same step's evidence as above (survivals
    0.5, 0.25, 0.125 believed; the second request verified 2 and accepted both, the third verified 3, accepted 0)."""
    scheduler = ConfidenceScheduler(3, flat_table(0.001))
    scheduler.allot([[0.5, 0.5, 0.5]] * 3)
    scheduler.learn([-1, 2, 3], [-1, 2, 0])
    scheduler.correction.fold()
    skill = scheduler.correction.skill
    assert skill.verified.tolist() == pytest.approx([2.0, 2.0, 1.0])
    assert skill.survived.tolist() == pytest.approx([1.0, 1.0, 0.0])
    # position 0: 0.5 believed, one survived and one not (rate 0.5): error 0.25 each, skill 1 - 0.25 / 0.25 = 0;
    # position 1: 0.25 believed, error 0.5625 + 0.0625: skill 1 - 0.3125 / 0.25; position 2: one draft, None
    assert skill.per_position() == [0.0, pytest.approx(1 - 0.3125 / 0.25), None]
    # a head that foretells each draft scores 1; the stats report it, and a reset starts the sums afresh
    sharp = SurvivalSkill(2)
    sharp.add(np.array([[1.0, 1.0], [0.0, 0.0]]), np.array([2, 2]), np.array([2, 0]))
    assert sharp.per_position() == [1.0, 1.0]
    assert ConfidenceStats().as_dict(scheduler)["survival_skill_per_position"] == skill.per_position()
    scheduler.correction.reset_skill()
    assert scheduler.correction.skill.per_position() == [None, None, None]
    assert scheduler.correction.verified.tolist() == pytest.approx([2.0, 2.0, 1.0])  # the correction kept its own


# ---- the engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def confident_drafter(near_bigram_target, make_drafter):
    return make_drafter(near_bigram_target, 4, oracle=True)


def engine(target, drafter, **spec) -> LLM:
    """The scheduler's own decisions: the speculation guard off unless asked (it would drop blocks by timings)."""
    spec = {"speculation_guard": False, **spec}
    return LLM(str(target), speculative_config=DSparkDecodingConfig(speculative_model=str(drafter), **spec),
               **ENGINE)


def test_greedy_outputs_are_the_same_with_scheduling_on_and_off(near_bigram_target, confident_drafter):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off = engine(near_bigram_target, confident_drafter)
    on = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True)
    want = [o.token_ids for o in off.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in on.generate(PROMPTS, greedy)] == want == builders.hf_greedy(
        near_bigram_target, PROMPTS, 24)
    stats = on.get_metrics()["confidence_scheduling"]
    # profiled at startup, then learning (the verify steps', or where drafting did not pay, the plain steps')
    assert stats["decisions"] > 0 and stats["cost_table_observations"] + stats["plain_cost_table_observations"] > 0
    table = on.rank_info()[0]["confidence_cost_table"]  # the engine's state, as it stands
    assert table["observations"] == stats["cost_table_observations"] and table["step_ms"]
    mixed = on.rank_info()[0]["confidence_mixed_step_costs"]  # the prefill steps learned apart
    assert mixed["observations"] == stats["mixed_step_observations"] > 0
    assert mixed["excess"] == stats["mixed_step_excess"]
    assert "confidence_cost_table" not in off.rank_info()[0]
    assert 1.0 <= stats["mean_committed_tokens_per_request"] <= 5.0  # what the survivals' prediction is against
    assert 1.0 <= stats["mean_expected_tokens_per_request"] <= 5.0
    assert on.engine.confidence.costs.measured and "confidence_scheduling" not in off.get_metrics()
    assert len(stats["survival_correction"]) == 4 and stats["survival_correction"] != [1.0] * 4  # it learned
    assert stats["explored_decisions"] >= 0
    assert on.get_metrics()["prefix_cache_queries"] == off.get_metrics()["prefix_cache_queries"]  # no profile left


def test_the_padded_layout_keeps_greedy_outputs(tmp_path, near_bigram_target, confident_drafter):
    """A GPU engine's scheduler caps every request's verify (its graphs pad); forced here on a CPU engine, whose
    steps run eagerly, the cap still only decides how many drafts are verified, never the tokens."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    path = tmp_path / "table.json"
    flat_table(3.0).save(path)  # a column of 4 drafts costs what 1.2 tokens pay: caps below whole blocks pay
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    assert llm.engine.confidence.layout == "ragged"  # no graphs on a CPU
    llm.engine.confidence.layout = "padded"
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == builders.hf_greedy(near_bigram_target, PROMPTS, 24)
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["layout"] == "padded" and stats["next_budget_per_request"] is None
    # (the last decision may be one of the every-32nd that verify whole blocks to keep learning: any cap then)
    assert 0 <= stats["next_cap"] <= 4 and stats["mean_verify_budget_per_request"] < stats["mean_offered_per_request"]


def test_the_startup_profile_follows_a_schedule_that_drafts_less_or_nothing(near_bigram_target, confident_drafter):
    """Under a ``draft_len_schedule`` the startup profile times each batch at the block drafted there (3 drafts at 2
    requests) and leaves out the sizes it drafts nothing for (above 2): a tuned schedule that turns speculation off
    at some loads used to stop the engine from starting ("never reached a drafted step")."""
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 draft_len_schedule={1: 4, 2: 3})
    costs = llm.engine.confidence.costs
    rows = {b: [t for t, v in zip(costs.token_counts, row) if v == v] for b, row in zip(costs.batch_sizes,
                                                                                        costs.step_ms.tolist())}
    assert rows[1] == [1, 2, 3, 4, 5] and rows[2] == [2, 4, 6, 8]  # up to 4 and 3 drafts
    assert all(not measured for b, measured in rows.items() if b > 2)
    measured = ~np.isnan(costs.step_ms)  # each profiled cell at the contexts of its timed steps (16-token prompts on)
    assert (costs.context[measured] >= 16).all()
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == builders.hf_greedy(near_bigram_target, PROMPTS, 16)


def test_a_cost_table_file_is_used_instead_of_profiling(tmp_path, near_bigram_target, confident_drafter):
    path = tmp_path / "table.json"
    # tokens are dear: after the first steps, nothing is verified (at 100 ms a token against a 10 ms step, one
    # draft surviving at 0.995, as a fit of this oracle drafter may come to believe, beat none by 4.5%: flaky)
    flat_table(1000.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["next_budget_per_request"] == 0.0 and stats["last"]["verify_budget"] == 0
    assert stats["mean_verify_budget_per_request"] <= 1.0  # whole blocks of 4 at most twice in 8 decisions


def test_an_engine_whose_executor_offers_host_work_folds_there(tmp_path, near_bigram_target, confident_drafter):
    """On the local executor the engine runs its deferred folds at the device waits its steps yield (a read-back)."""
    path = tmp_path / "table.json"
    flat_table(0.001).save(path)  # no plain steps in it: drafting is never held, every step decides and learns
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    engine_, ran = llm.engine, []
    correction = engine_.confidence.correction
    assert correction.defer_to is engine_.host_work
    fold = correction._deferred_fold
    correction._deferred_fold = lambda: (ran.append(len(engine_.host_work)), fold())
    llm.generate(PROMPTS, SamplingParams(max_tokens=6 * TUNING.fold_every, temperature=0.0, ignore_eos=True))
    assert ran and correction.verified.sum() > 0  # folded by a task the runner ran at a read-back


def test_a_full_batch_with_a_queue_is_decided_as_a_packed_step(tmp_path, near_bigram_target, confident_drafter):
    """Under a steady load requests always wait; a step whose batch is full admits none of them, so it feeds only
    its verifies and is decided as a packed step where packed graphs serve it (here: the engine told its steps may
    be packed, the choice spied on). A step with room for a waiting request is mixed: a padded cap. Greedy outputs
    stay the target's."""
    path = tmp_path / "table.json"
    flat_table(0.001).save(path)
    llm = LLM(str(near_bigram_target), speculative_config=DSparkDecodingConfig(
        speculative_model=str(confident_drafter), enable_confidence_scheduling=True,
        confidence_cost_table_path=str(path), speculation_guard=False), **{**ENGINE, "max_num_seqs": 2})
    eng, chosen = llm.engine, []
    eng._packs_steps_of = lambda num: True
    scheduler = eng.confidence
    for name in ("allot", "allot_packed"):
        method = getattr(scheduler, name)
        setattr(scheduler, name, lambda *a, _m=method, _n=name, **k: (
            chosen.append((_n, len(eng.scheduler.running), eng.scheduler.may_admit())), _m(*a, **k))[1])
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:3], greedy)
    assert [o.token_ids for o in outputs] == builders.hf_greedy(near_bigram_target, PROMPTS[:3], 10)
    assert ("allot_packed", 2, False) in chosen  # two running, the third waiting: no room, packed
    assert all(name == "allot" for name, _, room in chosen if room)  # room for an arrival: mixed


def test_a_deferred_decision_chooses_what_an_immediate_one_does():
    """A mixed step's padded decision applies the cap an earlier step chose at once and runs the rest (survivals, the
    next cap, its Decision, whether drafting pays, then the engine's ``then``) while the device computes: whether
    the host work runs it or the next decision (or ``learn``) settles it, every choice is the one ``allot`` makes
    at once, in the same order. A ragged decision ranks the step's own survivals: it cannot be deferred."""
    rng = np.random.default_rng(3)
    k = 4
    table = StepCostTable([1, 8], [1, 8, 40, 200], [[3.0, 3.2, 4.5, 9.0], [3.5, 3.8, 5.5, 11.0]])
    now, later = (ConfidenceScheduler(k, table.copy(), layout="padded", graph_batches=[1, 8]) for _ in range(2))
    work, then_saw, caps = HostWork(), [], set()
    for step in range(120):
        num = int(rng.integers(1, 9))
        confidences = [rng.uniform(0.05, 0.99, size=int(rng.integers(0, k + 1))).tolist() for _ in range(num)]
        others = (int(rng.integers(0, 3)), int(rng.integers(1, 60)), int(rng.integers(0, 2000)))
        history = rng.integers(0, 2 * k + 1, size=num).tolist()
        serial = bool(step % 5 == 0)
        now.serial = later.serial = serial
        want = now.allot(confidences, *others, history)
        got = later.allot_deferred(confidences, *others, history, work,
                                   then=lambda: then_saw.append((later.last, later.cap)))
        later.serial = not serial  # the next step's regime, set before the rest ran: it prices in its own
        assert got == want and len(work) == 1
        if step % 3:  # the device's wait ran it; else the next decision or learn settles it
            work.run()
        verified = [min(n, int(rng.integers(0, k + 1))) for n in want]
        accepted = [int(rng.integers(-1, n + 1)) for n in verified]
        now.learn(verified, accepted)
        later.learn(verified, accepted)
        work.run()  # (a task the learn settled already: nothing left to do)
        assert then_saw[-1] == (now.last, now.cap) and len(then_saw) == step + 1  # after the rest, once a decision
        assert later.drafting_pays == now.drafting_pays and later.decisions == now.decisions
        caps.add(now.cap)
    assert len(caps) >= 3  # decisions that differ
    ragged = ConfidenceScheduler(k, table, layout="ragged")
    with pytest.raises(ValueError, match="a ragged decision cannot be deferred"):
        ragged.allot_deferred([[0.9, 0.8]], 0, 0, 0, None, work)


def test_a_mixed_step_decides_its_rest_while_the_device_computes(tmp_path, monkeypatch, near_bigram_target,
                                                                  confident_drafter):
    """On a graphed engine's layout (forced here on a CPU engine), a step that feeds prompt chunks beside its
    verifies applies the cap at once and leaves the rest of its decision, and the learning of its time, to the
    executor's host work, which the runner runs while the step computes; steps that verify alone decide at once.
    Greedy outputs stay the target's; every decision is recorded once."""
    from runtime.engine import core as engine_module

    monkeypatch.setattr(engine_module, "HOST_WORK_SHARE", 1e3)  # (no budget runs out on a slow CI host)
    path = tmp_path / "table.json"
    flat_table(3.0).save(path)  # caps below whole blocks pay
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    eng = llm.engine
    eng.confidence.layout = "padded"
    work, where, calls = eng.host_work, {"device_wait": False}, []
    run, settle, deferred = work.run, eng.confidence.settle, eng.confidence.allot_deferred

    def run_marked(**kwargs):
        where["device_wait"] = True
        try:
            run(**kwargs)
        finally:
            where["device_wait"] = False

    def settle_marked():
        pending = eng.confidence._unsettled is not None
        settle()
        if pending:
            calls.append(("rest", where["device_wait"]))

    work.run, eng.confidence.settle = run_marked, settle_marked
    eng.confidence.allot_deferred = lambda *a, **k: (calls.append(("deferred", eng.scheduler.may_admit())),
                                                     deferred(*a, **k))[1]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids, outputs, steps = [eng.add_request(PROMPTS[0], greedy)], {}, 0
    while eng.has_unfinished():
        if len(ids) < len(PROMPTS) and steps % 3 == 2:  # arrivals while the others decode: mixed steps
            ids.append(eng.add_request(PROMPTS[len(ids)], greedy))
        for out in eng.step():
            outputs[out.request_id] = out.token_ids
        steps += 1
    assert [outputs[i] for i in ids] == builders.hf_greedy(near_bigram_target, PROMPTS, 16)
    deferred_calls = [c for c in calls if c[0] == "deferred"]
    rests = [c for c in calls if c[0] == "rest"]
    assert deferred_calls and len(rests) == len(deferred_calls)
    assert all(during for _, during in rests)  # each ran in the device's wait, not on the path between steps
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["decisions"] > len(deferred_calls)  # the pure verify steps (nothing to admit) decided at once
    assert stats["mixed_step_observations"] > 0  # learned by the host work
    trace_agrees_with_the_stats(eng.confidence_stats)  # deferred decisions traced with their own steps


def test_a_step_that_admits_an_arrival_is_priced_with_its_prompt(tmp_path, near_bigram_target, confident_drafter):
    """An arrival joins the next step with its whole prompt: the decision made before that step prices it beside the
    verifies (such steps were priced as the verifies alone, 7.9 ms where they took 21), where the requests
    already running feed nothing else."""
    path = tmp_path / "table.json"
    flat_table(0.001).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    eng, seen = llm.engine, []
    method = eng.confidence.allot
    eng.confidence.allot = lambda confidences, others=0, other_tokens=0, *a, **k: (
        seen.append((len(confidences), others, other_tokens)), method(confidences, others, other_tokens, *a, **k))[1]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [eng.add_request(prompt, greedy) for prompt in PROMPTS[:2]]
    while not seen:
        eng.step()
    assert seen[-1][1:] == (0, 0)  # both decoding, nobody waits: the verifies alone
    late = eng.add_request(PROMPTS[2], greedy)
    eng.step()
    assert seen[-1] == (2, 1, len(PROMPTS[2]))  # the arrival's 31 prompt tokens beside the two verifies
    outputs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id] = out.token_ids
    assert [outputs[i] for i in (*first, late)] == builders.hf_greedy(near_bigram_target, PROMPTS[:3], 12)


def test_with_prefill_apart_every_decision_is_a_pure_verify_step(tmp_path, near_bigram_target, confident_drafter):
    """``enable_mixed_prefill=False``: arrivals and prompt chunks get steps of their own, so each step the scheduler
    decides feeds only verifies: priced as such (nothing beside them) and packed where packed graphs serve it, and
    no decision is made for a prefill step. Greedy outputs stay the target's."""
    path = tmp_path / "table.json"
    flat_table(0.001).save(path)
    llm = LLM(str(near_bigram_target), speculative_config=DSparkDecodingConfig(
        speculative_model=str(confident_drafter), enable_confidence_scheduling=True,
        confidence_cost_table_path=str(path), speculation_guard=False), **{**ENGINE, "enable_mixed_prefill": False,
                                                  "max_num_batched_tokens": 16})
    eng, chosen = llm.engine, []
    eng._packs_steps_of = lambda num: True
    for name in ("allot", "allot_packed"):
        method = getattr(eng.confidence, name)
        setattr(eng.confidence, name, lambda confidences, others=0, other_tokens=0, *a, _m=method, _n=name, **k: (
            chosen.append((_n, others, other_tokens)), _m(confidences, others, other_tokens, *a, **k))[1])
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids, outputs, steps = [eng.add_request(PROMPTS[0], greedy)], {}, 0
    while eng.has_unfinished():
        if len(ids) < len(PROMPTS) and steps % 3 == 2:  # an arrival every third step, one of 31 tokens (chunks)
            ids.append(eng.add_request(PROMPTS[len(ids)], greedy))
        for out in eng.step():
            outputs[out.request_id] = out.token_ids
        steps += 1
    assert chosen and all(decision == ("allot_packed", 0, 0) for decision in chosen)
    assert [outputs[i] for i in ids] == builders.hf_greedy(near_bigram_target, PROMPTS, 12)


def test_expected_admissions_follow_the_schedules_limits():
    """The queue's head in arrival order, within the token budget (a prompt cut at it) and the free slots."""
    pages = PageAllocator(num_pages=64, page_size=4)
    scheduler = Scheduler(SchedulerLimits(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128), pages)
    for n, length in enumerate((10, 30, 5)):
        scheduler.add(Sequence(f"r{n}", list(range(3, 3 + length)), SamplingParams(max_tokens=4), seed=0, arrival=n))
    assert scheduler.expected_admissions(64) == (3, 45)
    assert scheduler.expected_admissions(20) == (2, 20)  # the second prompt cut at the budget
    assert scheduler.expected_admissions(0) == (0, 0)
    scheduler.schedule()  # all three admitted: no slot left
    assert scheduler.expected_admissions(64) == (0, 0)


def test_scheduling_needs_a_confidence_head(near_bigram_target, make_drafter):
    bare = make_drafter(near_bigram_target, 4, confidence=False)
    with pytest.raises(ValueError, match="enable_confidence_scheduling needs a drafter with a confidence head"):
        engine(near_bigram_target, bare, enable_confidence_scheduling=True)


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution_with_scheduling_on(tmp_path, near_bigram_target,
                                                                         make_drafter):
    """Rejection sampling with ragged, confidence-chosen verify lengths: still the target's joint distribution."""
    path = tmp_path / "table.json"
    flat_table(0.02).save(path)  # a token costs a little: the budget lands between none and all
    drafter = make_drafter(near_bigram_target, 2, "vanilla", oracle=True, oracle_scale=3.0)
    spec = DSparkDecodingConfig(speculative_model=str(drafter), use_rejection_sampling=True,
                                enable_confidence_scheduling=True, confidence_cost_table_path=str(path),
                                speculation_guard=False)
    llm = LLM(str(near_bigram_target), speculative_config=spec, dtype="float32", device="cpu", num_pages=4096,
              page_size=4, max_num_seqs=512, max_num_batched_tokens=4096)
    name = "top-k=5"
    joint = exact_joint(near_bigram_target, 1.0, 5, 1.0)
    tv, bound = empirical_tv(llm, joint, FILTERS[name]), tv_bound(joint, N)
    stats = llm.get_metrics()["confidence_scheduling"]
    assert 0 < stats["mean_verify_budget_per_request"] < stats["mean_offered_per_request"]  # really trimmed
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"


def test_a_row_is_read_as_its_lower_envelope():
    """GPU step times are not monotone in the tokens fed (a 2.7B target at 64 requests: 7 tokens a request
    9.3 ms, 8 tokens 8.1). A row reads each cell as the cheapest of itself and every longer cell: a dearer shorter
    cell is priced as the longer one, so the scheduler never chooses it, and the whole block keeps its own price
    (the least-squares non-decreasing fit read before pooled 10.36 and 8.55 ms into 9.46: whole blocks 11% too
    dear, one run). A spike is ignored; a dip is a trim the scheduler makes, serves, and so learns at its cost."""
    tokens = [64 * q for q in range(1, 9)]
    row = [5.5, 5.9, 6.6, 6.7, 8.7, 8.1, 10.4, 8.6]  # one run's profiled 64-request row, 1..8 tokens a request
    table = StepCostTable([64], tokens, [row])
    predicted = table.predict_ms_many(64, np.asarray(tokens))
    assert predicted.tolist() == pytest.approx([5.5, 5.9, 6.6, 6.7, 8.1, 8.1, 8.6, 8.6])
    assert table.step_ms[0].tolist() == row  # what was measured is kept (and saved) as measured
    scheduler = ConfidenceScheduler(7, table, layout="packed")
    likely = [[0.95, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8]] * 64
    scheduler.allot_packed(likely)
    assert scheduler.columns == 7  # whole blocks at their own 8.6 ms, never 6 columns at the same price
    # one run's host-bound batch-1 row with a dip at 4 tokens: the scheduler trims to it, and the served steps
    # teach the cell its real cost until whole blocks are chosen again
    dip = StepCostTable([1], list(range(1, 9)), [[1.49, 1.65, 1.70, 1.10, 1.68, 1.68, 1.72, 1.73]])
    assert dip.predict_ms_many(1, np.arange(1, 9)).tolist() == pytest.approx([1.10] * 4 + [1.68, 1.68, 1.72, 1.73])
    fooled = ConfidenceScheduler(7, dip, layout="padded")
    likely = [[0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5]]
    fooled.allot(likely)
    assert fooled.cap == 3
    for _ in range(40):  # the trimmed steps take 1.66 ms
        fooled.allot(likely)
        dip.observe(1, 4, 0.00166)
    dip.flush()
    assert fooled.allot(likely) == [7] or fooled.cap == 7
    spiky = StepCostTable([192], list(range(1, 9)), [[3.20, 4.91, 4.04, 4.20, 3.85, 3.88, 3.93, 3.72]])
    assert spiky.predict_ms_many(192, np.arange(1, 9)).tolist() == pytest.approx([3.20] + [3.72] * 7)
    rising = StepCostTable([1], list(range(1, 9)), [[1.0 + 0.1 * t for t in range(1, 9)]])
    assert rising.predict_ms_many(1, np.arange(1, 9)) == pytest.approx([1.0 + 0.1 * t for t in range(1, 9)])


def test_a_packed_step_drafts_one_past_the_longest_share_a_request_took_at_the_columns_chosen():
    """The block for a packed step is drafted before it exists: the device will pick the top S x c survivals, so the
    engine drafts one past the longest share a request took of this block at those columns (a request it trusts
    takes more than c, one it doubts none), whole blocks at whole-block columns, one draft at none."""
    survival = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.1, 0.05, 0.01], [0.4, 0.3, 0.02, 0.01]])
    # 2 columns over 3 requests: the top 6 are the trusted request's 4 and the others' first (0.5, 0.4)
    assert top_drafts(survival, np.ones_like(survival, dtype=bool), 6).tolist() == [4, 1, 1]
    assert packed_draft_len(survival, [4, 4, 4], 2, 7) == 5  # grows past the block: a request took all of it
    assert packed_draft_len(survival, [4, 4, 4], 2, 4) == 4  # (never past max_draft_len)
    assert packed_draft_len(survival, [4, 4, 4], 1, 7) == 4  # top 3: the trusted request's first three
    assert packed_draft_len(survival, [4, 4, 4], 7, 7) is None  # whole blocks: the schedule's length
    assert packed_draft_len(survival, [4, 4, 4], 0, 7) == 1  # nothing verified: one draft keeps it in view
    assert packed_draft_len(survival, [2, 4, 4], 2, 7) == 3  # the first block proposed two: it takes both
    # the scheduler sets it with the columns it chose for the next step: here only first drafts pay
    costs = StepCostTable([64], [64 * q for q in range(1, 9)], [[2.0 + 0.02 * 64 * q for q in range(1, 9)]])
    scheduler = ConfidenceScheduler(7, costs, layout="packed")
    assert scheduler.packed_draft_len is None  # no decision yet: whole blocks
    scheduler.allot_packed([[0.9] + [0.05] * 6] * 64)
    assert scheduler.columns == 1 and scheduler.packed_draft_len == 2


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("requests", [3, 40])  # the plain-Python path and numpy's
def test_graphed_steps_are_priced_at_the_graph_they_replay(layout, requests):
    """A graphed step of n requests replays the graph of the smallest batch bucket holding them, its padding rows
    computed too: it is priced at that bucket's row and rows x (Q + 1) tokens (the cells the engine learns it in),
    never at n's nearest row. One run's steps of 60 and 72 requests sat in the 64 row and priced its whole blocks
    ~13% too dear. A mixed step (a prefill chunk beside) stays at its own sizes."""
    k, bucket = 4, 4 if requests == 3 else 64
    batches = [1, 2, 4, 8, 16, 32, 64]
    tokens = [b * q for b in batches for q in range(1, k + 2)]
    # every row: 1 ms per token fed (so the row says which batch a step was read at: 10x less from 32 requests)
    table = StepCostTable(batches, sorted(set(tokens)), [[float(t) if b in (bucket, 32) else math.nan
                                                         for t in sorted(set(tokens))] for b in batches])
    scheduler = ConfidenceScheduler(k, table, layout=layout, graph_batches=batches)
    confidences = [[0.9, 0.8, 0.7, 0.6]] * requests
    if layout == "packed":
        scheduler.allot_packed(confidences)
    else:
        scheduler.allot(confidences)
    assert scheduler.graph_rows(requests) == bucket and scheduler.graph_rows(100) == 100
    assert scheduler.last.whole_predicted_ms == pytest.approx(table.predict_ms(bucket, bucket * (k + 1)))
    assert scheduler.last.whole_predicted_ms == pytest.approx(bucket * (k + 1))
    plain = ConfidenceScheduler(k, table, layout=layout)  # no graphs: the step's own batch
    plain.allot_packed(confidences) if layout == "packed" else plain.allot(confidences)
    assert plain.last.whole_predicted_ms == pytest.approx(table.predict_ms(requests, requests * (k + 1)))
    if layout == "padded":
        scheduler.allot(confidences, other_requests=1, other_tokens=16)
        assert scheduler.last.whole_predicted_ms == pytest.approx(
            scheduler.mixed_costs.predict_ms(requests + 1, 16 + requests * (k + 1), 0, 16))
        assert scheduler.last.whole_predicted_ms == pytest.approx(table.predict_ms(requests + 1, 16 + requests * (k + 1)))


def test_the_table_learns_whole_steps_as_the_startup_profile_times_them(tmp_path, near_bigram_target,
                                                                         confident_drafter, monkeypatch):
    """A served step is observed schedule to commit, as ``runtime.engine.step_profile`` times a step: host work outside
    the executor (here a commit made 30 ms slower) is in the observed time. Observing the executor alone made the cells the
    scheduler served look cheaper than the profiled ones it did not serve, so it kept trimming."""
    import time as time_module

    path = tmp_path / "table.json"
    flat_table(0.0, base=1.0).save(path)  # every step 1 ms, whatever it verifies
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    eng = llm.engine
    slow_commit = eng._commit_step

    def commit(*args, **kwargs):
        time_module.sleep(0.03)
        return slow_commit(*args, **kwargs)

    monkeypatch.setattr(eng, "_commit_step", commit)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["mean_measured_step_ms"] >= 30.0 and stats["mean_measured_decided_step_ms"] >= 30.0
    eng.confidence.costs.flush()  # the steps gathered since the last OBSERVE_EVERY
    assert eng.confidence.costs.observations > 0 and np.nanmax(eng.confidence.costs.step_ms) > 1.0 + 0.1 * 29.0
    assert eng.confidence.costs.context.max() > 0  # moving toward the contexts its request attended (7 tokens on)


def test_steps_that_feed_more_than_verifies_learn_the_mixed_excess(tmp_path, near_bigram_target, confident_drafter):
    """The prefill steps and the steps mixing a prefill chunk with verifies teach the mixed steps' excess
    (``MixedStepCosts``), never the verify steps' table, which only the steps of verifies alone teach: in one run one
    table let the ramp's mixed steps (eager, dearer) teach the whole-block cell at 256 requests 15 ms where a graphed
    whole-block step took 11.7, and the scheduler trimmed to 5.8 of 7 drafts for 0.86 of the tuned throughput. A
    mixed step is priced as the verify table's cell of its sizes plus that excess."""
    path = tmp_path / "table.json"
    flat_table(0.0, base=1.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    scheduler = llm.engine.confidence
    assert scheduler.mixed_costs.verify is scheduler.costs and scheduler.mixed_costs.excess_ms(4, 16) == 0.0
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.engine.add_request(PROMPTS[0], params)
    llm.engine.step()  # its prefill: nothing verified yet
    assert (scheduler.mixed_costs.observations, scheduler.costs.observations) == (1, 0)
    while not any(s.draft_ids for s in llm.engine.scheduler.running):
        llm.engine.step()
    llm.engine.add_request(PROMPTS[1], params)
    mixed_before = scheduler.mixed_costs.observations
    llm.engine.step()  # the first request verifies beside the second's prefill
    assert scheduler.mixed_costs.observations == mixed_before + 1 and scheduler.costs.observations == 0
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert scheduler.costs.observations > 0  # the verify steps alone, once both decode
    # the CPU's steps cost far more than the table's 1 ms: the excess learned it, and a mixed step is priced with it
    scheduler.mixed_costs.flush()
    excess = scheduler.mixed_costs.excess_ms(2, 8)
    assert excess > 0 and scheduler.predict_ms_list(2, (12,), 0, 8)[0] == pytest.approx(
        scheduler.costs.predict_ms(2, 12) + excess)
    assert scheduler.predict_ms_list(2, (12,), 0, 0)[0] == pytest.approx(scheduler.costs.predict_ms(2, 12))
    assert llm.get_metrics()["confidence_scheduling"]["mixed_step_observations"] == \
        scheduler.mixed_costs.observations


def test_the_mixed_excess_fits_what_mixed_steps_cost_beyond_the_verify_table():
    """Served mixed steps costing the verify table's cell + 6 ms + 4 ms per 256 tokens fed besides the verifies:
    the excess learns that (prior: none), the verify table is untouched, and the prediction is the sum."""
    table = StepCostTable([1, 64], [64, 512], [[2.0, 3.0], [5.0, 8.0]])
    mixed = MixedStepCosts(table)
    assert mixed.predict_ms(64, 512, 0, 100) == pytest.approx(8.0)  # nothing served: a verify step's price
    rng = np.random.default_rng(0)
    for _ in range(400):
        other = int(rng.integers(16, 512))
        batch = int(rng.integers(8, 65))
        tokens = other + batch * 8
        ms = table.predict_ms(batch, tokens) + 6.0 + 4.0 * other / 256
        mixed.observe(batch, tokens, ms / 1e3, 0, other)
    mixed.flush()
    assert mixed.observations == 400 and table.observations == 0
    for batch, other in ((64, 256), (16, 64), (40, 500)):
        assert mixed.excess_ms(batch, other) == pytest.approx(6.0 + 4.0 * other / 256, rel=0.03)
    assert mixed.predict_ms(64, 640, 0, 128) == pytest.approx(table.predict_ms(64, 640) + mixed.excess_ms(64, 128))
    fit = mixed.to_json()
    assert fit["observations"] == 400 and fit["excess"]["ms_per_other_token"] == pytest.approx(4.0 / 256, rel=0.05)
    # a fit below the verify table is read as no excess (a mixed step is not cheaper than a graphed verify step)
    cheap = MixedStepCosts(table)
    for _ in range(64):
        cheap.observe(64, 600, 1e-3, 0, 88)
    assert cheap.excess_ms(64, 88) == 0.0


def test_a_plain_mixed_step_pays_the_per_request_excess_per_verify_row():
    """The mixed excess is learned from drafting steps whose requests fed K + 1 rows each; a plain step of the same
    requests feeds one row a request, so the drafting judgement prices its alternative as the plain table plus the
    excess with its per-request part divided by the rows it was learned at (read whole, the plain
    alternative of 57 requests cost 10.4 ms where plain mixed steps took 3.9). A weak block in a mixed step then
    does not pay where the old reading (the verify-nothing step less the drafter) said it did; a strong one still
    does; a step of verifies alone is judged as before."""
    table = with_plain(flat_table(0.01), 4.0)  # drafting steps 10 ms + 0.01 a token, plain decoding 4 ms
    scheduler = ConfidenceScheduler(4, table, layout="padded")
    rng = np.random.default_rng(1)
    for _ in range(200):  # mixed steps of 5 rows a request: 1 ms + 0.2 ms a request beyond the verify table
        batch, other = int(rng.integers(8, 65)), int(rng.integers(16, 256))
        tokens = batch * 5 + other
        scheduler.mixed_costs.observe(batch, tokens, (table.predict_ms(batch, tokens) + 1.0 + 0.2 * batch) / 1e3, 0,
                                      other)
    scheduler.mixed_costs.flush()
    mixed = scheduler.mixed_costs
    assert mixed.rows_per_request == pytest.approx(5.0)
    assert mixed.excess_ms(32, 64) == pytest.approx(1.0 + 0.2 * 32, rel=0.05)
    a, b, c = mixed.coefficients
    assert mixed.plain_excess_ms(33, 64) == pytest.approx(a + b * 64 / 256 + c * 33 / 64 / mixed.rows_per_request)
    weak, strong = [[0.5] * 4] * 32, [[0.99] * 4] * 32
    scheduler.allot(weak, 1, 64, 0)
    decision = scheduler.last  # 1.94 tokens a request in ~20 ms, against one in ~7
    assert decision.plain_ms == pytest.approx(4.0 + mixed.plain_excess_ms(33, 64))
    assert scheduler.drafting_pays is False and decision.drafting_pays is False
    none_ms = scheduler.predict_ms_many(33, np.array([64 + 32]), 0, 64)[0]
    old = none_ms - (table.predict_ms(32, 32) - 4.0)  # the old reading: ~12.4 ms, and drafting "paid"
    assert decision.expected_tokens * old >= 32 * decision.predicted_ms > decision.expected_tokens * decision.plain_ms
    scheduler.allot(strong, 1, 64, 0)
    assert scheduler.drafting_pays is True  # ~4.9 tokens a request
    scheduler.allot(weak)  # verifies alone: the verify-nothing step less the drafter, as before
    assert scheduler.last.plain_ms == pytest.approx(table.predict_ms(32, 32) - (table.predict_ms(32, 32) - 4.0))
    # plain mixed steps served (a drafting hold's): once TUNING.plain_mixed_min were, their own excess prices the plain
    # alternative (here 2.5 ms beyond the plain table: drafting the strong block still pays, at a measured price)
    for step in range(TUNING.plain_mixed_min):
        assert scheduler.plain_mixed.observations == step
        scheduler.allot(strong, 1, 64, 0)
        assert scheduler.last.plain_ms == pytest.approx(4.0 + mixed.plain_excess_ms(33, 64))  # not yet
        scheduler.observe_plain_mixed_step(30 + step % 8, (4.0 + 2.5) / 1e3, 0, 40 + 8 * step)
    scheduler.allot(strong, 1, 64, 0)
    measured = scheduler.plain_mixed.predict_ms_list(33, (33,), 0, 64)[0]
    assert scheduler.last.plain_ms == pytest.approx(measured) and measured == pytest.approx(6.5, abs=0.3)
    assert scheduler.drafting_pays is True
    assert ConfidenceScheduler(4, flat_table(0.01)).plain_mixed is None  # no plain steps profiled: nothing to learn


def test_a_mixed_step_dominated_by_its_prefill_keeps_whole_blocks():
    """One run (an H200, 64 requests under mixed load): verify steps cost 5-8 ms, mixed ones 12-13. Priced as verify
    steps, trimming two drafts saves ~20% of the step and pays; priced with the excess the mixed steps showed, it
    saves ~10% of a dear step for ~20% of the tokens, and the scheduler keeps whole blocks."""
    k, num, other = 7, 64, 96
    tokens = [num * q for q in range(1, k + 2)] + [other + num * q for q in range(1, k + 2)]
    tokens = sorted(set(tokens))
    table = StepCostTable([num, num + 1], tokens, [[3.0 + t / 128 for t in tokens]] * 2)  # 1 ms per 128 tokens
    confidences = [[0.97, 0.95, 0.95, 0.92, 0.9, 0.4, 0.3]] * num  # the last two drafts survive ~0.29 / ~0.09
    cheap = ConfidenceScheduler(k, table, layout="padded", graph_batches=[num])
    cheap.allot(confidences, other_requests=1, other_tokens=other)
    assert cheap.cap < k  # a verify step's price: the trim pays
    dear = ConfidenceScheduler(k, table, layout="padded", graph_batches=[num])
    for _ in range(64):  # the mixed steps served cost the table's cell + 6 ms
        t = other + num * (k + 1)
        dear.mixed_costs.observe(num + 1, t, (table.predict_ms(num + 1, t) + 6.0) / 1e3, 0, other)
    dear.allot(confidences, other_requests=1, other_tokens=other)
    assert dear.cap == k and dear.last.whole_predicted_ms > table.predict_ms(num + 1, other + num * (k + 1)) + 5.0


def test_a_served_step_moves_its_own_cell_and_the_envelope_reads_the_rest():
    """A served step moves only its own cell; the row's lower envelope then prices every shorter cell no dearer
    than it. One run's startup profile timed the shorter verify lengths 1.5-3 ms too slow; serving visited only the
    full-block cell, and the untouched cells must not go on saying that trimming saves nothing. A raised cell says
    nothing of the longer ones (steps of 60 requests raised a cell of the 64-request row, and the bound read
    before carried it to the whole block)."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    profiled = [4.97, 5.01, 4.66, 4.72, 4.63, 4.41, 3.22, 3.25]  # one run's batch-1 row
    table = StepCostTable([1, 4], tokens, [profiled, [2.0] * 8])
    for _ in range(60):  # the served full-block steps take 1.78 ms
        table.observe(1, 8, 0.00178)
    table.flush()
    assert table.step_ms[0].tolist() == pytest.approx(profiled[:7] + [1.78], abs=0.01)
    assert table.predict_ms_many(1, np.arange(1, 9)) == pytest.approx([1.78] * 8, abs=0.01)
    assert table.step_ms[1].tolist() == [2.0] * 8  # another batch's row is its own
    rising = StepCostTable([1], tokens, [[1.0 + 0.1 * t for t in tokens]])
    rising.observe(1, 1, 0.005)  # raised to 1.49: the longer cells stay, and the envelope reads it at 1.2
    rising.flush()
    assert rising.step_ms[0].tolist() == pytest.approx([1.49, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8])
    assert rising.predict_ms(1, 1) == pytest.approx(1.2)
    gaps = StepCostTable([1], [1, 2, 3], [[5.0, math.nan, 6.0]])
    for _ in range(10):  # 6 -> 1 + 5 x 0.9^10 ms: the 1-token cell reads no dearer; the gap stays a gap
        gaps.observe(1, 3, 0.001)
    gaps.flush()
    assert math.isnan(gaps.step_ms[0][1]) and gaps.step_ms[0][0] == 5.0
    assert gaps.predict_ms(1, 1) == pytest.approx(1 + 5 * 0.9 ** 10) == gaps.step_ms[0][2]


def served(table: StepCostTable, batch: int, tokens: int, contexts, cost) -> None:
    """Serve steps of ``batch`` requests feeding ``tokens`` at each context of ``contexts``, each taking
    ``cost(tokens, context)`` ms, and learn them."""
    for context in contexts:
        table.observe(batch, tokens, 1e-3 * cost(tokens, context), int(context))
    table.flush()


def test_the_table_learns_what_a_context_token_costs_and_reads_every_cell_at_the_asked_context(tmp_path):
    """A step's time grows with the KV tokens its requests attend over; a cell remembers the context it was measured
    at, and the slope learned from the served steps reads every cell at the context asked. One run: a startup
    profile at under ~100 tokens of context a request beside cells served at 101-354, compared as if alike: predicted
    steps 7% under the measured, 5.7 of 7 drafts verified for 0.97 of whole blocks' throughput."""
    tokens = [4, 8, 12, 16, 20, 24, 28, 32]

    def cost(t, context):  # ms: 10 + 0.5 per token fed + 0.01 per context token
        return 10.0 + 0.5 * t + 0.01 * context

    table = StepCostTable([4], tokens)
    for t in tokens:  # the startup profile: short contexts
        table.record(4, t, cost(t, 400), context=400)
    assert table.ms_per_context_token == 0.0
    served(table, 4, 32, range(400, 4400, 50), cost)  # 80 served steps of whole blocks as the contexts grow
    assert table.ms_per_context_token == pytest.approx(0.01, rel=0.02)
    assert table.context[0, -1] > 2500  # the served cell moved to the contexts it saw
    # every cell read at one context, the profiled ones as well as the served one: the true costs
    for context in (400, 3600):
        assert table.predict_ms_many(4, tokens, context) == pytest.approx([cost(t, context) for t in tokens],
                                                                         rel=0.01)
    # without the contexts (a table written before they were kept) the served cell, measured late, reads ten
    # times dearer than the profiled cell beside it
    legacy = {k: v for k, v in table.to_json().items() if k in ("batch_sizes", "token_counts", "step_ms")}
    alike = StepCostTable.from_json(legacy)
    assert alike.context.tolist() == [[0.0] * len(tokens)] and alike.ms_per_context_token == 0.0
    assert alike.predict_ms(4, 32, 3600) - alike.predict_ms(4, 28, 3600) > 10 * (cost(32, 0) - cost(28, 0))
    path = tmp_path / "table.json"
    table.save(path)
    again = StepCostTable.load(path)
    assert again.to_json() == table.to_json() and again.ms_per_context_token == table.ms_per_context_token
    with pytest.raises(ValueError, match="context_tokens must be 1 rows of 8 non-negative numbers"):
        StepCostTable.from_json({**legacy, "context_tokens": [[-1.0] * len(tokens)]})


def test_the_plain_alternative_is_the_plain_step_at_the_steps_context_not_the_verify_slope_over_all_of_it():
    """The drafter's cost, taken off the verify-nothing step to price plain decoding, is the two tables' difference
    at the step's own context: with a verify slope learned (0.01 ms a context token) and the plain table's steps
    profiled (no slope of its own), the plain alternative at 3000 context tokens is the plain step (4 ms), not 4 +
    0.01 x 3000 (256 requests: plain decoding priced 10.1 ms where the held plain steps took 6.1)."""
    tokens = [1, 2, 3, 4, 5]

    def cost(t, context):
        return 10.0 + 1.0 * t + 0.01 * context

    table = StepCostTable([1], tokens)
    for t in tokens:
        table.record(1, t, cost(t, 400), context=400)
    served(table, 1, 5, range(400, 4400, 50), cost)
    assert table.ms_per_context_token == pytest.approx(0.01, rel=0.02)
    table.plain = StepCostTable([1], [1], [[4.0]])
    scheduler = ConfidenceScheduler(4, table)
    scheduler.allot([[0.9] * 4], context=3000)
    assert scheduler.last.plain_ms == pytest.approx(4.0, abs=0.05)
    assert scheduler.last.whole_predicted_ms == pytest.approx(cost(5, 3000), rel=0.01)  # the verifies at 3000


def test_the_slope_waits_for_evidence_never_goes_negative_and_the_envelope_compares_at_one_context():
    tokens = [4, 8]
    table = StepCostTable([4], tokens, [[10.0, 12.0]])
    served(table, 4, 8, range(0, 40 * 100, 100), lambda t, c: 12.0 + 0.01 * c)  # 40 steps: too few to use
    assert table.ms_per_context_token == 0.0
    falling = StepCostTable([4], tokens, [[10.0, 12.0]])
    served(falling, 4, 8, range(0, 8000, 100), lambda t, c: 92.0 - 0.01 * c)  # cheaper at longer contexts: noise
    assert falling.ms_per_context_token == 0.0
    served(table, 4, 8, range(4000, 8000, 100), lambda t, c: 12.0 + 0.01 * c)  # 80 steps in all: it is used
    assert table.ms_per_context_token > 0.005
    # the envelope compares cells at one context: a cell measured at a long context bounds a shorter one only
    # where, read at the same context, it is cheaper
    def bounded(slope: float) -> StepCostTable:
        table = StepCostTable([4], tokens)
        table.record(4, 4, 10.0, context=0)
        table.record(4, 8, 12.0, context=2000)
        table.ms_per_context_token = slope
        return table

    # at 0.005 ms a context token the 12 ms cell reads 2 ms at no context: below the 10 ms cell
    assert bounded(0.005).predict_ms_many(4, np.asarray(tokens), 2000).tolist() == pytest.approx([12.0, 12.0])
    # at 0.0005, 11 ms at no context: above it, so each keeps its own
    assert bounded(0.0005).predict_ms_many(4, np.asarray(tokens), 0).tolist() == pytest.approx([10.0, 11.0])


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_the_scheduler_compares_verify_lengths_at_the_steps_own_context(layout):
    """The profile measured short verifies at short contexts, serving measured whole blocks at long ones: read
    as alike, whole blocks look dear and the scheduler trims drafts that pay; read at one context, it verifies whole
    blocks, as the true costs say."""
    batch, k = 4, 7
    tokens = [batch * (n + 1) for n in range(k + 1)]

    def cost(t, context):  # ms: verify tokens are cheap, context dear
        return 10.0 + 0.1 * t + 0.01 * context

    def scheduler_over(table):
        scheduler = ConfidenceScheduler(k, table, layout=layout)
        confidences = [[0.95] * k] * batch
        for _ in range(3):
            lengths = scheduler.allot(confidences, context=4000)
        return lengths

    table = StepCostTable([batch], tokens)
    for t in tokens[:-1]:
        table.record(batch, t, cost(t, 200), context=200)
    table.record(batch, tokens[-1], cost(tokens[-1], 200), context=200)
    served(table, batch, tokens[-1], range(200, 4000, 50), cost)
    assert table.ms_per_context_token == pytest.approx(0.01, rel=0.02)
    assert scheduler_over(table) == [k] * batch
    alike = StepCostTable.from_json({k_: v for k_, v in table.to_json().items()
                                     if k_ in ("batch_sizes", "token_counts", "step_ms")})
    assert scheduler_over(alike) != [k] * batch  # without the contexts it trims


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("calibrated", [True, False])
def test_a_small_step_decides_in_plain_python_exactly_as_numpy(monkeypatch, calibrated, layout):
    """A step of few drafts is decided in plain Python (numpy's first calls after an engine step cost more than its
    arithmetic); over random steps (blocks cut short, confidences of 0, mixed-in prefill, a context, a learned
    survival fit and context slope, exploration, requests of every verify-history class) it chooses the same lengths
    and caps (or budgets), predicts the same tokens and time, and learns the same fit as the numpy path."""
    from runtime.spec import confidence as confidence_scheduler

    k = 5
    rng = np.random.default_rng(0)
    tokens = sorted({b * (n + 1) for b in (1, 2, 4, 8) for n in range(k + 1)} | {64, 128})
    table = StepCostTable([1, 2, 4, 8], tokens, [[2.0 + 0.05 * b + 0.3 * t ** 0.7 + (0.4 if t > 20 else 0.0)
                                                  for t in tokens] for b in (1, 2, 4, 8)])
    for step in range(80):
        table.observe(4, 4 * (step % 6 + 1), 1e-3 * (3.0 + 0.002 * step * 40), 40 * step)
    table.flush()
    temps = [0.7, 1.3, 2.0, 0.9, 1.1] if calibrated else None
    python, vectorized = (ConfidenceScheduler(k, table, temps, min_gain=0.02, layout=layout) for _ in range(2))
    caps = set()
    for step in range(300):
        num = int(rng.integers(1, 9))
        confidences = []
        for _ in range(num):
            block = rng.uniform(0.05, 0.99, size=int(rng.integers(0, k + 1))).round(6).tolist()
            if block and rng.random() < 0.1:
                block[int(rng.integers(0, len(block)))] = 0.0
            confidences.append(block)
        others = (int(rng.integers(0, 3)), int(rng.integers(0, 40)), int(rng.integers(0, 4000)))
        history = rng.integers(0, 2 * k + 1, size=num).tolist()
        monkeypatch.setattr(confidence_scheduler, "TUNING", dataclasses.replace(TUNING, small_step=64))
        got = python.allot(confidences, *others, history)
        monkeypatch.setattr(confidence_scheduler, "TUNING", dataclasses.replace(TUNING, small_step=0))
        want = vectorized.allot(confidences, *others, history)
        assert got == want and python.cap == vectorized.cap
        assert python.budget_per_request == vectorized.budget_per_request
        caps.add(python.cap if layout == "padded" else python.budget_per_request)
        if python.last is not None:
            assert python.last.budget == vectorized.last.budget
            assert python.last.expected_tokens == pytest.approx(vectorized.last.expected_tokens, rel=1e-12)
            assert python.last.predicted_ms == pytest.approx(vectorized.last.predicted_ms, rel=1e-12)
        if any(got):
            verified = [min(n, int(rng.integers(0, k + 1))) for n in got]
            accepted = [int(rng.integers(-1, n + 1)) for n in verified]
            python.learn(verified, accepted)
            vectorized.learn(verified, accepted)
    python.correction.fold()
    vectorized.correction.fold()
    assert python.correction.learned and python.explored > 0 and len(caps) >= 3  # decisions that differ
    assert python.correction.ratio.tolist() == pytest.approx(vectorized.correction.ratio.tolist(), rel=1e-12)
    assert python.correction.theta.tolist() == vectorized.correction.theta.tolist()
    assert (python.correction.theta != python.correction.prior).any()  # the fit moved


@pytest.mark.parametrize("layout", ["ragged", "padded", "packed"])
@pytest.mark.parametrize("requests", [3, 40])  # a small step (plain Python) and a large one (numpy)
def test_every_decision_records_the_survival_it_believed_at_each_position(layout, requests):
    """What the scheduler believed of every draft, verified or not (``Decision.position_survival``, averaged in
    ``mean_predicted_survival_per_position``): the bench sets it beside a whole-block engine's acceptance per
    position, which is what it should have been, so a trim made on survivals predicted too low shows as such."""
    rng = np.random.default_rng(requests)
    confidences = [list(rng.uniform(0.2, 0.99, size=4)) for _ in range(requests)]
    confidences[0] = confidences[0][:2]  # a short block: 0 past it
    scheduler = ConfidenceScheduler(4, flat_table(0.01), layout=layout)
    if layout == "packed":
        scheduler.allot_packed(confidences)
    else:
        scheduler.allot(confidences)
    table = np.zeros((requests, 4))
    for i, row in enumerate(confidences):
        table[i, :len(row)] = row
    assert scheduler.last.position_survival == pytest.approx(np.cumprod(table, axis=1).sum(axis=0).tolist())
    stats = ConfidenceStats()
    stats.record_decision(scheduler.last, requests)
    stats.record_decision(scheduler.last, requests)
    mean = stats.as_dict(scheduler)["mean_predicted_survival_per_position"]
    assert mean == pytest.approx((np.cumprod(table, axis=1).mean(axis=0)).tolist(), abs=1e-4)


def test_the_measured_step_time_beside_the_prediction_is_the_decided_steps_alone():
    """``mean_predicted_step_ms`` is the mean over the steps the scheduler decided; its measured counterpart is
    over the same steps (``mean_measured_decided_step_ms``), not over every timed step: one run's ramps made the
    all-steps mean 9.04 ms against 7.83 for the steady steps it predicted 7.94 for."""
    scheduler = ConfidenceScheduler(4, flat_table(0.01), layout="packed")
    stats = ConfidenceStats()
    scheduler.allot_packed([[0.9, 0.8, 0.7, 0.6]] * 4)
    stats.record_decision(scheduler.last, 4)
    stats.record_step(8.0)
    stats.record_step(20.0, decided=False)  # a prefill step of the ramp: no decision
    metrics = stats.as_dict(scheduler)
    assert metrics["mean_measured_decided_step_ms"] == 8.0 and metrics["mean_measured_step_ms"] == 14.0
    assert metrics["last"]["measured_step_ms"] == 8.0


def test_the_step_trace_keeps_each_steps_decision_beside_its_time_and_sums_it_by_kind():
    """``ConfidenceStats.trace``: one entry per timed step (the newest ``TUNING.trace_steps``), the decision's figures on
    decided steps only; ``trace_since`` takes a window by step number; the summary splits decided steps launched
    ahead from serial ones, and held steps from the rest (one run's whole-block price, 8.46 ms against the table's
    7.91, was a mean over both kinds)."""
    scheduler = ConfidenceScheduler(4, flat_table(0.01), layout="padded")
    stats = ConfidenceStats()
    stats.record_step(20.0, decided=False, requests=2, prompt_tokens=30)  # a prefill step of the ramp
    for serial, ms in ((False, 8.0), (True, 11.0), (False, 9.0)):
        scheduler.allot([[0.9, 0.8, 0.7, 0.6]] * 2)
        stats.record_decision(scheduler.last, 2)
        stats.record_outcome(5)
        stats.record_step(ms, serial=serial, requests=2, committed=5, decision=scheduler.last)
    stats.drafting_off_steps += 1
    stats.record_step(4.0, decided=False, requests=2, held=True)
    window = stats.trace_since(1, 4)  # the three decided steps
    assert window["fields"] == list(TRACE_FIELDS) and [row[0] for row in window["steps"]] == [2, 3, 4]
    row = dict(zip(TRACE_FIELDS, window["steps"][1]))
    assert row["serial"] and row["ms"] == 11.0 and row["budget"] == 8 == row["offered"]
    assert row["committed_tokens"] == 5 and row["predicted_ms"] == round(scheduler.last.predicted_ms, 4)
    summary = stats.trace_since()["summary"]
    assert summary["decided"]["steps"] == 2 and summary["decided"]["ms"] == 8.5
    assert summary["decided_serial"]["steps"] == 1 and summary["decided_serial"]["ms"] == 11.0
    assert summary["held"] == {"steps": 1, "ms": 4.0, "mixed": 0}
    assert summary["other"] == {"steps": 1, "ms": 20.0, "mixed": 1}  # (it fed prompt chunks)
    assert stats.trace[0][TRACE_FIELDS.index("prompt_tokens")] == 30 and summary["decided"]["mixed"] == 0
    assert summary["decided"]["committed_tokens"] == 5 and summary["decided"]["explores"] == 0
    # a snapshot (as the bench takes one before a run) starts its own trace; the engine's keeps the newest steps
    import dataclasses

    assert not dataclasses.replace(stats).trace and len(stats.trace) == 5
    for _ in range(TUNING.trace_steps):
        stats.record_step(1.0, decided=False)
    assert len(stats.trace) == TUNING.trace_steps and stats.trace[0][0] == 6


def test_a_decision_that_raises_the_next_budget_to_whole_blocks_says_so():
    """Every ``TUNING.explore_every``-th decision below whole blocks verifies whole blocks next: its ``Decision`` (and so
    the step trace) marks it."""
    scheduler = ConfidenceScheduler(4, flat_table(3.0), layout="padded")  # caps below whole blocks pay
    marks = []
    for _ in range(2 * TUNING.explore_every):
        scheduler.allot([[0.9, 0.5, 0.2, 0.1]] * 2)
        marks.append(scheduler.last.explores)
        if scheduler.last.explores:
            assert scheduler.cap == 4  # the next step verifies whole blocks
    assert sum(marks) == scheduler.explored >= 1 and not all(marks)


def test_a_bad_verify_history_is_refused_naming_what_was_expected():
    scheduler = ConfidenceScheduler(3, flat_table(0.001))
    for small in (True, False):  # the plain-Python and the numpy paths
        confidences = [[0.5, 0.5, 0.5]] * (2 if small else 60)
        with pytest.raises(ValueError, match="verify-history classes in 0..6 expected"):  # 2K + 1 of K = 3
            scheduler.allot(confidences, history=[0, 7] + [0] * (len(confidences) - 2))
        with pytest.raises(ValueError, match=f"{len(confidences)} verify-history classes"):
            scheduler.allot(confidences, history=[0])


# ---- drafting at all (point 6): plain decoding's steps, the drafting hold ----------------------------------


def with_plain(table: StepCostTable, plain_ms: float) -> StepCostTable:
    """``table`` with plain decoding's steps costing ``plain_ms`` at batch 1 and 64."""
    table.plain = StepCostTable([1, 64], [1, 64], [[plain_ms, math.nan], [math.nan, plain_ms]])
    return table


def test_the_plain_steps_round_trip_with_the_table_and_a_bad_one_is_named(tmp_path):
    table = with_plain(flat_table(1.0), 3.0)
    table.save(tmp_path / "t.json")
    back = StepCostTable.load(tmp_path / "t.json")
    assert back.plain.predict_ms(64, 64) == 3.0 and back.copy().plain.predict_ms(1, 1) == 3.0
    assert StepCostTable.from_json(flat_table(1.0).to_json()).plain is None  # a table written before: none
    data = table.to_json()
    data["plain_steps"]["step_ms"] = [[1.0]]
    with pytest.raises(ValueError, match="plain_steps"):
        StepCostTable.from_json(data)


def test_drafting_pays_only_where_the_best_verify_beats_plain_decoding():
    """A verify-nothing step of 10 ms + 1 ms a token drafts too: against plain steps of 4 ms (the drafting costs
    ~7 ms at one request) a block of survivals 0.5, 0.25 ... (1.94 tokens a step at best, 12-15 ms) does not pay;
    against plain steps of 10.5 ms it does; with no plain steps the scheduler cannot tell (None)."""
    weak = [[0.5] * 4]
    cheap = ConfidenceScheduler(4, with_plain(flat_table(1.0), 4.0))
    cheap.allot(weak)
    assert cheap.drafting_pays is False
    dear = ConfidenceScheduler(4, with_plain(flat_table(1.0), 10.5))
    dear.allot(weak)
    assert dear.drafting_pays is True
    unknown = ConfidenceScheduler(4, flat_table(1.0))
    unknown.allot(weak)
    assert unknown.drafting_pays is None
    # each decision shows its judgement: the plain step it priced (the 11-ms verify-nothing step less the drafter's
    # 11 - 4 or 11 - 10.5 ms) and the verdict; the metrics average them over the decisions that judged
    assert (cheap.last.plain_ms, cheap.last.drafting_pays) == (pytest.approx(4.0), False)
    assert (dear.last.plain_ms, dear.last.drafting_pays) == (pytest.approx(10.5), True)
    assert (unknown.last.plain_ms, unknown.last.drafting_pays) == (None, None)
    stats = ConfidenceStats()
    for scheduler in (cheap, dear, unknown):
        stats.record_decision(scheduler.last, 1)
    metrics = stats.as_dict(cheap)
    assert metrics["mean_judged_plain_step_ms"] == pytest.approx(7.25) and metrics["drafting_paid_share"] == 0.5
    assert ConfidenceStats().as_dict(cheap)["mean_judged_plain_step_ms"] is None
    for layout in ("padded", "packed"):  # every layout judges alike
        scheduler = ConfidenceScheduler(4, with_plain(flat_table(1.0), 4.0), layout=layout, graph_batches=[1, 64])
        if layout == "packed":
            scheduler.allot_packed(weak * 64)
        else:
            scheduler.allot(weak * 40)  # 160 drafts: the numpy path
        assert scheduler.drafting_pays is False, layout


def test_a_drafting_hold_doubles_while_drafting_does_not_pay_and_ends_when_it_does():
    """Each hold ends in a look: the judgement at the step verifying the look's block (made before its outcome)
    starts no hold; the next one, made knowing it, may."""
    hold = DraftingHold(first=4, most=16)
    assert not hold.off(64, 0)
    hold.record(64, 10, pays=False)
    assert [hold.off(64, s) for s in (10, 13, 14)] == [True, True, False] and not hold.off(128, 10)
    hold.record(64, 15, pays=False)  # verifying the look's block (drafted at 14): drafting goes on
    assert not hold.off(64, 16) and hold.holds == 1
    hold.record(64, 16, pays=False)  # with the look's outcome learned: still no
    assert hold.off(64, 23) and not hold.off(64, 24)
    for step in (25, 26, 45, 46):
        hold.record(64, step, pays=False)
    assert hold.until[64] == 46 + 16 and hold.holds == 4  # 4, 8, 16, then no longer than 16
    hold.record(64, 63, pays=True)
    assert not hold.off(64, 63) and hold.hold == {} and hold.looked == {}


def test_a_judgement_made_during_a_hold_neither_restarts_nor_doubles_it():
    """The step after a hold began verifies the block drafted before it (a packed decision is made a step ahead):
    its judgement is the evidence the hold began on, not a second one."""
    hold = DraftingHold(first=4, most=64)
    hold.record(256, 7, pays=False)
    hold.record(256, 8, pays=False)  # verifying the block drafted at 7
    assert hold.until[256] == 11 and hold.hold[256] == 8 and hold.holds == 1
    hold.record(256, 11, pays=False)  # the look's own judgement
    hold.record(256, 12, pays=False)  # knowing the look: a hold twice as long
    hold.record(256, 13, pays=False)
    assert hold.until[256] == 20 and hold.holds == 2
    hold.record(256, 14, pays=True)  # a block drafted before the hold that paid ends it
    assert not hold.off(256, 14)


def test_a_hold_a_mixed_steps_judgement_began_ends_at_the_first_decode_step():
    """A mixed step's judgement (prompt chunks beside the verifies) holds mixed steps; the first decode step after
    it ends the hold (its length kept), unless a decode step's judgement joined it; a hold a decode step began is
    not ended so; nor one begun at this very step."""
    hold = DraftingHold(first=4, most=64)
    hold.record(32, 10, pays=False, mixed=True)  # (a batch of 32 growing to 64 as its prompts come in)
    assert hold.off(32, 11) and hold.end_mixed(10) == 0  # (the step it began at)
    assert hold.end_mixed(12) == 1 and not hold.off(32, 12) and hold.mixed_ended == 1
    hold.record(32, 20, pays=False, mixed=True)  # the next mixed hold: twice as long
    assert hold.until[32] == 28
    hold.record(32, 21, pays=False)  # a decode step's judgement while it is on: every step held
    assert hold.end_mixed(22) == 0 and hold.off(32, 27)
    hold.record(32, 40, pays=False)  # (the look's own judgement)
    hold.record(32, 41, pays=False)  # a decode step's hold: decode steps do not end it
    assert hold.end_mixed(42) == 0 and hold.off(32, 42) and hold.mixed_ended == 1


def test_decode_steps_draft_again_once_the_prompts_beside_them_are_in(
        tmp_path, near_bigram_target, confident_drafter):
    """Judgements that mixed steps do not pay (forced; decode steps pay): arrivals prefilled beside the decodes
    begin holds, and the first decode step after each ends it; the engine drafts on, its tokens the target's."""
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True)
    eng = llm.engine
    scheduler, judge = eng.confidence, eng.confidence._judge_drafting

    def mixed_steps_lose(num, expected, predicted_ms, none_ms, other_requests=0, other_tokens=0, context=0):
        judge(num, expected, predicted_ms, none_ms, other_requests, other_tokens, context)
        scheduler.drafting_pays = other_tokens == 0 or other_requests == 0

    scheduler._judge_drafting = mixed_steps_lose
    scheduler._pays_after_refit = lambda confidence, history: False
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 2
    ids, outputs, steps = [eng.add_request(prompts[0], greedy)], {}, 0
    while eng.has_unfinished():
        if len(ids) < len(prompts) and steps % 6 == 3:  # arrivals while the others decode
            ids.append(eng.add_request(prompts[len(ids)], greedy))
        for out in eng.step():
            outputs[out.request_id] = out.token_ids
        steps += 1
    assert [outputs[i] for i in ids] == builders.hf_greedy(near_bigram_target, prompts, 40)
    stats = llm.get_metrics()["confidence_scheduling"]
    # (how the arrivals fall between steps moves with the trims the measured step times choose: a hold that the
    # next step's paying judgement ended at its batch size, before a decode step came, is not one of these)
    assert stats["drafting_holds"] >= 2 and stats["drafting_mixed_holds_ended"] >= 1
    assert stats["drafting_off_steps"] <= 2 * stats["drafting_holds"]  # (16 a hold, were they kept)


def test_a_refit_that_reverses_a_judgement_that_drafting_does_not_pay_says_so():
    """One run's four requests after one that rejected every draft: judged on that request's fit, drafting did not
    pay; the refit after the step, with their own verifies (all accepted), says drafting pays at the prices the
    judgement set (a whole block 30 ms, plain decoding 12 ms a step of four): ``learn`` returns True, and the next
    judgement, on their classes' evidence, pays. Requests that reject as the fit believed reverse nothing."""
    def taught(accepted_after: int) -> tuple[ConfidenceScheduler, list[bool]]:
        scheduler, history = ConfidenceScheduler(4, with_plain(flat_table(1.0), 12.0)), HISTORY_NONE
        for _ in range(12):  # one request rejecting its first draft, 0.9 confident, every step
            scheduler.allot([[0.9] * 4], history=[history])
            assert scheduler.learn([4], [0]) is False
            history = next_history(history, 4, 0, 4)
        reversed_, classes = [], [HISTORY_NONE] * 4
        for _ in range(3):
            scheduler.allot([[0.9] * 4] * 4, history=classes)
            judged = scheduler.drafting_pays
            reversed_.append(scheduler.learn([4] * 4, [accepted_after] * 4))
            assert not reversed_[-1] or (judged is False and scheduler.drafting_pays is True)
            classes = [next_history(c, 4, accepted_after, 4) for c in classes]
        return scheduler, reversed_
    scheduler, reversed_ = taught(4)
    assert reversed_[0] and scheduler.reversals == sum(reversed_)
    scheduler.allot([[0.9] * 4] * 4, history=[next_history(HISTORY_NONE, 4, 4, 4)] * 4)
    assert scheduler.drafting_pays is True
    scheduler, reversed_ = taught(0)
    assert reversed_ == [False] * 3 and scheduler.reversals == 0 and scheduler.drafting_pays is False


def test_a_hold_the_refit_reverses_ends_at_once(tmp_path, near_bigram_target, confident_drafter):
    """The engine's side: where every judgement that drafting does not pay is reversed by the refit after it, each
    hold it began ends with the step it was judged at (a decision made at once holds that step's drafting: the
    step the reversal costs), never two steps in a row."""
    path = tmp_path / "table.json"
    with_plain(flat_table(1.0, base=50.0), 1.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    llm.engine.confidence._pays_after_refit = lambda confidence, history: True
    batches = []
    executor = llm.engine.executor
    run = executor.execute
    executor.execute = lambda batch: (batches.append(batch), run(batch))[1]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], greedy)] == builders.hf_greedy(
        near_bigram_target, PROMPTS[:1], 40)
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["drafting_holds"] >= 2 and stats["drafting_judgements_reversed"] == stats["drafting_holds"]
    assert stats["drafting_off_steps"] <= stats["drafting_holds"]
    drafting = [b.num_next_drafts > 0 for b in batches[:-1]]
    assert not any(not a and not b for a, b in zip(drafting, drafting[1:])), drafting


def test_where_drafting_does_not_pay_the_engine_decodes_plainly_for_a_hold_then_looks_again(
        tmp_path, near_bigram_target, confident_drafter):
    """Plain steps far cheaper than any drafting step: after the first decision the engine drafts nothing for
    ``TUNING.hold_first`` steps (plain decode steps, learned into the plain table), drafts to look again, holds twice as
    long, and so on; the outputs are the target's greedy tokens all along."""
    path = tmp_path / "table.json"
    with_plain(flat_table(1.0, base=50.0), 1.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    greedy = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    batches = []
    executor = llm.engine.executor
    run = executor.execute
    executor.execute = lambda batch: (batches.append(batch), run(batch))[1]
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], greedy)] == builders.hf_greedy(
        near_bigram_target, PROMPTS[:1], 90)
    drafting = [b.num_next_drafts > 0 for b in batches]
    first_off = drafting.index(False)
    assert drafting[first_off:first_off + TUNING.hold_first] == [False] * TUNING.hold_first
    look = first_off + TUNING.hold_first
    # a look: a block drafted; the step verifying it drafts on (its judgement was made before its outcome), and the
    # next one, judging with the look learned, holds twice as long
    assert drafting[look] and drafting[look + 1]
    assert drafting[look + 2:look + 2 + 2 * TUNING.hold_first] == [False] * (2 * TUNING.hold_first)
    assert drafting[look + 2 + 2 * TUNING.hold_first]
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["drafting_holds"] >= 2 and stats["drafting_off_steps"] >= 3 * TUNING.hold_first - 2
    steps = trace_agrees_with_the_stats(llm.engine.confidence_stats)
    # the held steps are the plain ones, and each hold began after a decision that judged drafting to lose
    assert sum(s["held"] for s in steps) == stats["drafting_off_steps"]
    judged = [s["drafting_pays"] for s in steps if s["budget"] is not None]
    assert False in judged and all(s["plain_ms"] > 0 for s in steps if s["budget"] is not None)
    assert stats["plain_cost_table_observations"] >= 3 * TUNING.hold_first - 4
    assert llm.engine.confidence.plain_mixed.observations == 0  # one request: no prompt beside a plain decode


def test_a_holds_plain_steps_beside_prompt_chunks_teach_the_plain_alternative_of_mixed_steps(
        tmp_path, near_bigram_target, confident_drafter):
    """Where drafting does not pay the engine holds it; its plain steps that feed an arrival's prompt beside the
    decodes are the plain alternative of a mixed step, measured: they teach ``plain_mixed`` (in ``rank_info``),
    the pure plain decodes the plain table. Greedy outputs stay the target's."""
    path = tmp_path / "table.json"
    with_plain(flat_table(1.0, base=50.0), 1.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    eng = llm.engine
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 2
    ids, outputs, steps = [eng.add_request(prompts[0], greedy)], {}, 0
    while eng.has_unfinished():
        if len(ids) < len(prompts) and steps % 4 == 3:  # arrivals while the others decode plainly
            ids.append(eng.add_request(prompts[len(ids)], greedy))
        for out in eng.step():
            outputs[out.request_id] = out.token_ids
        steps += 1
    assert [outputs[i] for i in ids] == builders.hf_greedy(near_bigram_target, prompts, 40)
    learned = eng.confidence.plain_mixed
    assert learned.observations >= 3 and eng.confidence.costs.plain.observations > 0
    assert llm.rank_info()[0]["confidence_plain_mixed_step_costs"]["observations"] == learned.observations


def test_the_survival_fit_does_not_diverge_from_saturated_probabilities():
    """A calibration temperature of 0.1 (slope 10) on a head whose logits spread over tens: at the prior every
    probability is 0 or 1, and a full Newton step (its Hessian near the ridge alone) jumped to the parameters'
    limits (one run at 256 requests: position 0 at slope 30, bias 30; survivals believed 0.85 where 0.57 survived).
    The damped steps lower the loss: drafts accepted at 30% whatever their confidence fit a slope near 0 and
    their rate."""
    rng = np.random.default_rng(0)
    correction = SurvivalCorrection(2, np.array([1.0, 10.0]))
    for j in range(2):
        x = rng.normal(0.0, 15.0, TUNING.fit_window)
        correction._append(j, x, np.zeros(TUNING.fit_window, dtype=np.int64), (rng.random(TUNING.fit_window) < 0.3) * 1.0)
    for _ in range(3):
        correction.refit()
    slope, intercept = correction.theta[1, 0], correction.theta[1, 1] + correction.theta[1, 2]
    assert slope < 0.05 and abs(intercept - math.log(0.3 / 0.7)) < 0.15, correction.theta[1]
    assert np.abs(correction.theta).max() < 5


def test_a_request_that_drafted_is_not_priced_beside_the_verifies_of_the_next_step(
        tmp_path, near_bigram_target, confident_drafter):
    """What a step fed besides its verifies is the next decision's guess at what the next step feeds beside them;
    a request that drafted this step verifies in the next one: the step it finished its prefill in (or the look
    after a drafting hold) is learned as a mixed step, but its tokens are not priced twice."""
    path = tmp_path / "table.json"
    flat_table(0.0, base=1.0).save(path)
    llm = engine(near_bigram_target, confident_drafter, enable_confidence_scheduling=True,
                 confidence_cost_table_path=str(path))
    eng = llm.engine
    eng.add_request(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    eng.step()  # its whole prompt (31 tokens), then its first block drafted
    assert eng._other_fed[:2] == (1, len(PROMPTS[2])) and eng._beside_next == (0, 0, 0)
