"""Confidence calibration (the DSpark paper's STS, section 3.2.1): a temperature per draft position.

The confidence head's ``c_k`` estimates the chance that draft k survives given its prefix did; the scheduler
multiplies them into a survival ``a_k = prod_{j<=k} sigmoid(logit(c_j) / T_j)``. On held-out verifications
(each: the confidences of the drafts verified, how many were accepted) the temperatures are fitted left to
right: ``T_k`` minimizes the expected calibration error of ``a_k`` against "drafts 1..k all accepted", given
``T_1..T_{k-1}``. A temperature is order-preserving, so it changes no ranking within a position, only how much
survival the budget trusts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEMPERATURE_GRID = torch.logspace(-1.0, 1.0, 81, dtype=torch.float64)  # 0.1 .. 10
ECE_BINS = 15


def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, bins: int = ECE_BINS) -> float:
    """predicted [N] in [0, 1], outcome [N] in {0, 1} -> the bin-weighted |mean predicted - mean outcome|."""
    if predicted.numel() == 0:
        return 0.0
    which = (predicted * bins).long().clamp(0, bins - 1)
    pred = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, predicted)
    hit = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, outcome)
    return float((pred - hit).abs().sum() / predicted.numel())


def fit_temperatures(verifications: list[tuple[list[float], int]], max_draft_len: int) -> dict:
    """-> {"temperatures": [K], "ece_before": [K], "ece_after": [K], "verifications": N}: one temperature per
    position, fitted left to right; a position no verification reached keeps 1."""
    num = len(verifications)
    conf = torch.full((num, max_draft_len), 0.5, dtype=torch.float64)
    reached = torch.zeros(num, max_draft_len, dtype=torch.bool)
    accepted = torch.tensor([a for _, a in verifications], dtype=torch.float64)
    for i, (c, _) in enumerate(verifications):
        conf[i, :len(c)] = torch.tensor(c[:max_draft_len], dtype=torch.float64)
        reached[i, :len(c)] = True
    logits = torch.logit(conf.clamp(1e-6, 1 - 1e-6))
    temperatures, before, after = [], [], []
    prefix = torch.ones(num, dtype=torch.float64)  # survival through the positions fitted so far
    raw_prefix = torch.ones(num, dtype=torch.float64)
    for k in range(max_draft_len):
        rows = reached[:, k]
        outcome = (accepted[rows] >= k + 1).to(torch.float64)
        raw_prefix = raw_prefix * torch.sigmoid(logits[:, k])
        before.append(expected_calibration_error(raw_prefix[rows], outcome))
        if not bool(rows.any()):
            temperatures.append(1.0)
            after.append(0.0)
            continue
        candidates = prefix[rows, None] * torch.sigmoid(logits[rows, k, None] / TEMPERATURE_GRID[None, :])
        errors = [expected_calibration_error(candidates[:, j], outcome) for j in range(len(TEMPERATURE_GRID))]
        best = min(range(len(errors)), key=lambda j: (errors[j], abs(TEMPERATURE_GRID[j].item() - 1.0)))
        temperature = float(TEMPERATURE_GRID[best])
        temperatures.append(temperature)
        after.append(errors[best])
        prefix = prefix * torch.sigmoid(logits[:, k] / temperature)
    return {"temperatures": temperatures, "ece_before": before, "ece_after": after, "verifications": num}


def calibrate_drafter(target: str, drafter: str, prompts: list[list[int]], max_draft_len: int, max_tokens: int,
                      **engine) -> dict:
    """Greedy decoding of ``prompts`` with the drafter through the engine, its verifications fitted
    (``fit_temperatures``), the temperatures written into the drafter's config.json as
    ``confidence_temperatures`` -> the fit's record."""
    from configs import DSparkDecodingConfig
    from runtime.engine.llm import LLM
    from runtime.sampling.sampling_params import SamplingParams

    # every block verified whole (no speculation guard): each position's verifications are what is fitted
    spec = DSparkDecodingConfig(speculative_model=drafter, max_draft_len=max_draft_len, speculation_guard=False)
    llm = LLM(target, speculative_config=spec, **engine)
    llm.engine.verification_log = []
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if not llm.engine.verification_log:
        raise ValueError("calibration: no verification carried confidences (does the drafter have a confidence "
                         "head?)")
    fit = fit_temperatures(llm.engine.verification_log, max_draft_len)
    path = Path(drafter) / "config.json"
    config = json.loads(path.read_text())
    config["confidence_temperatures"] = fit["temperatures"]
    path.write_text(json.dumps(config, indent=1))
    return fit
