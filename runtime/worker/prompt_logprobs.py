"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt tokens' log-probabilities under the target, computed
from a prefill chunk's hidden states in slices of bounded memory, and attached to the step's results."""

from __future__ import annotations

import torch

from runtime.kernels.transfer import to_device
from runtime.models.target import TargetModel
from runtime.sampling.logprobs import TokenLogprob
from runtime.scheduling.step_io import RequestStepResult, ScheduledRequest

NON_FINITE_LOGITS = "the target produced non-finite logits (NaN/inf) for this request; it was stopped"
# rows of a step's prompt logprobs computed at once: a slice's logits [rows, V] float32 (and their log-softmax) bound
# the memory a long prompt chunk takes (512 rows of a 151,936-token vocabulary: 311 MB each)
PROMPT_LOGPROB_ROWS = 512


def chunk_prompt_logprobs(target: TargetModel, reqs: list[ScheduledRequest], hidden: torch.Tensor, row_ends: list[int],
                    device: torch.device, is_leader: bool) -> dict[int, list[TokenLogprob] | None] | None:
    """The prompt logprobs of the step's prefill chunks that asked for them (``ScheduledRequest.prompt_rows``):
    batch index -> one ``TokenLogprob`` per target token (None where a row's logits are not finite: that request
    fails alone), on rank 0; None when no chunk asked (every rank computes the logits: under tensor parallelism
    their gather is a collective). The raw distribution, the chunk's rows read from ``hidden`` [T, d]."""
    wanted = [(b, r) for b, r in enumerate(reqs) if r.prompt_rows is not None]
    if not wanted:
        return None
    index, targets = [], []
    for b, r in wanted:
        offset, tokens = r.prompt_rows
        first = row_ends[b] - len(r.token_ids) + offset  # a request's fed rows end at row_ends[b]
        index.extend(range(first, first + len(tokens)))
        targets.extend(tokens)
    states = hidden[to_device(index, device, torch.int64)]  # [R, d]
    wanted_ids = to_device(targets, device, torch.int64)  # [R]
    top = max(max(r.params.prompt_logprobs for _, r in wanted), 1)
    parts = []  # per slice of PROMPT_LOGPROB_ROWS rows: a long chunk's [R, V] logits never exist at once
    for start in range(0, len(index), PROMPT_LOGPROB_ROWS):
        logits = target.compute_logits(states[start:start + PROMPT_LOGPROB_ROWS])  # [r, V] float32
        if not is_leader:
            continue
        logp = torch.log_softmax(logits, dim=-1)  # [r, V]
        chosen = logp.gather(-1, wanted_ids[start:start + PROMPT_LOGPROB_ROWS, None]).squeeze(-1)  # [r]
        top_lp, top_ids = logp.topk(top, dim=-1)  # [r, N]
        rank = (logp > chosen[:, None]).sum(dim=-1) + 1  # [r] the prompt token's place (1: the most likely)
        finite = torch.isfinite(logits.amax(dim=-1))  # [r]: NaN propagates into the max, +inf is the max
        parts.append((chosen, top_ids, top_lp, rank, finite))
    if not is_leader:
        return None
    chosen_h, ids_h, lp_h, rank_h, finite_h = (torch.cat(column).tolist() for column in zip(*parts))
    out, row = {}, 0
    for b, r in wanted:
        n, count = r.params.prompt_logprobs, len(r.prompt_rows[1])
        span = range(row, row + count)
        out[b] = [TokenLogprob(targets[i], chosen_h[i], tuple(zip(ids_h[i][:n], lp_h[i][:n])), rank_h[i])
                  for i in span] if all(finite_h[i] for i in span) else None
        row += count
    return out


def with_prompt_logprobs(results: list[RequestStepResult],
                         prompt_logprobs: dict[int, list[TokenLogprob] | None]) -> list[RequestStepResult]:
    """``results`` (batch order) with each prefill chunk's prompt logprobs; a chunk whose prompt rows' logits were
    not finite fails its request (as a broken sampled row does)."""
    for b, logprobs in prompt_logprobs.items():
        if logprobs is None:
            results[b] = RequestStepResult(results[b].request_id, [], 0, [], NON_FINITE_LOGITS)
        elif results[b].error is None:
            results[b].prompt_logprobs = logprobs
    return results
