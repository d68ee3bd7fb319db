"""The recipe of ``smollm2-dspark``: a DSpark drafter for SmolLM2-135M-Instruct, trained by self-distillation.

One command reproduces the shipped checkpoint, on a GPU or on a CPU (``--scale``; auto picks by the device):
  1. prompts: the training prompt sets of ``benchmarks/data/train`` (arena-hard-v2, livecodebench, SWE-bench Lite;
     never the evaluation sets of ``benchmarks/data/eval``), arithmetic word problems filled from templates, and
     math problems, Python exercises and assistant questions the target writes itself on random topics (their places
     in the shuffled list are set here; the target writes each chunk's just before answering it, so a time-boxed
     answers stage spends no time writing prompts it never answers)
  2. answers: the target answers every prompt through the engine (its chat template, non-thinking as DeepSpec
     regenerates answers): greedily, and on the GPU scale also sampled three times (temperature 0.7 and top-p 0.8
     twice, temperature 1 once). Prompt chunks
     get steps of their own (enable_mixed_prefill off): the torch attention kernels pad every row of a step to its
     longest query, so a prompt chunk beside hundreds of decoding requests would multiply the work
  3. train: each variant with ``dspark train-drafter``'s trainer on the same answers and budget: DSpark drafters
     (vanilla Markov head, confidence head, DeepSpec's loss) of 1 and 3 layers and DFlash-style baselines (no
     Markov head, no confidence head, cross-entropy only), capture layers [1, 8, 14, 21, 27], block 7, MASK
     <empty_output> (id 16). The CPU scale caches the target's states once (``target_cache``) and trains less.
  4. export (``--export DIR``): the chosen variant in bfloat16, DeepSpec layout (what ``smollm2-dspark`` names)
Stages already done in ``--work`` are skipped (``--stages`` picks some), so a run can be split over several calls.

usage: python benchmarks/smollm2_drafter.py --work /tmp/smollm2 [--scale auto|gpu|cpu] [--variants dspark-1,...]
       [--seed N] [--init-from DRAFTER] [--export runtime/pretrained/smollm2-dspark --export-variant dspark-1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN_SETS = ("arena-hard-v2", "livecodebench", "swe-bench")
LAYER_IDS = [1, 8, 14, 21, 27]  # five of SmolLM2's 30 layers, evenly spaced from 1 to L - 3 (z-lab's rule)
MASK_TOKEN_ID = 16  # <empty_output>, a special token chat never uses
BLOCK = 7
ANSWER_CHUNK = 512  # prompts answered per chunk of the answers stage (the unit a time box or a rerun resumes at)
MARKOV_RANK = 64  # the shipped drafter must stay under 25 MB in bfloat16: the head is 2 x 49,152 x rank
VARIANTS = {
    "dspark-1": dict(num_draft_layers=1, markov_rank=MARKOV_RANK, confidence_head=True),
    "dspark-3": dict(num_draft_layers=3, markov_rank=MARKOV_RANK, confidence_head=True),
    "dflash-1": dict(num_draft_layers=1, markov_rank=0, confidence_head=False, ce_weight=1.0, l1_weight=0.0),
    "dflash-3": dict(num_draft_layers=3, markov_rank=0, confidence_head=False, ce_weight=1.0, l1_weight=0.0),
}


@dataclass(frozen=True)
class Scale:
    """How much each stage does."""

    template_math: int
    written: dict[str, int]  # prompts the target writes, per kind
    samplings: list[tuple[float, float]]  # (temperature, top_p) per answer of a prompt
    max_tokens: int
    max_prompt_tokens: int
    engine: dict
    epochs: float
    train: dict = field(default_factory=dict)
    train_prompts: int | None = None  # a random subset of the training sets' prompts (None: all)


SCALES = {
    # one H100 with the FlashInfer kernels: the target answers ~20k prompts x 4 in minutes (the answers stage is
    # time-boxed by --answer-seconds); a variant trains ~3 steps of 32 a second alone (--train-budget fits its
    # learning-rate schedule to the time given; variants may train side by side on one GPU)
    "gpu": Scale(template_math=6000, written={"math": 1500, "code": 1500, "chat": 2000},
                 samplings=[(0.0, 1.0), (0.7, 0.8), (0.7, 0.8), (1.0, 1.0)], max_tokens=512, max_prompt_tokens=1024,
                 engine=dict(dtype="bfloat16", device="cuda", max_num_seqs=512, kv_cache_memory=48 << 30,
                             max_num_batched_tokens=16384, max_model_len=1536, enable_mixed_prefill=False),
                 epochs=4.0, train=dict(batch_size=32, max_len=1536, num_anchors=64, lr=6e-4, dtype="float32",
                                        target_dtype="bfloat16", autocast="bfloat16", device="cuda")),
    # about an hour on two cores: the torch kernels' prefill and the target's forward dominate (~900 tokens/s)
    "cpu": Scale(template_math=400, written={"math": 100, "code": 100, "chat": 100}, samplings=[(0.0, 1.0)],
                 max_tokens=192, max_prompt_tokens=384, train_prompts=800,
                 engine=dict(dtype="float32", device="cpu", max_num_seqs=96, kv_cache_memory=6 << 30,
                             max_num_batched_tokens=4096, max_model_len=1024, enable_mixed_prefill=False),
                 epochs=2.0, train=dict(batch_size=4, max_len=1024, num_anchors=32, lr=6e-4, dtype="float32",
                                        target_dtype="float32", device="cpu")),
}


def conversations(scale: Scale, seed: int) -> list[dict]:
    """Stage 1: every prompt as ``{"source", "messages"}``, or, for one the target is to write, ``{"source",
    "write": kind}`` (``written_in``)."""
    from runtime.training.prompt_sets import read_turns, template_math_problems

    rows = []
    for name in TRAIN_SETS:
        for turns in read_turns(ROOT / "benchmarks" / "data" / "train" / f"{name}.jsonl"):
            rows.append({"source": name, "messages": [{"role": "user", "content": turns[0]}]})
    if scale.train_prompts is not None:
        rows = random.Random(seed).sample(rows, min(scale.train_prompts, len(rows)))
    for text in template_math_problems(scale.template_math, seed):
        rows.append({"source": "template-math", "messages": [{"role": "user", "content": text}]})
    for kind, count in scale.written.items():
        rows.extend({"source": f"written-{kind}", "write": kind} for _ in range(count))
    random.Random(seed).shuffle(rows)
    return rows


def written_in(llm, rows: list[dict], seed: int) -> list[dict]:
    """``rows`` with each prompt the target is to write written (``write_prompts``, every kind in one batch, the
    seed per kind and chunk); a written prompt that came out unusable (empty, too long, a repeat) is dropped."""
    from runtime.training.self_distill import write_prompts

    wanted: dict[str, int] = {}
    for row in rows:
        if "write" in row:
            wanted[row["write"]] = wanted.get(row["write"], 0) + 1
    kinds = {kind: (wanted[kind], seed + 1000 * (k + 1)) for k, kind in enumerate(sorted(wanted))}
    written = {kind: iter(texts) for kind, texts in write_prompts(llm, kinds).items()}
    out = []
    for row in rows:
        if "write" not in row:
            out.append(row)
            continue
        text = next(written[row["write"]], None)
        if text is not None:
            out.append({"source": row["source"], "messages": [{"role": "user", "content": text}]})
    return out


def stage(work: Path, name: str, wanted: set[str], run) -> dict:
    """Run ``run()`` unless ``WORK/stage-NAME.json`` records it done (or the stage is not wanted); its record. A
    result with ``"finished": False`` (a time box ran out) is not recorded: the next run resumes the stage."""
    record = work / f"stage-{name}.json"
    if record.is_file():
        return json.loads(record.read_text())
    if name.split(":")[0] not in wanted:
        return {}
    start = time.monotonic()
    result = {**run(), "seconds": round(time.monotonic() - start, 1)}
    if result.get("finished", True):
        record.write_text(json.dumps(result, indent=2))
    print(json.dumps({name: result}), flush=True)
    return result


def train_variant(name: str, scale: Scale, work: Path, rows: int, seed: int, budget: float | None,
                  init_from: Path | None = None, states_in_memory: bool = False) -> dict:
    """Train (or resume) one variant for ``scale.epochs`` over the answers or, if sooner, ``budget`` seconds in all
    (its learning-rate schedule fitted to whichever ends first), from ``init_from``'s weights where given; the
    target's states from a folder on a CPU, from the GPU's memory with ``states_in_memory``, else live."""
    from configs.training import DrafterTrainConfig
    from runtime.training.drafter_trainer import train_drafter

    steps = max(1, math.ceil(scale.epochs * rows / scale.train["batch_size"]))
    cache = {}
    if scale.train["device"] == "cpu":
        cache = {"target_cache": str(work / "target-states")}
    elif states_in_memory:
        cache = {"target_cache_in_memory": True}
    cfg = DrafterTrainConfig(target="smollm2", data=str(work / "answers.jsonl"), out=str(work / name),
                             block_size=BLOCK, target_layer_ids=LAYER_IDS, mask_token_id=MASK_TOKEN_ID, steps=steps,
                             seed=seed, log_every=100, save_every=max(steps // 4, 100), time_budget_s=budget,
                             init_from=None if init_from is None else str(init_from), **cache,
                             **scale.train, **VARIANTS[name])
    stats = train_drafter(cfg)
    return {"config": cfg.model_dump(), "finished": stats["finished"],
            **{k: stats.get(k) for k in ("step", "loss", "accept_len", "seconds_in_all")}}


SHIPPED_BYTES = 25 << 20  # the most a drafter committed to the repository may weigh


def export(work: Path, variant: str, dest: Path, max_bytes: int | None = SHIPPED_BYTES) -> dict:
    """The trained variant in bfloat16 into ``dest`` (config.json, model.safetensors); refuses more than
    ``max_bytes``."""
    import torch
    from safetensors.torch import load_file, save_file

    source = work / variant
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(source / "model.safetensors")).items()}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_bytes is not None and size > max_bytes:
        raise SystemExit(f"export: {variant} is {size / 2**20:.1f} MiB in bfloat16, over the {max_bytes / 2**20:g} "
                         "MiB a shipped drafter may weigh")
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["_name_or_path"] = "smollm2"  # (not the converted target's cache folder on the training machine)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return {"variant": variant, "bytes": size, "dest": str(dest)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--work", required=True, help="folder for every stage's output (rerun to resume)")
    parser.add_argument("--scale", choices=["auto", *SCALES], default="auto", help="gpu or cpu sizes (default: "
                        "gpu where CUDA is available)")
    parser.add_argument("--stages", default="prompts,answers,train", help="stages to run (default all but export)")
    parser.add_argument("--variants", default="dspark-1,dflash-1,dspark-3",
                        help=f"drafters to train, of {', '.join(VARIANTS)}")
    parser.add_argument("--export", type=Path, help="write the --export-variant drafter here in bfloat16")
    parser.add_argument("--export-variant", default="dspark-1", choices=list(VARIANTS))
    parser.add_argument("--answer-seconds", type=float, help="start no new chunk of answers once this many seconds "
                        "have passed since the command started: training uses the chunks done, and a rerun with the "
                        "same --work answers the rest")
    parser.add_argument("--train-budget", type=float, help="train each variant for at most this many seconds in "
                        "all (summed over reruns with the same --work): its learning-rate schedule anneals by then")
    parser.add_argument("--init-from", type=Path, help="start every variant from this trained drafter of its shape "
                        "(e.g. the shipped smollm2-dspark, trained further on answers of another --seed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts the target writes, the sampled "
                        "answers and the training")
    parser.add_argument("--states-in-memory", action="store_true", help="gpu scale: hold the target's states of "
                        "every answer in the GPU's memory (one pass of the target before training, then none a step; "
                        "target_cache_in_memory) instead of running the target on every batch; for a variant that "
                        "has the GPU alone (the cpu scale keeps them in a folder already)")
    args = parser.parse_args(argv)
    started = time.monotonic()

    import logging

    import torch

    from runtime.engine.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from runtime.training.self_distill import Sampling, answer_prompts

    scale_name = args.scale if args.scale != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    scale = SCALES[scale_name]
    if args.states_in_memory and scale.train["device"] == "cpu":
        parser.error("--states-in-memory: the cpu scale keeps the target's states in a folder already")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    wanted = set(args.stages.split(","))
    llm = None

    def engine():
        nonlocal llm
        llm = llm or LLM("smollm2", **scale.engine)
        return llm

    def make_prompts():
        rows = conversations(scale, args.seed)
        with (work / "prompts.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["source"]] = counts.get(r["source"], 0) + 1
        return {"scale": scale_name, "prompts": len(rows), "by_source": counts}

    def make_answers():
        """In chunks of ``ANSWER_CHUNK`` prompts, each its own file, so an interrupted stage keeps what it wrote."""
        rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().split("\n") if line]
        samplings = [Sampling(t, p) for t, p in scale.samplings]
        totals: dict[str, int] = {}
        chunks = []
        finished = True
        for c, lo in enumerate(range(0, len(rows), ANSWER_CHUNK)):
            part = work / f"answers-{c:03d}.jsonl"
            done = work / f"answers-{c:03d}.json"
            if not done.is_file() and args.answer_seconds is not None and \
                    time.monotonic() - started > args.answer_seconds:
                finished = False
                continue
            if not done.is_file():
                # (the chunk's own seeds for the prompts the target writes: 10,000 apart, past any kind's requests)
                chunk = written_in(engine(), rows[lo:lo + ANSWER_CHUNK], args.seed + 10_000 * (c + 1))
                counts = answer_prompts(engine(), chunk, samplings, scale.max_tokens, scale.max_prompt_tokens, part,
                                        args.seed + lo * len(samplings), progress=True)
                counts["written_dropped"] = len(rows[lo:lo + ANSWER_CHUNK]) - len(chunk)
                done.write_text(json.dumps(counts))
            for k, v in json.loads(done.read_text()).items():
                totals[k] = totals.get(k, 0) + v
            chunks.append(part)
        with (work / "answers.jsonl").open("w") as f:
            for part in chunks:
                f.write(part.read_text())
        return {"scale": asdict(scale), **totals, "chunks": len(chunks), "finished": finished}

    records = {"prompts": stage(work, "prompts", wanted, make_prompts)}
    records["answers"] = stage(work, "answers", wanted, make_answers)
    del llm  # the engine's KV pages go before training
    llm = None
    if "train" in wanted:
        rows = sum(1 for _ in (work / "answers.jsonl").open())
        for name in variants:
            records[name] = stage(work, f"train:{name}", wanted, lambda n=name: train_variant(
                n, scale, work, rows, args.seed, args.train_budget, args.init_from, args.states_in_memory))
    if args.export is not None:
        records["export"] = export(work, args.export_variant, args.export)
    (work / "recipe.json").write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
