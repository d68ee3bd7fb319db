"""Training data: JSONL rows or a folder of source files, tokenized into sequences with a loss mask.

JSONL rows: ``{"prompt": ..., "response": ...}`` (only the response is supervised), ``{"prompt_ids": [...],
"response_ids": [...]}`` (exact token ids, as self-distillation writes them) or ``{"text": ...}`` (all of it).
A folder: every ``*.py`` file below it, all supervised. Long sequences are cut into windows of ``max_len`` tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Example:
    token_ids: list[int]
    loss_mask: list[int]  # 1 where the token is supervised


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        return [{"text": f.read_text(encoding="utf-8", errors="replace")} for f in sorted(path.rglob("*.py"))]
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        keys = row.keys() if isinstance(row, dict) else set()
        if not ({"text"} <= keys or {"prompt", "response"} <= keys or {"prompt_ids", "response_ids"} <= keys):
            raise ValueError(f"{path}:{number}: each row needs 'text', 'prompt' and 'response', or 'prompt_ids' "
                             "and 'response_ids'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no training rows")
    return rows


def tokenize(rows: list[dict], tokenizer, max_len: int, eos_token_id: int | None) -> list[Example]:
    """Rows -> supervised windows of at most ``max_len`` tokens (each with at least two supervised tokens).

    Every string is encoded in one batched call, so a fast tokenizer spreads the work over all cores."""
    strings = []
    for row in rows:
        if "text" in row:
            strings.append(row["text"])
        elif "prompt_ids" not in row:
            strings += [row["prompt"], row["response"]]
    encoded = iter(tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else [])
    examples = []
    for row in rows:
        if "text" in row:
            ids = next(encoded)
            mask = [1] * len(ids)
        elif "prompt_ids" in row:  # exact tokens (self-distillation): no re-tokenization
            ids = list(row["prompt_ids"]) + list(row["response_ids"])
            mask = [0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"])
        else:
            prompt, response = next(encoded), next(encoded)
            if eos_token_id is not None and row.get("finished", True):
                response = response + [eos_token_id]
            ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
        for start in range(0, max(len(ids) - 1, 1), max_len):
            window = ids[start:start + max_len]
            if len(window) >= 2 and sum(mask[start:start + max_len]) >= 2:
                examples.append(Example(window, mask[start:start + max_len]))
    return examples


def batches(examples: list[Example], batch_size: int, seed: int, pad_id: int, pool: int = 32):
    """Endless shuffled batches: (input_ids [N, L], loss_mask [N, L], attention_mask [N, L], rows [N]), all int64,
    L the longest example of the batch, rows the examples' indices. Each pass shuffles the examples, sorts every
    ``pool`` batches' worth by length and shuffles those batches, so a batch holds examples of similar length (little
    padding) in random order. The examples are packed into compact tensors once (and the lists dropped), so a batch is
    a gather, not per-example Python: it is built on the host every training step."""
    count, width = len(examples), max(len(e.token_ids) for e in examples)
    lengths = torch.tensor([len(e.token_ids) for e in examples])  # [E]
    all_ids = torch.full((count, width), pad_id, dtype=torch.int32)  # [E, W]
    all_loss = torch.zeros((count, width), dtype=torch.bool)  # [E, W]
    for i, e in enumerate(examples):
        all_ids[i, :len(e.token_ids)] = torch.tensor(e.token_ids, dtype=torch.int32)
        all_loss[i, :len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.bool)
    del examples  # the generator's frame would otherwise keep every list alive
    rng = random.Random(seed)
    order = list(range(count))
    while True:
        rng.shuffle(order)
        groups = []
        for lo in range(0, count - batch_size + 1, batch_size * pool):
            chunk = sorted(order[lo:lo + batch_size * pool], key=lambda i: int(lengths[i]))
            groups += [chunk[s:s + batch_size] for s in range(0, len(chunk) - batch_size + 1, batch_size)]
        rng.shuffle(groups)
        for group in groups:
            rows = torch.tensor(group)  # [N]
            length = int(lengths[rows].max())
            attn = (torch.arange(length) < lengths[rows, None]).long()  # [N, L]
            yield all_ids[rows, :length].long(), all_loss[rows, :length].long(), attn, rows
