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


UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
SIZE_FORMS = "bytes, or a number with a unit: 512MiB, 16GiB, 0.5GB"


def memory_size(text: str) -> int:
    """A positive size in bytes: a plain integer, or a number with a unit (KiB/MiB/GiB/TiB, or KB/MB/GB)."""
    number_part = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number_part):].lower()
    try:
        value = float(number_part) * UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"wants {SIZE_FORMS}; got {text!r}") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"wants a size of at least 1 byte ({SIZE_FORMS}); got {text!r}")
    return int(value)


def gib(text: str) -> int:
    """A positive number of GiB, in bytes (the older spelling of a memory size)."""
    return int(number(0, above=True)(text) * (1 << 30))


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = number(0, above=True)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"wants a fraction in (0, 1], got {text!r}")
    return value


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N (what ``LLMConfig.device`` takes)."""
    from configs.engine import DEVICE_PATTERN

    if not DEVICE_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"wants one of auto, cpu, cuda, cuda:N; got {text!r}")
    return text


def moe_backend(text: str) -> str:
    """A MoE backend this build runs (AUTO, VANILLA, DENSEGEMM, TRITON); another name of the reference's list is
    refused with the reason it does not run here."""
    from runtime.worker.devices import MOE_BACKENDS_ELSEWHERE, MOE_BACKENDS_RUN

    if text in MOE_BACKENDS_RUN:
        return text
    why = MOE_BACKENDS_ELSEWHERE.get(text)
    runs = ", ".join(MOE_BACKENDS_RUN)
    raise argparse.ArgumentTypeError(f"{text}: {why}; choose from {runs}" if why else
                                     f"wants one of {runs}; got {text!r}")
