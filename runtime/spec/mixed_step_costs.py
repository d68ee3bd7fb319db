"""``MixedStepCosts``: what a step that feeds more than verifies costs, as the verify steps' table plus a learned excess.

A **mixed** step feeds something besides the verifies the confidence scheduler chose: a prefill chunk, a decode
without drafts. It rarely fits a CUDA graph (a prefill chunk beside padded verifies would pad every request to the
chunk's length), so it runs eagerly, and it costs more than a graphed verify step of the same batch and tokens by
an amount the verify length hardly moves: the eager kernels' launches, the chunk's own attention and planning. On
an H200 (a 2.7B target, 64 requests) the mixed steps took 10-17 ms where the verify steps' cells at the same
sizes said 5-8.

Before, mixed steps learned a (batch, tokens) table of their own with the verify steps' profile as its prior: only
the nearest cell learned, the row's lower envelope read the learned dear cells at the unlearned cheap ones beyond
them, and the table's context slope took the difference between mixed and verify cells for context (0.00078 ms a
context token, the whole of a 5-ms cell): one run's mixed steps were predicted 8.19 ms and measured 12.61, so the
scheduler saw a trim as saving ~35% more of the step than it did, trimmed to 5.5 of 7 drafts, and served 0.81 of
the tuned schedule's tokens/s.

Here a mixed step is priced as the verify steps' table at its own sizes (``StepCostTable.predict_ms_many(batch,
tokens, context)``: batch its requests, tokens all it feeds; what a verify token adds is read there, from the cells
the graphed verify steps keep measuring) **plus an excess** ``a + b x other_tokens + c x batch`` (ms; ``other_tokens``
what it feeds besides the verifies), fitted by least squares to the served mixed steps' residuals (measured less
the table's prediction at the time), older steps fading (``DECAY`` a step), with a ridge ``PRIOR_STEPS`` toward no
excess (so before any mixed step is served a mixed step is priced as a verify step of its sizes, as the old prior
did). The excess does not depend on the verify lengths the scheduler chooses between, so it only sets the level
the saving of a trim is measured against: in a step dominated by a prefill chunk's eager cost, trimming saves a
small share of the step. A negative excess is read as none (a mixed step is not cheaper than a graphed verify step
of the same sizes; a fit below it is noise).

A **serial** verify step is priced and learned here too, with no other tokens: on an engine that launches each step
before the one before it is read back, the startup profile and the steady steps are launched ahead, and a step's
wall time is about the device's alone; a step that was not launched ahead (the first verify after a prefill, every
step of a sampled batch) adds the host's whole step work, which grows with the batch (``a + c x batch``, the same
features; a mixed step is never launched ahead, so its excess holds that work too).
"""

from __future__ import annotations

import numpy as np

from runtime.spec.step_costs import OBSERVE_EVERY, StepCostTable

DECAY = 0.99  # per mixed step served: the fit weighs the last ~100
# the ridge toward no excess, in (scaled) steps of evidence: light on the level (one step's residual says it), more
# on the slopes (which need steps of different sizes to tell apart)
PRIOR_STEPS = np.array([0.05, 1.0, 1.0])
TOKEN_SCALE = 256.0  # the features' scales (other tokens, requests): the ridge weighs their coefficients alike
BATCH_SCALE = 64.0
FEATURES = ("ms", "ms_per_other_token", "ms_per_request")


