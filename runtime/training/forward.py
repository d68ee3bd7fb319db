"""The drafter's training forward: all blocks of a batch in one pass, dense masked attention.

It reuses the serving modules (``DSparkDrafter`` layers, heads, RoPE) so the trained weights mean
exactly what the engine computes: context K/V from ``hidden_norm(fc(captured))`` through each layer's
own k/v projections (k_norm, RoPE at the context positions), block queries from the block only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.models.drafter import DSparkDrafter


def block_hidden(drafter: DSparkDrafter, block_embeds: torch.Tensor, block_pos: torch.Tensor,
                 captured: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """block_embeds [N, S, d] (S = A*B slots), block_pos [N, S], captured [N, L, m*d], mask [N, 1, S, L+S]
    -> block hidden states after the final norm [N, S, d]."""
    n, slots, d = block_embeds.shape
    length = captured.shape[1]
    ctx = drafter.hidden_norm(drafter.fc(captured)).reshape(n * length, d)
    ctx_cos, ctx_sin = drafter.rotary(torch.arange(length, device=captured.device).repeat(n), ctx.dtype)
    cos, sin = drafter.rotary(block_pos.reshape(-1), ctx.dtype)
    h = block_embeds.reshape(n * slots, d)
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.project_q(x, cos, sin).view(n, slots, -1, attn.head_dim)
        k_blk, v_blk = attn.project_kv(x, cos, sin)
        k_ctx, v_ctx = attn.project_kv(ctx, ctx_cos, ctx_sin)
        k = torch.cat([k_ctx.view(n, length, -1, attn.head_dim), k_blk.view(n, slots, -1, attn.head_dim)], dim=1)
        v = torch.cat([v_ctx.view(n, length, -1, attn.head_dim), v_blk.view(n, slots, -1, attn.head_dim)], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=attn.scale, enable_gqa=q.shape[2] != k.shape[2])
        h = h + attn.o_proj(out.transpose(1, 2).reshape(n * slots, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(n, slots, d)


def teacher_forced_logits(drafter: DSparkDrafter, base_logits: torch.Tensor, prev_ids: torch.Tensor,
                          hidden: torch.Tensor) -> torch.Tensor:
    """z_k = U_k + W2 low_rank(x_{k-1}) with the true previous tokens (the RNN unrolled over the block).

    base_logits [N, A, B, V], prev_ids [N, A, B] (anchor, then labels), hidden [N, A, B, d] -> [N, A, B, V].
    Only the rank-r recurrence runs position by position; W2 and the sum run once over the whole block (a sum per
    position into a stack made the backward write a vocabulary-wide zero-filled gradient per position).
    """
    head = drafter.markov_head
    if head is None:
        return base_logits
    n, a, block, _ = base_logits.shape
    state = head.initial_state(n * a, hidden)
    lows = []
    for j in range(block):
        low, state = head.low_rank(prev_ids[:, :, j].reshape(-1), hidden[:, :, j].reshape(n * a, -1), state)
        lows.append(low.view(n, a, -1))
    return base_logits + head.markov_w2(torch.stack(lows, dim=2)).float()  # [N, A, B, r] -> [N, A, B, V]


def confidence_logits(drafter: DSparkDrafter, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
    """Pre-sigmoid confidence [N, A, B] (None without a confidence head)."""
    if drafter.confidence_head is None:
        return None
    features = hidden
    if drafter.spec.confidence_head_with_markov:
        features = torch.cat([hidden, drafter.markov_head.prev_embeddings(prev_ids).to(hidden.dtype)], dim=-1)
    return drafter.confidence_head.proj(features).squeeze(-1).float()


def greedy_block(drafter: DSparkDrafter, lm_head, hidden: torch.Tensor, prev: torch.Tensor) -> list[int]:
    """A block's drafts decoded greedily one position at a time, the way DeepSpec's evaluator does: position k's
    logits are the target's head over ``hidden[k]`` plus the Markov head's correction given the draft before it
    (``prev``, [1], at first the anchor token). ``hidden``: [K, d], the block's hidden states of one request."""
    head = drafter.markov_head
    state = head.initial_state(1, hidden) if head is not None else None
    drafts = []
    for k in range(hidden.shape[0]):
        z = lm_head(hidden[k:k + 1]).float()  # [1, V]
        if head is not None:
            low_rank, state = head.low_rank(prev, hidden[k:k + 1], state)
            z = z + head.markov_w2(low_rank).float()
        prev = z.argmax(dim=-1)
        drafts.append(int(prev))
    return drafts
