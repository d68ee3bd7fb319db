"""Speculation that never costs, on pairs of known worth: ``dspark bench --drafter-kinds`` (``bench.drafter_kinds``,
whose docstring says what each kind is and how it is measured), runnable without installing the package.

usage: python3 benchmarks/speculation_guard.py --out FILE.json [--kinds untrained,weak,good,mixed]
           [--concurrency 1,4,16,64] [--tokens 64] [--rounds 6] [--seconds 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.drafter_kinds import KINDS, measure_kinds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=1.0, help="wall time of each engine's run in a round")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    try:
        measure_kinds(args.kinds.split(","), [int(c) for c in args.concurrency.split(",")], args.tokens, args.rounds,
                      args.seconds, args.device, "python3 " + shlex.join(sys.argv), args.out)
    except ValueError as exc:  # (an unknown kind, named with the ones offered)
        parser.error(f"--kinds: {exc}")


if __name__ == "__main__":
    main()
