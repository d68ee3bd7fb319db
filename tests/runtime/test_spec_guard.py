"""The speculation guard (runtime.spec.guard): its decisions on given prices and acceptance, and in the engine:
greedy output unchanged, a drafter that never pays mostly off, one that pays mostly on."""

import pytest

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.spec.guard import GuardTuning, SpeculationGuard, bucket_of
from tests.builders import hf_greedy

K = 4


def priced(guard: SpeculationGuard, batch: int, plain: float = 1.0, drafting: float = 1.3, per_draft: float = 0.01):
    """Teach ``guard`` a bucket's prices: plain steps of ``plain`` s, drafting steps of ``drafting`` s plus
    ``per_draft`` s a verified draft (whole blocks and none)."""
    for drafts in (0, batch * K) * 4:
        guard.observe_step(batch, True, drafts, drafting + per_draft * drafts)
    for _ in range(4):
        guard.observe_step(batch, False, 0, plain)


def teach(guard: SpeculationGuard, request_id: str, accepted: int, verifies: int = 8) -> None:
    """``verifies`` verifications of ``request_id``, each accepting ``accepted`` of K drafts."""
    for _ in range(verifies):
        guard.observe_verify(request_id, K, accepted)


def good_and_bad(guard: SpeculationGuard) -> tuple[list[str], list[str]]:
    """Four requests that accept every draft and four that accept none, taught to ``guard``."""
    good, bad = [f"g{i}" for i in range(4)], [f"b{i}" for i in range(4)]
    for request_id in good:
        teach(guard, request_id, K)
    for request_id in bad:
        teach(guard, request_id, 0)
    return good, bad


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_unpriced_it_drafts_then_times_two_plain_steps_until_one_is_priced():
    guard = SpeculationGuard(K)
    reasons = [guard.plan(step, ["a"]).reason for step in range(4)]
    assert reasons == ["unpriced"] * 4
    for _ in range(4):
        guard.observe_step(1, True, K, 1.2)
    for first in (4, 10):  # the first plain step at a bucket is left out (warm-ups): a second exploration
        assert guard.plan(first, ["a"]).reason == "explore" and guard.drafts(first + 1) is False  # (a launch-ahead)
        assert guard.plan(first + 1, ["a"]).reason == "explore"
        guard.observe_step(1, False, 0, 1.0)
        if first == 4:
            assert guard.buckets[1].plain_s is None and guard.drafts(first + 2) is True
            for step in range(first + 2, first + 6):
                assert guard.plan(step, ["a"]).reason == "unpriced"
                guard.observe_step(1, True, K, 1.2)
    assert guard.buckets[1].plain_s == 1.0


def test_where_steps_run_ahead_an_exploration_is_four_plain_plans_and_only_a_steady_plain_step_is_a_price():
    guard = SpeculationGuard(K, runs_ahead=True)
    for step in range(4):
        guard.plan(step, ["a"])
        guard.observe_step(1, True, K, 1.2)
    # the block drafted at 3 verified at 4; 5 in its turn, launching 6 ahead; 6 launching 7 ahead: the steady one
    assert guard.plan(4, ["a"]).reason == "explore" and guard.drafts(5) is False
    assert guard.plan(5, ["a"]).reason == "explore" and guard.drafts(6) is False
    assert guard.plan(6, ["a"], ahead=True).reason == "ahead" and guard.drafts(7) is False
    assert guard.plan(7, ["a"], ahead=True).reason == "ahead" and guard.drafts(8) is True
    for _ in range(3):
        guard.observe_step(1, False, 0, 5.0, steady=False)  # between drafting steps: no price
    assert guard.buckets[1].plain_s is None and guard.buckets[1].plain_seen == 0
    guard.observe_step(1, False, 0, 1.0)
    guard.observe_step(1, False, 0, 1.0)  # (the first one timed at a bucket is left out)
    assert guard.buckets[1].plain_s == 1.0


def test_explorations_that_time_nothing_come_ever_more_rarely():
    """Under a steady load of short requests a step often feeds a prompt (no price): an exploration that timed no
    plain step doubles the wait for the next (4, 8, 16 ... drafting steps, at most explore_every)."""
    guard = SpeculationGuard(K)
    starts, step = [], 0
    while step < 600:
        plan = guard.plan(step, ["a"])
        if plan.reason == "explore":
            if not starts or starts[-1][1] != step - 1:
                starts.append((len(starts), step))
        else:
            guard.observe_step(1, True, K, 1.2)
        step += 1  # (the plain steps feed a prompt: never observed)
    waits = [b - a - 2 for (_, a), (_, b) in zip(starts, starts[1:])]
    assert waits[:6] == [8, 16, 32, 64, 128, 256] and set(waits[6:]) <= {256}
    assert guard.buckets[1].plain_s is None


