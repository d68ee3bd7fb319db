"""The speculation guard: drafting only where it pays, per request and per batch, learned online.

Speculation costs twice: the drafter's forward at every drafting step (the whole batch's), and the target's work on
every verified draft. It pays a request only through the drafts that request gets accepted. The guard learns both
sides while the engine serves and decides, step by step:

- **which requests verify**: each request's expected accepted drafts a verify (``gain``: its recent verifications' mean,
  shrunk toward the population's, which learns from the steps that verified every block), ranked; the batch verifies the
  top ``m`` requests' blocks where that maximizes expected committed tokens per second, the others verify none (their
  verify width drops to 1: a plain decode of one token);
- **whether the batch drafts at all**: when the best ``m`` is 0 (nobody's drafts pay for their verify and the
  drafter's forward), the step drafts nothing and the next one is the plain decode step.

The prices come from the engine's own steps, per batch bucket (powers of two): a plain step's time (``plain_s``), a
drafting step's time as a function of its verified drafts (``drafting_s + verify_s x drafts``, a ridge fit that forgets
old steps) and, for verifying everyone's block, the time of the drafting steps that did (``whole_s``: a step that leaves
some out is ragged, which on a GPU can cost more than a uniform step verifying more; it is priced no lower than a plain
step plus its drafts, nor than the whole price less the drafts it leaves out: the fit only interpolates, and where every
step verifies whole blocks its drafts barely vary). Steps that decode beside a prompt chunk are priced apart
(``prompt_buckets``) and compared where a bucket's pure steps are unpriced. A plain step is priced as a run of plain
steps runs, since that is what a batch that stops drafting does: on an engine that launches each plain step while the
host still finishes the one before (``runs_ahead``), only a *steady* plain step is timed, one launched ahead and
launching the next ahead; a plain step between drafting steps also pays the host's work that the overlap hides (on a GPU
15-60% more than a steady step). On such an engine a batch that keeps drafting for everyone launches each step ahead
too, so the whole price is the steady whole steps' (``whole_s``), and the steps in their turn (a drafting run's first, a
probe's) are priced apart (``whole_serial_s``: they price a probe, and a ragged step no lower than the dearer whole
price). A bucket not yet priced decides by the nearest priced bucket's prices (a drafting step's price over a plain
one's moves slowly with the batch). Where no bucket is priced the guard drafts (the engine was given a drafter) and, now
and then, runs plain steps in a row to time one (``exploration``: two, the second clean of the block verified at the
first; with ``runs_ahead`` four, the third steady; ever more rarely while drafting clearly beats plain decoding); unless
the requests' expected extra tokens together do not beat the margin: a drafting step never costs less than a plain one,
so then drafting cannot pay at any price (an untrained drafter at a batch size not seen before decodes plain from its
first step).

A plain decision stands, without ranking the gains and pricing every ``m`` again, until a request arrives or
leaves, a verify is observed, a probe is due or ``probe_first`` steps pass (only the prices' drift goes unweighed
that long): on an engine that launches no step ahead, a batch decoding plain otherwise pays the whole plan each step.

Learning needs observations, and a request or a batch that stopped drafting shows none. So it is probed again at a
bounded cost: a request left out verifies its block at its next probe (after 8 steps, then 16, 32, ... 512 while it
keeps not paying), a batch that stopped drafting drafts one step for everyone after 8 steps, then 16, ... 512
(``probe_first`` .. ``probe_max``), and requests that arrived since and never verified have theirs verified on the same
doubling schedule; each interval starts over once drafting pays again. A batch's probes and its arrivals' together come
no more often than keeps what a probe costs over a plain step within ``probe_budget`` (2%) of the plain steps' time
after it: where a probe costs 4 plain steps, one every 150 steps at most. A probe costs its drafting step and, at the
step after it, its blocks' verify: the verify is priced from the decode steps that verified drafts and drafted none (on
a compute-bound batch, many requests verifying K + 1 tokens each, it is most of a probe's price). Where steps run ahead
a batch probe drafts two steps in a row (``probe_len``): the second, launched ahead and launching the next, is steady,
so a batch that decodes plain still learns what a run of drafting steps costs. A step's time enters
the prices at most at 4x what was learned (a host's pause is no price), and the first of each kind at a bucket not at
all.

A seeded sampled request is pinned: its blocks are always verified and the batch drafts while it runs (which
steps verify drafts changes a sampled request's tokens, and a seed promises the same tokens whatever else runs).

Invariants: the guard only ever drops whole blocks before they are verified (a request verifies its block or none)
and decides from past acceptance, never from the drafts in hand, so greedy output is token for token the same and
sampled output keeps the target's distribution. ``plan`` at step ``t`` decides step ``t``'s drafting and which
requests verify the blocks drafted there (at step ``t + 1``); ``drafts(t + 1)`` predicts the next plan's drafting
(an engine that launches a plain decode step ahead on a False prediction plans that step with ``ahead``: plain).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardTuning:
    """The guard's constants."""

    memory: float = 0.8  # per verify, the weight left to a request's older verifies in its gain
    prior_verifies: float = 1.5  # the population's gain counts as this many of a request's own verifies
    # weight of a verify in the population's gain (a new request's): only verifies of blocks that everyone's were
    # verified beside count, since a plan that leaves requests out verifies the better ones and a request's probe
    # the worse (on an H100 at 16 requests of SmolLM2, mostly probes, the gain fell to 0.72 where verifies took 1.1)
    population_weight: float = 0.02
    forget: float = 0.97  # per step, the weight left to older drafting steps in a bucket's cost fit
    plain_weight: float = 0.1  # per step, the weight a plain step's time takes from the older ones
    ridge: float = 1e-3  # the fit's pull of the per-draft cost toward the last estimate (seconds^2 scale-free)
    # drafting starts only where it beats plain decoding by this fraction, and stops only where plain decoding beats it
    # by as much (a band: gains near break-even do not flip the batch from step to step)
    margin: float = 0.03
    probe_first: int = 8  # steps before a left-out request (or a plain batch) is probed again
    probe_max: int = 512  # the longest such interval (it doubles each probe that did not pay)
    # a probe's price over a plain step's, spread over the steps until the next probe, is at most this share of their
    # time: where a drafting step costs several plain ones (a CPU verifying 32 rows: 3.8x), probes wait longer
    probe_budget: float = 0.02
    explore_every: int = 256  # drafting steps between two plain steps timed at a bucket (first: after 4)
    explore_max: int = 4096  # the longest such wait: it doubles while drafting beats plain by clear_advantage
    clear_advantage: float = 1.5  # drafting's expected tokens/s over plain decoding's past which a price is not news
    replan_every: int = 4  # steps a decision that everyone verifies stands while the batch stays the same


