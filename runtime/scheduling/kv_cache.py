"""Paged KV caches as device tensors: allocation, sizing, and scrubbing pages a faulted request filled."""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels.transfer import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_caches(layers: nn.ModuleList, num_pages: int, page_size: int, dtype: torch.dtype,
                    device: torch.device) -> KVCaches:
    """One (k, v) pair [num_pages, page_size, Hkv_local, D] per attention layer."""
    caches = []
    for layer in layers:
        attn = layer.self_attn
        shape = (num_pages, page_size, attn.kv_width // attn.head_dim, attn.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return caches


def scrub_pages(caches: KVCaches, page_ids: list[int], device: torch.device) -> None:
    """Zero ``page_ids`` in every (k, v) cache [P, S, H, D] (pages a faulted request may have filled with NaN)."""
    if not page_ids:
        return
    index = to_device(page_ids, device)
    for k_cache, v_cache in caches:
        k_cache.index_fill_(0, index, 0)
        v_cache.index_fill_(0, index, 0)


def bytes_per_page(layers: list[nn.Module], page_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * page_size * layer.self_attn.kv_width * itemsize for layer in layers)