def test_where_every_step_feeds_a_prompt_the_guard_prices_and_decides_on_such_steps():
    """Under a steady load of short requests nearly every step feeds a prompt chunk: those steps are priced apart
    (``prompt_buckets``) and, while the pure steps are unpriced, the plan compares them: a batch whose half never
    accepts verifies the good half only."""
    guard = SpeculationGuard(K)
    good, bad = good_and_bad(guard)
    assert guard.plan(0, good + bad).reason == "unpriced"
    for drafts in (0, 8 * K) * 4:
        guard.observe_step(8, True, drafts, 1.3 + 0.01 * drafts, steady=False, prompt=True)
    for _ in range(4):
        guard.observe_step(8, False, 0, 1.0, steady=False, prompt=True)
    assert guard.buckets[8].plain_s is None and guard.prompt_buckets[8].plain_s == 1.0
    plan = guard.plan(1, good + bad)
    assert plan.reason == "pays" and plan.verifiers == frozenset(good)
    assert guard.as_dict()["prompt_buckets"][8]["plain_ms"] == 1000.0


def test_verifying_everyone_is_priced_by_the_steps_that_did():
    """Ragged steps (a few blocks verified beside single tokens) cost more than their drafts say where no whole-step
    graph serves them: the batch verifies everyone at the price whole steps took, not the fit over both kinds."""
    guard = SpeculationGuard(K)
    batch = 8
    for _ in range(6):  # ragged steps: 2 blocks, 3.0 s; whole steps: 8 blocks, 1.5 s
        guard.observe_step(batch, True, 2 * K, 3.0, whole=False)
        guard.observe_step(batch, True, batch * K, 1.5)
    for _ in range(4):
        guard.observe_step(batch, False, 0, 1.0)
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        teach(guard, request_id, 1)
    assert guard.buckets[batch].whole_s == 1.5
    # by the fit (slope clipped at 0, ~2.25 s a step) 8 + 8 tokens in 2.25 s lose to 8 plain tokens a second with the
    # margin; at the whole price (1.5 s) they win
    plan = guard.plan(100, ids)
    assert plan.drafts and plan.verifiers is None and plan.reason == "pays"
    assert guard.as_dict()["buckets"][batch]["whole_ms"] == 1500.0


def test_where_steps_run_ahead_a_run_of_drafting_steps_is_priced_by_its_steady_steps():
    """A drafting step in its turn (the first of a run, after plain steps) pays the host's work that a run of them,
    each launched ahead, overlaps: a batch that keeps drafting is priced by the steady steps, not by the mean over
    both kinds; the serial ones price what a step in its turn costs (a probe's)."""
    guard = SpeculationGuard(K, runs_ahead=True)
    batch = 8
    for _ in range(6):  # every block verified: 3.0 s in its turn, 1.5 s launched ahead
        guard.observe_step(batch, True, batch * K, 3.0, steady=False)
        guard.observe_step(batch, True, batch * K, 1.5, steady=True)
    for _ in range(4):
        guard.observe_step(batch, False, 0, 1.0)
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        teach(guard, request_id, 1)
    costs = guard.buckets[batch]
    assert costs.whole_s == 1.5 and costs.whole_serial_s == 3.0
    assert costs.whole_price() == 1.5 and costs.whole_price(steady=False) == 3.0
    # 8 + 8 tokens in 1.5 s beat 8 plain tokens a second with the margin (in 3.0 s, or the ~2.25 s mean, they lose)
    plan = guard.plan(100, ids)
    assert plan.drafts and plan.verifiers is None and plan.reason == "pays"
    priced_ms = guard.as_dict()["buckets"][batch]
    assert priced_ms["whole_ms"] == 1500.0 and priced_ms["whole_serial_ms"] == 3000.0
    # an engine that launches no step ahead: every step is steady, one price as before
    alone = SpeculationGuard(K)
    alone.observe_step(batch, True, 0, 1.0)
    alone.observe_step(batch, True, batch * K, 2.0)
    assert alone.buckets[batch].whole_s == 2.0 and alone.buckets[batch].whole_serial_s is None


