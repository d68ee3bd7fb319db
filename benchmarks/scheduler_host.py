"""The confidence scheduler's host work per step, where the engine pays it: right after an engine step.

A decision of each layout (``ConfidenceScheduler``: ``padded``, what a graphed engine runs; ``ragged``, an eager
engine's) and its learning are timed two ways, each with the plain-Python path for small steps on and off
(``TUNING.small_step``):

- ``after_step_us``: the median over ``--steps`` engine steps of the time of one decision + learn made right after
  a step of a tiny engine on this host (numpy's code is cold then: the first use of each numpy call costs
  microseconds, which is what a serving engine sees);
- ``in_loop_us``: the same call repeated back to back (warm caches: what a micro-benchmark sees).

CPU only (the engine is the tiny random shape in float32); the scheduler's host code is the same on a GPU host.

usage: python3 benchmarks/scheduler_host.py --out FILE.json [--batches 1,4,8,16] [--steps 80]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import write_shape  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.spec import confidence as confidence_scheduler  # noqa: E402
from runtime.spec.confidence import ConfidenceScheduler  # noqa: E402
from runtime.spec.tuning import TUNING

K = 7


def median_us(call, steps: int, before=None) -> float:
    """Median microseconds of ``call()``, each time right after ``before()`` if given."""
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    target, drafter = write_shape(Path(tempfile.mkdtemp()), "tiny", 1, K)
    spec = {"speculative_model": str(drafter), "max_draft_len": K, "load_format": "dummy",
            "enable_confidence_scheduling": True}
    llm = LLM(str(target), speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=4,
              kv_cache_memory=64 << 20, max_model_len=16384, load_format="dummy")
    engine = llm.engine
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=15000, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    block = list(engine.scheduler.running[0].draft_confidence or [0.5] * K)
    default_tuning = confidence_scheduler.TUNING
    default = default_tuning.small_step
    rows = []
    try:
        for layout, batch in ((layout, int(b)) for layout in ("padded", "ragged") for b in args.batches.split(",")):
            confidences = [block] * batch
            scheduler = ConfidenceScheduler(K, engine.confidence.costs, [1.2] * K, layout=layout)

            def decide():
                lengths = scheduler.allot(confidences, 0, 0, 100 * batch)
                scheduler.learn(lengths, [min(3, n) for n in lengths])

            row = {"layout": layout, "batch": batch}
            for name, small in (("python", 1 << 30), ("numpy", 0)):
                confidence_scheduler.TUNING = dataclasses.replace(default_tuning, small_step=small)
                row[f"{name}_after_step_us"] = round(median_us(decide, args.steps, engine.step), 1)
                row[f"{name}_in_loop_us"] = round(median_us(decide, 5 * args.steps), 1)
            row["numpy_over_python_after_step"] = round(row["numpy_after_step_us"] / row["python_after_step_us"], 2)
            row["chosen_by_default"] = "python" if batch * K <= default else "numpy"
            rows.append(row)
            print(row, flush=True)
    finally:
        confidence_scheduler.TUNING = default_tuning
        engine.executor.shutdown()
    record = {"benchmark": "scheduler_host", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "hardware": f"cpu ({os.cpu_count()} cores)", "torch": torch.__version__, "max_draft_len": K,
              "small_step": default, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
