"""Piecewise CUDA graphs of the target's forward: the steps no whole-step graph serves (``runtime.worker.graphs``).

A step that mixes prefill chunks with decoding requests (``LLMConfig.enable_mixed_prefill``), a long prompt chunk, or
a mix too ragged to pad into a uniform graph has a layout no graph captured in advance can plan: FlashInfer's
attention needs the step's query lengths on the host. Run eagerly, such a step launches every kernel of every layer
from Python (~10 a layer): on an H200 a 2.7B target's mixed steps at 64 requests took 12-23 ms for the ~8 ms of
device work a graphed verify of the same requests takes, host-bound and as noisy as the host.

So the forward is cut at each layer's attention, as vLLM's piecewise graphs cut it: everything between two
attentions (the output projection, the residual adds and norms, the MLP, the next layer's q/k/v projection, q/k norm,
RoPE and the KV-cache write; the embedding before the first, the final norm and the captured layers after the last)
is one graph piece, captured once per token bucket (``token_buckets``) and replayed; the attention between pieces runs
eagerly with the step's own plan (FlashInfer's prefill kernel, any query lengths) on the step's real rows. A step of
T tokens replays the pieces of the smallest bucket >= T: its rows past T are padding (token 0 at position 0, writing
the scratch page no request owns, attending to nothing: their attention output is zero), dropped from the outputs.

Invariants:
- Pieces of every bucket share one memory pool and one set of buffers (the attention's query and output, the inputs,
  the final states): the pieces run in the order they were captured, one forward at a time, so memory one piece
  frees is reused by the next piece (or the next bucket) only after the piece that wrote it has run.
- Each piece copies the query it computed into the shared query buffer (so the eager attention reads a fixed address),
  and reads the attention's output from the shared output buffer (so the eager attention writes one); the outputs are
  views of shared buffers, valid until the next piecewise forward.
- The values are the eager forward's, kernel for kernel (the same modules run at capture); padding rows never reach a
  real row (rows are independent outside attention, and the attention's plan holds the real rows only).

Single rank only (under tensor parallelism every rank would have to replay the same buckets; not yet built).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from runtime.kernels import AttentionGeometry, PagedAttentionMeta
from runtime.models.target import TargetModel
from runtime.scheduling.kv_cache import KVCaches
from runtime.worker.graph_layout import bucket_of
from runtime.worker.graphs import ContextAppend
from runtime.worker.step_tensors import StepTensors

log = logging.getLogger(__name__)

# Token counts a piecewise forward is captured for: fine steps where mixed steps of up to a few hundred tokens land
# (64 decoding requests verifying blocks of 8 feed 512), coarser above, where a step is device-bound and its padding
# is what it costs; none past PIECEWISE_MAX_TOKENS (a longer step's launches are small beside its device time).
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
PIECEWISE_MAX_TOKENS = TOKEN_BUCKETS[-1]


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets for steps of up to ``max_tokens`` (``LLMConfig.max_num_batched_tokens``) tokens: every
    ``TOKEN_BUCKETS`` size below it, and ``max_tokens`` itself as the last one when it is within
    ``PIECEWISE_MAX_TOKENS``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    buckets = [b for b in TOKEN_BUCKETS if b < max_tokens]
    return buckets + [max_tokens] if max_tokens <= PIECEWISE_MAX_TOKENS else buckets


@dataclass
class PiecewiseOutputs:
    """One piecewise forward's results for its T real rows (views of shared buffers, valid until the next one)."""

    hidden: torch.Tensor  # [T, d] final-normed states
    captured: torch.Tensor | None  # [T, m*d]
    context_appended: bool  # the drafter's context append ran inside the last piece's graph


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph]  # layers + 1: before the first attention, between two, after the last
    context: torch.cuda.CUDAGraph | None  # appends the bucket's captured rows to the drafter's cache


