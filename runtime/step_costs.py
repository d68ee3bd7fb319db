"""``StepCostTable``: seconds per engine step as a function of batch size and tokens fed, learned while serving.

A grid of measured step times (``batch_sizes`` x ``token_counts``, milliseconds, NaN where nothing was measured)
predicts any (batch, tokens) by linear interpolation in tokens within the two nearest measured batch rows (then
between them); outside the measured range it extrapolates the nearest row's last slope. Every step the engine
serves is an observation: the grid cell nearest to it moves toward the measured time (an exponential moving
average), so the table follows the hardware and the load it actually sees, mixed prefill + decode steps included.
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


class StepCostTable:
    def __init__(self, batch_sizes: list[int], token_counts: list[int], step_ms: list[list[float]] | None = None):
        if sorted(set(batch_sizes)) != list(batch_sizes) or sorted(set(token_counts)) != list(token_counts):
            raise ValueError("step cost table: batch_sizes and token_counts must be strictly increasing")
        if not batch_sizes or not token_counts:
            raise ValueError("step cost table: batch_sizes and token_counts must not be empty")
        self.batch_sizes, self.token_counts = list(batch_sizes), list(token_counts)
        self.step_ms = [list(row) for row in step_ms] if step_ms is not None else \
            [[math.nan] * len(token_counts) for _ in batch_sizes]
        if len(self.step_ms) != len(batch_sizes) or any(len(r) != len(token_counts) for r in self.step_ms):
            raise ValueError(f"step cost table: step_ms must be {len(batch_sizes)} rows of {len(token_counts)}")
        self.observations = 0

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"batch_sizes": self.batch_sizes, "token_counts": self.token_counts,
                "step_ms": [[None if math.isnan(v) else round(v, 4) for v in row] for row in self.step_ms]}

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
        return any(not math.isnan(v) for row in self.step_ms for v in row)

    def record(self, batch: int, tokens: int, ms: float, weight: float = 1.0) -> None:
        """Move the cell nearest to (batch, tokens) toward ``ms`` (weight 1: replace it; an empty cell takes it)."""
        i = _nearest(self.batch_sizes, batch)
        j = _nearest(self.token_counts, tokens)
        old = self.step_ms[i][j]
        self.step_ms[i][j] = ms if math.isnan(old) else old + weight * (ms - old)

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """A step the engine served: learn from it."""
        self.record(batch, tokens, 1e3 * seconds, OBSERVATION_WEIGHT)
        self.observations += 1

    def predict_ms(self, batch: int, tokens: int) -> float:
        """Predicted milliseconds of a step of ``batch`` requests feeding ``tokens`` tokens in all."""
        return float(self.predict_ms_many(batch, np.asarray([tokens]))[0])

    def predict_ms_many(self, batch: int, tokens) -> np.ndarray:
        """``predict_ms`` for every entry of ``tokens`` [N] (ints: array-like) at once -> [N] float64 (numpy: the
        scheduler calls this every step on the host)."""
        rows = [(b, row) for b, row in zip(self.batch_sizes, self.step_ms) if any(not math.isnan(v) for v in row)]
        if not rows:
            raise ValueError("step cost table: nothing measured yet")
        sizes = [b for b, _ in rows]
        k = bisect.bisect_left(sizes, batch)
        x = np.asarray(tokens, dtype=np.float64)
        if k == 0 or k == len(rows) or sizes[k] == batch:
            return _along_tokens_many(self.token_counts, rows[min(k, len(rows) - 1)][1], x)
        (b0, r0), (b1, r1) = rows[k - 1], rows[k]
        f = (batch - b0) / (b1 - b0)
        return (1 - f) * _along_tokens_many(self.token_counts, r0, x) + f * _along_tokens_many(self.token_counts,
                                                                                               r1, x)


def _along_tokens_many(token_counts: list[int], row: list[float], x: np.ndarray) -> np.ndarray:
    """Piecewise-linear in tokens through the row's measured points (flat with one point, the end slopes
    extended outside them), at every entry of ``x``."""
    points = [(t, v) for t, v in zip(token_counts, row) if not math.isnan(v)]
    if len(points) == 1:
        return np.full_like(x, points[0][1])
    xs = np.asarray([t for t, _ in points], dtype=np.float64)
    ys = np.asarray([v for _, v in points], dtype=np.float64)
    k = np.searchsorted(xs, x).clip(1, len(points) - 1)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return np.maximum(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


def _nearest(values: list[int], x: int) -> int:
    k = bisect.bisect_left(values, x)
    if k == len(values):
        return k - 1
    if k > 0 and x - values[k - 1] < values[k] - x:
        return k - 1
    return k
