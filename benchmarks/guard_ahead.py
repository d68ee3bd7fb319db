"""What the speculation guard does to launching steps ahead, without a GPU: ``python benchmarks/guard_ahead.py``.

On a GPU the engine launches the next greedy verify before it reads the current step back when that step verifies
every request's block (``ScheduledBatch.run_ahead``; a plain decode step likewise), so a plan that leaves one block
out costs the overlap too. Here an ``Engine`` steps over an executor that answers at once with canned results (the
drafts each request gets accepted: ``all`` 7 of 7, ``some`` 3, ``none`` 0, ``mixed`` half the requests 7 and half 0)
and declares that it plans, runs and verifies ahead as the GPU worker does, and the share of steps the engine
launched ahead is counted for DSpark with every block verified (``fixed``), with the guard (``guard``), never
drafting (``floor``) and autoregressive decoding (``ar``), with the share of steps that drafted and the host time
per step (this host's Python, and ``--jitter-us``: a random wait a step, seeded, for steps whose times vary as a
device's do: the guard prices steps by their times). ``--tree DIR`` runs another checkout's engine (before/after).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ACCEPTED = {"all": 7, "some": 3, "none": 0, "mixed": None}  # drafts of 7 accepted per verify (mixed: 7 or 0)


def run(root: Path, mode: str, acceptance: str, requests: int, steps: int, jitter_us: float) -> dict:
    import random

    from configs import LLMConfig
    from engine_host import VOCAB, CannedExecutor
    from runtime.engine.core import Engine
    from runtime.sampling.sampling_params import SamplingParams

    class AheadExecutor(CannedExecutor):
        """Canned results, and the GPU worker's launch-ahead members; counts what each step's batch asked."""

        plans_ahead = runs_ahead = verifies_ahead = True

        def __init__(self, *args):
            super().__init__(*args)
            self.steps = self.ahead = self.drafting = 0
            self.rng = random.Random(0)

        def execute(self, batch):
            end = time.perf_counter() + 1e-6 * self.rng.uniform(0, jitter_us)
            while time.perf_counter() < end:  # a device step's time, varying from step to step
                pass
            self.steps += 1
            self.ahead += bool(batch.run_ahead)
            self.drafting += bool(batch.num_next_drafts)
            if ACCEPTED[acceptance] is not None:
                return super().execute(batch)
            results = []
            for r in batch.requests:  # mixed: even request ids accept every draft, odd ones none
                self.accepted = 7 if int(r.request_id) % 2 == 0 else 0
                results += super().execute(dataclasses.replace(batch, requests=[r]))
            return results

    spec = None if mode == "ar" else {"speculative_model": str(root), "max_draft_len": 7,
                                      "speculation_guard": mode == "guard"}
    max_tokens = 8 * (2 * steps + 100)  # every request decodes through the whole timing
    config = LLMConfig(model=str(root), speculative_config=spec, page_size=16, max_num_seqs=requests,
                       num_pages=requests * ((64 + max_tokens) // 16 + 2) + 64,
                       max_num_batched_tokens=max(8192, requests * 8), device="cpu", dtype="float32")
    executor = AheadExecutor(config.num_pages, 7 if spec else 0, ACCEPTED[acceptance] or 0)
    engine = Engine(config, executor)
    if mode == "floor":
        engine.forced_draft_len = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    for i in range(requests):
        engine.add_request([(i * 13 + j) % (VOCAB - 10) + 5 for j in range(64)], params)
    while engine.num_waiting:  # prefill, then steps the guard learns its first prices in
        engine.step()
    for _ in range(50):
        engine.step()
    executor.steps = executor.ahead = executor.drafting = 0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    host_us = 1e6 * (time.perf_counter() - start) / steps
    return {"requests": requests, "engine": mode, "acceptance": acceptance,
            "launched_ahead": round(executor.ahead / executor.steps, 3),
            "drafting": round(executor.drafting / executor.steps, 3), "host_us_per_step": round(host_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="1,64,256")
    parser.add_argument("--acceptance", default="all,some,mixed,none", help=f"from {', '.join(ACCEPTED)}")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--jitter-us", type=float, default=0.0, help="each step also waits a random time up to this "
                        "many microseconds (seeded): steps whose times vary as a device's do")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the checkout to run")
    parser.add_argument("--out")
    args = parser.parse_args()
    unknown = sorted(set(args.acceptance.split(",")) - set(ACCEPTED))
    if unknown:
        parser.error(f"--acceptance: unknown {unknown}; choose from {', '.join(ACCEPTED)}")
    sys.path[:0] = [args.tree, str(Path(__file__).resolve().parent)]
    from engine_host import model_dir
    from guard_host import write_record

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = model_dir(Path(tmp))
        for batch in (int(b) for b in args.requests.split(",")):
            rows.append(run(root, "ar", "none", batch, args.steps, args.jitter_us))
            rows.append(run(root, "floor", "none", batch, args.steps, args.jitter_us))
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
            for acceptance in args.acceptance.split(","):
                for mode in ("fixed", "guard"):
                    rows.append(run(root, mode, acceptance, batch, args.steps, args.jitter_us))
                    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_record(args.out, "guard_ahead", args.tree, rows)


if __name__ == "__main__":
    main()
