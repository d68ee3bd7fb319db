"""The survival fit: each draft's chance to be accepted given its prefix was, fitted online to what the engine's
own verifications accepted, with the offline calibration as its prior (``runtime.spec.confidence``, point 4)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from runtime.spec.history import HISTORY_NONE, history_classes, history_rows
from runtime.spec.tuning import TUNING


class SurvivalSkill:
    """How much the corrected survivals tell drafts apart, per position: of the drafts verified at position k, the
    Brier score of the survival the scheduler believed (corrected as when the step was decided) against what
    happened (the first k + 1 drafts all accepted), as a skill against always predicting the position's observed
    rate: ``1 - brier / (rate * (1 - rate))``. Near 0: the survivals are the position's average for every request
    (however well calibrated, a schedule can then only cap all requests alike); 1: they foretell each draft.
    Negative: worse than the average (miscalibrated). Only verified drafts count, so a load whose budget trims
    late positions scores them on what it still verified."""

    def __init__(self, max_draft_len: int):
        self.verified = np.zeros(max_draft_len)  # [K] drafts verified at each position
        self.survived = np.zeros(max_draft_len)  # [K] of them, how many survived
        self.squared_error = np.zeros(max_draft_len)  # [K] summed (survival - survived)^2

    def add(self, survival: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> None:
        """survival [S, K'] as believed, lengths [S] drafts verified, accepted [S] of them accepted (<= lengths)."""
        k = survival.shape[1]
        verified = np.arange(k)[None, :] < lengths[:, None]  # [S, K']
        survived = (np.arange(k)[None, :] < accepted[:, None]).astype(np.float64)  # [S, K']
        self.verified[:k] += verified.sum(axis=0)
        self.survived[:k] += (survived * verified).sum(axis=0)
        self.squared_error[:k] += (((survival - survived) ** 2) * verified).sum(axis=0)

    def per_position(self) -> list[float | None]:
        """[K] the skill at each position (rounded), None where fewer than 2 drafts were verified or all alike."""
        out = []
        for n, hits, error in zip(self.verified, self.survived, self.squared_error):
            rate = hits / n if n else 0.0
            spread = rate * (1.0 - rate)
            out.append(round(float(1.0 - error / n / spread), 4) if n >= 2 and spread > 0 else None)
        return out


class SurvivalCorrection:
    """The survivals the scheduler believes, corrected online by what the engine's own verifications accepted.

    **The fit** (what the scheduler ranks and prices by): each draft's conditional survival (its prefix survived)
    is ``sigmoid(a_k logit(c_k) + b_k + d_{h,k})`` for a request of verify-history class h, its survival the
    cumulative product along the block (so non-increasing). Per position, ``a_k`` (the slope), ``b_k`` and the class
    offsets ``d_{h,k}`` are a logistic regression on the drafts of that position the engine reached (verified, its
    prefix accepted) and whether each was accepted: the last ``TUNING.fit_window`` of them, a ridge prior of precision
    ``TUNING.fit_prior`` at the offline calibration (``a_k = 1 / T_k``, no bias: with no evidence the survivals are STS's),
    redone by ``TUNING.newton_steps`` Newton steps once ``TUNING.fit_every`` new drafts were reached. Where the head tells drafts
    apart the slope keeps that; where it does not (a drafter trained briefly: one run) the slope falls and each
    class's bias carries what the requests' histories tell; a bias of the whole position is what the ratio
    correction of earlier runs learned (the offline temperature, fitted on other text, left the late drafts' survivals
    10-25% low, and the scheduler trimmed drafts that would have paid). A multiplicative ratio could not separate
    requests whose survivals spread over orders of magnitude (a temperature of 0.1 pushes them to 0 or 1): a ratio
    of 3 on 1e-6 is still nothing, where a fitted slope of 0.2 brings them to the class's rate.

    **The diagnostic** ``ratio`` [K] (metrics only): of the drafts verified at position k, how many survived over the
    survival the offline calibration predicted for them, with a prior of ``TUNING.correction_prior`` drafts at ratio 1 (at
    the position's mean prediction) and a window of ``TUNING.correction_window`` verified drafts.

    A position is learned only where drafts reach it (see ``TUNING.explore_every``). Evidence is folded in every
    ``TUNING.fold_every`` steps, the fit made at the first fold with evidence, then redone once ``TUNING.fit_every`` new drafts were
    reached, the new ones are ``TUNING.refit_growth`` of the window's, or ``TUNING.refit_folds`` folds went by (a refit costs ~0.7
    ms of numpy: at 64 requests once per ~8 steps; at a few requests each time the evidence grew by a quarter while
    the window fills, at least once per 64 steps); an engine whose executor runs host work while the device computes
    (``defer_to``) folds there, off the step's path, and refits there a slice at a time within its budget.

    The ridge is light (``TUNING.fit_prior``: the weight of one draft per parameter): a Gaussian prior on the logit weighs
    most in the tails, and at 4 (the weight of a few drafts) a request whose drafter accepted nothing was still
    believed to keep 7% of its first drafts after 80 rejections (1.17 tokens a step expected where 1.0 came), so
    drafting still looked as if it paid against plain decoding (one run at one request: 0.97 of the tuned
    throughput); at 1, 4% after 24 steps, and the engine stops drafting there (``DraftingHold``)."""

    def __init__(self, max_draft_len: int, inverse_temperatures: np.ndarray | None = None):
        k = max_draft_len
        self.history_names = history_classes(k)
        classes = len(self.history_names)
        inverse = np.ones(k) if inverse_temperatures is None else np.asarray(inverse_temperatures, dtype=np.float64)
        self.inverse_temperatures = inverse[:k]
        # the diagnostic ratio
        self.predicted = np.zeros(k)  # [K] summed calibrated survival of the verified drafts
        self.survived = np.zeros(k)  # [K] how many of them survived
        self.verified = np.zeros(k)  # [K] how many were verified
        self.ratio = np.ones(k)  # [K]
        # the fit: per position (slope, intercept, one offset per class), at the calibration until evidence moves it
        self.prior = np.zeros((k, 2 + classes))
        self.prior[:, 0] = self.inverse_temperatures
        self.theta = self.prior.copy()  # [K, 2 + H]
        self._x = np.zeros((k, TUNING.fit_window))  # [K, W] logit(c) of the reached drafts (a ring per position)
        self._h = np.zeros((k, TUNING.fit_window), dtype=np.int64)  # [K, W] their requests' classes
        self._y = np.zeros((k, TUNING.fit_window))  # [K, W] 1 where accepted
        self._filled = np.zeros(k, dtype=np.int64)  # [K] ring entries in use
        self._next = np.zeros(k, dtype=np.int64)  # [K] where the next one goes
        self._new = 0  # reached drafts since the last fit
        self._folds = 0  # folds since the last fit
        self._lock = threading.Lock()  # evidence and refits: the engine's thread and a metrics scrape's
        self._set_parameters()
        self.learned = False  # no fit yet: the survivals are the calibration's
        self._evidence: list[tuple] = []  # steps not yet folded in: (confidence, allotted, verified, accepted, history)
        # where a due fold waits to run while the device computes the next step (the engine's executor's host work,
        # ``runtime.engine.host_work.HostWork``); None: at once, in ``learn``
        self.defer_to = None
        self._fold_queued = False
        self._refit = None  # a deferred refit under way (its slices: _refit_slices), or None
        self.skill = SurvivalSkill(k)  # how sharp the believed survivals were (metrics; reset_skill)

    def _set_parameters(self) -> None:
        """The fit's parameters as the survivals read them: ``slope`` [K] and ``bias`` [H, K] (numpy and lists)."""
        self.slope = self.theta[:, 0].copy()
        self.bias = (self.theta[:, 1][:, None] + self.theta[:, 2:]).T.copy()  # [H, K]
        self.bias_factor = np.exp(-self.bias)  # [H, K]: sigmoid(a x + b) = 1 / (1 + odds ** a * exp(-b))
        self.slope_list, self.bias_list = self.slope.tolist(), self.bias.tolist()
        identity = bool((self.slope == 1.0).all() and (self.bias == 0.0).all())  # survival = cumprod(c)
        # what the survivals read, swapped in one assignment (a metrics scrape may refit while the engine decides)
        self._params = (self.slope, self.bias_factor, self.slope_list, self.bias_factor.tolist(), identity)

    def reset_skill(self) -> None:
        """Start the skill's sums afresh (a bench's next concurrency); the correction itself keeps its evidence."""
        with self._lock:
            self._fold()
            self.skill = SurvivalSkill(len(self.ratio))

    def survival(self, confidence, history=None) -> np.ndarray:
        """confidence [S, K'] (K' <= K; 0 where nothing was proposed), history [S] classes (None: all
        ``HISTORY_NONE``; classes of ``history_classes``) -> the believed survival [S, K'], in [0, 1] and
        non-increasing along each row."""
        confidence = np.asarray(confidence, dtype=np.float64)
        slope, bias_factor, _, _, identity = self._params
        if identity:
            return np.cumprod(np.maximum(confidence, 0.0), axis=1)
        rows = history_rows(history, confidence.shape[0], len(self.history_names))
        return fitted_survival(confidence, slope, bias_factor[rows, :confidence.shape[1]])

    def survival_row(self, confidence: list[float], k: int, history: int = HISTORY_NONE) -> list[float]:
        """``survival`` of one request's confidences [K'] in plain Python, padded with 0 to ``k``."""
        out, alive = [0.0] * k, 1.0
        _, _, slope, factors, identity = self._params
        factor = factors[history]
        for j, c in enumerate(confidence):
            if not c > 0:  # nothing proposed here (or a confidence of 0): no draft from here on survives
                break
            if not identity:
                c = min(max(c, 1e-9), 1 - 1e-9)
                c = 1.0 / (1.0 + ((1.0 - c) / c) ** slope[j] * factor[j])
            alive *= c
            out[j] = alive
        return out

    def learn(self, confidence, allotted, verified, accepted, history=None) -> None:
        """One step's verified requests: ``confidence`` [S, K'] the head's confidences (0 past a block; an array or
        S lists of one length), ``allotted`` [S] the drafts each was allotted and ``verified`` [S] how many it
        verified (the lesser counts), ``accepted`` [S] how many of them it accepted (-1: unknown, left out),
        ``history`` [S] each one's class when the step was decided (None: all ``HISTORY_NONE``); converted when
        folded in with the steps before it, once ``TUNING.fold_every`` have gathered: at once, or with ``defer_to`` set, by a
        task queued there (the fold and the refit it may bring, ~3 ms of numpy per 8 steps at 256 requests on a
        2-core host, then run while the device computes the next step instead of between steps; the decisions it
        would have moved read it a step later: the fit lags ``TUNING.fold_every`` steps anyway). Deferred folds that do
        not get to run (no step waits on the device) run here once ``TUNING.fold_deferred_most`` steps gathered."""
        with self._lock:
            self._evidence.append((confidence, allotted, verified, accepted, history))
            gathered = len(self._evidence)
            if gathered < TUNING.fold_every:
                return
            if self.defer_to is None or gathered >= TUNING.fold_deferred_most:
                self._fold()
                return
            if self._fold_queued:
                return
            self._fold_queued = True
        self.defer_to.add(self._deferred_fold)

    def _deferred_fold(self) -> None:
        with self._lock:
            self._fold_queued = False
            self._fold()

    def fold(self) -> None:
        """Fold the gathered steps' evidence into the diagnostic's sums and the fit's window; refit if due. Safe
        beside the engine's own calls (a metrics scrape folds from another thread)."""
        with self._lock:
            self._fold()

    def refit_now(self) -> None:
        """Fold the gathered evidence in and refit, whatever is due (a judgement that depends on the newest step);
        a deferred refit under way is dropped (this one fits newer evidence)."""
        with self._lock:
            self._fold()
            self._refit = None
            self.refit()

    def _fold(self) -> None:
        if not self._evidence:
            return
        steps = [np.asarray(confidence, dtype=np.float64).reshape(len(accepted), -1)
                 for confidence, _, _, accepted, _ in self._evidence]  # each [S, K']
        k = max(step.shape[1] for step in steps)
        confidence = np.concatenate([np.pad(c, ((0, 0), (0, k - c.shape[1]))) if c.shape[1] < k else c
                                     for c in steps])  # [sum S, K'] (0 past a step's blocks)
        lengths = np.minimum(np.concatenate([np.asarray(a, dtype=np.int64) for _, a, _, _, _ in self._evidence]),
                             np.concatenate([np.asarray(v, dtype=np.int64) for _, _, v, _, _ in self._evidence]))
        accepted = np.concatenate([np.asarray(a, dtype=np.int64) for _, _, _, a, _ in self._evidence])
        classes = len(self.history_names)
        history = np.concatenate([history_rows(h, len(a), classes) for _, _, _, a, h in self._evidence])  # [sum S]
        self._evidence = []
        known = accepted >= 0
        if not known.any():
            return
        lengths = np.where(known, np.minimum(lengths, k), 0)  # [S]: a request left out verified nothing
        accepted = np.where(known, np.minimum(accepted, lengths), 0)
        self.skill.add(self.survival(confidence, history), lengths, accepted)  # as believed when decided
        self._add_diagnostic(fitted_survival(confidence, self.inverse_temperatures), lengths, accepted)  # STS's
        c = np.minimum(np.maximum(confidence, 1e-9), 1 - 1e-9)
        logit = np.log(c) - np.log1p(-c)  # [S, K']
        for j in range(k):  # the drafts at position j the engine reached: verified, every draft before accepted
            reached = (j < lengths) & (accepted >= j)
            count = int(reached.sum())
            if count:
                self._append(j, logit[reached, j], history[reached], (accepted[reached] > j).astype(np.float64))
                self._new += count
        self._folds += 1
        # the first fit at the first fold with evidence, then again whenever the evidence grew by TUNING.refit_growth: a
        # small batch would otherwise believe the calibration, then its first few drafts' fit, for TUNING.refit_folds x
        # TUNING.fold_every steps (64 at one request; those runs' drafters accepted nothing there, and the engine
        # kept drafting for 0.93-0.97 of the tuned throughput). Refits grow geometric, then every TUNING.refit_folds folds.
        if self._new >= TUNING.fit_every or (self._new and (self._folds >= TUNING.refit_folds or not self.learned
                                                     or self._new >= TUNING.refit_growth * int(self._filled.sum()))):
            if self.defer_to is None:
                self.refit()
            elif self._refit is None:  # in slices, in the host work's budget (a refit already running: it goes on)
                self._refit = self._refit_slices()
                self.defer_to.add(self._advance_refit)

    def _advance_refit(self) -> None:
        """A deferred refit's next slice (``_refit_slices``); queued again until it ends."""
        with self._lock:
            if self._refit is None:  # (superseded by a refit at once: refit_now)
                return
            try:
                next(self._refit)
            except StopIteration:
                self._refit = None
                return
        self.defer_to.add(self._advance_refit)

    def _add_diagnostic(self, survival: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> None:
        k = survival.shape[1]
        # at position j: the requests that verified (accepted) more than j drafts (counts, reverse-cumulated)
        self.verified[:k] += np.bincount(lengths, minlength=k + 1)[::-1].cumsum()[::-1][1:]
        self.survived[:k] += np.bincount(accepted, minlength=k + 1)[::-1].cumsum()[::-1][1:]
        self.predicted[:k] += (survival * (np.arange(k)[None, :] < lengths[:, None])).sum(axis=0)
        if self.verified.max() > TUNING.correction_window:  # the oldest evidence fades past the window
            scale = np.minimum(1.0, TUNING.correction_window / np.maximum(self.verified, 1.0))  # [K]
            self.predicted *= scale
            self.survived *= scale
            self.verified *= scale
        # the prior: TUNING.correction_prior drafts at the position's mean prediction, all surviving as predicted
        prior = TUNING.correction_prior * self.predicted / np.maximum(self.verified, 1e-12)  # [K]
        positive = self.predicted + prior > 0  # a position never verified, or predicted 0 throughout: ratio 1
        self.ratio = np.where(positive, (self.survived + prior) / np.where(positive, self.predicted + prior, 1.0),
                              1.0)

    def _append(self, j: int, x: np.ndarray, h: np.ndarray, y: np.ndarray) -> None:
        """Position ``j``'s reached drafts into its ring (the newest ``TUNING.fit_window`` kept)."""
        x, h, y = x[-TUNING.fit_window:], h[-TUNING.fit_window:], y[-TUNING.fit_window:]
        slots = (self._next[j] + np.arange(len(x))) % TUNING.fit_window
        self._x[j, slots], self._h[j, slots], self._y[j, slots] = x, h, y
        self._next[j] = (self._next[j] + len(x)) % TUNING.fit_window
        self._filled[j] = min(TUNING.fit_window, self._filled[j] + len(x))

    def refit(self) -> None:
        """Refit at once (``_refit_slices`` run to the end): see there."""
        for _ in self._refit_slices():
            pass

    def _refit_slices(self):
        """``TUNING.newton_steps`` Newton steps of every position's ridge logistic regression, from the current parameters.
        The features are logit(c), 1 and the class's one-hot, so the gradient and Hessian are sums per position and
        class of a few weighted terms: one ``bincount`` each over the window (a refit of 7 x 2048 drafts ~0.7 ms on a
        2-core CPU host, where dense [K, W, F] products of 7 x 4096 and four steps cost 5). A step that moves a
        parameter by more than ``TUNING.trusted_step`` is damped: a position whose penalized loss it does not lower takes
        half of it, and so on (``TUNING.halvings``), else none of it; while steps are being halved (the fit far from its
        optimum), up to ``TUNING.damped_steps`` steps a refit.
        A full Newton step from saturated probabilities (a head whose logits spread over tens, read at a slope of 10:
        a calibration temperature of 0.1) has a Hessian near the ridge alone and jumps to the parameters' limits:
        one run at 256 requests fitted position 0 at slope 30 and bias 30 (``TUNING.fit_limit``), believed a survival of 0.85
        where 0.57 survived (Brier skill -0.34) and verified drafts that did not pay.
        A generator: it yields after taking its copy, within each Newton step and before each loss it evaluates
        (slices of ~0.1-0.4 ms of numpy on a 2-core host; a whole refit 1.3 ms typically, up to 4.3 while steps are
        halved), so a deferred refit runs a slice at a time in the host work's budget (``_advance_refit``); it fits
        a copy of the window taken at its start (folds may come in between) and sets the parameters at its end. Its
        caller holds the lock around each slice."""
        self._new = self._folds = 0
        k, classes = self._x.shape[0], len(self.history_names)
        # the rings fill from their first slot: until one wraps, no slot past the fullest holds a draft, and a young
        # window (refitted the most often: TUNING.refit_growth) costs its size, not TUNING.fit_window's
        width = int(self._filled.max())
        used = (np.arange(width)[None, :] < self._filled[:, None]).astype(np.float64)  # [K, W]
        member = self._h[:, :width].copy()  # [K, W] each draft's class
        index = (np.arange(k)[:, None] * classes + member).reshape(-1)  # [K*W] position-major (position, class)
        x, y = self._x[:, :width].copy(), self._y[:, :width].copy()
        yield

        def per_class(weights: np.ndarray) -> np.ndarray:  # [K, W] -> [K, H] summed per position and class
            return np.bincount(index, weights=weights.reshape(-1), minlength=k * classes).reshape(k, classes)

        def linear(theta: np.ndarray) -> np.ndarray:  # [K, F] -> eta [K, W]
            return theta[:, :1] * x + theta[:, 1:2] + np.take_along_axis(theta[:, 2:], member, axis=1)

        def loss(theta: np.ndarray) -> np.ndarray:  # [K, F] -> [K] each position's penalized negative log-likelihood
            eta = linear(theta)
            return (used * (np.logaddexp(0.0, eta) - y * eta)).sum(1) \
                + 0.5 * TUNING.fit_prior * ((theta - self.prior) ** 2).sum(1)

        def bounded(theta: np.ndarray) -> np.ndarray:
            theta = theta.copy()
            theta[:, 0] = np.clip(theta[:, 0], 0.0, TUNING.fit_limit)  # the head's order is kept (or ignored), never reversed
            theta[:, 1:] = np.clip(theta[:, 1:], -TUNING.fit_limit, TUNING.fit_limit)
            return theta

        theta = self.theta.copy()
        ridge = TUNING.fit_prior * np.eye(2 + classes)
        damped = False
        for step_index in range(TUNING.damped_steps):
            if step_index >= TUNING.newton_steps and not damped:
                break
            eta = linear(theta)  # [K, W]
            p = 0.5 * (1.0 + np.tanh(0.5 * eta))  # sigmoid, without exp's overflow
            residual, weight = (p - y) * used, p * (1.0 - p) * used
            r, rx = per_class(residual), per_class(residual * x)  # [K, H]
            yield
            w, wx, wxx = per_class(weight), per_class(weight * x), per_class(weight * x * x)
            gradient = np.concatenate([rx.sum(1, keepdims=True), r.sum(1, keepdims=True), r], axis=1) \
                + TUNING.fit_prior * (theta - self.prior)  # [K, F]
            hessian = np.zeros((k, 2 + classes, 2 + classes))
            hessian[:, 0, 0], hessian[:, 0, 1], hessian[:, 1, 1] = wxx.sum(1), wx.sum(1), w.sum(1)
            hessian[:, 1, 0] = hessian[:, 0, 1]
            diagonal = np.arange(classes) + 2
            hessian[:, 0, 2:] = hessian[:, 2:, 0] = wx
            hessian[:, 1, 2:] = hessian[:, 2:, 1] = w
            hessian[:, diagonal, diagonal] = w
            step = np.linalg.solve(hessian + ridge, gradient[..., None])[..., 0]  # [K, F]
            yield
            # a slope the step would take below 0 stops at 0, and the other parameters take the Newton step given
            # that (the bound's active set): clipping the slope alone dropped the part of the step it stood for,
            # and where every draft at a position has one confidence (logit(c) and 1 collinear) that was most of
            # it: 80 rejections in a row moved a survival of 0.55 only to 0.21
            pinned = theta[:, 0] - step[:, 0] < 0.0
            if pinned.any():
                h, g = (hessian + ridge)[pinned], gradient[pinned]  # [P, F, F], [P, F]
                moved = theta[pinned, 0]  # the slope's step: to 0
                rest = np.linalg.solve(h[:, 1:, 1:], (g[:, 1:] - h[:, 1:, 0] * moved[:, None])[..., None])[..., 0]
                step[pinned] = np.concatenate([moved[:, None], rest], axis=1)
            scale, worse = np.ones(k), np.zeros(k, dtype=bool)
            candidate = bounded(theta - step)
            searched = np.abs(step).max(axis=1) > TUNING.trusted_step  # near the optimum a Newton step is taken as is
            if searched.any():
                before = loss(theta)
                slack = 1e-9 * (1.0 + np.abs(before))  # rounding: at the optimum a step changes nothing
                for _ in range(TUNING.halvings + 1):
                    yield
                    worse = searched & (loss(candidate) > before + slack)
                    if not worse.any():
                        break
                    scale = np.where(worse, 0.5 * scale, scale)
                    candidate = bounded(theta - scale[:, None] * step)
            theta = np.where(worse[:, None], theta, candidate)  # a position no step lowered keeps its parameters
            damped = bool((scale < 1.0).any())
        self.theta = theta
        self._set_parameters()
        self.learned = True

    def fitted(self) -> dict:
        """The fit as it stands (metrics): ``slope`` [K] and ``bias`` per class [K], rounded."""
        with self._lock:
            self._fold()
            return {"slope": [round(float(a), 4) for a in self.slope],
                    "bias": {name: [round(float(b), 4) for b in row]
                             for name, row in zip(self.history_names, self.bias)}}


def fitted_survival(confidence: np.ndarray, slope: np.ndarray, bias_factor: np.ndarray | float = 1.0) -> np.ndarray:
    """confidence [S, K] (0 where nothing was proposed), slope [>= K], bias_factor [S, K] (exp(-bias); 1: no bias)
    -> the cumulative product of ``sigmoid(slope_k logit(c_k) + bias)`` [S, K]. At ``slope = 1 / T`` and no bias,
    the offline calibration's survival (STS)."""
    c = np.minimum(np.maximum(confidence, 1e-9), 1 - 1e-9)  # ufuncs: ndarray.clip costs ~5 us more per step
    factor = ((1.0 - c) / c) ** slope[:c.shape[1]] * bias_factor
    return np.cumprod(np.where(confidence > 0, 1.0 / (1.0 + factor), 0.0), axis=1)


def read_calibration(source: str | Path | dict, what: str) -> list[float]:
    """Per-position temperatures: a JSON file ``{"temperatures": [...]}`` (or a config dict holding
    ``confidence_temperatures``). A bad file or value is an error naming ``what``."""
    try:
        data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        values = data.get("temperatures", data.get("confidence_temperatures"))
        temps = [float(t) for t in ([values] if isinstance(values, (int, float)) else values)]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{what}: expected {{\"temperatures\": [positive numbers]}}: {exc}") from None
    if not temps or any(t <= 0 for t in temps):
        raise ValueError(f"{what}: temperatures must be positive numbers, got {temps}")
    return temps
