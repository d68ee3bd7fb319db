"""Acceptance on real text: tau of a drafter at K drafts on the evaluation prompt sets (DSpark's Table 1).

Each prompt of ``benchmarks/data/eval`` (GSM8K, MT-Bench, HumanEval, MBPP) goes through the target's chat template
and is answered with speculation, up to ``--max-tokens`` tokens, stopping at EOS, greedily (T=0) and sampled
(T=1, verified by rejection sampling against the drafter's Markov-corrected probabilities, as DeepSpec's evaluator
does). MT-Bench's second turn follows the model's own first answer, and both turns count. tau is the mean number of
tokens a verify step commits (accepted drafts + the target's own token), from the engine's speculative counters over
each dataset; per-position acceptance beside it.

Writes ``{"kind": "acceptance", "model", "drafter", "max_draft_len", "command", "date", "hardware",
"datasets": {name: {"tau_t0", "tau_t1", "prompts", ...}}}``.

usage: python benchmarks/acceptance.py --drafter smollm2-dspark --out benchmarks/results/acceptance.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASETS = ("gsm8k", "mt-bench", "humaneval", "mbpp")


def counters(llm) -> tuple[int, int, list[int]]:
    m = llm.get_metrics()
    return m["num_drafts"], m["num_accepted_tokens"], list(m["num_accepted_tokens_per_pos"])


def run_dataset(llm, rows: list[list[str]], temperature: float, max_tokens: int, seed: int) -> dict:
    """Answer every row's turns in order (each later turn after the model's own earlier answers); tau over all."""
    from runtime import SamplingParams

    drafts0, accepted0, per_pos0 = counters(llm)
    conversations: list[list[dict]] = [[] for _ in rows]
    tokens = turns_done = 0
    start = time.monotonic()
    for turn in range(max(len(r) for r in rows)):
        active = [i for i, r in enumerate(rows) if turn < len(r)]
        for i in active:
            conversations[i].append({"role": "user", "content": rows[i][turn]})
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + 1000 * turn + i)
                  for i in active]
        outs = llm.chat([conversations[i] for i in active], params)
        for i, out in zip(active, outs):
            conversations[i].append({"role": "assistant", "content": out.text})
            tokens += len(out.token_ids)
        turns_done += len(active)
    drafts1, accepted1, per_pos1 = counters(llm)
    drafts, accepted = drafts1 - drafts0, accepted1 - accepted0
    per_pos = [b - (per_pos0[k] if k < len(per_pos0) else 0) for k, b in enumerate(per_pos1)]
    return {"tau": 1 + accepted / drafts if drafts else 1.0, "verify_steps": drafts, "output_tokens": tokens,
            "turns": turns_done, "acceptance_per_position": [round(n / max(drafts, 1), 4) for n in per_pos],
            "seconds": round(time.monotonic() - start, 1)}


def hardware(device: str) -> str:
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2", help="target (default smollm2)")
    parser.add_argument("--drafter", action="append", required=True,
                        help="drafter checkpoint or name; repeat to measure several on the same prompts")
    parser.add_argument("--datasets", default=",".join(DATASETS), help=f"of {', '.join(DATASETS)}")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    parser.add_argument("--max-draft-len", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--limit", type=int, help="the first N prompts of each dataset (default all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV budget (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON file to write (one record per drafter: a list when "
                        "several)")
    args = parser.parse_args(argv)

    from runtime import LLM
    from runtime.training.prompt_sets import read_turns

    names = [d for d in args.datasets.split(",") if d]
    unknown = sorted(set(names) - set(DATASETS))
    if unknown:
        parser.error(f"--datasets: unknown {unknown}; choose from {', '.join(DATASETS)}")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    data = {n: read_turns(ROOT / "benchmarks" / "data" / "eval" / f"{n}.jsonl")[:args.limit] for n in names}
    # prompt chunks in steps of their own: the torch kernels pad a mixed step's decode rows to the chunk's length
    engine = {"device": args.device, "max_num_seqs": args.max_num_seqs, "max_model_len": 4096,
              "enable_mixed_prefill": False}
    if args.kv_cache_gib:
        engine["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
    records = []
    for drafter in args.drafter:
        # every block verified whole: tau at max_draft_len (the guard would drop blocks where drafting does not pay)
        spec = {"speculative_model": drafter, "max_draft_len": args.max_draft_len, "use_rejection_sampling": True,
                "speculation_guard": False}
        llm = LLM(args.model, speculative_config=spec, **engine)
        datasets: dict[str, dict] = {n: {"prompts": len(rows)} for n, rows in data.items()}
        for temperature in temperatures:
            key = f"t{temperature:g}".replace(".", "_")
            for name, rows in data.items():
                result = run_dataset(llm, rows, temperature, args.max_tokens, args.seed)
                datasets[name][f"tau_{key}"] = round(result["tau"], 4)
                datasets[name][key] = result
                print(json.dumps({"drafter": drafter, "dataset": name, "temperature": temperature,
                                  "tau": round(result["tau"], 3), "seconds": result["seconds"]}), flush=True)
        records.append({"kind": "acceptance", "model": args.model, "drafter": drafter,
                        "max_draft_len": args.max_draft_len, "max_tokens": args.max_tokens,
                        "command": "python benchmarks/acceptance.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                  else argv),
                        "date": datetime.date.today().isoformat(), "hardware": hardware(args.device),
                        "dtype": str(llm.engine.config.dtype), "datasets": datasets})
        del llm
        # rewritten after each drafter: a run cut short keeps the drafters it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records[0] if len(args.drafter) == 1 else records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
