"""The built-in demo pair: a small code model and its DSpark drafter, built on a CPU in minutes.

Steps (each time-boxed so the whole build fits 5 minutes on 2 CPU cores): a byte-level BPE tokenizer
and a Qwen3-architecture target trained on this interpreter's standard-library sources; the target
answers code prompts (self-distillation); a 1-layer drafter (K=4, vanilla Markov head, confidence
head) is trained on those answers; greedy acceptance is measured on held-out files' prompts, and
speculative output is checked against plain output. Cached under ``$DSPARK_CACHE`` (default
``~/.cache/dspark``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transformers import AutoTokenizer

from configs.training import DrafterTrainConfig, TargetTrainConfig
from runtime.llm import LLM
from runtime.training.distill import code_prompts, evaluate, regenerate
from runtime.training.drafter_trainer import train_drafter
from runtime.training.target_trainer import source_files, split, train_target

VERSION = "v1"
BLOCK = 4
ENGINE = dict(dtype="float32", device="cpu", num_pages=2048, page_size=16, max_num_seqs=128)
TARGET = TargetTrainConfig(out="", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                           max_len=128, max_corpus_bytes=3 << 20, batch_size=16, steps=700, max_seconds=105,
                           lr=3e-3, device="cpu")
DRAFTER = dict(block_size=BLOCK, num_draft_layers=1, markov_rank=32, max_len=80, batch_size=16, num_anchors=24,
               steps=1000, max_seconds=80, lr=2e-3, device="cpu", log_every=50, save_every=10_000)


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark").expanduser()


def demo_dir() -> Path:
    return cache_root() / f"demo-{VERSION}"


def cached_demo() -> dict | None:
    """The finished demo's record, or None when it has not been built (or is incomplete)."""
    record = demo_dir() / "demo.json"
    if not record.is_file():
        return None
    data = json.loads(record.read_text())
    if not all((Path(data[k]) / "config.json").is_file() for k in ("target", "drafter")):
        return None
    return data


def build_demo(progress: bool = True) -> dict:
    """Build the demo pair (or return the cached one); returns its JSON record."""
    found = cached_demo()
    if found is not None:
        return found
    root, start = demo_dir(), time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    target = str(root / "target")
    target_stats = train_target(TARGET.model_copy(update={"out": target}), progress=progress)
    train_files, heldout = split(source_files(None, TARGET.max_corpus_bytes), TARGET.heldout_every)
    tokenizer = AutoTokenizer.from_pretrained(target)
    distill = root / "distill.jsonl"
    regenerate(LLM(target, **ENGINE), code_prompts(train_files, tokenizer, 384, 24, seed=1), distill, max_tokens=40)
    drafter = str(root / "drafter")
    drafter_stats = train_drafter(DrafterTrainConfig(target=target, data=str(distill), out=drafter, **DRAFTER),
                                  progress=progress)
    result = evaluate(target, drafter, code_prompts(heldout, tokenizer, 24, 24, seed=2), BLOCK, 0.0, 48,
                      check_parity=True, **ENGINE)
    record = {"target": target, "drafter": drafter, "version": VERSION,
              "mean_acceptance_length": result["mean_acceptance_length"],
              "acceptance_per_position": result["acceptance_per_position"],
              "greedy_equals_plain": result["greedy_equals_plain"], "max_draft_len": BLOCK, "temperature": 0.0,
              "build_seconds": time.monotonic() - start, "target_training": target_stats,
              "drafter_training": {k: drafter_stats[k] for k in ("step", "seconds", "loss", "accept_len")}}
    (root / "demo.json").write_text(json.dumps(record, indent=2))
    return record
