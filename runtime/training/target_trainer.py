"""``train_target``: a small Qwen3-architecture model and a byte-level BPE tokenizer, from scratch.

The corpus is available offline on any machine with Python: the interpreter's own standard-library
sources (or a folder given). Every ``heldout_every``-th file (sorted by path) is held out; their paths
are written to ``heldout_files.txt`` for evaluation.
"""

from __future__ import annotations

import json
import logging
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from configs.training import TargetTrainConfig
from runtime.training.data_parallel import (STATS_FILE, agreed_max, average_gradients, barrier,
                                            rank_and_world)
from runtime.training.precision import autocast
from runtime.training.schedule import warmup_cosine
from runtime.worker.devices import resolve_device

log = logging.getLogger(__name__)
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<mask>"]
SKIPPED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")


def source_files(root: str | None, max_bytes: int) -> list[Path]:
    """Python sources under ``root`` (default: the stdlib), sorted, skipping tests and site-packages."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"data: {base} is not a directory")
    files, total = [], 0
    for path in sorted(base.rglob("*.py")):
        if SKIPPED_PARTS & set(path.relative_to(base).parts) or not path.is_file():
            continue
        size = path.stat().st_size
        if 200 <= size <= 200_000:
            files.append(path)
            total += size
        if total >= max_bytes:
            break
    if not files:
        raise ValueError(f"data: no Python sources under {base}")
    return files


def split(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    return [f for i, f in enumerate(files) if i % every], [f for i, f in enumerate(files) if i % every == 0]


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   mask_token="<mask>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(files: list[Path], tokenizer, max_len: int) -> torch.Tensor:
    """All files tokenized (each ending in EOS) and cut into rows of ``max_len`` tokens: [rows, max_len]."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:  # one batched call: all cores
        ids += encoded
        ids.append(tokenizer.eos_token_id)
    rows = len(ids) // max_len
    return torch.tensor(ids[:rows * max_len]).view(rows, max_len)


def lr_factor(step: int, steps: int, time_fraction: float = 0.0) -> float:
    """The target's schedule: ``warmup_cosine`` with 5% warmup; ``time_fraction`` is the share of
    ``max_seconds`` used, so a run its time limit stops has annealed to 0 by then."""
    return warmup_cosine(step, steps, max(steps // 20, 1), time_fraction)


def train_target(cfg: TargetTrainConfig, progress: bool = True) -> dict:
    """Train the tokenizer and the model; returns (and writes to ``out/train_stats.json``) the final statistics.

    Inside an initialized ``torch.distributed`` group (Ray Train's workers, or ``torchrun``) it is data
    parallel: rank 0 trains the tokenizer and the others load it, every rank starts from the same weights and
    draws its own batches, gradients are averaged before every step, rank 0 writes the model.
    """
    rank, world = rank_and_world()
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    train_files, heldout = split(source_files(cfg.data, cfg.max_corpus_bytes), cfg.heldout_every)
    if rank == 0:
        tokenizer = train_tokenizer(train_files, cfg.vocab_size)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
    barrier(world)
    if rank != 0:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    data = token_stream(train_files, tokenizer, cfg.max_len)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.hidden_size // cfg.num_heads,
                         intermediate_size=cfg.intermediate_size or 3 * cfg.hidden_size,
                         max_position_embeddings=max(2048, 4 * cfg.max_len), tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(cfg.seed + 7919 * rank)  # each rank its own batches
    start, step, loss_ema = time.monotonic(), 0, None  # loss_ema: a device scalar, read only for display
    time_fraction, lr = 0.0, 0.0  # time_fraction: the agreed share of max_seconds used so far
    bar = tqdm(total=cfg.steps, desc="train-target", disable=not progress or rank != 0)
    while step < cfg.steps:
        lr = cfg.lr * lr_factor(step, cfg.steps, time_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data[torch.randint(len(data), (cfg.batch_size,), generator=generator)].to(device)
        with autocast(cfg.autocast, device):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_ema = loss.detach() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.detach()
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{float(loss_ema):.3f}")
        if cfg.max_seconds is not None:
            time_fraction = agreed_max(time.monotonic() - start, world, device) / cfg.max_seconds
            if time_fraction >= 1:
                break
    bar.close()
    stats = {"steps": step, "loss": float(loss_ema), "last_lr": lr, "seconds": time.monotonic() - start,
             "train_files": len(train_files), "heldout_files": len(heldout), "data_parallel_ranks": world,
             "parameters": sum(p.numel() for p in model.parameters())}
    if rank == 0:
        model.save_pretrained(str(out))
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(str(out))
        (out / "heldout_files.txt").write_text("".join(f"{f}\n" for f in heldout))
        (out / STATS_FILE).write_text(json.dumps(stats))
        log.info("train-target: %d steps, loss %.3f, %d train / %d held-out files", step, stats["loss"],
                 len(train_files), len(heldout))
    return stats
