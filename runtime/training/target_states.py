"""What the frozen target gives a drafter's training step: its captured layer outputs and its final hidden states.

``LiveTarget`` runs the target on every batch. ``CachedTarget`` reads them from a cache that ``build_state_cache``
writes once, in one pass of the target over every training example, so a run pays for the target once instead of
every epoch (DeepSpec's target cache); ``DeviceTarget`` holds that pass's states in the training device's memory
instead (a GPU with room for them: a batch is then a gather on the device). All return the same tensors for the same
rows (the caches' to bfloat16 rounding):
captured [N, L, m*d] (decoder-layer outputs of ``target_layer_ids``, HF ``hidden_states[l + 1]``) and final
[N, L, d] (after the target's final norm: the LM head's input, from which the target's distributions come).

The cache holds bfloat16 rows in two flat files (``captured.npy``, ``final.npy``, read through numpy memory maps as
raw 16-bit words) and ``index.json``: each example's offset, the layer ids and what the cache was made from, so a
cache of other examples, layers or target is rebuilt rather than misread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from runtime.training.data import Example

CACHE_VERSION = 1


class LiveTarget:
    """The target run on each batch."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int]):
        self.target, self.layer_ids = target, list(layer_ids)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, attn [N, L] (on the target's device), rows [N] -> captured [N, L, m*d], final [N, L, d]."""
        out = self.target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        captured = torch.cat([out.hidden_states[layer + 1] for layer in self.layer_ids], dim=-1)
        return captured, out.last_hidden_state


def cache_key(examples: list[Example], layer_ids: list[int], target: str) -> str:
    """A digest of the examples' tokens, the layer ids and the target checkpoint's weights file sizes and names."""
    digest = hashlib.sha256(json.dumps([CACHE_VERSION, list(layer_ids), str(target)]).encode())
    for example in examples:
        digest.update(np.asarray(example.token_ids, dtype=np.int32).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def target_batches(live: LiveTarget, examples: list[Example], batch_tokens: int, progress: bool = True,
                   ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """One pass of the target over every example, longest first, about ``batch_tokens`` tokens a batch (right-padded):
    yields (the batch's example indices, captured [n, width, m*d], final [n, width, d]) on the target's device."""
    device = next(live.target.parameters()).device
    lengths = [len(e.token_ids) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: -lengths[i])
    bar = tqdm(total=sum(lengths), desc="target states", unit="tok", disable=not progress)
    start = 0
    while start < len(order):
        width = lengths[order[start]]
        count = max(1, batch_tokens // width)
        rows = order[start:start + count]
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, :lengths[i]] = torch.tensor(examples[i].token_ids)
            attn[r, :lengths[i]] = 1
        cap, fin = live(ids.to(device), attn.to(device), torch.tensor(rows))
        yield rows, cap, fin
        bar.update(sum(lengths[i] for i in rows))
        start += count
    bar.close()


def build_state_cache(live: LiveTarget, examples: list[Example], out: Path, key: str, batch_tokens: int = 8192,
                      progress: bool = True) -> None:
    """Run the target once over every example (``target_batches``) and write its captured and final states to
    ``out``. Writes ``index.json`` last, so an interrupted build is redone."""
    out.mkdir(parents=True, exist_ok=True)
    d = live.target.config.hidden_size
    m = len(live.layer_ids)
    lengths = [len(e.token_ids) for e in examples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    captured = np.lib.format.open_memmap(out / "captured.npy", mode="w+", dtype=np.uint16, shape=(total, m * d))
    final = np.lib.format.open_memmap(out / "final.npy", mode="w+", dtype=np.uint16, shape=(total, d))
    for rows, cap, fin in target_batches(live, examples, batch_tokens, progress):
        cap, fin = _words(cap), _words(fin)
        for r, i in enumerate(rows):
            captured[offsets[i]:offsets[i + 1]] = cap[r, :lengths[i]]
            final[offsets[i]:offsets[i + 1]] = fin[r, :lengths[i]]
    captured.flush()
    final.flush()
    (out / "index.json").write_text(json.dumps({"key": key, "offsets": offsets.tolist(), "captured_width": m * d,
                                                "hidden_size": d, "layer_ids": live.layer_ids}))


def _words(t: torch.Tensor) -> np.ndarray:
    """A tensor as bfloat16 bit patterns (uint16) on the host."""
    return t.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)


class CachedTarget:
    """The states ``build_state_cache`` wrote, gathered per batch and moved to ``device`` in ``dtype``."""

    def __init__(self, out: Path, key: str, device: torch.device, dtype: torch.dtype):
        index = json.loads((out / "index.json").read_text())
        if index["key"] != key:
            raise ValueError(f"target state cache {out} was made from other examples, layers or target")
        self.offsets = np.asarray(index["offsets"], dtype=np.int64)
        self.captured = np.load(out / "captured.npy", mmap_mode="r")
        self.final = np.load(out / "final.npy", mmap_mode="r")
        self.device, self.dtype = device, dtype

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached states of examples ``rows`` [N], padded with zeros to ids' length L -> [N, L, m*d], [N, L, d]."""
        n, length = ids.shape
        captured = np.zeros((n, length, self.captured.shape[1]), dtype=np.uint16)
        final = np.zeros((n, length, self.final.shape[1]), dtype=np.uint16)
        for r, i in enumerate(rows.tolist()):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            captured[r, :hi - lo] = self.captured[lo:hi]
            final[r, :hi - lo] = self.final[lo:hi]
        return _tensor(captured, self.device, self.dtype), _tensor(final, self.device, self.dtype)


def _tensor(words: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).to(device=device, dtype=dtype)


def state_bytes(examples: list[Example], num_layers: int, hidden_size: int) -> int:
    """Bytes the target's states of ``examples`` take in bfloat16: (captured layers + final) x hidden a token."""
    return sum(len(e.token_ids) for e in examples) * (num_layers + 1) * hidden_size * 2


class DeviceTarget:
    """The target's states of every example held in the training device's memory (bfloat16), filled by one pass of
    the target: a batch's states are then a gather on the device (no forward, no host copy). Padding reads as zeros,
    as ``CachedTarget``'s does."""

    def __init__(self, live: LiveTarget, examples: list[Example], batch_tokens: int = 65536, progress: bool = True):
        device = next(live.target.parameters()).device
        d, m = live.target.config.hidden_size, len(live.layer_ids)
        need = state_bytes(examples, m, d)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if need > 0.6 * free:  # (the rest for the step's own tensors)
                raise ValueError(f"target_cache_in_memory: the target's states of these examples take "
                                 f"{need / 2**30:.1f} GiB, over 60% of the {free / 2**30:.1f} GiB free on {device}; "
                                 "use target_cache (a folder) or fewer examples")
        lengths = [len(e.token_ids) for e in examples]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.captured = torch.empty(int(offsets[-1]), m * d, dtype=torch.bfloat16, device=device)
        self.final = torch.empty(int(offsets[-1]), d, dtype=torch.bfloat16, device=device)
        for rows, cap, fin in target_batches(live, examples, batch_tokens, progress):
            for r, i in enumerate(rows):
                self.captured[offsets[i]:offsets[i + 1]] = cap[r, :lengths[i]]
                self.final[offsets[i]:offsets[i + 1]] = fin[r, :lengths[i]]
        self.offsets = torch.from_numpy(offsets).to(device)
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of examples ``rows`` [N], padded with zeros to ids' length L -> [N, L, m*d], [N, L, d], in
        bfloat16 (the step casts them as it does a live bfloat16 target's)."""
        rows = rows.to(self.offsets.device)
        pos = torch.arange(ids.shape[1], device=self.offsets.device)  # [L]
        valid = pos[None, :] < self.lengths[rows][:, None]  # [N, L]
        index = torch.where(valid, self.offsets[rows][:, None] + pos[None, :], 0)  # [N, L] rows of the flat states
        captured = self.captured[index].masked_fill_(~valid[..., None], 0)
        final = self.final[index].masked_fill_(~valid[..., None], 0)
        return captured, final


def open_state_cache(live: LiveTarget, examples: list[Example], out: Path, target: str, device: torch.device,
                     dtype: torch.dtype, progress: bool = True) -> CachedTarget:
    """The cache at ``out`` for these examples, built first when missing or made from anything else."""
    key = cache_key(examples, live.layer_ids, target)
    index = out / "index.json"
    if not index.is_file() or json.loads(index.read_text()).get("key") != key:
        index.unlink(missing_ok=True)
        build_state_cache(live, examples, out, key, progress=progress)
    return CachedTarget(out, key, device, dtype)
