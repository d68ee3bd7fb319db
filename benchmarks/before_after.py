"""The after / before ratio of each step figure of ``benchmarks/before_after.sh``'s bench records.

Rounds pair in order (before-0 with after-0, ...): each ratio is taken within a pair (the two ran back to back on
one host), then summarized over the pairs by its mean and range. ``FIGURES`` are the bench run rows' step figures
an engine change could move; the rows pair by concurrency.

usage: python3 benchmarks/before_after.py OUT/before-*.json OUT/after-*.json --out FILE.json [--revision REV]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import date
from pathlib import Path

FIGURES = ("ar_step_ms", "dspark_step_ms", "dspark_step_vs_ar", "ar_tokens_per_s", "dspark_tokens_per_s")


def rounds(paths: list[str]) -> dict[str, dict[int, dict]]:
    """{"before"|"after": {round: record}} from files named NAME-ROUND.json."""
    found: dict[str, dict[int, dict]] = {"before": {}, "after": {}}
    for path in paths:
        match = re.fullmatch(r"(before|after)-(\d+)\.json", Path(path).name)
        if match is None:
            raise SystemExit(f"{path}: not a before-N.json or after-N.json record")
        found[match[1]][int(match[2])] = json.loads(Path(path).read_text())
    if not found["before"] or not found["after"]:
        raise SystemExit("give at least one before-N.json and one after-N.json")
    return found


def by_concurrency(record: dict) -> dict[int, dict]:
    return {row["concurrency"]: row for row in record["runs"]}


def compare(found: dict[str, dict[int, dict]]) -> dict:
    """Per concurrency and figure: the after / before ratio of each round pair, their mean, min and max; and the
    later tree's own figures (``after_figures``)."""
    pairs = sorted(set(found["before"]) & set(found["after"]))
    if not pairs:
        raise SystemExit("no round has both a before and an after record")
    table: dict[int, dict[str, dict]] = {}
    for n in pairs:
        before, after = by_concurrency(found["before"][n]), by_concurrency(found["after"][n])
        for c in sorted(set(before) & set(after)):
            for figure in FIGURES:
                if before[c].get(figure) and after[c].get(figure) is not None:
                    cell = table.setdefault(c, {}).setdefault(figure, {"ratios": []})
                    cell["ratios"].append(after[c][figure] / before[c][figure])
    for cells in table.values():
        for cell in cells.values():
            ratios = cell["ratios"]
            cell.update(mean=statistics.fmean(ratios), min=min(ratios), max=max(ratios))
    return {"pairs": len(pairs), "after_over_before": {str(c): cells for c, cells in table.items()},
            "after": after_figures([found["after"][n] for n in pairs])}


def after_figures(records: list[dict]) -> dict:
    """The later tree's own figures, each the mean over its rounds: per concurrency the step times, the AR step's
    share of the bandwidth roofline (the bench's copy bandwidth) and tokens/s; and that copy bandwidth."""
    rows: dict[str, dict[str, list[float]]] = {}
    for record in records:
        for c, row in by_concurrency(record).items():
            for figure in (*FIGURES, "roofline_fraction"):
                if row.get(figure) is not None:
                    rows.setdefault(str(c), {}).setdefault(figure, []).append(row[figure])
    bandwidth = [r["copy_bandwidth_gbs"] for r in records if r.get("copy_bandwidth_gbs")]
    return {"copy_bandwidth_gbs": statistics.fmean(bandwidth) if bandwidth else None,
            "by_concurrency": {c: {figure: statistics.fmean(v) for figure, v in cells.items()}
                               for c, cells in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--revision", help="the earlier tree's revision (recorded)")
    parser.add_argument("--after-revision", help="the later tree's revision (recorded)")
    args = parser.parse_args()
    found = rounds(args.records)
    first = found["after"][min(found["after"])]
    record = {"kind": "before-after", "date": date.today().isoformat(), "before_revision": args.revision,
              "after_revision": args.after_revision,
              "hardware": first.get("hardware"), "bench_command": first.get("command"),
              "command": "bash benchmarks/before_after.sh run OUT; python3 benchmarks/before_after.py OUT/*.json --out "
                         "FILE --revision REV",
              **compare(found)}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for c, cells in record["after_over_before"].items():
        print(c, {figure: round(cell["mean"], 3) for figure, cell in cells.items()})


if __name__ == "__main__":
    main()
