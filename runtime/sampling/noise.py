"""Counter-based randomness keyed by (request seed, token position, purpose).

Every random number a request consumes is a pure function of its seed, the absolute position
of the token being decided and what it is for (drafting, target sampling, the acceptance test,
the residual draw). Nothing depends on how requests are batched or how many drafts a step
verified, so a seeded request gives the same output whatever else is in the batch, after
preemption and recompute, and (with exact-match verification) with or without speculation.

The hash is the 32-bit integer finalizer of Thomas Mueller (constant 0x45d9f3b), computed in
int64 so every product stays below 2**63 on any device.
"""

from __future__ import annotations

import enum

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B


class Stream(enum.IntEnum):
    """What a random number is for; each is an independent stream."""

    TARGET = 1  # the target's own sample (plain decoding, exact-match verification, the bonus)
    DRAFT = 2  # the drafter's sample of a draft token
    ACCEPT = 3  # the uniform of the rejection test
    RESIDUAL = 4  # the draw from norm(max(0, p - q)) after a rejection


def hash32(x: torch.Tensor) -> torch.Tensor:
    # x: int64 tensor of values in [0, 2**32) -> same shape, same range
    x = (((x >> 16) ^ x) * MIX) & MASK32
    x = (((x >> 16) ^ x) * MIX) & MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream) -> torch.Tensor:
    # seeds, positions: [R] int64 -> [R] int64 keys
    key = hash32((seeds & MASK32) ^ hash32(torch.full_like(seeds, int(stream)) + (seeds >> 32)))
    return hash32(key ^ hash32(positions & MASK32))


def uniforms(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[R] keys -> [R, width] float32 uniforms in (0, 1), 24 random bits each (exactly representable)."""
    cols = hash32(torch.arange(width, device=keys.device, dtype=torch.int64) * 0x9E3779B1 & MASK32)
    bits = hash32(keys[:, None] ^ cols[None, :]) >> 8
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [R, V] for exponential-race sampling (``argmax(p / E)``)."""
    return -torch.log(uniforms(row_keys(seeds, positions, stream), vocab_size))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream) -> torch.Tensor:
    """One uniform in (0, 1) per row, [R]."""
    return uniforms(row_keys(seeds, positions, stream), 1)[:, 0]
