"""Benchmarking: our autoregressive baseline and DSpark side by side, same engine and kernels (the whole method in
``sweep``'s docstring and ``dspark bench --help``). It reads engines through their public API and imports no Ray:
a Ray replica's engine class is handed in (``run(args, replica_engine=cluster.LLM)``, what ``cluster.bench_cli``,
the command's arguments and entry point, does).

- ``shapes``: model shapes built with random weights; ``measure``: step times, workloads, bytes, peers;
  ``profiling``: where a step's time goes; ``stats``: paired rounds, ratios, spreads, bounds; ``sweep``: the sweep
  and the record; ``tuning``: the fastest draft length per concurrency; ``report``: its summary;
  ``drafter_kinds``: speculation against AR on pairs of known worth; ``schedule_tuning``: a draft-length schedule
  from per-position acceptance; ``plot``: a record as a PNG.
"""

from bench.measure import (agreement, copy_bandwidth, end_to_end, expert_bytes, mixed_workload, routing_stats,
                           time_steps, weight_bytes)
from bench.profiling import AllocatorEvents, GcPauses, StepWindowProfile, local_worker, profile_step, replay_ms
from bench.report import summary, variant_summary
from bench.shapes import MODEL_SHAPES, write_shape
from bench.stats import (confidence_bounds, mixed_noise_floor, paired_ratio, piecewise_ratios, prefill_apart_ratios,
                         round_spread, schedule_cap, step_spread)
from bench.sweep import run
from bench.tuning import read_schedule

__all__ = ["MODEL_SHAPES", "AllocatorEvents", "GcPauses", "StepWindowProfile", "agreement",
           "confidence_bounds", "copy_bandwidth", "end_to_end", "expert_bytes", "local_worker", 
           "mixed_noise_floor", "mixed_workload", "paired_ratio", "piecewise_ratios", "prefill_apart_ratios",
           "profile_step", "read_schedule", "replay_ms", "round_spread", "routing_stats", "run", "schedule_cap", "step_spread", "summary",
           "time_steps", "variant_summary", "weight_bytes", "write_shape"]
