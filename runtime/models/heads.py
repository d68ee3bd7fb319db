"""DSpark's sequential heads: the low-rank Markov head and the confidence head (DESIGN.md section 3).

Markov head of rank r, ``W1 = Embedding(V, r)`` (``markov_w1``), ``W2 = Linear(r -> V)`` (``markov_w2``):
  vanilla  z_k = U_k + W2 W1[x_{k-1}]
  gated    z_k = U_k + W2(sigmoid(G [h_k; W1[x_{k-1}]]) * W1[x_{k-1}])            G = gate_proj  [r, d+r]
  rnn      [g, c, o] = J [s_{k-1}; W1[x_{k-1}]; h_k]                              J = joint_proj [3r, 2r+d]
           s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c);  z_k = U_k + W2 tanh(o);  s_0 = 0
Confidence: c_k = sigmoid(w [h_k; W1[x_{k-1}]] + b), the W1 part only with ``confidence_head_with_markov``.
``x_0`` is the anchor; ``h_k`` the block's hidden state after the drafter's final norm.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        if kind not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {list(MARKOV_HEAD_TYPES)}, got {kind!r}")
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        if kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(batch, self.rank) if self.kind == "rnn" else None

    def prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def low_rank(self, prev_ids: torch.Tensor, hidden: torch.Tensor,
                 state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rank-r vector whose W2 image corrects U_k: prev_ids [B], hidden [B, d], state [B, r] (rnn)
        -> (low_rank [B, r], next state). ``z_k = U_k + markov_w2(low_rank)``."""
        e = self.markov_w1(prev_ids).to(hidden.dtype)  # [B, r]
        if self.kind == "vanilla":
            low_rank = e
        elif self.kind == "gated":
            low_rank = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
        else:
            g, c, o = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(g)
            state = gate * state + (1 - gate) * torch.tanh(c)
            low_rank = torch.tanh(o)
        return low_rank, state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [..., d(+r)] -> probability [...] that the draft survives given its prefix did
        return torch.sigmoid(self.proj(features).squeeze(-1).float())