@pytest.mark.parametrize("runs_ahead,probe_steps", [(False, 1), (True, 2)])
def test_where_steps_run_ahead_a_batch_probe_drafts_two_steps_so_its_second_is_steady(runs_ahead, probe_steps):
    """A batch decoding plain learns drafting prices only from its probes; where steps run ahead a probe's first step
    runs in its turn, so a probe drafts twice in a row (the second launched ahead: a steady price), everyone
    verifying, and then waits as long again within the probe budget; a step launched ahead as a plain decode ends it."""
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=64, probe_budget=1.0), runs_ahead=runs_ahead)
    priced(guard, 4)
    ids = ["a", "b", "c", "d"]
    for request_id in ids:
        guard.observe_verify(request_id, K, 0)
    runs, run = [], []
    for step in range(300):
        plan = guard.plan(step, ids)
        if plan.drafts:
            assert plan.reason == "probe" and plan.verifiers is None
            run.append(step)
        elif run:
            runs.append(run)
            run = []
            for request_id in ids:
                guard.observe_verify(request_id, K, 0)
    assert len(runs) >= 3 and all(len(r) == probe_steps and r == list(range(r[0], r[0] + probe_steps)) for r in runs)
    assert guard.stats.batch_probes == len(runs)
    if runs_ahead:  # the second step of a probe, launched ahead as a plain decode, drafts nothing
        nxt = next(s for s in range(300, 600) if guard.plan(s, ids).drafts)
        assert guard.plan(nxt + 1, ids, ahead=True).drafts is False and guard.plan(nxt + 2, ids).drafts is False


def test_where_everyone_accepts_alike_leaving_a_block_out_never_looks_cheaper():
    """The drafting fit extrapolates from the drafts its steps verified; where they barely varied (whole blocks, or
    all but one) its line is noise far from them. Leaving blocks out saves only their drafts: a step verifying
    fewer is priced no lower than a plain step plus its drafts, nor than the whole price less the drafts left out,
    so a batch whose requests all accept alike verifies everyone (a step leaving one out is ragged: on a GPU it is
    not launched ahead)."""
    guard = SpeculationGuard(K)
    batch = 8
    for _ in range(6):  # whole steps 1.5 s; one block left out 1.2 s: 0.06 s a draft, through zero at 1 block
        guard.observe_step(batch, True, batch * K, 1.5)
        guard.observe_step(batch, True, (batch - 1) * K, 1.2, whole=False)
    for _ in range(4):
        guard.observe_step(batch, False, 0, 1.0)
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        teach(guard, request_id, K)
    base, slope = guard.buckets[batch].drafting_fit(guard.tuning.ridge)
    assert base == 0.0 and slope > 0.05  # (by the fit alone, one block verified would cost 0.25 s)
    for step in range(100, 110):
        plan = guard.plan(step, ids)
        assert plan.drafts and plan.verifiers is None and plan.reason == "pays", (step, plan)


def test_where_steps_run_ahead_and_everyone_accepts_alike_leaving_a_block_out_never_looks_cheaper_either():
    """A step leaving blocks out is priced no lower than the dearer of the whole prices (the steady and the serial:
    where the host's timing puts the steady ones above the serial ones, a run launched ahead still costs no more than
    a ragged step run in its turn) less the drafts left out."""
    guard = SpeculationGuard(K, runs_ahead=True)
    batch = 64  # (leaving one of 64 out saves a sliver: a price a few percent low tips it)
    for _ in range(6):  # steady whole steps 0.85 s, serial ones 0.80 s, ragged ones 0.83 s (slope ~0: their fit 0.83 s)
        guard.observe_step(batch, True, batch * K, 0.85, steady=True)
        guard.observe_step(batch, True, batch * K, 0.80, steady=False)
        guard.observe_step(batch, True, (batch - 1) * K, 0.83, steady=False, whole=False)
    for _ in range(4):
        guard.observe_step(batch, False, 0, 0.5)
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        teach(guard, request_id, 3)
    for step in range(100, 110):
        plan = guard.plan(step, ids)
        assert plan.drafts and plan.verifiers is None and plan.reason == "pays", (step, plan)


def test_a_decision_that_everyone_verifies_stands_a_few_steps_while_the_batch_is_the_same():
    """Where everyone's drafts pay, the choice is made again every replan_every steps (not every step: gains and
    prices move by one verify's weight a step); a request whose drafts stopped paying is left out that much later,
    and a batch that changed is planned at once."""
    guard = SpeculationGuard(K, GuardTuning(replan_every=4))
    batch = 8
    priced(guard, batch, plain=1.0, drafting=1.1, per_draft=0.05)
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        teach(guard, request_id, K)
    assert guard.plan(100, ids).verifiers is None
    teach(guard, "r0", 0, verifies=20)  # r0's drafts stop paying
    assert [guard.plan(step, ids).verifiers for step in (101, 102, 103)] == [None] * 3
    assert guard.plan(104, ids).verifiers == frozenset(ids[1:])
    fresh = SpeculationGuard(K, GuardTuning(replan_every=4))  # the same knowledge, planned from scratch
    priced(fresh, batch, plain=1.0, drafting=1.1, per_draft=0.05)
    for request_id in ids:
        teach(fresh, request_id, K)
    assert fresh.plan(100, ids).verifiers is None
    teach(fresh, "r0", 0, verifies=20)
    assert fresh.plan(101, ids[:-1]).verifiers == frozenset(ids[1:-1])  # a request left: planned at once


