"""``StepCostTable``: seconds per engine step as a function of batch size and tokens fed, learned while serving.

A grid of measured step times (``batch_sizes`` x ``token_counts``, milliseconds, NaN where nothing was measured)
predicts any (batch, tokens) by linear interpolation in tokens within the two nearest measured batch rows (then
between them); outside the measured range it extrapolates the nearest row's last slope. A row is read as its
**lower envelope** in tokens: each cell as the cheapest of itself and every cell of more tokens (a step can always
feed more: a verify of fewer drafts never needs to cost more than the cheapest longer one). GPU step times are not
monotone in the tokens fed: on the H200, a 2.7B target at 64 requests verified 7 tokens a request in 9.3-10.4 ms and 8
in 8.1-8.6 ms, 5 tokens slower than 6 likewise (the startup profiles and the fixed-K tuning alike; a
kernel's tiling), and the least-squares non-decreasing fit read before pooled such a cell with the whole
block, pricing whole blocks 11% too dear (9.47 ms against 8.77 measured, so trims that did not pay looked as
if they did). Under the envelope a dearer cell of fewer tokens is never chosen (it gives fewer tokens for no less
time); a cell measured too dear by noise is read at its longer neighbour, and one measured too cheap is a trim the
scheduler makes, serves, and so learns at its real cost. Every step the engine serves is an observation: the grid
cell nearest to it moves toward the measured time (an exponential moving average), so the table follows the
hardware and the load it actually sees, mixed prefill + decode steps included; a cell the scheduler never visits
keeps what the startup profile measured, and where serving lowered a longer cell the envelope reads it no dearer
(one run's profile timed the shorter verify lengths 1.5-3 ms too slow, and serving corrected only the full-block
cell).
Served steps are gathered and learned ``OBSERVE_EVERY`` at a time (``flush``; ``to_json`` flushes first), and a
prediction is cached until a cell changes: the scheduler asks for the same few vectors every step, and a table
that moved every step would refit a row and interpolate again each time (~20 us of the host's step at one
request); an average with weight 0.1 loses nothing by lagging a few steps.

A step also reads every request's KV cache: its time grows with the **context** it attends over (the KV tokens before
its fed tokens, summed over its requests), which a serving engine's steps do from one step to the next while a cell
is keyed only by (batch, tokens). Each cell therefore remembers the mean context of its measurements, and the table
learns one slope, milliseconds per context token (``ms_per_context_token``), from the served steps: the
least-squares fit of how far a step's time sat from its cell's mean against how far its context did (pooled over
cells, older steps fading, never below 0, 0 until ``SLOPE_MIN_STEPS`` steps moved their context). A prediction reads
every cell as if measured at the asked context (``cell - slope x (cell context - context)``; the row's envelope is
taken over those). Without it, cells measured at different contexts were compared as if alike: in one run (an H200, 256
requests) the startup profile, its steps at under ~100 tokens of context a request, read 10.1 ms for 6 tokens a request
and 12.7 ms for 8, where the tuning measured 11.8 and 13.9 at the sweep's 101-354; the cells the scheduler served
moved to the serving contexts while the others kept the profile's, its predicted steps were 7% under the
measured, and it capped at 5.7 of 7 drafts for 0.97 of whole blocks' throughput.
A table may carry a second one, ``plain``: the steps of plain decoding (a token a request, nothing drafted, the
drafter's context kept), at each profiled batch size (batch, batch tokens): what a step costs with the drafter idle,
against which the scheduler judges whether drafting pays at all (``ConfidenceScheduler.drafting_pays``).

JSON (``to_json`` / ``from_json``): ``{"batch_sizes": [...], "token_counts": [...], "step_ms": [[...], ...],
"context_tokens": [[...], ...], "context_slope": {...}, "plain_steps": {a table}}``, the format ``dspark bench
--profile-steps`` writes and ``confidence_cost_table_path`` reads (a table without ``context_tokens``, written
before, reads as measured at no context; one without ``plain_steps`` never stops the drafting).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import numpy as np

OBSERVATION_WEIGHT = 0.1  # how far one served step moves its cell toward the measured time
OBSERVE_EVERY = 8  # served steps gathered before they move their cells (the predictions stay cached in between)
PREDICTIONS_KEPT = 256  # cached prediction vectors, dropped all at once past this many
SLOPE_MIN_STEPS = 64  # served steps whose context moved from their cell's (decayed count) before the slope is used
SLOPE_DECAY = 0.999  # per served step: the slope's sums weigh the last ~1000 steps


class StepCostTable:
    def __init__(self, batch_sizes: list[int], token_counts: list[int], step_ms: list[list[float]] | None = None):
        if sorted(set(batch_sizes)) != list(batch_sizes) or sorted(set(token_counts)) != list(token_counts):
            raise ValueError("step cost table: batch_sizes and token_counts must be strictly increasing")
        if not batch_sizes or not token_counts:
            raise ValueError("step cost table: batch_sizes and token_counts must not be empty")
        self.batch_sizes, self.token_counts = list(batch_sizes), list(token_counts)
        shape = (len(batch_sizes), len(token_counts))
        if step_ms is not None and (len(step_ms) != shape[0] or any(len(r) != shape[1] for r in step_ms)):
            raise ValueError(f"step cost table: step_ms must be {shape[0]} rows of {shape[1]}")
        # [batch sizes, token counts] ms, NaN = not measured (numpy: the scheduler predicts from it every step)
        self.step_ms = np.array(step_ms, dtype=np.float64) if step_ms is not None else np.full(shape, np.nan)
        # [batch sizes, token counts] mean context (KV tokens attended, summed over a step's requests) of each
        # cell's measurements; 0 where not given (a table written before contexts were kept)
        self.context = np.zeros(shape)
        self._slope_sums = [0.0, 0.0, 0.0]  # sum dx*dy, sum dx*dx, steps: context against step-time deviations
        self.ms_per_context_token = 0.0  # the learned slope (see the module doc)
        self._tokens = np.asarray(token_counts, dtype=np.float64)
        self._rows: list[tuple[int, np.ndarray, np.ndarray]] | None = None  # measured rows; rebuilt when one fills
        self._fits: dict[int, np.ndarray] = {}  # row -> its measured cells' lower envelope; dropped on a change
        self._predicted: dict[tuple[int, bytes], np.ndarray] = {}  # (batch, tokens) -> predict_ms_many, read-only
        self._listed: dict[tuple[int, tuple], list[float]] = {}  # (batch, tokens) -> predict_ms_list at no context
        self._pending: list[tuple[int, int, float, int]] = []  # served steps not yet learned
        self.observations = 0  # served steps observed (learned or pending)
        self.plain: StepCostTable | None = None  # plain decoding's steps (see the module doc), if profiled

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict:
        self.flush()
        data = {"batch_sizes": self.batch_sizes, "token_counts": self.token_counts,
                "step_ms": [[None if math.isnan(v) else round(float(v), 4) for v in row] for row in self.step_ms],
                "context_tokens": [[round(float(c), 1) for c in row] for row in self.context],
                "context_slope": {"ms_per_context_token": self.ms_per_context_token,
                                  "sums": [float(v) for v in self._slope_sums]}}
        if self.plain is not None:
            data["plain_steps"] = self.plain.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "step cost table") -> StepCostTable:
        try:
            rows = [[math.nan if v is None else float(v) for v in row] for row in data["step_ms"]]
            table = cls([int(b) for b in data["batch_sizes"]], [int(t) for t in data["token_counts"]], rows)
            if "context_tokens" in data:
                context = np.array(data["context_tokens"], dtype=np.float64)
                if context.shape != table.step_ms.shape or not np.isfinite(context).all() or (context < 0).any():
                    raise ValueError(f"context_tokens must be {table.step_ms.shape[0]} rows of "
                                     f"{table.step_ms.shape[1]} non-negative numbers")
                table.context = context
            slope = data.get("context_slope")
            if slope is not None:
                sums = np.array(slope["sums"], dtype=np.float64)
                value = float(slope["ms_per_context_token"])
                if sums.shape != (3,) or not np.isfinite(sums).all() or not value >= 0:
                    raise ValueError("context_slope: {ms_per_context_token >= 0, sums: 3 numbers} expected")
                table._slope_sums, table.ms_per_context_token = sums.tolist(), value
            if data.get("plain_steps") is not None:
                table.plain = cls.from_json(data["plain_steps"], f"{where}: plain_steps")
            return table
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: expected {{batch_sizes, token_counts, step_ms[, context_tokens, "
                             f"context_slope, plain_steps]}}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> StepCostTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"confidence_cost_table_path: cannot read {path}: {exc}") from None
        return cls.from_json(data, f"confidence_cost_table_path {path}")

    def copy(self) -> StepCostTable:
        """An independent table holding this one's cells, contexts and slope (none of its served steps pending)."""
        return StepCostTable.from_json(self.to_json())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    # ---- use ----------------------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        """Whether any cell is measured (from the cached measured rows: the scheduler asks every step)."""
        return bool(self._measured_rows())

    def record(self, batch: int, tokens: int, ms: float, weight: float = 1.0,
               context: float = 0.0) -> tuple[int, int, float, float]:
        """Move the cell nearest to (batch, tokens), and the context it was measured at, toward ``ms`` measured at
        ``context`` (weight 1: replace them; an empty cell takes them); -> (its row, its column, its value and its
        context before)."""
        i = _nearest(self.batch_sizes, batch)
        j = _nearest(self.token_counts, tokens)
        old, old_context = float(self.step_ms[i, j]), float(self.context[i, j])
        if math.isnan(old):
            self._rows = None  # a new measured cell: the rows' points change
            self.step_ms[i, j], self.context[i, j] = ms, context
        else:
            self.step_ms[i, j] = old + weight * (ms - old)
            self.context[i, j] += weight * (context - self.context[i, j])
        self._fits.pop(i, None)
        self._forget_predictions()
        return i, j, old, old_context

    def observe(self, batch: int, tokens: int, seconds: float, context: int = 0) -> None:
        """A step the engine served (``context``: the KV tokens its requests attended before the tokens it fed,
        summed): learned with the others gathered, once ``OBSERVE_EVERY`` have been."""
        self._pending.append((batch, tokens, seconds, context))
        self.observations += 1
        if len(self._pending) >= OBSERVE_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the gathered steps, in the order served."""
        pending, self._pending = self._pending, []
        for batch, tokens, seconds, context in pending:
            self._learn(batch, tokens, seconds, context)
        if pending:
            self._fit_slope()

    def _learn(self, batch: int, tokens: int, seconds: float, context: int) -> None:
        """One served step: its cell, and the context slope's evidence."""
        _, _, before, before_context = self.record(batch, tokens, 1e3 * seconds, OBSERVATION_WEIGHT, context)
        if not math.isnan(before):  # how far this step sat from its cell, in time and in context (Python floats)
            dx, dy = context - before_context, 1e3 * seconds - before
            sxy, sxx, steps = self._slope_sums
            self._slope_sums = [SLOPE_DECAY * sxy + dx * dy, SLOPE_DECAY * sxx + dx * dx,
                                SLOPE_DECAY * steps + (dx != 0)]

    def _forget_predictions(self) -> None:
        """A cell (or the context slope) changed: every cached prediction goes."""
        self._predicted.clear()
        self._listed.clear()

    def _fit_slope(self) -> None:
        """The context slope from its sums (0 until ``SLOPE_MIN_STEPS`` steps moved their context; never below 0:
        a step never gets cheaper for attending over more; nor so steep that a measured cell's context alone
        would cost more than the whole cell did); the rows' envelopes follow it."""
        sxy, sxx, steps = self._slope_sums
        slope = max(sxy / sxx, 0.0) if steps >= SLOPE_MIN_STEPS and sxx > 0 else 0.0
        attended = (self.context > 0) & ~np.isnan(self.step_ms)
        if slope and attended.any():
            slope = min(slope, float((self.step_ms[attended] / self.context[attended]).min()))
        if slope != self.ms_per_context_token:
            self.ms_per_context_token = slope
            self._fits.clear()
            self._forget_predictions()

    def predict_ms(self, batch: int, tokens: int, context: int = 0) -> float:
        """Predicted milliseconds of a step of ``batch`` requests feeding ``tokens`` tokens in all, its requests
        attending over ``context`` KV tokens in all before them."""
        return float(self.predict_ms_many(batch, np.asarray([tokens]), context)[0])

    def predict_ms_many(self, batch: int, tokens, context: int = 0) -> np.ndarray:
        """``predict_ms`` for every entry of ``tokens`` [N] (ints: array-like) at once -> [N] float64 (numpy, a
        dozen vectorized operations: the scheduler calls this every step on the host), read-only. The prediction
        at no context is cached until a cell (or the context slope) changes; a context adds ``slope x context``."""
        base = self._predict_at_no_context(batch, tokens)
        if context and self.ms_per_context_token:
            base = base + self.ms_per_context_token * context
            base.flags.writeable = False
        return base

    def predict_ms_list(self, batch: int, tokens: tuple[int, ...], context: int = 0) -> list[float]:
        """``predict_ms_many`` as a Python list, for the few lengths of a small step (``tokens`` a tuple: the cache
        key): the scheduler's plain-Python path (``ConfidenceScheduler``: numpy's first calls after a step cost
        it more than the arithmetic)."""
        key = (batch, tokens)
        base = self._listed.get(key)
        if base is None:
            base = self._listed[key] = self._predict_at_no_context(batch, tokens).tolist()
            if len(self._listed) >= PREDICTIONS_KEPT:
                self._listed.clear()
                self._listed[key] = base
        add = self.ms_per_context_token * context
        return [b + add for b in base] if add else base

    def _predict_at_no_context(self, batch: int, tokens) -> np.ndarray:
        x = np.asarray(tokens, dtype=np.float64)
        key = (batch, x.tobytes())
        cached = self._predicted.get(key)
        if cached is not None:
            return cached
        rows = self._measured_rows()
        if not rows:
            raise ValueError("step cost table: nothing measured yet")
        sizes = [self.batch_sizes[i] for i, _, _ in rows]
        k = bisect.bisect_left(sizes, batch)
        if k == 0 or k == len(rows) or sizes[k] == batch:
            i, xs, cells = rows[min(k, len(rows) - 1)]
            predicted = _along_tokens_many(xs, self._envelope(i, cells), x)
        else:
            (i0, xs0, cells0), (i1, xs1, cells1) = rows[k - 1], rows[k]
            f = (batch - sizes[k - 1]) / (sizes[k] - sizes[k - 1])
            predicted = (1 - f) * _along_tokens_many(xs0, self._envelope(i0, cells0), x) + \
                f * _along_tokens_many(xs1, self._envelope(i1, cells1), x)
        if len(self._predicted) >= PREDICTIONS_KEPT:
            self._predicted.clear()
        predicted.flags.writeable = False
        self._predicted[key] = predicted
        return predicted

    def _envelope(self, row: int, cells: np.ndarray) -> np.ndarray:
        """The row's measured cells as read at no context (each less the slope x its context): their lower
        envelope (see the module doc), cached until a cell of the row or the slope changes."""
        fit = self._fits.get(row)
        if fit is None:
            at_no_context = self.step_ms[row, cells] - self.ms_per_context_token * self.context[row, cells]
            fit = self._fits[row] = lower_envelope(at_no_context)
        return fit

    def _measured_rows(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(row, its measured token counts, their column indices) of every row with a measured cell; cached until
        an empty cell is filled (learning only moves values, the points stay)."""
        if self._rows is None:
            measured = ~np.isnan(self.step_ms)
            self._rows = [(int(i), self._tokens[measured[i]], np.flatnonzero(measured[i]))
                          for i in np.flatnonzero(measured.any(axis=1))]
        return self._rows


def lower_envelope(values: np.ndarray) -> np.ndarray:
    """Each of ``values`` [N] as the least of itself and every later value (a suffix minimum): non-decreasing."""
    return np.minimum.accumulate(values[::-1])[::-1]


def _along_tokens_many(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear in tokens through a row's measured points (xs, ys) (flat with one point, the end slopes
    extended outside them), at every entry of ``x``."""
    if len(xs) == 1:
        return np.full_like(x, ys[0])
    k = np.minimum(np.maximum(np.searchsorted(xs, x), 1), len(xs) - 1)  # ufuncs: ndarray.clip costs ~5 us more
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return np.maximum(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


def _nearest(values: list[int], x: int) -> int:
    k = bisect.bisect_left(values, x)
    if k == len(values):
        return k - 1
    if k > 0 and x - values[k - 1] < values[k] - x:
        return k - 1
    return k
