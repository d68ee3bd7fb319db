"""``StepCostTable``: seconds per engine step as a function of batch size and tokens fed, learned while serving.

A grid of measured step times (``batch_sizes`` x ``token_counts``, milliseconds, NaN where nothing was measured)
predicts any (batch, tokens) by linear interpolation in tokens within the two nearest measured batch rows (then
between them); outside the measured range it extrapolates the nearest row's last slope. A row is read as its
least-squares non-decreasing fit (isotonic regression, pool adjacent violators): feeding more tokens never makes a
step cheaper, so a dip is measurement noise (a host-bound step's timing jitter, a cell measured from few steps), and
taken at face value it would tell the scheduler that verifying fewer drafts saves time where it costs none; a spike is
noise as well, which a running maximum would carry to every longer length (a run-24 row of 3.2, 4.9, 4.0, 4.2, 3.9 ms
read as 4.9 from the second cell on), while the fit averages it with its neighbours. Every step the engine serves is
an observation: the grid cell nearest to it moves toward the measured time (an exponential moving average), so the
table follows the hardware and the load it actually sees, mixed prefill + decode steps included; and since a step
never costs less for feeding more, the learned cell bounds the rest of its row on the side its move may have put out
of order (lowered: no cell of fewer tokens above it; raised: none of more tokens below it). A scheduler visits few
cells (the lengths it chooses), and without the bound a cell it never visits keeps whatever the startup profile
measured: run 37's profile timed the shorter verify lengths 1.5-3 ms too slow, serving corrected only the full-block
cell, and read through the non-decreasing fit the row went on saying that trimming drafts saves nothing.
Served steps are gathered and learned ``OBSERVE_EVERY`` at a time (``flush``; ``to_json`` flushes first), and a
prediction is cached until a cell changes: the scheduler asks for the same few vectors every step, and a table
that moved every step would refit a row and interpolate again each time (~20 us of the host's step at one
request); an average with weight 0.1 loses nothing by lagging a few steps.
JSON (``to_json`` / ``from_json``): ``{"batch_sizes": [...], "token_counts": [...], "step_ms": [[...], ...]}``,
the format ``dspark bench --profile-steps`` writes and ``confidence_cost_table_path`` reads.
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
        self._tokens = np.asarray(token_counts, dtype=np.float64)
        self._rows: list[tuple[int, np.ndarray, np.ndarray]] | None = None  # measured rows; rebuilt when one fills
        self._fits: dict[int, np.ndarray] = {}  # row -> its measured cells' non-decreasing fit; dropped on a change
        self._predicted: dict[tuple[int, bytes], np.ndarray] = {}  # (batch, tokens) -> predict_ms_many, read-only
        self._pending: list[tuple[int, int, float]] = []  # served steps not yet learned (batch, tokens, seconds)
        self.observations = 0  # served steps observed (learned or pending)

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict:
        self.flush()
        return {"batch_sizes": self.batch_sizes, "token_counts": self.token_counts,
                "step_ms": [[None if math.isnan(v) else round(float(v), 4) for v in row] for row in self.step_ms]}

    @classmethod
    def from_json(cls, data: dict, where: str = "step cost table") -> StepCostTable:
        try:
            rows = [[math.nan if v is None else float(v) for v in row] for row in data["step_ms"]]
            return cls([int(b) for b in data["batch_sizes"]], [int(t) for t in data["token_counts"]], rows)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: expected {{batch_sizes, token_counts, step_ms}}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> StepCostTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"confidence_cost_table_path: cannot read {path}: {exc}") from None
        return cls.from_json(data, f"confidence_cost_table_path {path}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    # ---- use ----------------------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        return bool((~np.isnan(self.step_ms)).any())

    def record(self, batch: int, tokens: int, ms: float, weight: float = 1.0) -> tuple[int, int, float]:
        """Move the cell nearest to (batch, tokens) toward ``ms`` (weight 1: replace it; an empty cell takes it);
        -> (its row, its column, its value before)."""
        i = _nearest(self.batch_sizes, batch)
        j = _nearest(self.token_counts, tokens)
        old = self.step_ms[i, j]
        if math.isnan(old):
            self._rows = None  # a new measured cell: the rows' points change
        self.step_ms[i, j] = ms if math.isnan(old) else old + weight * (ms - old)
        self._fits.pop(i, None)
        self._predicted.clear()
        return i, j, old

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """A step the engine served: learned with the others gathered, once ``OBSERVE_EVERY`` have been."""
        self._pending.append((batch, tokens, seconds))
        self.observations += 1
        if len(self._pending) >= OBSERVE_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the gathered steps, in the order served."""
        pending, self._pending = self._pending, []
        for batch, tokens, seconds in pending:
            self._learn(batch, tokens, seconds)

    def _learn(self, batch: int, tokens: int, seconds: float) -> None:
        """One served step: its cell, then the bound that cell puts on its row."""
        i, j, before = self.record(batch, tokens, 1e3 * seconds, OBSERVATION_WEIGHT)
        row = self.step_ms[i]
        learned = row[j]
        # the side the move may have left out of order (NaN cells compare false: they stay unmeasured)
        if learned < before:  # lowered: no cell of fewer tokens above it
            row[:j] = np.where(row[:j] > learned, learned, row[:j])
        elif learned > before:  # raised: no cell of more tokens below it
            row[j + 1:] = np.where(row[j + 1:] < learned, learned, row[j + 1:])

    def predict_ms(self, batch: int, tokens: int) -> float:
        """Predicted milliseconds of a step of ``batch`` requests feeding ``tokens`` tokens in all."""
        return float(self.predict_ms_many(batch, np.asarray([tokens]))[0])

    def predict_ms_many(self, batch: int, tokens) -> np.ndarray:
        """``predict_ms`` for every entry of ``tokens`` [N] (ints: array-like) at once -> [N] float64 (numpy, a
        dozen vectorized operations: the scheduler calls this every step on the host), read-only: cached until a
        cell changes."""
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
            predicted = _along_tokens_many(xs, self._monotone(i, cells), x)
        else:
            (i0, xs0, cells0), (i1, xs1, cells1) = rows[k - 1], rows[k]
            f = (batch - sizes[k - 1]) / (sizes[k] - sizes[k - 1])
            predicted = (1 - f) * _along_tokens_many(xs0, self._monotone(i0, cells0), x) + \
                f * _along_tokens_many(xs1, self._monotone(i1, cells1), x)
        if len(self._predicted) >= PREDICTIONS_KEPT:
            self._predicted.clear()
        predicted.flags.writeable = False
        self._predicted[key] = predicted
        return predicted

    def _monotone(self, row: int, cells: np.ndarray) -> np.ndarray:
        """The row's measured cells as read: their least-squares non-decreasing fit (see the module doc), cached
        until a cell of the row changes."""
        fit = self._fits.get(row)
        if fit is None:
            fit = self._fits[row] = isotonic(self.step_ms[row, cells])
        return fit

    def _measured_rows(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(row, its measured token counts, their column indices) of every row with a measured cell; cached until
        an empty cell is filled (learning only moves values, the points stay)."""
        if self._rows is None:
            measured = ~np.isnan(self.step_ms)
            self._rows = [(int(i), self._tokens[measured[i]], np.flatnonzero(measured[i]))
                          for i in np.flatnonzero(measured.any(axis=1))]
        return self._rows


def isotonic(values: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of ``values`` [N] (pool adjacent violators: a value below the mean of
    the block before it merges into that block, the merged block taking the mean)."""
    sums: list[float] = []
    counts: list[int] = []
    for v in values.tolist():
        total, count = v, 1
        while sums and sums[-1] * count > total * counts[-1]:  # the previous block's mean above this one's
            total, count = total + sums.pop(), count + counts.pop()
        sums.append(total)
        counts.append(count)
    return np.repeat(np.asarray(sums) / np.asarray(counts), counts)


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
