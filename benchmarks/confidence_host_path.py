"""The confidence scheduler's host work on an engine step's path, per step, beside the same engine without it.

On the CPU (float32): a near-bigram target and an oracle drafter (``tests.builders``: most drafts accepted, so every
step decides and learns), ``--batch`` requests decoding together, ``--steps`` steps timed after a warmup, first on a
DSpark engine with a fixed block, then on the same engine with confidence scheduling (the same greedy tokens). Each
of the engine's methods the scheduler adds to a step is timed (``timed``): the decision
(``_allot_verify_lengths``), its bookkeeping (``_note_other_fed``, ``_learn_step_time``), the commit
(``_commit_step``, both engines; the confidence engine's holds ``_learn_acceptance``), the survival fit's folds and
refits (``SurvivalCorrection._fold``: ``fold``) and a deferred decision's rest (``ConfidenceScheduler.settle``:
``rest``), each under its own name where it ran on the path between a step's read-back and the next launch, and as
``NAME@wait`` where it ran as the executor's host work (``runtime.engine.host_work.HostWork``: where the runner waits for the
device). ``path_ms``: each engine's step less its executor's ``execute`` (the host work between read-back and
launch, the decision included); ``on_path_ms``: the confidence engine's ``path_ms`` less the fixed engine's (what
scheduling adds to that path); ``off_path_ms``: its host work in the device's wait. The scheduler prices steps by a
flat table (``flat_costs``: verify tokens nearly free, plain decoding dearer than a drafting step), so it verifies
whole blocks and keeps drafting as the fixed engine does: the two engines do the same work, and what it decides does
not depend on this host's timing.

``--mixed``: one request arrives before every step (a 16-token prompt, ``BLOCK x 6`` tokens), so each step feeds a
prompt beside the verifies, and the confidence engine decides under the padded layout a graphed engine's mixed steps
use (forced on this CPU engine, whose steps are eager): such a decision applies the cap chosen earlier and defers its
rest to the host work (``ConfidenceScheduler.allot_deferred``), as on a GPU, where mixed steps are neither packed nor
launched ahead and the device waits for everything on the path.

A CPU run says what the host code costs, not what a GPU step loses: on a GPU the path's time shows where the
device waits for it (a mixed prefill + decode step; a step launched ahead hides what fits in the step before).

usage: python3 benchmarks/confidence_host_path.py --out FILE.json [--batches 4,64,256] [--steps 40] [--mixed]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.spec.step_costs import StepCostTable  # noqa: E402
from tests import builders  # noqa: E402

BLOCK = 8  # drafts K = 7
METHODS = ("_allot_verify_lengths", "_note_other_fed", "_learn_step_time", "_commit_step", "_learn_acceptance")


@contextlib.contextmanager
def timed(owner, name: str, totals: dict, key) -> Iterator[None]:
    """Within the block, ``owner.name`` (if it has one) adds the host seconds of each call to ``totals[key]`` (``key``:
    a string, or a callable naming it when the call ends: where it ran). Here, not ``bench.profiling.timed``, so that
    the script runs unchanged at an earlier checkout."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return

    def add(start: float) -> None:
        named = key if isinstance(key, str) else key()
        totals[named] = totals.get(named, 0.0) + time.perf_counter() - start

    def finished(run, start: float):  # a step with device waits: timed until it is done
        try:
            return (yield from run)
        finally:
            add(start)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        except BaseException:
            add(start)
            raise
        if inspect.isgenerator(result):
            return finished(result, start)
        add(start)
        return result

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


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


