"""What any verify schedule could gain over whole blocks, from a trained-pair bench record and its step-time table.

Issue 16 asks the confidence scheduler for 1.10x the tuned schedule at 64 requests and above. This bounds what is
there to gain, per concurrency of the record, from the measured acceptance per position (the fixed K engine's, which
verifies whole blocks) and a step-time table (``--profile-steps``: the startup profile; or a record's
``confidence_cost_table_served`` saved as a file):

- ``padded_best``: the best single cap Q for every request (what CUDA graphs padded to one length per step allow),
  expected tokens ``1 + sum(acceptance[:Q])`` per request over the table's step of ``batch x (Q + 1)`` tokens,
  against whole blocks. A scheduler that varies Q from step to step can beat it a little (steps differ), no more.
- ``oracle_ragged``: a scheduler that knew which drafts each request will accept and fed exactly those (``tau``
  tokens a request for ``tau`` committed): the table's step of ``batch x tau`` tokens against whole blocks. No
  real scheduler reaches it; a per-request (ragged) choice from confidences recovers part of it.

These are computed, not measured: the table's cells are noisy, so read them as bounds to a few percent.

usage: python3 benchmarks/schedule_bounds.py BENCH.json STEP_COSTS.json [--concurrency 64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.step_costs import StepCostTable  # noqa: E402


def bounds(run: dict, table: StepCostTable) -> dict:
    """One concurrency's row of a bench record -> its bounds (see the module doc)."""
    batch = int(run["concurrency"])
    acceptance = list(run["acceptance_per_position"])
    k = len(acceptance)
    tau = 1.0 + sum(acceptance)
    whole_ms = table.predict_ms(batch, batch * (k + 1))
    whole = tau / whole_ms  # committed tokens per request per ms
    caps = [(1.0 + sum(acceptance[:q])) / table.predict_ms(batch, batch * (q + 1)) for q in range(k + 1)]
    best = max(range(k + 1), key=caps.__getitem__)
    oracle_ms = table.predict_ms(batch, round(batch * tau))
    return {"concurrency": batch, "tau": round(tau, 3), "whole_block_step_ms": round(whole_ms, 3),
            "padded_best_cap": best, "padded_best": round(caps[best] / whole, 3),
            "oracle_ragged_step_ms": round(oracle_ms, 3), "oracle_ragged": round(whole_ms / oracle_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a dspark bench record of a trained pair (its runs' acceptance_per_position)")
    parser.add_argument("step_costs", help="the step-time table the same run wrote (--profile-steps)")
    parser.add_argument("--concurrency", default="64,256", help="comma-separated concurrencies of the record")
    args = parser.parse_args()
    record = json.loads(Path(args.bench).read_text())
    table = StepCostTable.load(args.step_costs)
    wanted = {int(c) for c in args.concurrency.split(",")}
    rows = [bounds(run, table) for run in record["runs"]
            if int(run["concurrency"]) in wanted and run.get("acceptance_per_position")]
    if not rows:
        raise SystemExit(f"schedule_bounds: no run of {sorted(wanted)} requests with acceptance in {args.bench}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
