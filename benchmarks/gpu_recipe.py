"""The GPU recipe: a small code target, its DSpark drafter and a DFlash baseline, evaluated at K=7.

Every stage is time-boxed so the whole recipe fits one 10-minute run on one H200, and stages chain: a rerun
with the same ``--work`` skips finished stages (``--stages`` picks some) and resumes the drafters, so several
back-to-back runs on a warm machine train longer:
  1. train-target: ~27M-parameter Qwen3-architecture model + byte-level BPE on the stdlib sources
  2. regenerate: the target answers code prompts greedily (self-distillation)
  3. train-drafter twice on the same data (the distilled answers plus the training files' text) and budget: DSpark (2 layers, vanilla Markov head rank 64,
     confidence head, DeepSpec loss) and DFlash (Markov rank 0, cross-entropy only)
  4. evaluate both on held-out files' prompts at K=7, temperature 0 and 1
Writes one JSON record (stage timings, tau, per-position acceptance).

usage: python benchmarks/gpu_recipe.py --out results.json --work /tmp/recipe
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.training import DrafterTrainConfig, TargetTrainConfig  # noqa: E402
from runtime.training.distill import code_prompts, evaluate, regenerate  # noqa: E402
from runtime.training.drafter_trainer import train_drafter  # noqa: E402
from runtime.training.target_trainer import source_files, split, train_target  # noqa: E402

K = 7
ENGINE = dict(dtype="bfloat16", device="cuda", kv_cache_memory=16 << 30, max_num_seqs=256,
              max_num_batched_tokens=8192)


STAGES = ("target", "distill", "dspark", "dflash", "eval")


def target_config(work: Path, args) -> TargetTrainConfig:
    cfg = TargetTrainConfig(out=str(work / "target"), vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8,
                            num_kv_heads=4, intermediate_size=1536, max_len=512, max_corpus_bytes=24 << 20,
                            batch_size=48, steps=args.target_steps, max_seconds=args.target_seconds, lr=2e-3,
                            device=ENGINE["device"])
    if args.smoke:
        cfg = cfg.model_copy(update=dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                                         intermediate_size=128, max_len=64, max_corpus_bytes=1 << 19, batch_size=4,
                                         steps=5))
    return cfg


def drafter_configs(work: Path, target: str, data: Path, args) -> dict[str, DrafterTrainConfig]:
    common = dict(target=target, data=str(data), block_size=K, max_len=256, batch_size=32, num_anchors=64,
                  steps=5 if args.smoke else args.drafter_steps, max_seconds=args.drafter_seconds, lr=1e-3,
                  device=ENGINE["device"], log_every=100, save_every=2000)
    return {"dspark": DrafterTrainConfig(out=str(work / "dspark"), num_draft_layers=2, markov_rank=64,
                                         markov_head_type="vanilla", **common),
            "dflash": DrafterTrainConfig(out=str(work / "dflash"), num_draft_layers=2, markov_rank=0,
                                         confidence_head=False, ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0,
                                         **common)}


def distill(work: Path, target: str, train_files, tokenizer, args) -> Path:
    """Self-distilled answers plus the training files' own text (held-out files excluded): the L1 term distills
    the target's distribution at every position, so raw code is distillation data too, and far more of it."""
    answers, data = work / "distill.jsonl", work / "drafter-data.jsonl"
    regenerate(target, code_prompts(train_files, tokenizer, args.distill_prompts, 64, seed=1), answers,
               max_tokens=192, **ENGINE)
    with data.open("w") as f:
        f.write(answers.read_text())
        for path in train_files:
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--work", required=True, help="working directory; stages found done there are skipped, "
                        "drafters resume, so back-to-back runs on a warm machine chain")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--target-seconds", type=float, default=200)
    parser.add_argument("--target-steps", type=int, default=6000)
    parser.add_argument("--drafter-seconds", type=float, default=75, help="training time per drafter per run")
    parser.add_argument("--drafter-steps", type=int, default=20000, help="total steps a drafter trains to")
    parser.add_argument("--distill-prompts", type=int, default=1536)
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, to check the script runs")
    args = parser.parse_args()
    if args.smoke:
        ENGINE.update(dtype="float32", device="cpu", kv_cache_memory=1 << 28)
    wanted = set(args.stages.split(","))
    if not wanted <= set(STAGES):
        raise SystemExit(f"--stages: choose from {','.join(STAGES)}")
    work, t0 = Path(args.work), time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    stages_file = work / "stages.json"
    stages = json.loads(stages_file.read_text()) if stages_file.is_file() else {}
    target_cfg = target_config(work, args)
    if "target" in wanted and "target" not in stages:
        stages["target"] = train_target(target_cfg, progress=False)
        stages_file.write_text(json.dumps(stages))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_cfg.out)
    train_files, heldout = split(source_files(None, target_cfg.max_corpus_bytes), target_cfg.heldout_every)
    data = work / "drafter-data.jsonl"
    if "distill" in wanted and "distill" not in stages:
        start = time.monotonic()
        data = distill(work, target_cfg.out, train_files, tokenizer, args)
        stages["distill"] = {"seconds": time.monotonic() - start, "prompts": args.distill_prompts}
        stages_file.write_text(json.dumps(stages))
    drafters = drafter_configs(work, target_cfg.out, data, args)
    for name, cfg in drafters.items():
        if name in wanted:
            stages[f"train-{name}"] = train_drafter(cfg, progress=False)  # resumes a previous run's checkpoint
            stages_file.write_text(json.dumps(stages))
    gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    record = {"benchmark": "gpu_recipe", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python", *sys.argv]), "hardware": {"gpus": gpu},
              "software": {"torch": torch.__version__, "python": platform.python_version()},
              "max_draft_len": K, "stages": stages, "results": {}}
    if "eval" in wanted:
        prompts = code_prompts(heldout, tokenizer, args.eval_prompts, 64, seed=2)
        for name, cfg in drafters.items():
            record["results"][name] = {f"t={t}": evaluate(target_cfg.out, cfg.out, prompts, K, t, 128, **ENGINE)
                                       for t in (0.0, 1.0)}
            Path(args.out).write_text(json.dumps(record, indent=2))  # partial records survive a timeout
        results = record["results"]
        record["dspark_over_dflash_tau"] = {t: results["dspark"][t]["mean_acceptance_length"]
                                            / results["dflash"][t]["mean_acceptance_length"] for t in results["dspark"]}
    record["total_seconds"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({"tau": {n: {t: round(r[t]["mean_acceptance_length"], 3) for t in r}
                              for n, r in record["results"].items()},
                      "gain": record.get("dspark_over_dflash_tau"), "total_seconds": record["total_seconds"]},
                     indent=1))


if __name__ == "__main__":
    main()
