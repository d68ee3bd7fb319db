"""The CPU's few-row GEMM choice (``runtime.worker.cpu_gemm``) on the demo pair, end to end: each engine's output
tokens/s with the measured choice installed and with every linear on ``F.linear``, alternating on the same engine.

Our autoregressive engine and our DSpark engine (the shipped drafter, the engine's defaults) load once each; at each
concurrency both serve ``--requests`` real prompts (the evaluation sets' first turns, ``e2e_bench.real_prompts``)
closed-loop to EOS or ``--max-tokens``, in ``--rounds`` rounds that alternate the two GEMM ways (the order flips each
round): the ratio of each engine's tokens/s with the choice to without it is paired by round. The greedy tokens are
checked equal between the two ways (the choice may change how a value rounds in the last bit, which on these prompts
changes no token). The record holds each shape's measured milliseconds (the engine's ``cpu_gemms``).

usage: python3 benchmarks/cpu_gemm.py --out benchmarks/results/DATE-cpu-gemm-smollm2.json [--concurrency 1,4]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def cpu_linears(llm) -> list:
    from runtime.worker.cpu_gemm import CpuLinear

    worker = llm.engine.executor.worker
    models = [m for m in (worker.target, worker.drafter, worker.vocab) if m is not None]
    return list({id(m): m for model in models for m in model.modules() if isinstance(m, CpuLinear)}.values())


def set_way(linears: list, chosen: dict, measured: bool) -> None:
    """Every ``CpuLinear`` follows its measured choice, or (``measured`` False) takes F.linear at every row count."""
    from runtime.worker.cpu_gemm import CpuGemmChoice

    for linear in linears:
        linear.choice = chosen[id(linear)] if measured else CpuGemmChoice(frozenset())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--drafter", default="smollm2-dspark")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from e2e_bench import closed_loop, real_prompts

    from runtime import LLM, SamplingParams
    from runtime.engine.heap import freeze_long_lived

    engines = {"ar": LLM(args.model, device="cpu", dtype="float32"),
               "dspark": LLM(args.model, device="cpu", dtype="float32",
                             speculative_config={"speculative_model": args.drafter})}
    freeze_long_lived("the benchmark's engines")  # as a server does once started (runtime.engine.heap)
    prompts = real_prompts(engines["ar"].tokenizer, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    linears = {name: cpu_linears(llm) for name, llm in engines.items()}
    chosen = {id(m): m.choice for found in linears.values() for m in found}
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        row = {"concurrency": concurrency, "requests": args.requests}
        for name, llm in engines.items():
            rates = {True: [], False: []}
            for r in range(args.rounds):
                for measured in ((True, False) if r % 2 == 0 else (False, True)):
                    set_way(linears[name], chosen, measured)
                    rates[measured].append(closed_loop(llm.engine, prompts, concurrency, params)["tokens_per_s"])
            set_way(linears[name], chosen, True)
            row[f"{name}_tokens_per_s"] = statistics.fmean(rates[True])
            row[f"{name}_linear_tokens_per_s"] = statistics.fmean(rates[False])
            row[f"{name}_over_linear_paired"] = statistics.fmean(a / b for a, b in zip(rates[True], rates[False]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the same greedy tokens either way (a few prompts, each engine)
    same = {}
    for name, llm in engines.items():
        outs = {}
        for measured in (True, False):
            set_way(linears[name], chosen, measured)
            outs[measured] = [o.token_ids for o in llm.generate(prompts[:4], params, use_tqdm=False)]
        set_way(linears[name], chosen, True)
        same[name] = outs[True] == outs[False]
    record = {"benchmark": "cpu_gemm", "date": str(date.today()), "model": args.model, "drafter": args.drafter,
              "hardware": f"cpu ({platform.processor() or 'x86'}), torch {__import__('torch').__version__}",
              "host": platform.node(), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "command": "python3 benchmarks/cpu_gemm.py " + shlex.join(sys.argv[1:]),
              "same_greedy_tokens": same, "rows": rows,
              "cpu_gemms": engines["ar"].engine.executor.describe()[0]["cpu_gemms"],  # (measured by the first)
              "finished": time.strftime("%H:%M:%S")}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
