"""What any verify schedule could gain over whole blocks, from a trained-pair bench record and its step-time table.

The goal asks the confidence scheduler for 1.10x the tuned schedule at 64 requests and above. This bounds what is
there to gain, per concurrency of the record, from the measured acceptance per position (the fixed K engine's, which
verifies whole blocks) and a step-time table (``--profile-steps``: the startup profile; or a record's
``confidence_cost_table_served`` saved as a file): ``padded_best`` (the best single cap) and ``oracle_ragged`` (a
schedule that knew which drafts will be accepted), as ``runtime.spec.schedule_bounds`` defines them. ``dspark bench``
records the same bounds in each run (``confidence_oracle_bound``, ``confidence_padded_bound``); this prices an
older record, or one against another table.

usage: python3 benchmarks/schedule_bounds.py BENCH.json STEP_COSTS.json [--concurrency 64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.spec.schedule_bounds import schedule_bounds  # noqa: E402
from runtime.spec.step_costs import StepCostTable  # noqa: E402


def bounds(run: dict, table: StepCostTable) -> dict:
    """One concurrency's row of a bench record -> its bounds (``runtime.spec.schedule_bounds``), rounded to 3 places."""
    row = schedule_bounds(int(run["concurrency"]), list(run["acceptance_per_position"]), table)
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}


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
