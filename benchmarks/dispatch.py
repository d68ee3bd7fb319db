"""What one step's driver-to-replica round trip costs: Ray tasks against a Ray Compiled Graph, side by side.

``--actors`` actors (default 2: a TP=2 replica's shards; 1: a TP=1 replica) each receive a real ``ScheduledBatch`` of
``--batch`` decoding requests
(K=7 blocks, page lists of a 2,048-token context) and return as many small results, the shape of
``RayExecutor.execute``; the actors do no work, so the time is the dispatch alone:
  tasks     ray.put(batch), one .remote() per actor, ray.get (what RayExecutor did first)
  compiled  one execute() of a compiled graph over shared-memory channels, the whole batch pickled
  delta     the same graph carrying ``cluster.dispatch``'s delta (what RayExecutor does): the actors rebuild
            the batch from the pages and parameters they already hold, and send their results as tuples, each
            direction pickled into one bytes object
Median of ``--steps`` round trips after warm-up. Writes a JSON record (hardware, command, date).

usage: python3 benchmarks/dispatch.py [--batch 1,64,256] [--steps 300] [--actors 2] [--out FILE.json]
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

from cluster.dispatch import BatchDecoder, BatchEncoder, decode_results, encode_results  # noqa: E402
from runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest  # noqa: E402


def batch_of(num: int) -> ScheduledBatch:
    params = SamplingParams(max_tokens=256, temperature=0.0)
    return ScheduledBatch(requests=[ScheduledRequest(
        request_id=str(i), token_ids=list(range(8)), start_position=2048, page_ids=list(range(129)), num_drafts=7,
        sample=True, params=params, seed=i) for i in range(num)], num_next_drafts=7, maintain_draft_context=True)


def results_of(batch: ScheduledBatch) -> list[RequestStepResult]:
    return [RequestStepResult(r.request_id, [1, 2, 3], 2, list(range(7))) for r in batch.requests]


@ray.remote(num_cpus=0)
class Shard:
    def __init__(self):
        self.decoder = BatchDecoder()

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        return results_of(batch)

    def execute_delta(self, wire) -> list[tuple]:
        return encode_results(results_of(self.decoder.decode(wire)))


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
    parser.add_argument("--actors", type=int, default=2, help="replica actors (default 2: TP=2; 1: TP=1)")
    parser.add_argument("--out")
    args = parser.parse_args()
    from ray.dag import InputNode, MultiOutputNode

    ray.init(include_dashboard=False, log_to_driver=False)
    if args.actors < 1:
        parser.error(f"--actors must be >= 1, got {args.actors}")
    shards = [Shard.remote() for _ in range(args.actors)]
    batches = {num: batch_of(num) for num in args.batch}
    runs = {num: {"batch": num} for num in args.batch}

    def tasks(batch):
        ref = ray.put(batch)
        ray.get([s.execute.remote(ref) for s in shards])

    for num, batch in batches.items():
        runs[num]["tasks_ms"] = median_ms(lambda: tasks(batch), args.steps)
    # an actor takes part in one compiled graph at a time: each variant gets its own, torn down after
    for name, method in (("compiled_ms", "execute"), ("delta_ms", "execute_delta")):
        with InputNode() as inp:
            graph = MultiOutputNode([getattr(s, method).bind(inp) for s in shards]).experimental_compile()
        encoder = BatchEncoder()
        for num, batch in batches.items():
            if method == "execute":
                runs[num][name] = median_ms(lambda: ray.get(graph.execute(batch)), args.steps)
            else:  # steady state: the same requests every step, no new pages
                runs[num][name] = median_ms(lambda: decode_results(ray.get(graph.execute(encoder.encode(batch)))[0]),
                                            args.steps)
        graph.teardown()
    for row in runs.values():
        row["compiled_vs_tasks"] = row["compiled_ms"] / row["tasks_ms"]
        row["delta_vs_tasks"] = row["delta_ms"] / row["tasks_ms"]
        print(json.dumps(row), flush=True)
    runs = list(runs.values())
    record = {"benchmark": "dispatch", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "ray": ray.__version__, "actors": args.actors, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