OUTLIER = 4.0  # a step's time is taken as at most this many times the price learned so far


def forgetting_mean(mean: float | None, count: int, since: int, seconds: float, forget: float) -> float:
    """``mean`` (of ``count - 1`` times, the last ``since`` steps ago) with ``seconds`` folded in: at most 4x the mean
    (a pause of the host is not a price), weighed 1/count or, where steps passed since, what ``forget`` a step leaves
    the older ones (a price timed long ago gives way to a new one)."""
    if mean is None:
        return seconds
    weight = max(1.0 / count, 1.0 - forget ** max(since, 1))
    return mean + weight * (min(seconds, OUTLIER * mean) - mean)


@dataclass(slots=True)
class _RequestState:
    accepted: float = 0.0  # its verifies' accepted drafts, older ones weighed down (GuardTuning.memory)
    weight: float = 0.0  # those verifies' weight
    verifies: int = 0  # its verifications seen
    probe_interval: int = 0  # steps between its probes while it does not pay (0: never probed)
    next_probe: int = 0  # the step of its next probe (while left out)


@dataclass
class _BucketCosts:
    """A batch bucket's step prices (seconds): plain steps' mean, drafting steps' ridge fit on verified drafts."""

    plain_s: float | None = None
    plain_steps: int = 0  # fitted (plain_seen: observed)
    plain_seen: int = 0
    drafting_seen: int = 0
    # sufficient statistics of the drafting steps' fit y = a + b x (x: verified drafts), exponentially forgotten
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    drafting_steps: int = 0
    since_exploration: int = 0
    explore_wait: int = 0  # drafting steps from one exploration to the next, once priced (0: explore_every)
    advantage: float = 0.0  # the last drafting plan's expected tokens/s over plain decoding's
    explorations: int = 0
    probe_interval: int = 0  # steps between batch probes while the bucket decodes plain (0: not yet)
    next_probe: int = 0
    arrival_interval: int = 0  # steps between probes of new requests while the bucket decodes plain
    next_arrival_probe: int = 0
    # no probe of either kind before this step: each probe's price over a plain step's is spread over the plain steps
    # after it (``probe_budget``), so the batch's probes and its arrivals' together stay within the budget
    probe_quiet_until: int = 0
    plain_at: int = 0  # the step of the last plain observation (drafting_at: drafting)
    drafting_at: int = 0
    # drafting steps that verified every request's block (none left out): their own mean, the price of verifying
    # everyone. A step that verifies a few blocks beside others' single tokens is ragged: on a GPU no whole-step
    # graph serves it from ~32 requests on, and the fit over both kinds would price a uniform step by it
    whole_s: float | None = None
    whole_steps: int = 0
    whole_at: int = 0
    # on an engine that launches steps ahead, such steps run in their turn (the first of a drafting run, after plain
    # steps: a probe's) pay the host's work that a run of drafting steps, each launched ahead, overlaps: their mean is
    # kept apart, ``whole_s`` the steady ones' (on an H100 at 16 requests of SmolLM2, verifying every block outran
    # plain decoding by 1.08-1.17x while the mean over both kinds priced such a step at 2.5-2.7 plain ones)
    whole_serial_s: float | None = None
    whole_serial_steps: int = 0
    whole_serial_at: int = 0
    # a verified draft's price over a plain step, from the steps that verified drafts and drafted none (the step
    # after a probe or after drafting stopped): a probe pays its blocks' verify there, which on a compute-bound step
    # (many requests, K + 1 tokens each) costs several plain steps, while its drafting step alone costs little more
    # than a plain one and a fit over probes alone, whose drafting steps verify nothing, cannot see it
    verify_draft_s: float | None = None
    verify_steps: int = 0
    verify_at: int = 0

    def observe_plain(self, seconds: float, step: int, forget: float) -> None:
        """A plain step's time: the first at this bucket is left out (a first step at a shape pays warm-ups), the
        others averaged, each at most 4x the average so far (a pause of the host is not a price); the older ones
        weigh ``forget`` less for every step that passed since the last (a price timed long ago, when the host
        was busier or the contexts shorter, gives way to a new one)."""
        self.plain_seen += 1
        if self.plain_seen == 1:
            return
        self.plain_steps += 1
        self.plain_s = forgetting_mean(self.plain_s, self.plain_steps, step - self.plain_at, seconds, forget)
        self.plain_at = step

    def observe_drafting(self, drafts: int, seconds: float, step: int, forget: float, ridge: float) -> None:
        """A drafting step's time, fitted on its verified drafts: the first at this bucket left out, the others at
        most 4x the fit's price; the fit forgets ``forget`` for every step since the last drafting step (drafting
        every step: a step's weight decays 3% a step; a probe after 64 plain steps weighs the old fit 14%)."""
        self.since_exploration += 1
        self.drafting_seen += 1
        if self.drafting_seen == 1:
            return
        self.drafting_steps += 1
        fit = self.drafting_fit(ridge)
        if fit is not None and self.drafting_steps > 2:
            seconds = min(seconds, OUTLIER * (fit[0] + fit[1] * drafts))
        decay = forget ** max(step - self.drafting_at, 1)
        self.drafting_at = step
        self.sw, self.sx, self.sy = decay * self.sw + 1, decay * self.sx + drafts, decay * self.sy + seconds
        self.sxx, self.sxy = decay * self.sxx + drafts * drafts, decay * self.sxy + drafts * seconds

    def observe_whole(self, seconds: float, step: int, forget: float, steady: bool = True) -> None:
        """A drafting step that verified every block: averaged as plain steps are (``observe_plain``), after the
        drafting fit has left out the bucket's first drafting step; a steady one (launched ahead and launching the
        next ahead, or any on an engine that launches none ahead) into ``whole_s``, one that ran in its turn into
        ``whole_serial_s``."""
        if self.drafting_steps == 0:
            return
        if steady:
            self.whole_steps += 1
            self.whole_s = forgetting_mean(self.whole_s, self.whole_steps, step - self.whole_at, seconds, forget)
            self.whole_at = step
        else:
            self.whole_serial_steps += 1
            self.whole_serial_s = forgetting_mean(self.whole_serial_s, self.whole_serial_steps,
                                                  step - self.whole_serial_at, seconds, forget)
            self.whole_serial_at = step

    def whole_price(self, steady: bool = True) -> float | None:
        """The price of a drafting step verifying every block: a run of them (``steady``: the steady steps' mean
        where known) or one in its turn, a probe's (the serial steps' mean where known), else the other kind's."""
        first, other = (self.whole_s, self.whole_serial_s) if steady else (self.whole_serial_s, self.whole_s)
        return first if first is not None else other

    def observe_verify_only(self, drafts: int, seconds: float, step: int, forget: float) -> None:
        """A step that verified ``drafts`` drafts and drafted none: its time over the plain price, per verified draft,
        averaged as plain steps are (``observe_plain``); nothing before a plain price exists."""
        if self.plain_s is None or drafts <= 0:
            return
        self.verify_steps += 1
        per_draft = max(seconds - self.plain_s, 0.0) / drafts
        self.verify_draft_s = forgetting_mean(self.verify_draft_s, self.verify_steps, step - self.verify_at,
                                              per_draft, forget)
        self.verify_at = step

    def drafting_fit(self, ridge: float) -> tuple[float, float] | None:
        """(seconds of a drafting step verifying nothing, seconds a verified draft), or None before any drafting
        step. The slope's ridge pulls it toward 0 where the drafts verified barely varied (every step whole
        blocks: then only the mean of such steps is known, and the plan prices every ``m`` near it)."""
        if self.sw == 0:
            return None
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        cov = self.sxy / self.sw - mx * my
        scale = max(mx * mx, 1.0)
        slope = max(cov / (var + ridge * scale), 0.0)
        return max(my - slope * mx, 0.0), slope