class _AttentionCut:
    """Stands in for FlashInfer's plan while a forward is captured: at each layer's attention it copies the query
    into the shared query buffer, ends the piece being captured and begins the next (``capturing``), and hands the
    layer the shared attention output as its attention's result. Used unchanged, without graphs, for the warm-up."""

    def __init__(self, owner: PiecewiseTargetForward, rows: int, capturing: bool):
        self.owner, self.rows, self.capturing = owner, rows, capturing
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, in forward order

    def begin(self) -> None:
        if self.capturing:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.owner.pool)
            self.pieces.append(graph)

    def end(self) -> None:
        if self.capturing:
            self.pieces[-1].capture_end()

    def ensure(self, geometry: AttentionGeometry) -> None:
        if geometry != self.owner.geometry:
            raise ValueError(f"piecewise graphs: a layer's attention geometry {geometry} differs from the "
                             f"target's {self.owner.geometry}")

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # q: [rows, Hq, D] -> the shared attention output [rows, Hq, D] (zero: filled at replay by the real attention)
        self.owner.query[:self.rows].copy_(q)
        self.caches.append((k_cache, v_cache))
        self.end()
        self.begin()
        return self.owner.attention_out[:self.rows]


class PiecewiseTargetForward:
    """The target's forward cut at its attentions, graphed piece by piece per token bucket (see the module doc).

    ``forward(t)`` runs a step whose tensors ``build_step_tensors`` made (planned with the target's geometry on the
    flashinfer backend) and whose token count ``serves``: the pieces of its bucket replay around the step's eager
    attentions."""

    def __init__(self, target: TargetModel, caches: KVCaches, geometry: AttentionGeometry, page_size: int,
                 scratch_page: int, max_tokens: int, device: torch.device,
                 append_context: ContextAppend | None = None):
        self.target, self.caches, self.geometry, self.device = target, caches, geometry, device
        self.append_context = append_context
        self.scratch_slot = scratch_page * page_size
        self.page_size = page_size
        self.buckets = token_buckets(max_tokens)
        width = self.buckets[-1]
        self.inputs = torch.zeros(3, width, dtype=torch.int64, device=device)  # ids, positions, slots
        self.query = torch.zeros(width, geometry.num_q_heads, geometry.head_dim, dtype=geometry.dtype, device=device)
        self.attention_out = torch.zeros_like(self.query)  # [width, Hq, D]
        self.hidden = torch.zeros(width, target.config.hidden_size, dtype=geometry.dtype, device=device)
        captured = len(target.capture_layer_ids)
        self.captured = torch.zeros(width, captured * target.config.hidden_size, dtype=geometry.dtype,
                                    device=device) if captured else None
        self.pool = torch.cuda.graph_pool_handle()
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: dict[int, _Bucket] = {}
        self.replays = 0  # forwards served
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        stream = torch.cuda.Stream(device)  # one side stream: its warm-ups' cached blocks serve every bucket
        with torch.inference_mode():
            for bucket in reversed(self.buckets):  # the largest first: smaller ones reuse its pool memory
                self.graphs[bucket] = self._capture(bucket, stream)
        # the warm-ups' blocks, cached by the allocator for the side stream, go back to the device: what stays is the
        # graphs' pool (one bucket's working set at a time) and the shared buffers
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        self.capture_seconds = time.perf_counter() - start
        log.info("dspark: captured piecewise CUDA graphs of %d pieces for steps of %s tokens in %.1f s, %.0f MiB",
                 self.num_pieces, self.buckets, self.capture_seconds, self.capture_bytes / 2**20)

    @property
    def num_pieces(self) -> int:
        return len(self.layer_caches) + 1

    def serves(self, num_tokens: int) -> bool:
        return bucket_of(self.buckets, num_tokens) is not None

    def as_dict(self) -> dict:
        """What ``rank_info()`` shows."""
        return {"token_buckets": self.buckets, "pieces": self.num_pieces, "replays": self.replays,
                "capture_s": round(self.capture_seconds, 2), "capture_mib": round(self.capture_bytes / 2**20, 1)}

    def _pad_inputs(self, start: int, end: int) -> None:
        """Rows ``start..end`` of the inputs are padding: token 0 at position 0, writing the scratch page."""
        self.inputs[:2, start:end].zero_()
        self.inputs[2, start:end].fill_(self.scratch_slot)

    def _body(self, bucket: int, cut: _AttentionCut) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, positions, slots = (x[:bucket] for x in self.inputs)
        seq_lens = self.inputs[0, :1]  # placeholders: the cut reads nothing of the layout
        meta = PagedAttentionMeta(query_start_loc=seq_lens, seq_lens=seq_lens, page_table=seq_lens[:, None],
                                  max_query_len=bucket, max_seq_len=0, causal=True, num_tokens=bucket,
                                  page_size=self.page_size, plan=cut, geometry=self.geometry)
        hidden, captured = self.target(ids, positions, self.caches, meta, slots)
        self.hidden[:bucket].copy_(hidden)
        if captured is not None:
            self.captured[:bucket].copy_(captured)
        return self.hidden[:bucket], self.captured[:bucket] if captured is not None else None

    def _capture(self, bucket: int, stream: torch.cuda.Stream) -> _Bucket:
        self._pad_inputs(0, bucket)  # capture-time inputs: every row a padding row's
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graphs (lazy inits, Triton compilation for these shapes)
                self._body(bucket, _AttentionCut(self, bucket, capturing=False))
            torch.cuda.synchronize(self.device)
            cut = _AttentionCut(self, bucket, capturing=True)
            cut.begin()
            _, captured = self._body(bucket, cut)
            cut.end()
            context = None
            if self.append_context is not None and captured is not None:
                positions, slots = self.inputs[1, :bucket], self.inputs[2, :bucket]
                self.append_context(captured, positions, slots)  # warm-up: writes the scratch page only
                context = torch.cuda.CUDAGraph()
                context.capture_begin(pool=self.pool)
                self.append_context(captured, positions, slots)
                context.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if not self.layer_caches:
            self.layer_caches = cut.caches
        elif [c[0].data_ptr() for c in cut.caches] != [c[0].data_ptr() for c in self.layer_caches]:
            raise RuntimeError("piecewise graphs: buckets cut the forward at different layers")
        return _Bucket(cut.pieces, context)

    def forward(self, t: StepTensors, append_context: bool) -> PiecewiseOutputs:
        """Run the step of ``t`` (``serves`` its token count; ``t.meta`` planned by the flashinfer backend with the
        target's geometry) through its bucket's pieces and the step's eager attentions; ``append_context``: the
        drafter's context append too (when one was captured)."""
        num = t.input_ids.shape[0]
        bucket = bucket_of(self.buckets, num)
        if bucket is None:
            raise ValueError(f"piecewise graphs serve steps of up to {self.buckets[-1]} tokens, got {num}")
        graphs = self.graphs[bucket]
        plan = t.meta.plan
        plan.ensure(self.geometry)
        self.inputs[0, :num].copy_(t.input_ids)
        self.inputs[1, :num].copy_(t.positions)
        self.inputs[2, :num].copy_(t.slots)
        if num < bucket:
            self._pad_inputs(num, bucket)
            self.attention_out[num:bucket].zero_()  # padding rows attend to nothing (their rows are dropped)
        query, out = self.query[:num], self.attention_out[:num]
        for piece, (k_cache, v_cache) in zip(graphs.pieces, self.layer_caches):
            piece.replay()
            plan.run(query, k_cache, v_cache, out=out)
        graphs.pieces[-1].replay()
        appended = append_context and graphs.context is not None
        if appended:
            graphs.context.replay()
        self.replays += 1
        return PiecewiseOutputs(self.hidden[:num], self.captured[:num] if self.captured is not None else None,
                                appended)


__all__ = ["PIECEWISE_MAX_TOKENS", "TOKEN_BUCKETS", "PiecewiseOutputs", "PiecewiseTargetForward", "token_buckets"]
