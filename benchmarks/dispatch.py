"""What one step's driver-to-replica round trip costs: Ray tasks against a Ray Compiled Graph, side by side.

Two actors (a TP=2 replica's shards) each receive a real ``ScheduledBatch`` of ``--batch`` decoding requests
(K=7 blocks, page lists of a 2,048-token context) and return as many small results, the shape of
``RayExecutor.execute``; the actors do no work, so the time is the dispatch alone:
  tasks     ray.put(batch), one .remote() per actor, ray.get (what RayExecutor did before)
  compiled  one execute() of a compiled graph over shared-memory channels (what it does now)
Median of ``--steps`` round trips after warm-up. Writes a JSON record (hardware, command, date).

usage: python3 benchmarks/dispatch.py [--batch 1,64,256] [--steps 300] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest  # noqa: E402


def batch_of(num: int) -> ScheduledBatch:
    params = SamplingParams(max_tokens=256, temperature=0.0)
    return ScheduledBatch(requests=[ScheduledRequest(
        request_id=str(i), token_ids=list(range(8)), start_position=2048, page_ids=list(range(129)), num_drafts=7,
        sample=True, params=params, seed=i) for i in range(num)], num_next_drafts=7, maintain_draft_context=True)


@ray.remote(num_cpus=0)
class Shard:
    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        return [RequestStepResult(r.request_id, [1, 2, 3], 2, list(range(7))) for r in batch.requests]


def median_ms(step, steps: int) -> float:
    for _ in range(20):
        step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,64,256", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    from ray.dag import InputNode, MultiOutputNode

    ray.init(include_dashboard=False, log_to_driver=False)
    shards = [Shard.remote() for _ in range(2)]
    with InputNode() as inp:
        graph = MultiOutputNode([s.execute.bind(inp) for s in shards]).experimental_compile()
    runs = []
    for num in args.batch:
        batch = batch_of(num)

        def tasks():
            ref = ray.put(batch)
            ray.get([s.execute.remote(ref) for s in shards])

        def compiled():
            ray.get(graph.execute(batch))

        row = {"batch": num, "tasks_ms": median_ms(tasks, args.steps), "compiled_ms": median_ms(compiled, args.steps)}
        row["compiled_vs_tasks"] = row["compiled_ms"] / row["tasks_ms"]
        runs.append(row)
        print(json.dumps(row), flush=True)
    graph.teardown()
    record = {"benchmark": "dispatch", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "ray": ray.__version__, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