def test_where_drafting_clearly_pays_the_plain_price_is_timed_ever_more_rarely():
    """An exploration (plain steps timed at a bucket) costs the drafts those steps do not make; where drafting beats
    plain decoding by clear_advantage or more a fresh plain price changes no decision, so each such exploration
    doubles the wait for the next (up to explore_max); where drafting pays narrowly the wait stays explore_every."""
    def starts(drafting_s: float, accepted: int) -> list[int]:
        guard = SpeculationGuard(K, GuardTuning(explore_every=16, explore_max=64))
        batch, ids = 4, ["a", "b", "c", "d"]
        begun, last = [], None
        for step in range(600):
            plan = guard.plan(step, ids)
            if plan.reason == "explore" and last != "explore":
                begun.append(step)
            last = plan.reason
            if plan.drafts:
                guard.observe_step(batch, True, batch * K, drafting_s)
                for request_id in ids:
                    guard.observe_verify(request_id, K, accepted)
            else:
                guard.observe_step(batch, False, 0, 1.0)
        return [b - a for a, b in zip(begun, begun[1:])]

    clear = starts(1.3, K)  # 5 tokens a request in 1.3 s against 1 in 1 s: 3.8x
    assert clear[:4] == [18, 34, 66, 66], clear  # (each wait counts drafting steps; an exploration is 2 plain)
    narrow = starts(2.9, 3)  # ~4 tokens in 2.9 s: 1.3x
    assert set(narrow[1:]) == {18}, narrow


def test_a_pause_of_the_host_is_no_price():
    guard = SpeculationGuard(K)
    priced(guard, 1)
    guard.observe_step(1, False, 0, 100.0)
    guard.observe_step(1, True, K, 100.0)
    assert guard.buckets[1].plain_s == 1.0 + 0.25 * 3.0  # taken as 4 s (4x), weighed 1/4 (its 4th fitted step)
    base, per_draft = guard.buckets[1].drafting_fit(1e-3)
    assert base + per_draft * K < 1.3 + 0.01 * K + 1.0


def test_a_drafter_that_never_pays_stops_and_the_batch_is_probed_ever_more_rarely():
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=64, probe_budget=1.0))  # (cheap probes)
    priced(guard, 4)
    ids = ["a", "b", "c", "d"]
    for request_id in ids:
        guard.observe_verify(request_id, K, 0)
    drafting = []
    for step in range(400):
        plan = guard.plan(step, ids)
        if plan.drafts:
            drafting.append(step)
            assert plan.reason == "probe" and plan.verifiers is None  # the whole batch verifies one block
            for request_id in ids:
                guard.observe_verify(request_id, K, 0)
        else:
            assert guard.drafts(step) is False
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert drafting[0] == 8 and gaps[:3] == [16, 32, 64] and set(gaps[3:]) == {64}


@pytest.mark.parametrize("accepted,decision", [(1, "plain"), (K, "pays")])
def test_a_batch_size_not_yet_priced_decides_by_the_nearest_priced_one(accepted, decision):
    """Requests draining to one (bucket 1, never priced) after decoding four together (bucket 4 priced: a drafting
    step costs 3.8 plain ones): where drafting did not pay at four it decodes plain from the first step, where it
    pays it drafts; before, every step at a new batch size drafted until priced there."""
    guard = SpeculationGuard(K)
    priced(guard, 4, plain=1.0, drafting=3.5, per_draft=0.01)
    teach(guard, "a", accepted)
    plan = guard.plan(0, ["a"])
    assert plan.reason == decision and plan.drafts == (decision == "pays")


def test_probes_that_cost_several_plain_steps_wait_until_their_cost_is_a_small_share():
    """Where verifying everyone's block costs 5 plain steps (a CPU verifying many rows), the batch's probes come no
    more often than every (5 - 1) / probe_budget steps (the doubling schedule alone probes after 8, 24, 56 steps)."""
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=64, probe_budget=0.02))
    priced(guard, 4, plain=1.0, drafting=4.72, per_draft=0.01)  # everyone verifying: 4.72 + 0.01 x 28 = 5.0 s
    ids = ["a", "b", "c", "d"]
    for request_id in ids:
        guard.observe_verify(request_id, K, 0)
    probes = []
    for step in range(1000):
        plan = guard.plan(step, ids)
        if plan.drafts:
            assert plan.reason == "probe"
            probes.append(step)
            for request_id in ids:
                guard.observe_verify(request_id, K, 0)
    assert probes and probes[0] >= 190 and all(b - a >= 190 for a, b in zip(probes, probes[1:]))  # (~4 s over 1 s)


