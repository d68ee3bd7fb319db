"""The built-in demo pair: a small code model and its DSpark drafter, built on a CPU in minutes.

Steps: a byte-level BPE tokenizer and a Qwen3-architecture target trained on the shipped corpus
(``demo_corpus``: 3 MiB of standard-library sources); the target answers code prompts
(self-distillation); a 1-layer drafter (K=4, vanilla Markov head, confidence head) is trained on those
answers; greedy acceptance is measured on held-out files' prompts, and speculative output is checked
against plain output. Cached under ``$DSPARK_CACHE`` (default ``~/.cache/dspark``).

Invariant: the build is deterministic. It trains a fixed number of steps (``DemoPlan``) with fixed
seeds on a fixed corpus, with torch held to ``BUILD_THREADS`` intra-op threads (a CPU reduction's
order, hence its rounding, depends on the thread count), so the same pair comes out on every machine
of the same torch version and CPU kind. A slow machine takes longer; it never trains less. The time
taken is reported (``build_seconds``), not enforced.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from configs.training import DrafterTrainConfig, TargetTrainConfig
from runtime.llm import LLM
from runtime.training.demo_corpus import CORPUS_BYTES, CORPUS_SHA256, unpack_corpus
from runtime.training.distill import code_prompts, evaluate, regenerate
from runtime.training.drafter_trainer import train_drafter
from runtime.training.target_trainer import source_files, split, train_target

VERSION = "v2"
BLOCK = 4
# torch intra-op threads of every stage: fixed, so results do not depend on the machine. One: this model's GEMMs are
# too small for a second thread to pay (the full build alone on a 2-core host: 342 s with one thread, 362 s with two,
# the same weights bit for bit; before, it ran two), and the second core stays free for whatever else the machine
# runs (the test suite's other worker)
BUILD_THREADS = 1
ENGINE = dict(dtype="float32", device="cpu", num_pages=2048, page_size=16, max_num_seqs=128)
TARGET = TargetTrainConfig(out="", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                           max_len=128, max_corpus_bytes=CORPUS_BYTES, batch_size=16, steps=700, lr=3e-3,
                           device="cpu")
DRAFTER = dict(block_size=BLOCK, num_draft_layers=1, markov_rank=32, max_len=80, batch_size=16, num_anchors=24,
               lr=2e-3, device="cpu", log_every=50, save_every=10_000)


@dataclass(frozen=True)
class DemoPlan:
    """How much the build does: optimizer steps of each model and prompt counts of each stage."""

    target_steps: int = 700
    drafter_steps: int = 1000
    distill_prompts: int = 384
    distill_tokens: int = 40
    eval_prompts: int = 24
    eval_tokens: int = 48


DEMO_PLAN = DemoPlan()
# Greedy mean acceptance length the DEMO_PLAN build reaches (torch 2.13, x86-64 CPU; tests/test_demo.py checks it).
EXPECTED_ACCEPTANCE = 2.812


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark").expanduser()


def demo_dir() -> Path:
    return cache_root() / f"demo-{VERSION}"


def cached_demo(root: Path | None = None) -> dict | None:
    """The finished demo's record, or None when it has not been built (or is incomplete)."""
    record = (root or demo_dir()) / "demo.json"
    if not record.is_file():
        return None
    data = json.loads(record.read_text())
    if not all((Path(data[k]) / "config.json").is_file() for k in ("target", "drafter")):
        return None
    return data


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_demo(progress: bool = True, plan: DemoPlan = DEMO_PLAN, root: Path | None = None) -> dict:
    """Build the demo pair under ``root`` (default ``demo_dir()``), or return the cached one; returns its
    JSON record. Deterministic (see the module docstring)."""
    root = root or demo_dir()
    found = cached_demo(root)
    if found is not None:
        return found
    start = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "drafter", ignore_errors=True)  # an interrupted build's checkpoint would resume
    corpus = unpack_corpus(root / "corpus")
    target = str(root / "target")
    with torch_threads(BUILD_THREADS):
        target_cfg = TARGET.model_copy(update={"out": target, "data": str(corpus), "steps": plan.target_steps})
        target_stats = train_target(target_cfg, progress=progress)
        train_files, heldout = split(source_files(str(corpus), TARGET.max_corpus_bytes), TARGET.heldout_every)
        tokenizer = AutoTokenizer.from_pretrained(target)
        distill = root / "distill.jsonl"
        regenerate(LLM(target, **ENGINE), code_prompts(train_files, tokenizer, plan.distill_prompts, 24, seed=1),
                   distill, max_tokens=plan.distill_tokens)
        drafter = str(root / "drafter")
        drafter_cfg = DrafterTrainConfig(target=target, data=str(distill), out=drafter, steps=plan.drafter_steps,
                                         **DRAFTER)
        drafter_stats = train_drafter(drafter_cfg, progress=progress)
        result = evaluate(target, drafter, code_prompts(heldout, tokenizer, plan.eval_prompts, 24, seed=2), BLOCK,
                          0.0, plan.eval_tokens, check_parity=True, **ENGINE)
    record = {"target": target, "drafter": drafter, "version": VERSION,
              "mean_acceptance_length": result["mean_acceptance_length"],
              "acceptance_per_position": result["acceptance_per_position"],
              "greedy_equals_plain": result["greedy_equals_plain"], "max_draft_len": BLOCK, "temperature": 0.0,
              "build_seconds": time.monotonic() - start, "plan": asdict(plan), "threads": BUILD_THREADS,
              "torch": torch.__version__, "corpus_sha256": CORPUS_SHA256, "target_training": target_stats,
              "drafter_training": {k: drafter_stats[k] for k in ("step", "seconds", "loss", "accept_len")}}
    (root / "demo.json").write_text(json.dumps(record, indent=2))
    return record