@dataclass
class GuardPlan:
    """One step's decision: whether it drafts, and whose blocks the next step verifies (``None``: everyone's)."""

    step: int
    drafts: bool
    verifiers: frozenset[str] | None
    reason: str  # "pays", "probe", "explore", "unpriced", "plain"


@dataclass
class GuardStats:
    plain_steps: int = 0  # plans that drafted nothing
    drafting_steps: int = 0
    batch_probes: int = 0
    request_probes: int = 0
    explorations: int = 0
    trimmed_blocks: int = 0  # blocks dropped before their verify (their requests decoded a token instead)


def bucket_of(batch: int) -> int:
    """The power of two at or above ``batch`` (the guard's price tables are per bucket)."""
    return 1 << max(batch - 1, 0).bit_length()


class SpeculationGuard:
    """Decides per step whether the batch drafts and whose drafts are verified (see the module docstring)."""

    def __init__(self, max_draft_len: int, tuning: GuardTuning | None = None, runs_ahead: bool = False):
        self.max_draft_len = int(max_draft_len)
        self.tuning = tuning or GuardTuning()
        # the engine launches a plain step ahead when it expects the next to be one too: an exploration is then four
        # plain plans (the block verified at the first; the second serial; the third launched ahead and launching
        # the fourth: steady, the one timed), else two (the second timed)
        self.exploration_len = 4 if runs_ahead else 2
        # a batch probe drafts this many steps in a row: there the second, launched ahead by the first and launching
        # the step that verifies it, is steady, so a bucket that decodes plain still learns what a run of drafting
        # steps costs (its probes' first steps, in their turn, pay the host's work besides)
        self.probe_len = 2 if runs_ahead else 1
        self.population_gain: float | None = None  # accepted drafts a verify over every request seen
        self.verified_share = 1.0  # drafts a verifying request verified, over its block (confidence trims it)
        self.requests: dict[str, _RequestState] = {}
        self.buckets: dict[int, _BucketCosts] = {}  # pure decode steps' prices
        self.prompt_buckets: dict[int, _BucketCosts] = {}  # prices of decode steps that also fed a prompt chunk
        self.plan_now: GuardPlan | None = None
        self._verifying_plan: GuardPlan | None = None  # the plan before plan_now: whose blocks this step verifies
        self.stats = GuardStats()
        self._explore_left = 0  # plain plans left of an exploration (exploration_len in a row)
        self._probe_left = 0  # drafting plans left of a batch probe (probe_len in a row)
        self._bucket = 0  # the bucket of the last plan
        self._verifies_seen = 0  # every verify observed (a plan that decided plain stands until one comes)
        # a plain decision that stands: (the step it lapses at, verifies seen then, the requests it was made for)
        self._plain_standing: tuple[int, int, list[str]] | None = None
        # the step from which the last plain decision's batch probes (its own or its arrivals', whichever is due first,
        # each no sooner than the probe budget allows): what ``drafts`` predicts for a plain batch's next steps
        self._probe_due = 0
        # a decision that everyone verifies, standing: (the step it lapses at, the requests it was made for)
        self._whole_standing: tuple[int, list[str]] | None = None

    # ---- learning ---------------------------------------------------------------------------------

    def observe_verify(self, request_id: str, verified: int, accepted: int) -> None:
        """A request verified ``verified`` drafts and ``accepted`` of them were accepted."""
        self.observe_verifies([(request_id, verified, accepted)])

    def observe_verifies(self, outcomes: list[tuple[str, int, int]]) -> None:
        """A step's verifies, in order: (request, drafts verified, drafts accepted) each (one call a step: this is
        per-request host work on every drafting step)."""
        tuning, requests = self.tuning, self.requests
        memory, k = tuning.memory, max(self.max_draft_len, 1)
        # (the population learns from a step whose blocks were all verified: not a selection of the better or worse)
        verifying = self._verifying_plan
        weight = tuning.population_weight if verifying is None or verifying.verifiers is None else 0.0
        pop, share, seen = self.population_gain, self.verified_share, self._verifies_seen
        for request_id, verified, accepted in outcomes:
            if verified <= 0:
                continue
            if weight or pop is None:
                pop = accepted if pop is None else pop + weight * (accepted - pop)
            share += 0.05 * (min(verified / k, 1.0) - share)
            state = requests.get(request_id)  # (every verify of every request: no state built to be thrown away)
            if state is None:
                state = requests[request_id] = _RequestState()
            seen += 1
            state.accepted = memory * state.accepted + accepted
            state.weight = memory * state.weight + 1.0
            state.verifies += 1
        self.population_gain, self.verified_share, self._verifies_seen = pop, share, seen

    def observe_step(self, batch: int, drafted: bool, verified_drafts: int, seconds: float,
                     steady: bool = True, prompt: bool = False, whole: bool = True) -> None:
        """A decode step's wall time: ``batch`` requests, whether it drafted, the drafts it verified, whether it ran
        as a run of plain steps runs (``steady``: launched ahead by the step before it and launching the next one
        ahead; every step of an engine that launches none ahead), whether it also fed a prompt chunk (``prompt``:
        its prices are kept apart, ``prompt_buckets``; such a step is never launched ahead), whether every block
        drafted for it was verified (``whole``: nobody left out). A plain step (drafted nothing, verified nothing),
        steady or feeding a prompt, times the plain price; a drafting step the drafting fit, and one that verified
        every block also the whole price (a steady one that of a run of drafting steps, else that of a step in its
        turn); a decode step that only verified (the one after a probe, or after drafting
        stopped) the price of a verified draft over a plain step (``verify_draft_s``: what a probe's verify costs); a
        plain step that is neither steady nor feeding a prompt, nothing."""
        table = self.prompt_buckets if prompt else self.buckets
        costs = table.setdefault(bucket_of(batch), _BucketCosts())
        step = self.plan_now.step if self.plan_now is not None else 0
        if drafted:
            costs.observe_drafting(verified_drafts, seconds, step, self.tuning.forget, self.tuning.ridge)
            if whole and verified_drafts:
                costs.observe_whole(seconds, step, 1.0 - self.tuning.plain_weight, steady)
        elif verified_drafts == 0 and (steady or prompt):
            costs.observe_plain(seconds, step, 1.0 - self.tuning.plain_weight)
        elif verified_drafts and not prompt:
            costs.observe_verify_only(verified_drafts, seconds, step, 1.0 - self.tuning.plain_weight)

    # ---- deciding ---------------------------------------------------------------------------------

    def gain(self, request_id: str) -> float:
        """Expected accepted drafts when ``request_id`` verifies a block: its own recent verifies' mean, shrunk toward
        the population's (worth ``prior_verifies`` verifies: one unlucky block does not drop a request the drafter
        serves well, nor one lucky block keep one it does not); before any verify at all, a whole block (the
        drafter is presumed to work until it shows otherwise)."""
        return self._gains([request_id])[0][0]

    def drafts(self, step: int) -> bool:
        """Whether step ``step`` drafts: the plan made at it, or (the next step, before its plan) a prediction: an
        exploration's second step decodes plain, a plain batch until a probe is due (its own or its arrivals', each
        no sooner than the probe budget allows), a drafting batch drafts. (An engine that launches the next plain
        decode ahead on a False prediction plans it with ``ahead``: a step predicted to draft is not launched ahead,
        and its host work is then not hidden behind the device's.)"""
        plan = self.plan_now
        if plan is None:
            return True
        if plan.step == step:
            return plan.drafts
        if self._explore_left:
            return False
        if plan.drafts:
            return True
        return step >= self._probe_due

    def verifies(self, request_id: str) -> bool:
        """Whether ``request_id``'s block drafted at the last plan is verified (else it is dropped unverified)."""
        plan = self.plan_now
        return plan is None or plan.verifiers is None or request_id in plan.verifiers

    def verifies_all(self) -> bool:
        """Whether every block drafted at the last plan is verified (a launch-ahead verify needs it)."""
        plan = self.plan_now
        return plan is None or plan.verifiers is None

    def plan(self, step: int, request_ids: list[str], ahead: bool = False,
             pinned: frozenset[str] = frozenset()) -> GuardPlan:
        """Decide step ``step`` (``request_ids``: the running requests): whether it drafts, and whose blocks the
        next step verifies. ``ahead``: the step was launched ahead as a plain decode (it cannot draft). ``pinned``:
        requests whose blocks are always verified and for which the batch always drafts (a seeded sampled request:
        its tokens depend on which steps verified drafts, so they must not depend on the rest of the batch or on
        step times)."""
        tuning = self.tuning
        batch = len(request_ids)
        self._bucket = bucket_of(batch)
        costs = self.buckets.setdefault(self._bucket, _BucketCosts())
        if len(self.requests) > 2 * batch + 64:  # forget requests that left (an O(batch) prune, rarely)
            live = set(request_ids)
            self.requests = {r: s for r, s in self.requests.items() if r in live}
        if ahead:
            self._explore_left, self._probe_left = max(self._explore_left - 1, 0), 0
            return self._record(GuardPlan(step, False, frozenset(), "ahead"))
        if self._probe_left:  # a batch probe's next drafting step, everyone verifying
            self._probe_left -= 1
            return self._record(GuardPlan(step, True, None, "probe"))
        if not pinned and (self._explore_left or self._exploration_due(costs)):
            if self._explore_left == 0:  # plain steps in a row until one is clean and steady (exploration_len)
                self._explore_left, costs.since_exploration = self.exploration_len, 0
                # where drafting clearly pays, a fresh plain price changes no decision: the next wait doubles
                clear = costs.plain_steps and costs.advantage >= tuning.clear_advantage
                costs.explore_wait = min(2 * (costs.explore_wait or tuning.explore_every), tuning.explore_max) \
                    if clear else tuning.explore_every
                costs.explorations += 1
                self.stats.explorations += 1
            self._explore_left -= 1
            return self._record(GuardPlan(step, False, frozenset(), "explore"))
        standing = self._plain_standing
        if standing is not None and not pinned and step < standing[0] and self._verifies_seen == standing[1] \
                and request_ids == standing[2]:
            # nothing the last plain plan weighed has changed but the prices' drift (bounded: it lapses at the next
            # probe or after probe_first steps): plain again, without ranking gains and pricing every m each step
            return self._record(GuardPlan(step, False, frozenset(), "plain"))
        standing = self._whole_standing
        if standing is not None and not pinned and step < standing[0] and request_ids == standing[1]:
            # everyone verified a step ago and the batch is the same: gains and prices move by a verify's weight a
            # step, so the choice is made again every replan_every steps (a request whose drafts stopped paying is
            # left out that much later), not every step
            return self._record(GuardPlan(step, True, None, "pays"))
        self._whole_standing = None
        gains = sorted(self._gains(request_ids), reverse=True)  # [batch] (gain, request) best first
        prices = self._prices(costs)
        fit = prices.drafting_fit(tuning.ridge)
        # a drafting step never costs less than a plain one, so where everyone's expected extra tokens together do
        # not beat the margin drafting cannot pay at any price: decide so before this bucket's prices are known
        hopeless = sum(gain for gain, _ in gains) <= tuning.margin * batch  # (gains are means of counts: >= 0)
        if (prices.plain_s is None or fit is None) and not hopeless:
            return self._record(GuardPlan(step, True, None, "unpriced"))
        best_m = 0
        if not hopeless:
            base, per_draft = fit
            drafts_each = self.max_draft_len * self.verified_share
            # the fit only interpolates where its drafts varied (every step verifying whole blocks, or all but one,
            # they barely do: its line can then run through zero or below the whole price), so a step verifying
            # some blocks is priced no lower than a plain step plus its drafts (a drafting step runs the drafter
            # besides), nor than the whole price less the drafts left out (leaving blocks out saves at most their
            # verify: the drafter's forward and the step's fixed work remain)
            base = max(base, prices.plain_s)
            # (a step leaving some out runs in its turn, and never costs less than one verifying everyone either way)
            ragged_whole = max((w for w in (prices.whole_s, prices.whole_serial_s) if w is not None), default=None)
            if ragged_whole is not None:
                base = max(base, ragged_whole - per_draft * drafts_each * batch)
            # the margin is a band: a batch that drafted because it paid keeps drafting until plain decoding beats it
            # by the margin, a batch decoding plain starts only where drafting beats plain by it; otherwise a dip of
            # the gains near break-even sends the batch plain until its next probe, tens of steps later within the
            # probe budget (replayed on SmolLM2's recorded verifies at an H100's prices: 1.07x AR at 16 requests
            # against 1.12x with the band, fixed K 1.13x)
            paying = self.plan_now is not None and self.plan_now.reason == "pays"
            best_rate = batch / prices.plain_s * (1 - tuning.margin if paying else 1 + tuning.margin)
            tokens = float(batch)
            last = 0.0
            for m, (gain, _) in enumerate(gains[:-1], start=1):  # some left out: priced by the fit
                tokens += gain
                rate = tokens / (base + per_draft * drafts_each * m)
                if rate > best_rate:
                    best_m, best_rate = m, rate
                elif m > 1 and rate < last:  # (gains fall with m, the cost grows linearly: the rate only falls on)
                    break
                last = rate
            # everyone: the whole price where known (a uniform step), else the fit
            whole = prices.whole_price()  # (a batch that keeps drafting for everyone launches each step ahead)
            everyone = whole if whole is not None else base + per_draft * drafts_each * batch
            everyone_rate = (batch + sum(gain for gain, _ in gains)) / everyone
            if everyone_rate > best_rate:
                best_m, best_rate = batch, everyone_rate
            costs.advantage = best_rate * prices.plain_s / batch if best_m else 0.0
        if best_m == 0 and pinned:
            return self._record(GuardPlan(step, True, None if len(pinned) == batch else frozenset(pinned), "pinned"))
        if best_m == 0:
            arrivals = [r for _, r in gains if self._unseen(r)]
            quiet = costs.probe_quiet_until  # (a probe of either kind ran lately: its price is not yet spread)
            spacing = self._probe_spacing(prices, fit, batch, batch, self.probe_len)  # (0 where unpriced)
            if costs.probe_interval == 0:  # drafting just stopped paying here: the first probe after probe_first
                costs.probe_interval, costs.next_probe = tuning.probe_first, step + max(tuning.probe_first, spacing)
            elif step >= max(costs.next_probe, quiet):  # the whole batch verifies one block (the arrivals' too), then
                # waits twice as long; first, so that a stream of arrivals never keeps the batch from its probes
                costs.probe_interval = min(2 * costs.probe_interval, tuning.probe_max)
                costs.next_probe = step + costs.probe_interval
                costs.probe_quiet_until = step + spacing
                self.stats.batch_probes += 1
                self._probe_left = self.probe_len - 1
                return self._record(GuardPlan(step, True, None, "probe"))
            if arrivals and step >= max(costs.next_arrival_probe, quiet):  # requests never verified: now and then
                costs.arrival_interval = min(max(2 * costs.arrival_interval, tuning.probe_first), tuning.probe_max)
                costs.next_arrival_probe = step + costs.arrival_interval
                costs.probe_quiet_until = step + self._probe_spacing(prices, fit, len(arrivals), batch)
                self.stats.request_probes += len(arrivals)
                return self._record(GuardPlan(step, True, None if len(arrivals) == batch else frozenset(arrivals),
                                              "probe"))
            due = max(costs.next_probe, quiet)
            if arrivals:
                due = min(due, max(costs.next_arrival_probe, quiet))
            self._probe_due = due
            self._plain_standing = (min(due, step + tuning.probe_first), self._verifies_seen, list(request_ids))
            return self._record(GuardPlan(step, False, frozenset(), "plain"))
        costs.probe_interval, costs.next_probe, costs.arrival_interval, costs.next_arrival_probe = 0, 0, 0, 0
        requests = self.requests
        chosen = set(pinned)
        chosen.update(request_id for _, request_id in gains[:best_m])
        for _, request_id in gains[:best_m]:  # chosen: a left-out request's probe interval starts over
            state = requests.get(request_id)
            if state is not None and state.probe_interval:
                state.probe_interval = 0
        for _, request_id in gains[best_m:]:  # left out: probed after probe_first steps, then twice as long
            state = requests.get(request_id)
            if state is None:
                state = requests[request_id] = _RequestState()
            if state.probe_interval == 0:
                state.probe_interval, state.next_probe = tuning.probe_first, step + tuning.probe_first
            elif step >= state.next_probe:
                chosen.add(request_id)
                self.stats.request_probes += 1
                state.probe_interval = min(2 * state.probe_interval, tuning.probe_max)
                state.next_probe = step + state.probe_interval
        if best_m == batch and not pinned:  # (everyone pays: not a batch whose left-out requests are all probed)
            self._whole_standing = (step + tuning.replan_every, list(request_ids))
        return self._record(GuardPlan(step, True, None if len(chosen) == batch else frozenset(chosen), "pays"))

    def _prices(self, costs: _BucketCosts) -> _BucketCosts:
        """The prices a plan at this bucket compares: its pure decode steps' where both are known, else its steps
        that also fed a prompt (``prompt_buckets``), where both of those are (under a steady load of short requests
        nearly every step feeds one, and the plan's choice is then between such steps, the prompt's share the same
        either way), else the nearest bucket's pure steps' where both are known there."""
        if costs.plain_s is not None and costs.sw:
            return costs
        mixed = self.prompt_buckets.get(self._bucket)
        if mixed is not None and mixed.plain_s is not None and mixed.sw:
            return mixed
        # else the nearest bucket whose pure steps are priced: a drafting step's price over a plain one's moves
        # slowly with the batch, and is a far better guess than none (a CPU's drafting step cost 3.6 plain ones at
        # one request and 3.8 at four: a batch size first met in a drain drafted every step until priced)
        nearest = self._nearest_bucket(lambda other: other.plain_s is not None and other.sw)
        return nearest if nearest is not None else costs

    def _nearest_bucket(self, has) -> _BucketCosts | None:
        """The pure decode bucket nearest the last plan's (in powers of two) for which ``has(costs)`` holds, or None."""
        known = [(abs(bucket.bit_length() - self._bucket.bit_length()), bucket) for bucket, other
                 in self.buckets.items() if has(other)]
        return self.buckets[min(known)[1]] if known else None

    def _gains(self, request_ids: list[str]) -> list[tuple[float, str]]:
        """[(gain, request)] for ``request_ids`` (see ``gain``), in one pass: the plan's per-step host work."""
        prior = self.population_gain if self.population_gain is not None else float(self.max_draft_len)
        n, requests, out = self.tuning.prior_verifies, self.requests, []
        for request_id in request_ids:
            state = requests.get(request_id)
            out.append((prior if state is None or not state.verifies
                        else (n * prior + state.accepted) / (n + state.weight), request_id))
        return out

    def _unseen(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        return state is None or state.verifies == 0

    def _probe_spacing(self, prices: _BucketCosts, fit: tuple[float, float] | None, verified: int, batch: int,
                       steps: int = 1) -> int:
        """The fewest steps from one probe verifying ``verified`` of the batch's blocks to the next such that the
        probe's price over a plain step's is at most ``probe_budget`` of the plain steps' time between: 0 where
        no price of it is known (the doubling schedule alone). A probe drafts at one step (``steps`` in a row: each
        priced alike) and verifies at the next: a step's price is the drafting step's (the fit's, verifying nothing)
        plus its drafts' verify, each draft priced at the most of the fit's slope and of what the steps that only
        verified showed (``verify_draft_s``, this bucket's or the nearest bucket's: a draft's verify moves slowly
        with the batch), and never below what a drafting step that verified everyone in its turn cost
        (``whole_price(steady=False)``) where everyone is probed."""
        plain = prices.plain_s
        if plain is None:
            return 0
        verify = self._verify_draft_s(prices)
        candidates = []
        if fit is not None or verify is not None:
            base, slope = fit if fit is not None else (plain, 0.0)
            per_draft = max(slope, verify or 0.0)
            candidates.append(max(base, plain) + per_draft * self.max_draft_len * self.verified_share * verified)
        whole = prices.whole_price(steady=False)
        if verified == batch and whole is not None:
            candidates.append(whole)
        if not candidates:
            return 0
        return math.ceil(steps * max(max(candidates) - plain, 0.0) / (self.tuning.probe_budget * plain))

    def _verify_draft_s(self, prices: _BucketCosts) -> float | None:
        """A verified draft's price over a plain step (``_BucketCosts.verify_draft_s``): the priced bucket's, else the
        nearest bucket's that has one, else None."""
        if prices.verify_draft_s is not None:
            return prices.verify_draft_s
        nearest = self._nearest_bucket(lambda other: other.verify_draft_s is not None)
        return nearest.verify_draft_s if nearest is not None else None

    def _exploration_due(self, costs: _BucketCosts) -> bool:
        """Time a plain step at this bucket: none timed yet (after 4 drafting steps), or ``explore_every``
        drafting steps since the last (twice as many after each exploration begun while drafting beat plain
        decoding by ``clear_advantage``, up to ``explore_max``). Before a price exists, an exploration that timed
        nothing (a request finished or arrived in it: a step that feeds a prompt is no price, and under a steady
        load with short requests most steps do) doubles the wait for the next, up to ``explore_every``: plain steps
        that never price anything must not become a fixed share of the steps."""
        if costs.plain_steps == 0:  # (the first plain step timed is left out: two explorations at least)
            misses = max(costs.explorations - costs.plain_seen, 0)  # explorations that timed no plain step
            wait = min(4 << min(misses, 16), self.tuning.explore_every)
            return costs.drafting_seen >= 4 and costs.since_exploration >= wait
        return costs.since_exploration >= (costs.explore_wait or self.tuning.explore_every)

    def _record(self, plan: GuardPlan) -> GuardPlan:
        self._verifying_plan, self.plan_now = self.plan_now, plan
        if plan.drafts:
            self.stats.drafting_steps += 1
        else:
            self.stats.plain_steps += 1
        return plan

    def as_dict(self) -> dict:
        """The guard's counters and prices (``Engine.get_metrics()["speculation_guard"]``)."""
        def priced(table: dict[int, _BucketCosts]) -> dict:
            out = {}
            for bucket, costs in sorted(table.items()):
                fit = costs.drafting_fit(self.tuning.ridge)
                out[bucket] = {
                    "plain_ms": None if costs.plain_s is None else round(1e3 * costs.plain_s, 4),
                    "drafting_ms": None if fit is None else round(1e3 * fit[0], 4),
                    "ms_per_verified_draft": None if fit is None else round(1e3 * fit[1], 5),
                    "whole_ms": None if costs.whole_s is None else round(1e3 * costs.whole_s, 4),
                    "whole_serial_ms": None if costs.whole_serial_s is None else round(1e3 * costs.whole_serial_s, 4),
                    "plain_steps": costs.plain_steps, "drafting_steps": costs.drafting_steps}
            return out

        buckets, prompt_buckets = priced(self.buckets), priced(self.prompt_buckets)
        stats = self.stats
        return {"plain_steps": stats.plain_steps, "drafting_steps": stats.drafting_steps,
                "batch_probes": stats.batch_probes, "request_probes": stats.request_probes,
                "explorations": stats.explorations, "trimmed_blocks": stats.trimmed_blocks,
                "population_gain": None if self.population_gain is None else round(self.population_gain, 4),
                "last_plan": None if self.plan_now is None else self.plan_now.reason, "buckets": buckets,
                "prompt_buckets": prompt_buckets}