def never_accepting_plain_batch(probe_max: int, runs_ahead: bool = False) -> SpeculationGuard:
    """A guard whose batch of four never accepts a draft and whose plain steps take 1 s (``compute_bound_step``
    prices the rest), probing within a 2% budget."""
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=probe_max, probe_budget=0.02),
                             runs_ahead=runs_ahead)
    for request_id in "abcd":
        teach(guard, request_id, 0, verifies=1)
    for _ in range(4):
        guard.observe_step(4, False, 0, 1.0)
    return guard


def compute_bound_step(guard: SpeculationGuard, step: int, batch: list[str], verifying: int):
    """One engine step, in the engine's order (plan; run: verify the last step's blocks, draft; learn) on a
    compute-bound batch (many requests, K + 1 tokens each at a verify): a plain step 1 s, a drafting step 1.1 s, and
    verifying every block of the batch 3 s more -> (the plan, the step's seconds, the drafts the next step verifies)."""
    plan = guard.plan(step, batch)
    blocks = len(batch) * K
    seconds = 1.0 + 0.1 * plan.drafts + 3.0 * verifying / blocks
    guard.observe_step(len(batch), plan.drafts, verifying, seconds)
    for request_id in batch if verifying else ():
        teach(guard, request_id, 0, verifies=1)
    return plan, seconds, blocks if plan.drafts else 0


def test_a_probes_price_counts_the_verify_of_its_blocks_in_the_step_after_it():
    """A probe's drafting step costs little more than a plain one (1.1 s against 1 s), the step after it, verifying
    everyone's block, 4 s. Priced by its drafting step alone (which verifies nothing) a probe looked nearly free and
    the doubling schedule alone spaced the probes (every 64 steps here: ~5% of the time); timed from the steps that
    only verified, probes come no more often than keeps their ~3.1 s within the 2% budget."""
    guard = never_accepting_plain_batch(probe_max=64)
    verifying, spent, probes = 0, 0.0, []
    for step in range(4000):
        plan, seconds, verifying = compute_bound_step(guard, step, list("abcd"), verifying)
        if plan.drafts:
            probes.append(step)
        spent += seconds
    assert probes and spent / 4000 - 1.0 <= 0.025, (probes, spent)
    later = [b - a for a, b in zip(probes[2:], probes[3:])]  # (once a probe's verify was timed)
    assert later and min(later) >= 150, probes


def test_a_plain_batchs_next_step_is_predicted_as_its_plan_will_be():
    """``drafts(t + 1)`` decides whether the engine launches step t + 1 ahead (a plain decode, its host work hidden
    behind the device's). While a probe waits for the budget (its doubling schedule due, the budget not yet spent),
    the next step is plain: predicting it drafting kept such steps from being launched ahead (on a batch whose probe
    costs 4 plain steps, 8% of the steps); only the step after a probe, which verifies it, is predicted to draft and
    does not. A due arrival probe is predicted too, so launching ahead never starves it. (The step an arrival joins
    is not compared: it was predicted before the arrival, and an engine that admits a request launches nothing
    ahead.)"""
    guard = never_accepting_plain_batch(probe_max=512, runs_ahead=True)
    verifying, after_probe, wrong = 0, 0, []
    for step in range(3000):
        after_probe += bool(verifying)
        predicted = guard.drafts(step)
        batch = list("abcd") + [f"new{step // 500}"]  # an arrival every 500 steps, never accepting
        plan, _, verifying = compute_bound_step(guard, step, batch, verifying)
        if predicted != plan.drafts and step % 500:
            wrong.append((step, predicted, plan.reason))
    assert all(predicted and reason == "plain" for _, predicted, reason in wrong), wrong
    assert len(wrong) <= after_probe, wrong  # (the step after each probe)