def measure(target: Path, drafter: Path, costs: Path, batch: int, steps: int, confidence: bool,
            mixed: bool = False) -> dict:
    """ms per step of each timed method over ``steps`` steps of ``batch`` decoding requests (``mixed``: and an
    arrival before each step), each named by where it ran (``NAME@wait``: in the executor's host work)."""
    spec = DSparkDecodingConfig(speculative_model=str(drafter), enable_confidence_scheduling=confidence,
                                **({"confidence_cost_table_path": str(costs)} if confidence else {}))
    llm = LLM(str(target), speculative_config=spec, dtype="float32", device="cpu", num_pages=16384, page_size=4,
              max_num_seqs=batch + (steps + 16 if mixed else 0), max_num_batched_tokens=16384)
    engine = llm.engine
    if confidence and mixed:
        engine.confidence.layout = "padded"  # a graphed engine's mixed steps (this CPU engine's are eager)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=BLOCK * (steps + 20), temperature=0.0, ignore_eos=True)
    arrival = SamplingParams(max_tokens=BLOCK * 6, temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        return torch.randint(3, 60, (16,), generator=generator).tolist()

    for _ in range(batch):
        engine.add_request(prompt(), params)
    for _ in range(8):  # prefill and warmup
        if mixed:
            engine.add_request(prompt(), arrival)
        engine.step()
    totals: dict[str, float] = {}
    waiting = {"now": False}

    def where(name: str):
        return lambda: f"{name}@wait" if waiting["now"] else name

    with contextlib.ExitStack() as stack:
        for name in METHODS:
            if hasattr(engine, name) and (confidence or name == "_commit_step"):
                stack.enter_context(timed(engine, name, totals, where(name)))
        stack.enter_context(timed(engine, "step", totals, "step"))
        stack.enter_context(timed(engine.executor, "execute", totals, "execute"))
        # the engine's deferred work (earlier checkouts: the executor's), run at the steps' device waits
        work = getattr(engine, "host_work", None)
        if work is None:  # (an earlier checkout's engine: its executor's)
            work = getattr(engine.executor, "host_work", None)
        if work is not None:  # (none without confidence scheduling: nothing is deferred)
            run = work.run

            def run_marked(**kwargs):
                began, waiting["now"] = time.perf_counter(), True
                try:
                    run(**kwargs)
                finally:
                    waiting["now"] = False
                    totals["host_work"] = totals.get("host_work", 0.0) + time.perf_counter() - began

            work.run = run_marked
            stack.callback(setattr, work, "run", run)
        if confidence:  # the folds and a deferred decision's rest, by where they ran
            stack.enter_context(timed(engine.confidence.correction, "_fold", totals, where("fold")))
            stack.enter_context(timed(engine.confidence, "settle", totals, where("rest")))
        began = time.perf_counter()
        for _ in range(steps):
            if mixed:
                engine.add_request(prompt(), arrival)
            engine.step()
        wall = time.perf_counter() - began
    out = {name: round(1e3 * value / steps, 4) for name, value in sorted(totals.items())}
    out["path_ms"] = round(1e3 * (totals["step"] - totals["execute"]) / steps, 4)
    out["wall_step_ms"] = round(1e3 * wall / steps, 3)
    metrics = llm.get_metrics()
    out["mean_acceptance_length"] = metrics.get("mean_acceptance_length")
    if confidence:
        out["decisions"] = metrics["confidence_scheduling"]["decisions"]
    engine.executor.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="4,64,256")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mixed", action="store_true", help="an arrival before every step: mixed prefill + verify "
                        "steps, decided under the padded layout (forced), their decisions deferred")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    target, drafter = pair(root)
    costs = flat_costs(root / "costs.json")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        fixed = measure(target, drafter, costs, batch, args.steps, confidence=False, mixed=args.mixed)
        scheduled = measure(target, drafter, costs, batch, args.steps, confidence=True, mixed=args.mixed)
        row = {"batch": batch, "fixed": fixed, "confidence": scheduled,
               "on_path_ms": round(scheduled["path_ms"] - fixed["path_ms"], 4),
               "off_path_ms": round(scheduled.get("host_work", 0.0) - fixed.get("host_work", 0.0), 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    record = {"benchmark": "confidence_host_path", "date": str(date.today()), "checkout": commit,
              "command": "python3 " + shlex.join(sys.argv), "hardware": f"cpu ({os.cpu_count()} cores)",
              "host": platform.node(), "torch": torch.__version__, "max_draft_len": BLOCK - 1, "mixed": args.mixed,
              "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
