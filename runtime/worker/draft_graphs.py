"""CUDA graphs of the drafter's block step (block forward, Markov chain, confidence), one per (batch bucket, block
length): the block length is ``max_draft_len`` and every shorter length a ``draft_len_schedule`` asks for.

The graphed step is ``DraftRunner.draft_block`` over persistent buffers: anchors [B], their positions (= each
request's context length) [B] and page tables [B, P]. Every length is read on the device (the block attention is
a Triton kernel that needs no host plan), so the step's inputs are written with device-to-device copies right
after verification and the replay follows with no host synchronization. Padding rows draft from token 0 with a
one-token context on the scratch page; their outputs are dropped. Requests whose drafts are sampled (rejection
sampling) run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from runtime.worker.draft_runner import DraftOutput, DraftRunner
from runtime.worker.graph_layout import batch_buckets, bucket_of

log = logging.getLogger(__name__)


class DraftGraphs:
    def __init__(self, runner: DraftRunner, block_sizes: list[int], max_batch: int, max_pages: int,
                 scratch_page: int):
        self.runner, self.device, self.scratch_page = runner, runner.device, scratch_page
        self.block_sizes = sorted(set(block_sizes))
        self.buckets = batch_buckets(max_batch)
        self.anchors = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self.anchor_pos = torch.ones(max_batch, dtype=torch.int64, device=self.device)
        self.page_table = torch.full((max_batch, max_pages), scratch_page, dtype=torch.int64, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DraftOutput]] = {}
        start = time.perf_counter()
        for block in self.block_sizes:
            for batch in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
                self.graphs[(batch, block)] = self._capture(batch, block)
        self.capture_seconds = time.perf_counter() - start
        log.info("dspark: captured %d drafter CUDA graphs (batch %s x block %s) in %.1f s", len(self.graphs),
                 self.buckets, self.block_sizes, self.capture_seconds)

    def serves(self, num: int, k_next: int) -> bool:
        return k_next in self.block_sizes and num <= self.buckets[-1]

    def run(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, page_table: torch.Tensor,
            k_next: int) -> DraftOutput:
        """anchors, anchor_pos [S], page_table [S, P] (device) -> the S real rows of the replayed graph's output
        (a block of ``k_next`` drafts)."""
        num, width = page_table.shape
        batch = bucket_of(self.buckets, num)
        self.anchors[:num].copy_(anchors)
        self.anchor_pos[:num].copy_(anchor_pos)
        self.page_table[:num, :width].copy_(page_table)
        if batch > num:  # padding rows: token 0, a one-token context on the scratch page
            self.anchors[num:batch].zero_()
            self.anchor_pos[num:batch].fill_(1)
            self.page_table[num:batch, 0].fill_(self.scratch_page)
        graph, out = self.graphs[(batch, k_next)]
        graph.replay()
        return out.rows(num)

    def _capture(self, batch: int, block: int) -> tuple[torch.cuda.CUDAGraph, DraftOutput]:
        args = (self.anchors[:batch], self.anchor_pos[:batch], self.page_table[:batch], block)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits, Triton compilation)
            for _ in range(2):
                self.runner.draft_block(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.runner.draft_block(*args)
        return graph, out
