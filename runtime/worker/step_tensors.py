"""Device tensors for one step, built from the plain-data batch (the same on every process)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import AttentionGeometry, HostLayout, KernelBackend, PagedAttentionMeta
from runtime.kernels.transfer import to_device
from runtime.scheduling.step_io import ScheduledRequest
from runtime.worker.graph_layout import graph_inputs


@dataclass(frozen=True, slots=True)
class StepTensors:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat KV slots (page * page_size + offset)
    meta: PagedAttentionMeta  # causal attention of the fed tokens over the pages
    page_table: torch.Tensor  # [B, max_pages]
    row_ends: list[int]  # [B] host: one past each request's last row of the step's outputs (its sampled row + 1)


def query_start_loc(reqs: list[ScheduledRequest]) -> list[int]:
    """[B+1] cumulative token counts of the requests fed this step (host)."""
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + len(r.token_ids))
    return qsl


def padded_page_table(reqs: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    """[B, max_pages] the requests' pages on ``device``, rows padded with page 0 (never read past a request's
    length)."""
    width = max(len(r.page_ids) for r in reqs)
    return to_device([r.page_ids + [0] * (width - len(r.page_ids)) for r in reqs], device)


def build_step_tensors(reqs: list[ScheduledRequest], page_size: int, device: torch.device,
                       kernels: KernelBackend, geometry: AttentionGeometry | None = None) -> StepTensors:
    """Flat inputs of the fed tokens and their attention metadata, planned once for every layer."""
    lens = [len(r.token_ids) for r in reqs]
    qsl = query_start_loc(reqs)
    qsl_t, lens_t = to_device(qsl, device), to_device(lens, device)
    starts = to_device([r.start_position for r in reqs], device)
    req_of_token = torch.repeat_interleave(torch.arange(len(reqs), device=device), lens_t, output_size=qsl[-1])
    positions = starts[req_of_token] + torch.arange(qsl[-1], device=device) - qsl_t[req_of_token]
    page_table = padded_page_table(reqs, device)
    slots = page_table[req_of_token, positions // page_size] * page_size + positions % page_size
    meta = PagedAttentionMeta(query_start_loc=qsl_t, seq_lens=starts + lens_t,
                              page_table=page_table, max_query_len=max(lens),
                              max_seq_len=max(r.end_position for r in reqs), causal=True, num_tokens=qsl[-1],
                              page_size=page_size, geometry=geometry,
                              host=HostLayout(lens, [r.end_position for r in reqs], [r.page_ids for r in reqs]))
    input_ids = to_device([t for r in reqs for t in r.token_ids], device)
    return StepTensors(input_ids, positions, slots, kernels.plan_attention(meta), page_table, qsl[1:])


def build_uniform_step_tensors(reqs: list[ScheduledRequest], q_len: int, page_size: int, scratch_page: int,
                               device: torch.device, kernels: KernelBackend,
                               geometry: AttentionGeometry | None = None) -> StepTensors:
    """An eager step in a graph's uniform layout (``runtime.worker.graph_layout.graph_inputs``, no padding requests): each
    request feeds ``q_len`` rows, a shorter one's padding (token 0 at its last position) writing ``scratch_page``, so
    a step of blocks of different lengths is a [B, q_len] grid (a packed verify's layout). Padding rows repeat the
    last real position: ``runtime.sampling.verify.block_verdicts`` never counts them as drafts. ``page_table`` is the
    requests' own pages (what the drafter reads); ``row_ends`` each request's last grid row + 1."""
    num = len(reqs)
    inputs, layout = graph_inputs(reqs, num, q_len, page_size, scratch_page)  # [3, B*Q]
    ids, positions, slots = torch.from_numpy(inputs).to(device, non_blocking=True)
    width = max(len(p) for p in layout.page_ids)
    table = to_device([p + [scratch_page] * (width - len(p)) for p in layout.page_ids], device)  # [B, pages]
    meta = PagedAttentionMeta(query_start_loc=to_device([q_len * b for b in range(num + 1)], device),
                              seq_lens=to_device(layout.kv_lens, device), page_table=table, max_query_len=q_len,
                              max_seq_len=max(layout.kv_lens), causal=True, num_tokens=num * q_len,
                              page_size=page_size, geometry=geometry, host=layout)
    return StepTensors(ids, positions, slots, kernels.plan_attention(meta), padded_page_table(reqs, device),
                       [(b + 1) * q_len for b in range(num)])


def sampled_entries(reqs: list[ScheduledRequest]) -> list[int]:
    """Indices of the requests that commit tokens this step."""
    return [i for i, r in enumerate(reqs) if r.sample]


def greedy_only(entry: ScheduledRequest) -> bool:
    """Whether ``entry``'s tokens are argmaxes of the model's rows and nothing else: greedy, no logprobs, no
    penalties, no logit bias, no stop token banned (min_tokens), no grammar, no allowed-token list, no bad words
    (whose bans depend on the tokens before each row: a step launched ahead could not know them)."""
    return entry.params.greedy and entry.params.logprobs is None and entry.penalty_history is None \
        and not entry.params.logit_bias and entry.banned is None and entry.token_mask is None \
        and entry.params.allowed_token_ids is None and not entry.params.bad_words


def plain_greedy(entry: ScheduledRequest) -> bool:
    """Whether ``entry`` decodes greedily with nothing else to compute: no drafts to verify, no logprobs, no
    penalties (its step's answer is the argmax of one row: ``runtime.sampling.verify.greedy_verdicts``)."""
    return entry.num_drafts == 0 and greedy_only(entry)


def uses_rejection(entry: ScheduledRequest, use_rejection_sampling: bool) -> bool:
    """Whether ``entry``'s drafts are sampled from q and verified by rejection sampling."""
    return use_rejection_sampling and not entry.params.greedy
