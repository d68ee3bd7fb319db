"""Logprobs of committed tokens: the rows of a verify step, read for the requests that asked for them.

Row r of a request in a step ([anchor, d_1..d_k] fed) is the target's distribution of the request's r-th token
committed that step: an accepted draft, or the token drawn at the first rejection or after the last draft. It is
the distribution plain decoding computes for that token, so logprobs are the same with and without speculation
(and with rejection sampling a token resampled from the residual still reports its target log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels.transfer import to_device


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated (or prompt) token's log-probability and the most likely alternatives', best first (``top`` holds
    ``SamplingParams.logprobs`` of them; the token itself may be among them or not). ``rank``: a prompt token's
    place in its distribution (1: the most likely; ties share the best place), as vLLM reports prompt logprobs; None
    for generated tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


class LogprobSource:
    """The log-probabilities [S', K+1, V] of the step's entries at ``rows`` (those asking for logprobs), each
    asking for ``tops[j]`` alternatives. Filled by ``set_logits`` (log-softmax of logits) or ``set_processed``."""

    def __init__(self, rows: list[int], tops: list[int]):
        self.rows, self.tops = rows, tops
        self.logp: torch.Tensor | None = None  # [S', K+1, V] float32

    def _index(self, device: torch.device) -> torch.Tensor:
        return to_device(self.rows, device)

    def set_logits(self, logits: torch.Tensor) -> None:
        """logits [S, K+1, V] (any float dtype): the log-softmax of the wanted rows."""
        self.logp = torch.log_softmax(logits[self._index(logits.device)].float(), dim=-1)

    def set_processed(self, logits: torch.Tensor, probs: torch.Tensor, greedy: torch.Tensor) -> None:
        """The distribution each row's token was drawn from: log ``probs`` [S, K+1, V] (after penalties,
        temperature and filters; filtered-out tokens -inf), or for greedy rows (``greedy`` [S]) the log-softmax
        of the (penalized) ``logits``."""
        index = self._index(logits.device)
        drawn = torch.log(probs[index].float())
        argmaxed = torch.log_softmax(logits[index].float(), dim=-1)
        self.logp = torch.where(greedy[index][:, None, None], argmaxed, drawn)

    def top(self, committed: torch.Tensor) -> dict[int, list[list[TokenLogprob]]]:
        """committed [S, K+1] -> per wanted entry (its index in the step), a ``TokenLogprob`` for every row (the
        caller keeps the first accepted + 1). One host transfer per tensor, only in steps that asked."""
        index = self._index(committed.device)
        tokens = committed[index]  # [S', K+1]
        chosen = self.logp.gather(-1, tokens[..., None]).squeeze(-1)  # [S', K+1]
        top_lp, top_ids = self.logp.topk(max(max(self.tops), 1), dim=-1)  # [S', K+1, N]
        tokens_h, chosen_h, ids_h, lp_h = tokens.tolist(), chosen.tolist(), top_ids.tolist(), top_lp.tolist()
        out = {}
        for j, (row, n) in enumerate(zip(self.rows, self.tops)):
            out[row] = [TokenLogprob(tokens_h[j][r], chosen_h[j][r], tuple(zip(ids_h[j][r][:n], lp_h[j][r][:n])))
                        for r in range(len(tokens_h[j]))]
        return out