class MixedStepCosts:
    """Mixed steps' predicted milliseconds: ``verify`` (the verify steps' table, shared, learning on its own) at the
    step's sizes, plus the learned excess (see the module doc). Served mixed steps are gathered and fitted
    ``OBSERVE_EVERY`` at a time, as the table's are."""

    def __init__(self, verify: StepCostTable):
        self.verify = verify
        self._xtx = np.zeros((3, 3))  # decayed sums over the served mixed steps of x x^T and x * residual
        self._xty = np.zeros(3)
        self.coefficients = np.zeros(3)  # (a ms, b ms per other token, c ms per request), see FEATURES
        self._pending: list[tuple[int, int, float, int, int]] = []
        self.observations = 0  # mixed steps observed (fitted or pending)
        self.mean_residual_ms = 0.0  # decayed mean of the residuals fitted (what the excess explains, for metrics)
        # decayed mean over the fitted steps of the rows each request fed besides the other tokens (its verify's
        # anchor and drafts): what the per-request excess was learned at (plain_excess_ms)
        self.rows_per_request = 1.0
        self._weight = 0.0

    def excess_ms(self, batch: float, other_tokens: int) -> float:
        """The learned excess of a mixed step of ``batch`` requests feeding ``other_tokens`` besides its verifies."""
        a, b, c = self.coefficients
        return max(float(a + b * other_tokens / TOKEN_SCALE + c * batch / BATCH_SCALE), 0.0)

    def plain_excess_ms(self, batch: int, other_tokens: int) -> float:
        """The excess of a **plain** mixed step of ``batch`` requests, each decoding one token, beside
        ``other_tokens`` (the drafting judgement's alternative, ``ConfidenceScheduler._plain_ms``): the fit's level
        and its other tokens' part as they are, its per-request part read as per verify row (it was learned from
        steps whose requests fed ``rows_per_request`` rows each: the eager attention of those rows is most of it),
        so a plain step's one row a request pays 1 / rows_per_request of it. One run (an H200, 57 requests, 8 rows a
        request): the drafting mixed steps' excess ~4 ms, nearly all per request, priced the plain alternative
        10.4 ms where the AR engine's mixed steps took 3.9."""
        return self.excess_ms(batch / self.rows_per_request, other_tokens)

    def predict_ms_many(self, batch: int, tokens, context: int, other_tokens: int) -> np.ndarray:
        """[N] predicted ms of a mixed step of ``batch`` requests feeding each of ``tokens`` [N] in all (of which
        ``other_tokens`` besides the verifies), attending over ``context`` KV tokens."""
        return self.verify.predict_ms_many(batch, tokens, context) + self.excess_ms(batch, other_tokens)

    def predict_ms_list(self, batch: int, tokens: tuple[int, ...], context: int, other_tokens: int) -> list[float]:
        """``predict_ms_many`` as a list, for a small step (the table's cached plain-Python path)."""
        excess = self.excess_ms(batch, other_tokens)
        return [v + excess for v in self.verify.predict_ms_list(batch, tokens, context)]

    def predict_ms(self, batch: int, tokens: int, context: int, other_tokens: int) -> float:
        return self.verify.predict_ms(batch, tokens, context) + self.excess_ms(batch, other_tokens)

    def observe(self, batch: int, tokens: int, seconds: float, context: int, other_tokens: int) -> None:
        """A mixed step served: ``batch`` requests fed ``tokens`` (``other_tokens`` of them besides verifies) in
        ``seconds``, attending over ``context`` KV tokens; fitted with the others gathered once ``OBSERVE_EVERY``
        have been."""
        self._pending.append((batch, tokens, seconds, context, other_tokens))
        self.observations += 1
        if len(self._pending) >= OBSERVE_EVERY:
            self.flush()

    def flush(self) -> None:
        """Fit the gathered steps: each one's residual against the verify table as it stands now."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        for batch, tokens, seconds, context, other_tokens in pending:
            x = np.array([1.0, other_tokens / TOKEN_SCALE, batch / BATCH_SCALE])
            residual = 1e3 * seconds - self.verify.predict_ms(batch, tokens, context)
            self._xtx = DECAY * self._xtx + np.outer(x, x)
            self._xty = DECAY * self._xty + x * residual
            self._weight = DECAY * self._weight + 1.0
            self.mean_residual_ms += (residual - self.mean_residual_ms) / max(self._weight, 1.0)
            rows = max((tokens - other_tokens) / max(batch, 1), 1.0)
            self.rows_per_request += (rows - self.rows_per_request) / max(self._weight, 1.0)
        self.coefficients = np.linalg.solve(self._xtx + np.diag(PRIOR_STEPS), self._xty)

    def to_json(self) -> dict:
        """The fit as it stands (for ``rank_info`` and the bench record)."""
        self.flush()
        return {"observations": self.observations, "mean_residual_ms": round(self.mean_residual_ms, 4),
                "rows_per_request": round(self.rows_per_request, 3),
                "excess": {name: round(float(v) / scale, 6) for name, v, scale in
                           zip(FEATURES, self.coefficients, (1.0, TOKEN_SCALE, BATCH_SCALE))}}
