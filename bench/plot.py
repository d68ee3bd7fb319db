"""A bench record's speedup and tokens/s against concurrency, as a PNG.

Two panels sharing a log2 concurrency axis: output tokens/s of our autoregressive baseline and of DSpark
(measured), and DSpark's speedup over the baseline (measured, and projected where the record has a
``projected_speedup``). Needs matplotlib (``pip install 'dspark[bench]'``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def require_matplotlib(flag: str) -> None:
    """Raise SystemExit naming ``flag`` when matplotlib is missing (checked before a long run, not after)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(f"dspark: {flag} needs matplotlib, which is not installed (pip install 'dspark[bench]')")


def plot(record: dict, path: str | Path) -> Path:
    """Draw ``record`` (``dspark bench``'s JSON) into the PNG ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(record["runs"], key=lambda r: r["concurrency"])
    conc = [r["concurrency"] for r in runs]
    fig, (rate, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    schedules = [(kind, label, marker, color) for kind, label, marker, color in
                 (("tuned", "DSpark, tuned schedule", "^-", "C2"),
                  ("confidence", "DSpark, confidence scheduling", "v-", "C3"))
                 if all(f"{kind}_tokens_per_s" in r for r in runs)]  # the schedules the run swept too
    dspark = "DSpark, fixed K" if schedules else "DSpark"
    rate.plot(conc, [r["ar_tokens_per_s"] for r in runs], "o-", color="C0", label="autoregressive")
    rate.plot(conc, [r["dspark_tokens_per_s"] for r in runs], "s-", color="C1", label=dspark)
    for kind, label, marker, color in schedules:
        rate.plot(conc, [r[f"{kind}_tokens_per_s"] for r in runs], marker, color=color, label=label)
    rate.set_ylabel("output tokens/s")
    speed.plot(conc, [r["speedup"] for r in runs], "s-", color="C1", label=dspark if schedules else "measured")
    for kind, label, marker, color in schedules:
        speed.plot(conc, [r[f"{kind}_tokens_per_s"] / r["ar_tokens_per_s"] for r in runs], marker, color=color,
                   label=label)
    if all("projected_speedup" in r for r in runs):
        tau = record.get("projected_tau", {}).get("tau")
        speed.plot(conc, [r["projected_speedup"] for r in runs], "d--", label=f"projected (tau {tau})")
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set_ylabel("DSpark / autoregressive")
    for ax in (rate, speed):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency (requests decoding together)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{record['model']} ({record['kind']}) on {record['hardware']}, {record['date']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
