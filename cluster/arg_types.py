"""argparse value types that refuse out-of-range numbers at parse time, so a bad flag is named at once (argparse
prefixes the flag: ``argument --steps: wants an integer >= 1, got '0'``) instead of hanging a benchmark or failing
after minutes of work (``dspark serve`` builds the demo pair before it binds its port)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An int type accepting ``minimum`` <= value (<= ``maximum``)."""
    wanted = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants {wanted}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"wants {wanted}, got {text!r}")
        return value

    return parse


def number(minimum: float, above: bool = False) -> Callable[[str], float]:
    """A float type accepting values >= ``minimum`` (> ``minimum`` with ``above``); never NaN or infinite."""
    wanted = f"a number {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants {wanted}, got {text!r}") from None
        if not value < float("inf") or (value <= minimum if above else value < minimum):  # NaN fails the first
            raise argparse.ArgumentTypeError(f"wants {wanted}, got {text!r}")
        return value

    return parse


NEVER = "never"


def number_or_never(minimum: float, above: bool = False) -> Callable[[str], float | str]:
    """``number(minimum, above)``, or the word ``never`` (returned as ``NEVER``: the caller maps it to the config's
    None, which a flag's own None, "not given", cannot say)."""
    parse_number = number(minimum, above)

    def parse(text: str) -> float | str:
        if text == NEVER:
            return NEVER
        try:
            return parse_number(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} or {NEVER!r}") from None

    return parse
