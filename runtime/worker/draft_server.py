"""The separate drafter's step: the far end of ``RemoteDraftChannel`` (global rank N of the replica).

It receives the same plain-data batch as the target shards, so only tensors it cannot rebuild
cross ``torch.distributed``: captured states from rank 0, then the verification outcome; it sends
back the features rank 0 needs to rebuild draft probabilities, and returns the drafts themselves
to the driver as plain data.

Pipelined steps (``ScheduledBatch.pipelined``; ``parallel.pipeline_drafter`` while enough requests run): the
engine alternates two request groups. A step first drafts the group rank 0 verified in the previous step (its
verification outcome kept from then), while rank 0 verifies this step's group, then receives this group's captured
states and outcome and keeps them for the next step. A step that is not pipelined drafts its own requests once
their outcome arrives; a group kept from a pipelined step before it is dropped (its requests are in this step, and
their blocks are drafted from where it leaves them). Rank 0's side is the same either way (it sends, it never
waits for a draft), and its sends meet these receives in the same order. Every step returns ``(late, now)``: the
blocks of the group kept from the step before, and of this step's requests. Pipelining verifies by exact match
only: no features travel back from a kept group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.kernels.transfer import to_device
from runtime.scheduling.step_io import ScheduledBatch
from runtime.spec.wire import confidence_from_ints
from runtime.worker.draft_channel import DraftFeatures, send_features
from runtime.worker.draft_runner import DraftRunner
from runtime.worker.step_tensors import build_step_tensors, sampled_entries, uses_rejection

TARGET_LEADER = 0


class DraftServer:
    def __init__(self, runner: DraftRunner, captured_width: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.runner, self.captured_width, self.kernels = runner, captured_width, runner.kernels
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.pending: tuple | None = None  # pipelined: (entries, committed, accepted, page table, K) of last step

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[dict, dict]:
        """-> (late, now): request id -> the block proposed for its next step and its drafts' confidences (None
        without a confidence head), of the group a pipelined step before kept (drafted now, beside rank 0's verify
        of this step's group; only when this step is pipelined too), and of this step's requests (when it is not)."""
        self.runner.scrub(batch.scrub_page_ids)
        late = {}
        if self.pending is not None:  # the group verified last step, while rank 0 verifies this one
            entries, committed, accepted, table, k_next = self.pending
            self.pending = None
            if batch.pipelined:  # (else its requests are in this step: drafted below, from where it leaves them)
                late = self._blocks(entries, self.runner.draft(entries, committed, accepted, table, k_next))
        reqs = batch.requests
        if not reqs or not batch.maintain_draft_context:
            return late, {}
        t = build_step_tensors(reqs, self.page_size, self.device, self.kernels)
        captured = torch.empty(len(t.input_ids), self.captured_width, dtype=self.dtype, device=self.device)
        dist.recv(captured, src=TARGET_LEADER)
        self.runner.append_context(captured, t.positions, t.slots)
        sampled = sampled_entries(reqs)
        k_next = batch.num_next_drafts
        if not sampled or not k_next:
            return late, {}
        entries = [reqs[i] for i in sampled]
        k_max = max(e.num_drafts for e in entries)
        committed = torch.empty(len(entries), k_max + 1, dtype=torch.int64, device=self.device)
        accepted = torch.empty(len(entries), dtype=torch.int64, device=self.device)
        dist.recv(committed, src=TARGET_LEADER)
        dist.recv(accepted, src=TARGET_LEADER)
        table = t.page_table[to_device(sampled, self.device)] if len(sampled) < len(reqs) else t.page_table
        if batch.pipelined:  # drafted next step, beside rank 0's verify of the other group
            self.pending = (entries, committed, accepted, table, k_next)
            return late, {}
        out = self.runner.draft(entries, committed, accepted, table, k_next)
        rows = [i for i, e in enumerate(entries) if uses_rejection(e, self.runner.use_rejection)]
        if rows:
            index = to_device(rows, self.device)
            low = out.low_rank[index] if out.low_rank is not None else None
            send_features(DraftFeatures(out.hidden[index], low), dst=TARGET_LEADER)
        return late, self._blocks(entries, out)

    def _blocks(self, entries, out) -> dict[str, tuple[list[int], list[float] | None]]:
        """The driver's plain data of a drafted block: request id -> (drafts, confidences or None)."""
        host = out.block.tolist()  # tokens, length, confidences: packed where they were drafted
        k = out.tokens.shape[1]
        return {e.request_id: (row[:row[k]], confidence_from_ints(row[k + 1:k + 1 + row[k]])
                               if out.confidence is not None else None) for e, row in zip(entries, host)}
