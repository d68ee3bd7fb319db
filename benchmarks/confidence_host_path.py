"""The confidence scheduler's host work on an engine step's path, per step, beside the same engine without it.

On the CPU (float32): a near-bigram target and an oracle drafter (``tests.builders``: most drafts accepted, so every
step decides and learns), ``--batch`` requests decoding together, ``--steps`` steps timed after a warmup, first on a
DSpark engine with a fixed block, then on the same engine with confidence scheduling (the same greedy tokens). Each
of the engine's methods the scheduler adds to a step is timed (``cluster.bench.timed``): the decision
(``_allot_verify_lengths``), its bookkeeping (``_note_other_fed``, ``_learn_step_time``), the commit
(``_commit_step``, both engines; the confidence engine's holds ``_learn_acceptance``), and the survival fit's folds
and refits (``SurvivalCorrection._fold``), split by where they ran: inside the commit (on the path between a step's
read-back and the next step's launch) or elsewhere (the executor's host work, ``runtime.transfer.HostWork``: where
the runner waits for the device). ``on_path_ms``: the confidence engine's own work on that path (``ON_PATH``: the
decision, the bookkeeping, the learning and the folds in the commit); ``off_path_ms``: the folds elsewhere. The
scheduler prices steps by a flat table (``flat_costs``: verify tokens nearly free, plain decoding dearer than a
drafting step), so it verifies whole blocks and keeps drafting as the fixed engine does: the two engines do the
same work, and what it decides does not depend on this host's timing.

A CPU run says what the host code costs, not what a GPU step loses: on a GPU the path's time shows where the
device waits for it (a mixed prefill + decode step; a step launched ahead hides what fits in the step before).

usage: python3 benchmarks/confidence_host_path.py --out FILE.json [--batches 4,64,256] [--steps 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.bench import timed  # noqa: E402
from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.step_costs import StepCostTable  # noqa: E402
from tests import builders  # noqa: E402

BLOCK = 8  # drafts K = 7
METHODS = ("_allot_verify_lengths", "_note_other_fed", "_learn_step_time", "_commit_step", "_learn_acceptance")
# the confidence engine's own work between a step's read-back and the next launch (``_learn_acceptance`` and the folds
# in the commit run inside ``_commit_step``, whose remainder is the fixed engine's work too)
ON_PATH = ("_allot_verify_lengths", "_note_other_fed", "_learn_step_time", "_learn_acceptance", "fold_in_commit")


def pair(root: Path) -> tuple[Path, Path]:
    target = builders.save_target(root / "target", "qwen3", seed=4, residual_scale=0.6)
    config = builders.drafter_config(target, block_size=BLOCK, markov_rank=builders.VOCAB, head_type="vanilla",
                                     confidence=True)
    tensors = builders.drafter_tensors(config, seed=0)
    builders.make_oracle(tensors, config, builders.bigram_table(target))
    return target, builders.save_drafter(root / "drafter", config, tensors)


def flat_costs(path: Path) -> Path:
    """A step-time table where verify tokens are nearly free (10 ms a step + 1 us a token) and plain decoding
    costs 9 ms a step: the scheduler verifies whole blocks and drafting pays, whatever this host's timing."""
    tokens = [1, 64, 2048]
    table = StepCostTable([1, 256], tokens, [[10.0 + 0.001 * t for t in tokens]] * 2)
    table.plain = StepCostTable([1, 256], [1, 256], [[9.0, math.nan], [math.nan, 9.0]])
    table.save(path)
    return path


def measure(target: Path, drafter: Path, costs: Path, batch: int, steps: int, confidence: bool) -> dict:
    """ms per step of each timed method over ``steps`` steps of ``batch`` decoding requests."""
    spec = DSparkDecodingConfig(speculative_model=str(drafter), enable_confidence_scheduling=confidence,
                                **({"confidence_cost_table_path": str(costs)} if confidence else {}))
    llm = LLM(str(target), speculative_config=spec, dtype="float32", device="cpu", num_pages=16384, page_size=4,
              max_num_seqs=batch, max_num_batched_tokens=16384)
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=BLOCK * (steps + 20), temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 60, (16,), generator=generator).tolist(), params)
    for _ in range(8):  # prefill and warmup
        engine.step()
    totals: dict[str, float] = {}
    where = {"commit": False}
    with contextlib.ExitStack() as stack:
        for name in METHODS:
            if hasattr(engine, name) and (confidence or name == "_commit_step"):
                stack.enter_context(timed(engine, name, totals, name))
        if confidence:  # the folds, by where they ran
            commit = engine._commit_step

            def commit_marked(*args, **kwargs):
                where["commit"] = True
                try:
                    return commit(*args, **kwargs)
                finally:
                    where["commit"] = False

            engine._commit_step = commit_marked
            correction = engine.confidence.correction
            fold = correction._fold

            def fold_timed(*args, **kwargs):
                began = time.perf_counter()
                try:
                    return fold(*args, **kwargs)
                finally:
                    key = "fold_in_commit" if where["commit"] else "fold_elsewhere"
                    totals[key] = totals.get(key, 0.0) + time.perf_counter() - began

            correction._fold = fold_timed
        began = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - began
    out = {name: round(1e3 * value / steps, 4) for name, value in sorted(totals.items())}
    out["step_ms"] = round(1e3 * wall / steps, 3)
    metrics = llm.get_metrics()
    out["mean_acceptance_length"] = metrics.get("mean_acceptance_length")
    engine.executor.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="4,64,256")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    target, drafter = pair(root)
    costs = flat_costs(root / "costs.json")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        fixed = measure(target, drafter, costs, batch, args.steps, confidence=False)
        scheduled = measure(target, drafter, costs, batch, args.steps, confidence=True)
        on_path = sum(scheduled.get(name, 0.0) for name in ON_PATH)
        row = {"batch": batch, "fixed": fixed, "confidence": scheduled, "on_path_ms": round(on_path, 4),
               "off_path_ms": scheduled.get("fold_elsewhere", 0.0)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    record = {"benchmark": "confidence_host_path", "date": str(date.today()), "checkout": commit,
              "command": "python3 " + shlex.join(sys.argv), "hardware": f"cpu ({os.cpu_count()} cores)",
              "host": platform.node(), "torch": torch.__version__, "max_draft_len": BLOCK - 1, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