def test_a_batchs_probes_and_its_arrivals_share_one_probe_budget():
    """Where a probe costs several plain steps, the batch's probes and its arrivals' probes together come no more often
    than the budget allows after each (a probe's ~3.8 s over a 1 s plain step, at 2%: ~190 steps), though arrivals
    keep coming and each kind's own schedule is due sooner; a stream of arrivals does not keep the batch from its own
    probes."""
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=64, probe_budget=0.02))
    priced(guard, 4, plain=1.0, drafting=4.72, per_draft=0.01)
    ids = ["a", "b", "c"]
    for request_id in ids:
        teach(guard, request_id, 0, verifies=1)
    probes = []
    for step in range(2000):
        batch = ids + [f"new{step // 20}"]  # a new request every 20 steps, never accepting
        plan = guard.plan(step, batch)
        if plan.drafts:
            assert plan.reason == "probe"
            probes.append((step, "batch" if plan.verifiers is None else "arrival"))
            for request_id in batch if plan.verifiers is None else plan.verifiers:
                teach(guard, request_id, 0, verifies=1)
    kinds = {kind for _, kind in probes}
    assert kinds == {"batch", "arrival"}
    gaps = [b - a for (a, _), (b, _) in zip(probes, probes[1:])]
    assert gaps and min(gaps) >= 185, probes


def test_in_a_plain_batch_a_new_request_is_probed_on_a_doubling_schedule():
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=32))
    priced(guard, 4)
    ids = ["a", "b", "c"]
    for request_id in ids:
        guard.observe_verify(request_id, K, 0)
    probes = []
    for step in range(120):
        arrival = f"new{step // 30}"  # a new request every 30 steps, never accepting
        plan = guard.plan(step, ids + [arrival])
        if plan.drafts and plan.reason == "probe" and plan.verifiers == frozenset({arrival}):
            probes.append(step)
            guard.observe_verify(arrival, K, 0)
    assert probes and all(b - a >= 8 for a, b in zip(probes, probes[1:]))  # bounded: at most one in 8 steps
    assert len(probes) <= 5


def test_a_plain_decision_stands_until_something_it_weighed_changes():
    """A batch that decodes plain is not re-planned from scratch every step: the decision stands until a request
    arrives or leaves, a verify is observed, a probe is due or probe_first steps pass; the plans it gives are those a
    full plan gives (the same random scenario through a guard whose standing decision is dropped before every plan)."""
    import random

    def run(fresh: bool) -> list[tuple]:
        rng = random.Random(3)
        guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=64))
        priced(guard, 4)
        ids, plans, full, pending = ["a", "b", "c", "d"], [], 0, None
        for request_id in ids:
            guard.observe_verify(request_id, K, 0)
        for step in range(600):
            if rng.random() < 0.03:  # a request leaves, another arrives
                ids = ids[1:] + [f"r{step}"]
            if fresh:
                guard._plain_standing = None
            before = guard._plain_standing
            plan = guard.plan(step, ids)
            full += plan.reason != "plain" or guard._plain_standing is not before
            plans.append((plan.drafts, plan.reason, plan.verifiers))
            if pending is not None:  # this step verifies the blocks drafted at the one before (after its plan)
                # (sorted: a frozenset's order follows the string hash, which differs from process to process)
                for request_id in ids if pending.verifiers is None else sorted(pending.verifiers):
                    guard.observe_verify(request_id, K, rng.choice((0, 0, 0, 0, 0, 0, 4)))
            pending = plan if plan.drafts else None
            guard.observe_step(len(ids), plan.drafts, 0, 1.3 if plan.drafts else 1.0)
        return plans, full

    standing, full_plans = run(False)
    fresh, every_step = run(True)
    assert standing == fresh
    assert sum(not p[0] for p in standing) > 360 and full_plans < 0.6 * every_step  # mostly plain, re-planned less


def test_a_mixed_batch_verifies_the_good_requests_and_probes_the_others():
    guard = SpeculationGuard(K, GuardTuning(probe_first=8, probe_max=512))
    priced(guard, 8, plain=1.0, drafting=1.1, per_draft=0.02)
    good, bad = good_and_bad(guard)
    probes = {request_id: [] for request_id in bad}
    for step in range(200):
        plan = guard.plan(step, good + bad)
        verifiers = set(good + bad) if plan.verifiers is None else plan.verifiers  # (None: every request)
        assert plan.drafts and plan.reason == "pays" and set(good) <= verifiers
        for request_id in verifiers & set(bad):
            probes[request_id].append(step)
            guard.observe_verify(request_id, K, 0)
        for request_id in good:
            guard.observe_verify(request_id, K, K)
    assert all(steps == [8, 24, 56, 120] for steps in probes.values()), probes


