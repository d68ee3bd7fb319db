"""Replica layouts side by side in one run: the single-process engine, Ray replicas at each tensor parallel size,
and a separate drafter, all on the same random-weight model shape.

Each layout is one ``dspark bench`` (its own process, so every layout starts on a clean GPU and Ray cluster) over
the same concurrencies, steps and kernels; this script then puts their step times into one record with the
ratios the cluster fast path is judged by:
  tp{N}_vs_tp1_ar_step          a TP=N replica's autoregressive step over the TP=1 replica's (goal at batch 1:
                                <= 0.60 for N=2, <= 0.35 for N=4); tp{N}_oneshot_* the same with the one-shot
                                all-reduce (--allreduce-strategy ONESHOT; --no-oneshot leaves it out)
  ray_tp1_vs_single_process_*   the Ray TP=1 replica's AR and DSpark steps over the single-process engine's
                                (goal <= 1.05: what the process boundary and dispatch cost), from the ray-tp1
                                layout's own bench, which measures the two side by side on one GPU in alternating
                                rounds (--beside-single-process: the paired median; ``_from`` says so)
  separate_*                    from the separate-drafter layout's own bench (it measures the colocated replica in
                                the same process): step_vs_colocated, throughput_vs_colocated, throughput_vs_serial
``agreement`` (with ``--e2e-prompts N``): per TP layout, how its greedy outputs of N prompts agree with one
process's in bf16 (the share identical, where each first differs). Each layout's full bench record is kept under
``layouts``. Layouts needing more GPUs than the host has are
skipped and said so in the record.

usage: python3 benchmarks/tp_scaling.py --out FILE.json [--model-shape qwen3-8b] [--tensor-parallel-sizes 1,2]
       [--concurrency 1,64] [--steps 30] [--draft-layers 1] [--e2e-prompts N] [--no-separate] [--no-oneshot]
       [--layouts A,B] [--kv-cache-gib 16] [--profile] [--sequential]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layouts(tp_sizes: list[int], separate: bool, gpus: int, oneshot: bool = True,
            e2e_prompts: int = 0) -> list[tuple[str, list[str], int]]:
    """(name, extra bench flags, GPUs needed) of every layout of the run, in order: above one rank each TP size
    with NCCL's all-reduce and (``oneshot``) with the one-shot one (``ray-tp{N}-oneshot``). ``e2e_prompts``: every
    TP layout also decodes that many prompts beside one process (their greedy outputs' agreement)."""
    out = [("single-process", [], 1)]
    agree = ["--beside-single-process", "--e2e-prompts", str(e2e_prompts)] if e2e_prompts else []
    for n in tp_sizes:
        # the TP=1 replica beside the one-process engine on its GPU, in alternating rounds (the paired ratio below)
        beside = agree or (["--beside-single-process"] if n == 1 else [])
        out.append((f"ray-tp{n}", ["--tensor-parallel-size", str(n), *beside], n))
        if n > 1 and oneshot:
            out.append((f"ray-tp{n}-oneshot", ["--tensor-parallel-size", str(n), "--allreduce-strategy", "ONESHOT",
                                               *agree], n))
    if separate:
        out.append(("ray-tp1-separate", ["--tensor-parallel-size", "1", "--drafter", "separate",
                                          "--pipeline-drafter"], 2))
    return [(name, flags, need) for name, flags, need in out if need <= gpus] + \
        [(name, None, need) for name, flags, need in out if need > gpus]


def by_concurrency(record: dict) -> dict[int, dict]:
    return {row["concurrency"]: row for row in record.get("runs", [])}


def ratios(records: dict[str, dict], tp_sizes: list[int]) -> dict:
    """The ratios of the module docstring, per concurrency, from the layouts that ran."""
    rows = {name: by_concurrency(rec) for name, rec in records.items()}
    out: dict = {}

    def ratio(a: str, b: str, field: str, c: int):
        x, y = rows.get(a, {}).get(c, {}).get(field), rows.get(b, {}).get(c, {}).get(field)
        return round(x / y, 4) if x and y else None

    concurrencies = sorted({c for r in rows.values() for c in r})
    for c in concurrencies:
        point: dict = {}
        for n in tp_sizes:
            if n != 1:
                for name in (f"tp{n}", f"tp{n}_oneshot"):
                    layout = "ray-" + name.replace("_", "-")
                    point[f"{name}_vs_tp1_ar_step"] = ratio(layout, "ray-tp1", "ar_step_ms", c)
                    point[f"{name}_vs_tp1_dspark_step"] = ratio(layout, "ray-tp1", "dspark_step_ms", c)
        paired = rows.get("ray-tp1", {}).get(c, {})
        beside = {kind: paired.get(f"ray_vs_single_process_{kind}_step_paired") for kind in ("ar", "dspark")}
        for kind, value in beside.items():  # measured beside each other in the TP=1 layout's rounds, else across
            point[f"ray_tp1_vs_single_process_{kind}_step"] = round(value, 4) if value else ratio(
                "ray-tp1", "single-process", f"{kind}_step_ms", c)
        point["ray_tp1_vs_single_process_from"] = "alternating rounds in the ray-tp1 layout" \
            if any(beside.values()) else "separate layouts"
        separate = rows.get("ray-tp1-separate", {}).get(c, {})
        for field in ("step_vs_colocated", "throughput_vs_colocated", "throughput_vs_serial"):
            if field in separate:
                point[f"separate_{field}"] = separate[field]
        out[c] = {k: v for k, v in point.items() if v is not None}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON record")
    parser.add_argument("--model-shape", default="qwen3-8b", help="dspark bench --model-shape (default qwen3-8b)")
    parser.add_argument("--tensor-parallel-sizes", default="1,2", help="comma-separated Ray replica TP sizes "
                        "(default 1,2; 1 is always included: the ratios' reference)")
    parser.add_argument("--concurrency", default="1,64", help="dspark bench --concurrency (default 1,64)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per point (default 30)")
    parser.add_argument("--kv-cache-gib", type=float, default=16, help="KV cache per engine (default 16)")
    parser.add_argument("--draft-layers", type=int, default=1, help="dspark bench --draft-layers: the random "
                        "drafter's depth (default 1; DeepSpec's Qwen3 DSpark drafter has 5, which is what a separate "
                        "drafter's GPU can take off the target's)")
    parser.add_argument("--no-separate", action="store_true", help="leave out the separate-drafter layout")
    parser.add_argument("--e2e-prompts", type=int, default=0, help="every TP layout also decodes N prompts "
                        "greedily beside the one-process engine (bf16: the share of identical outputs and where "
                        "each first differs, under agreement)")
    parser.add_argument("--layouts", help="comma-separated layout names to run, of those the other flags give "
                        "(default: all; e.g. ray-tp1,ray-tp2-oneshot to fit one host command)")
    parser.add_argument("--no-oneshot", action="store_true", help="leave out the TP layouts with the one-shot "
                        "all-reduce (allreduce_strategy ONESHOT; by default each TP size above 1 runs with it too)")
    parser.add_argument("--sequential", action="store_true", help="dspark bench --sequential in every layout: the "
                        "single-process layout's engines one at a time (a target too large for two on one GPU, "
                        "e.g. qwen3-30b-a3b; a replica's always are)")
    parser.add_argument("--profile", action="store_true", help="dspark bench --profile in every layout: a torch "
                        "profile of batch-1 steps (on every rank of a replica) in each layout's record")
    args = parser.parse_args()
    try:
        tp_sizes = sorted({1, *(int(x) for x in args.tensor_parallel_sizes.split(","))})
    except ValueError:
        parser.error(f"--tensor-parallel-sizes wants integers separated by commas, got {args.tensor_parallel_sizes!r}")
    if min(tp_sizes) < 1:
        parser.error(f"--tensor-parallel-sizes must be >= 1, got {args.tensor_parallel_sizes!r}")
    import torch

    gpus = torch.cuda.device_count()
    planned = layouts(tp_sizes, not args.no_separate, gpus, not args.no_oneshot, args.e2e_prompts)
    if args.layouts:
        wanted = args.layouts.split(",")
        unknown = sorted(set(wanted) - {name for name, _, _ in planned})
        if unknown:
            parser.error(f"--layouts: no layout {unknown} in this run; its layouts: {[n for n, _, _ in planned]}")
        planned = [layout for layout in planned if layout[0] in wanted]
    if gpus < 1:
        print("tp_scaling.py: needs a GPU", file=sys.stderr)
        return 2
    records: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    commands: dict[str, str] = {}

    def write() -> dict:
        record = {"benchmark": "tp_scaling", "date": str(date.today()),
                  "command": "python3 benchmarks/tp_scaling.py " + shlex.join(sys.argv[1:]),
                  "hardware": f"{gpus}x {torch.cuda.get_device_name(0)}", "model": args.model_shape,
                  "kind": "random-shape", "layout_commands": commands, "skipped": skipped,
                  "ratios": ratios(records, tp_sizes), "agreement": {
                      name: rec["end_to_end"]["replica_vs_single_process"] for name, rec in records.items()
                      if "replica_vs_single_process" in rec.get("end_to_end", {})}, "layouts": records}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        return record

    with tempfile.TemporaryDirectory(prefix="dspark-tp-") as tmp:
        for name, flags, need in planned:
            if flags is None:
                skipped[name] = f"needs {need} GPUs, the host has {gpus}"
                continue
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "cluster.cli", "bench", "--model-shape", args.model_shape,
                   "--concurrency", args.concurrency, "--steps", str(args.steps), "--kv-cache-memory",
                   f"{args.kv_cache_gib:g}GiB", "--draft-layers", str(args.draft_layers), *flags,
                   *(["--profile"] if args.profile else []), *(["--sequential"] if args.sequential else []),
                   "--out", str(out)]
            commands[name] = "dspark " + shlex.join(cmd[3:])
            print(f"tp_scaling.py: {name}: {commands[name]}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, cwd=ROOT)
            if done.returncode != 0 or not out.exists():
                skipped[name] = f"dspark bench exited {done.returncode}"
                continue
            records[name] = json.loads(out.read_text())
            write()  # after every layout: a run cut short keeps what it measured
        record = write()
    print(json.dumps({"ratios": record["ratios"], "skipped": skipped}, indent=1))
    for name, rec in records.items():
        for row in rec.get("runs", []):
            print(f"{name} c={row['concurrency']}: AR {row.get('ar_step_ms')} ms, DSpark {row.get('dspark_step_ms')} ms",
                  file=sys.stderr)
    return 0 if not any(v.startswith("dspark bench exited") for v in skipped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
