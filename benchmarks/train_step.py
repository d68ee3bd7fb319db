"""A drafter training step's time, DSpark against the DFlash-style baseline: ``python benchmarks/train_step.py``.

The SmolLM2 recipe's two 1-layer variants (``benchmarks/smollm2_drafter.py``: DSpark with its vanilla Markov head of
rank 64, confidence head and DeepSpec's loss; DFlash-style with neither head, cross-entropy only) take the same batch
(random token ids, every token supervised, random captured and final target states: the step's cost does not depend
on their values) through ``drafter_step`` and its backward, alternating, the median of ``--rounds`` rounds of
``--steps`` steps each, in the recipe's precision (on a GPU: a bfloat16 target and bfloat16 autocast; on a CPU:
float32). The target is only read there (its embeddings and LM head); its forward over the same batch, which a
training step without a state cache also runs (``LiveTarget``), is timed in the same rounds as ``target-forward``.
``--profile`` adds a torch profile of one step of each (the operators with the most device time, or host time on a
CPU). ``--tree DIR`` times another checkout's trainer (before/after a change). The recipe's GPU batch is
``--batch 32 --seq-len 1536 --anchors 64``. ``--shape smollm2`` takes a target of SmolLM2-135M's shape with random
weights instead of the checkpoint (what is timed depends on the shapes alone), so a GPU host times the step without
the GGUF package, which takes two commands to bring there.
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

import smollm2_drafter as recipe  # (this folder: the variants, capture layers and block it trains)

TIMED = ("dspark-1", "dflash-1")
# SmolLM2-135M-Instruct's architecture (the GGUF's): a Llama of 30 layers, 576 wide, 9 query and 3 key/value heads,
# a tied 49,152-token vocabulary
SHAPES = {"smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--target", default="smollm2", help="a target by name or path (default smollm2)")
    which.add_argument("--shape", choices=sorted(SHAPES),
                       help="instead of --target: a target of this shape with random weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=["auto", "off", "bfloat16"], default="auto",
                        help="the step's autocast (auto: bfloat16 on a GPU, off on a CPU, as the recipe trains)")
    parser.add_argument("--batch", type=int, default=2, help="sequences a step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=32, help="blocks a sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the checkout to time")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each (torch.profiler; the top operators go in the record)")
    parser.add_argument("--out", help="write the record here (JSON)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)  # (before the recipe's own checkout: the trainer timed is the tree's)

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from configs.training import DrafterTrainConfig
    from runtime.models.hub import resolve_checkpoint
    from runtime.training import drafter_trainer
    from runtime.training.loss import LossWeights
    from runtime.training.precision import autocast
    from runtime.training.target_states import LiveTarget

    device = torch.device(args.device)
    mode = args.autocast if args.autocast != "auto" else ("bfloat16" if device.type == "cuda" else "off")
    target_dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    if args.shape:
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[args.shape]), dtype=target_dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(args.target, "target"), dtype=target_dtype)
    target = target.to(device).eval()
    target.requires_grad_(False)
    tconf = target.config.to_dict()
    layer_ids = [i for i in recipe.LAYER_IDS if i < tconf["num_hidden_layers"] - 1] or [0]
    generator = torch.Generator().manual_seed(0)
    n, length, d = args.batch, args.seq_len, tconf["hidden_size"]
    ids = torch.randint(3, tconf["vocab_size"], (n, length), generator=generator).to(device)
    ones = torch.ones(n, length, device=device)
    anchors, keep = drafter_trainer.sample_anchors(torch.ones(n, length), args.anchors, generator)
    anchors, keep = anchors.to(device), keep.to(device)
    captured = torch.randn(n, length, len(layer_ids) * d, generator=generator).to(device, target_dtype)
    final = torch.randn(n, length, d, generator=generator).to(device, target_dtype)
    built = {}
    for name in TIMED:  # the drafter and loss weights as the trainer makes them from the recipe's variant
        cfg = DrafterTrainConfig(target=args.target, data="-", out="-", block_size=recipe.BLOCK,
                                 num_anchors=args.anchors, **recipe.VARIANTS[name])
        config = drafter_trainer.draft_config(
            tconf, block_size=cfg.block_size, mask_token_id=0, target_layer_ids=layer_ids,
            num_draft_layers=cfg.num_draft_layers, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
            confidence_head=cfg.confidence_head, confidence_head_with_markov=cfg.confidence_head_with_markov,
            num_anchors=cfg.num_anchors)
        drafter = drafter_trainer.build_drafter(config, device, torch.float32, 0)
        weights = LossWeights(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight, cfg.loss_decay)
        built[name] = (drafter, cfg, config, weights)

    live = LiveTarget(target, layer_ids)
    rows = torch.arange(n)

    def one_step(name: str) -> None:
        """One forward and backward pass of ``name`` (or the target's forward over the batch)."""
        if name == "target-forward":
            with autocast(mode, device):
                live(ids, ones.long(), rows)
            return
        drafter, cfg, config, weights = built[name]
        drafter.zero_grad(set_to_none=True)
        with autocast(mode, device):
            loss, _ = drafter_trainer.drafter_step(target, drafter, ids, ones, ones, anchors, keep, captured,
                                                   final, cfg, config, weights)
        loss.backward()

    def steps(name: str) -> float:
        """``--steps`` steps of ``name`` -> seconds a step."""
        began = time.perf_counter()
        for _ in range(args.steps):
            one_step(name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) / args.steps

    names = [*built, "target-forward"]
    for name in names:  # (warm-up: allocations)
        steps(name)
    timed = {name: [] for name in names}
    for r in range(args.rounds):  # each round in another order
        for name in names[r % len(names):] + names[:r % len(names)]:
            timed[name].append(steps(name))
    record = {"benchmark": "train_step", "date": str(date.today()), "command": "python " + shlex.join(sys.argv),
              "hardware": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
              "host": platform.node(), "torch": torch.__version__,
              "target": f"random weights, {args.shape}'s shape" if args.shape else args.target, "autocast": mode,
              "slots": n * args.anchors * recipe.BLOCK, "vocab_size": tconf["vocab_size"],
              "step_ms": {name: round(1e3 * statistics.median(t), 1) for name, t in timed.items()},
              "step_ms_rounds": {name: [round(1e3 * x, 1) for x in t] for name, t in timed.items()},
              "dspark_over_dflash": round(statistics.median(a / b for a, b in zip(timed["dspark-1"],
                                                                                   timed["dflash-1"])), 3)}
    if args.profile:
        record["profile"] = {name: profile(one_step, name, device) for name in names}
    print(json.dumps({k: record[k] for k in ("step_ms", "dspark_over_dflash")}))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


def profile(one_step, name: str, device, top: int = 12) -> list[dict]:
    """One step of ``name`` under torch.profiler -> its ``top`` operators by self device time (host time on a CPU),
    printed as the profiler's table too."""
    import torch
    from torch.profiler import ProfilerActivity

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        one_step(name)
        if on_gpu:
            torch.cuda.synchronize()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    print(f"== {name}", file=sys.stderr)
    print(prof.key_averages().table(sort_by=key, row_limit=top), file=sys.stderr)
    return [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3),
             "host_self_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in events]


if __name__ == "__main__":
    main()