def test_the_margin_is_a_band_a_drafting_batch_stops_only_where_plain_decoding_beats_it_by_as_much():
    """Gains near break-even (drafting 1% ahead of plain decoding, within the 3% margin): a batch that drafted because
    it paid keeps drafting; a batch decoding plain does not start."""
    ids = ["a", "b", "c", "d"]

    def near_break_even(guard: SpeculationGuard) -> None:
        for _ in range(100):  # alternating 0 and 1 accepted, the last 1: a gain of ~0.54 each, the population's ~0.5
            for accepted in (0, 1):
                guard.observe_verifies([(request_id, K, accepted) for request_id in ids])

    drafting = SpeculationGuard(K)
    priced(drafting, 4, plain=1.0, drafting=1.52, per_draft=0.0)  # (4 + 4 x 0.54) / 1.52 s: 1.01x plain's 4 a second
    for request_id in ids:
        teach(drafting, request_id, K)
    assert drafting.plan(100, ids).reason == "pays"
    near_break_even(drafting)
    assert 0.5 < drafting.gain("a") < 0.57
    plan = drafting.plan(200, ids)
    assert plan.drafts and plan.reason == "pays" and plan.verifiers is None
    plain = SpeculationGuard(K)
    priced(plain, 4, plain=1.0, drafting=1.52, per_draft=0.0)
    near_break_even(plain)
    assert abs(plain.gain("a") - drafting.gain("a")) < 0.01
    assert plain.plan(200, ids).reason == "plain"


def test_the_population_learns_only_from_steps_that_verified_everyones_blocks():
    """A plan that leaves requests out verifies the better ones, a request's probe the worse: neither is a sample of
    the population whose gain a new (or a left-out) request is shrunk toward; a step that verified every block is."""
    guard = SpeculationGuard(K)
    priced(guard, 8, plain=1.0, drafting=1.1, per_draft=0.02)
    good, bad = good_and_bad(guard)
    population = guard.population_gain
    assert 0 < population < K
    plan = guard.plan(100, good + bad)
    assert plan.drafts and plan.verifiers == frozenset(good)  # the bad requests left out
    guard.plan(101, good + bad)  # the next step verifies those blocks
    guard.observe_verifies([(request_id, K, K) for request_id in good])
    assert guard.population_gain == population and guard.gain("g0") > population  # the requests themselves learn
    everyone = SpeculationGuard(K)  # before any plan, and after one verifying everyone, every verify counts
    everyone.observe_verifies([("a", K, K)])
    everyone.plan(0, ["a"])
    everyone.plan(1, ["a"])
    everyone.observe_verifies([("a", K, 0)])
    assert everyone.population_gain < K


def test_the_batch_verifies_the_best_number_of_blocks():
    """The plan's ``m`` (the top requests by gain whose blocks are verified) maximizes expected tokens per second over
    every m, plain decoding (m = 0, with the margin) included: brute force over random gains and prices."""
    import random

    rng = random.Random(3)
    for trial in range(200):
        batch = rng.randint(1, 24)
        guard = SpeculationGuard(K)
        plain = rng.uniform(0.5, 2)  # (a drafting step never costs less than a plain one)
        drafting, per_draft = plain * rng.uniform(1, 3), rng.choice([0.0, rng.uniform(0, 0.2)])
        priced(guard, batch, plain, drafting, per_draft)
        ids = [f"r{i}" for i in range(batch)]
        for request_id in ids:
            teach(guard, request_id, rng.randint(0, K), verifies=rng.randint(1, 6))
        plan = guard.plan(100, ids)
        base, slope = guard.buckets[bucket_of(batch)].drafting_fit(guard.tuning.ridge)
        whole = guard.buckets[bucket_of(batch)].whole_s
        # (never below a plain step, and leaving blocks out saves only their drafts)
        base = max(base, guard.buckets[bucket_of(batch)].plain_s, whole - slope * K * guard.verified_share * batch)
        gains = sorted((guard.gain(r) for r in ids), reverse=True)
        rates = [batch / guard.buckets[bucket_of(batch)].plain_s * (1 + guard.tuning.margin)]
        rates += [(batch + sum(gains[:m])) / (base + slope * K * guard.verified_share * m) for m in range(1, batch)]
        rates.append((batch + sum(gains)) / guard.buckets[bucket_of(batch)].whole_s)  # everyone: the whole price
        best = max(range(batch + 1), key=lambda m: (rates[m], -m))  # (the first of equal rates)
        chosen = 0 if not plan.drafts else batch if plan.verifiers is None else len(plan.verifiers)
        assert chosen == best or plan.reason == "probe", (trial, chosen, best, plan.reason)


def test_a_request_that_pays_again_after_its_probe_is_verified_again():
    guard = SpeculationGuard(K, GuardTuning(probe_first=4))
    priced(guard, 2, plain=1.0, drafting=1.05, per_draft=0.05)
    teach(guard, "good", K)
    teach(guard, "late", 0)
    verified = []
    for step in range(20):
        plan = guard.plan(step, ["good", "late"])
        if "late" in (plan.verifiers if plan.verifiers is not None else {"good", "late"}):
            verified.append(step)
            guard.observe_verify("late", K, K)  # its drafts are accepted now
    assert verified[0] == 4 and verified[1:] == list(range(5, 20))  # probed once, then chosen on its gain


def test_one_unlucky_block_does_not_drop_a_request_the_drafter_serves_well():
    guard = SpeculationGuard(K)
    teach(guard, "steady", K)
    guard.observe_verify("steady", K, 0)
    assert guard.gain("steady") > K / 2
    teach(guard, "steady", 0, verifies=6)
    assert guard.gain("steady") < 1.5  # (its population, this request alone, still remembers whole blocks)


def test_a_plan_for_a_step_launched_ahead_is_plain():
    guard = SpeculationGuard(K)
    plan = guard.plan(0, ["a"], ahead=True)
    assert not plan.drafts and plan.reason == "ahead"


# ---- in the engine --------------------------------------------------------------------------------


def synthetic_prices(llm: LLM, plain: float = 1.0, drafting: float = 1.5, per_draft: float = 0.01) -> None:
    """Replace the step times the engine's guard learns by fixed prices (wall times of a CPU test vary)."""
    guard = llm.engine.guard
    observe = guard.observe_step

    def fixed(batch, drafted, verified_drafts, seconds, steady=True, prompt=False, whole=True):
        observe(batch, drafted, verified_drafts, (drafting + per_draft * verified_drafts) if drafted else plain,
                steady, prompt, whole)

    guard.observe_step = fixed


def prompts(n: int, length: int = 6) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 60 + 3 for j in range(length)] for i in range(n)]


@pytest.mark.parametrize("oracle", [False, True], ids=["untrained", "oracle"])
def test_greedy_output_is_transformers_and_the_guard_follows_what_pays(near_bigram_target, make_drafter, oracle):
    drafter = make_drafter(near_bigram_target, K + 1, oracle=oracle)
    llm = LLM(str(near_bigram_target), speculative_config=DSparkDecodingConfig(speculative_model=str(drafter)),
              dtype="float32", device="cpu", num_pages=512, page_size=4)
    synthetic_prices(llm)
    batch = prompts(4)
    outputs = llm.generate(batch, SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(near_bigram_target, batch, 96)
    guard = llm.get_metrics()["speculation_guard"]
    if oracle:  # nearly every draft accepted: the batch keeps drafting, the plain steps are explorations
        assert guard["drafting_steps"] > 3 * guard["plain_steps"], guard
    else:  # an untrained drafter: after its first verifies, plain steps, probed now and then
        assert guard["plain_steps"] > 2 * guard["drafting_steps"], guard
        assert guard["batch_probes"] >= 1


def test_the_guard_off_keeps_every_block(near_bigram_target, make_drafter):
    drafter = make_drafter(near_bigram_target, K + 1)
    llm = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=512, page_size=4,
              speculative_config=DSparkDecodingConfig(speculative_model=str(drafter), speculation_guard=False))
    outputs = llm.generate(prompts(2), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    assert "speculation_guard" not in llm.get_metrics()
    # every step after the first token verifies a whole block
    assert all(o.num_draft_tokens >= K * (40 // (K + 1) - 1) for o in outputs)


def test_with_confidence_scheduling_greedy_output_is_unchanged(near_bigram_target, make_drafter):
    drafter = make_drafter(near_bigram_target, K + 1)
    llm = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=512, page_size=4,
              speculative_config=DSparkDecodingConfig(speculative_model=str(drafter),
                                                      enable_confidence_scheduling=True))
    synthetic_prices(llm)
    batch = prompts(3)
    outputs = llm.generate(batch, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(near_bigram_target, batch, 64)
    assert llm.get_metrics()["speculation_guard"]["plain_steps"] > 0


def test_where_nobody_is_expected_to_accept_a_new_batch_size_decodes_plain_before_it_is_priced():
    """A drafting step never costs less than a plain one: with the population accepting nothing, a bucket the guard
    has no prices for decodes plain at once (and is probed on the doubling schedule), instead of drafting to learn
    what drafting costs there."""
    guard = SpeculationGuard(K)
    teach(guard, "old", 0, verifies=64)  # the population's gain falls to ~0
    running = [f"r{i}" for i in range(16)]
    for r in running:
        teach(guard, r, 0)
    plans = [guard.plan(step, running) for step in range(40)]
    assert plans[0].reason == "plain" and not plans[0].drafts
    assert sum(p.drafts for p in plans) <= 4 and all(p.reason in ("plain", "probe") for p in plans)
    teach(guard, "good", K, verifies=8)  # one request that accepts everything: worth pricing again
    assert guard.plan(40, [*running, "good"]).reason == "unpriced"
