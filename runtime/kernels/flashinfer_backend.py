"""The ``flashinfer`` kernel backend (CUDA): FlashInfer paged attention, fused Triton norm/RoPE/activation kernels.

Attention over the paged cache (prefill chunks, decode, the K+1-token verify) is FlashInfer's on the cache layout the
engine already uses (``[pages, page_size, kv_heads, head_dim]``, FlashInfer's NHD), planned once per forward from the
step's host-side layout (``PagedAttentionMeta.host``) and reused by every layer: its batch prefill kernel for eager
forwards (any mix of query lengths), its tensor-core decode kernel for the CUDA graphs of uniform steps
(``graph_wrapper``: Q tokens per request, the faster of the two there). A draft block (its context plus its own keys,
the context length known only on the device) runs a Triton flash-attention kernel (``triton_ops.block_attention``) that
needs no plan, so drafts can be graphed too.
RMSNorm (with the residual add fused), q/k norm + RoPE (fused with the KV-cache write), SiLU-and-mul and a greedy
Markov-head step (its product, the add and the argmax in one launch) are the Triton kernels of ``triton_ops``; the
exponential-race sampler is the torch reference's.

Loading this backend imports flashinfer and triton and needs a CUDA device; anything missing raises
``KernelBackendUnavailable`` naming it (the registry never substitutes another backend).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from runtime.kernels import torch_ref
from runtime.kernels.interface import AttentionGeometry, PagedAttentionMeta

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-k scratch, one per device (its docs recommend 128 MiB and up)


@dataclass(frozen=True, slots=True)
class HostIndptrs:
    """FlashInfer's page-table arrays for one forward, built on the host (int32, CPU)."""

    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [sum of pages]
    last_page_len: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B] keys per request


def host_indptrs(qo_lens: list[int], kv_lens: list[int], page_ids: list[list[int]], page_size: int) -> HostIndptrs:
    """qo_lens/kv_lens [B], page_ids per request (covering kv_lens) -> FlashInfer's CSR page table."""
    qo, kv, indices, last = [0], [0], [], []
    for q_len, kv_len, pages in zip(qo_lens, kv_lens, page_ids):
        used = -(-kv_len // page_size)
        if used > len(pages):
            raise ValueError(f"attention layout: {kv_len} keys need {used} pages, the request holds {len(pages)}")
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + used)
        indices.extend(pages[:used])
        last.append(kv_len - (used - 1) * page_size)

    def ints(values: list[int]) -> torch.Tensor:  # via numpy: torch.tensor(list) costs ~3x (1.8 ms for 33K ints)
        return torch.from_numpy(np.array(values, dtype=np.int32))

    return HostIndptrs(ints(qo), ints(kv), ints(indices), ints(last), ints(kv_lens))


class FlashInferPlan:
    """A planned FlashInfer wrapper shared by every layer of one forward.

    A prefill wrapper takes any query lengths; a decode wrapper (CUDA graphs of uniform steps) takes ``q_len``
    tokens per request, causal within the request's block, i.e. the same mask as the prefill kernel's causal
    one (aligned to each request's last key)."""

    def __init__(self, wrapper, indptrs: HostIndptrs, causal: bool, page_size: int):
        self.wrapper, self.indptrs, self.causal, self.page_size = wrapper, indptrs, causal, page_size
        self.planned: AttentionGeometry | None = None

    def ensure(self, geometry: AttentionGeometry) -> None:
        """Plan for ``geometry`` unless already planned for it.

        Always under ``torch.inference_mode()``: planning writes only the wrapper's own buffers (FlashInfer
        allocates some lazily, inside ``plan``), and a buffer made inside inference mode (an engine's forward)
        refuses in-place writes outside it, so a wrapper first planned by an engine and later by a caller outside
        inference mode (or the reverse) failed in FlashInfer's ``plan`` ("Inplace update to inference tensor
        outside InferenceMode"). One mode for every plan keeps the wrapper usable from both."""
        if self.planned == geometry:
            return
        i, g = self.indptrs, geometry
        if isinstance(self.wrapper, DecodeGraphWrapper) and not self.causal:
            raise ValueError(f"a decode wrapper serves {self.wrapper.q_len} causal tokens per request, got a "
                             "non-causal layout")
        with torch.inference_mode():
            if isinstance(self.wrapper, DecodeGraphWrapper):
                self.wrapper.plan(i, g, self.page_size)
            else:
                self.wrapper.plan(i.qo_indptr, i.kv_indptr, i.kv_indices, i.last_page_len, g.num_q_heads,
                                  g.num_kv_heads, g.head_dim, self.page_size, causal=self.causal, sm_scale=g.scale,
                                  q_data_type=g.dtype, kv_data_type=g.dtype)
        self.planned = geometry

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the planned forward's queries q [T, Hq, D] -> [T, Hq, D] (into ``out`` when given: the
        prefill wrapper only, as piecewise graphs read a fixed address, ``runtime.worker.piecewise``)."""
        if isinstance(self.wrapper, DecodeGraphWrapper):
            if out is not None:
                raise ValueError("a decode graph wrapper's attention returns its own output; out is for eager plans")
            return self.wrapper.run(q, k_cache, v_cache, self.planned.scale)
        return self.wrapper.run(q, (k_cache, v_cache), out=out)


@dataclass
class DecodeGraphWrapper:
    """FlashInfer's decode wrapper (tensor cores, fa2) fixed to ``q_len`` tokens per request: what a CUDA graph of
    a uniform step replays. Measured on H200 (``benchmarks/attention_decode.py``): as fast as the prefill kernel
    for one token at batch 1 and 1.3-1.6x faster for a K+1 = 8 token verify at batch 4-64.

    Its plan never waits for the device: FlashInfer copies the page table into the graph's buffers on the stream,
    and a copy from pageable host memory (or its blocking copy of host page indices) would first drain the
    stream. So the indptrs are staged in pinned memory and the page indices on the device (``stage``), and a plan
    can be made while the GPU still runs an earlier step (its copies queue behind that step). Invariant: the
    pinned staging is rewritten only after the previous plan's copies have run (the graph runner waits on an
    event recorded after each plan, ``GraphedTargetForward._plan``).

    Replanning is the hot path (every step whose layout was not planned ahead): the first plan of a geometry goes
    through FlashInfer's ``plan`` (which resolves and caches the kernel module and checks every argument), every
    later one (``_replan``) writes the page table into the wrapper's buffers and calls that cached module's planner
    directly with the keys per request the host already knows: the same planner, arguments and buffers as
    ``plan``'s fa2 tensor-core path (what FlashInfer's own ``fast_decode_plan`` does for SGLang), without ~0.2 ms
    of Python checks a step. ``tests/gpu`` holds both to the same plan info and outputs."""

    inner: object
    q_len: int
    indptr_host: torch.Tensor  # [B+1] int32, pinned
    last_page_len_host: torch.Tensor  # [B] int32, pinned
    indices_host: torch.Tensor  # [max_pages] int32, pinned
    indices_device: torch.Tensor  # [max_pages] int32
    qo_indptr_host: torch.Tensor  # [B+1] int32: 0, Q, 2Q, ... (every request feeds Q tokens)
    planned_geometry: AttentionGeometry | None = None  # what FlashInfer's own plan last resolved
    fast_plans: int = 0  # plans made by ``_replan``

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the planned step's queries q [B * q_len, Hq, D] over the caches."""
        return self.inner.run(q, (k_cache, v_cache))

    def stage(self, indptrs: HostIndptrs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy a plan's page table into the staging buffers -> (kv_indptr, kv_indices, last_page_len) views for
        ``plan``: pinned host, device (its copy queued on the current stream), pinned host."""
        b, n = len(indptrs.last_page_len), len(indptrs.kv_indices)
        self.indptr_host[:b + 1].copy_(indptrs.kv_indptr)
        self.last_page_len_host[:b].copy_(indptrs.last_page_len)
        self.indices_host[:n].copy_(indptrs.kv_indices)
        self.indices_device[:n].copy_(self.indices_host[:n], non_blocking=True)
        return self.indptr_host[:b + 1], self.indices_device[:n], self.last_page_len_host[:b]

    def plan(self, indptrs: HostIndptrs, geometry: AttentionGeometry, page_size: int) -> None:
        """Plan for ``indptrs`` (B requests of ``q_len`` tokens, B the wrapper's batch)."""
        batch = len(self.qo_indptr_host) - 1
        if not torch.equal(indptrs.qo_indptr, self.qo_indptr_host):
            q_lens = sorted(set((indptrs.qo_indptr[1:] - indptrs.qo_indptr[:-1]).tolist()))
            raise ValueError(f"a decode wrapper serves {batch} requests of {self.q_len} tokens per request, got "
                             f"{len(indptrs.qo_indptr) - 1} requests of {q_lens} tokens")
        indptr, indices, last = self.stage(indptrs)
        if self.planned_geometry == geometry:
            self._replan(indptr, indptrs.kv_lens, len(indptrs.kv_indices), geometry, page_size)
            return
        extra = {"q_len_per_req": self.q_len} if self.q_len > 1 else {}
        self.inner.plan(indptr, indices, last, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim,
                        page_size, sm_scale=geometry.scale, q_data_type=geometry.dtype, kv_data_type=geometry.dtype,
                        **extra)
        inner = self.inner
        if not (inner.use_tensor_cores and inner._backend == "fa2" and inner.is_cuda_graph_enabled):
            raise RuntimeError(f"kernel backend 'flashinfer': the graph's decode wrapper resolved to backend "
                               f"{inner._backend!r} (tensor cores {inner.use_tensor_cores}); its replanning "
                               "serves the fa2 tensor-core path only")
        self.planned_geometry = geometry

    def _replan(self, indptr_host: torch.Tensor, kv_lens: torch.Tensor, num_pages: int, geometry: AttentionGeometry,
                page_size: int) -> None:
        """FlashInfer's fa2 tensor-core plan for the staged page table: the buffers the graph reads, then the cached
        module's planner (it writes the work split into the pinned int workspace and queues its copy)."""
        inner, b = self.inner, len(kv_lens)
        self._copy_page_table(indptr_host, num_pages)
        inner._plan_info = inner._cached_module.plan(
            inner._float_workspace_buffer, inner._int_workspace_buffer, inner._pin_memory_int_workspace_buffer,
            self.qo_indptr_host, indptr_host, kv_lens, b * self.q_len, b, geometry.num_q_heads,
            geometry.num_kv_heads, page_size, True, geometry.head_dim, geometry.head_dim,
            self.q_len > 1,  # causal within the request's block
            -1,  # no sliding window
            -1, False, 0,  # split size chosen by the planner, split-kv allowed, no colocated CTAs
            self.q_len, True)  # every request feeds exactly q_len rows
        self.fast_plans += 1

    def _copy_page_table(self, indptr_host: torch.Tensor, num_pages: int) -> None:
        """The staged page table into the buffers the graph's kernel reads (copies queued on the stream)."""
        inner, b = self.inner, len(indptr_host) - 1
        inner._paged_kv_indptr_buf.copy_(indptr_host, non_blocking=True)
        inner._paged_kv_last_page_len_buf.copy_(self.last_page_len_host[:b], non_blocking=True)
        inner._paged_kv_indices_buf[:num_pages].copy_(self.indices_device[:num_pages], non_blocking=True)


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self):
        from runtime.kernels import KernelBackendUnavailable

        if not torch.cuda.is_available():
            raise KernelBackendUnavailable("kernel backend 'flashinfer' needs a CUDA device; none is visible")
        try:
            import flashinfer  # noqa: F401

            from runtime.kernels import triton_ops
        except ImportError as exc:
            raise KernelBackendUnavailable(f"kernel backend 'flashinfer' cannot run: {exc} (pip install "
                                           "'dspark[gpu]')") from exc
        self._ops = triton_ops
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._eager: dict[torch.device, object] = {}

    # ---- attention ----------------------------------------------------------------------------

    def workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[device]

    def graph_wrapper(self, device: torch.device, batch_size: int, max_pages: int, q_len: int) -> DecodeGraphWrapper:
        """A CUDA-graph-safe wrapper for exactly ``batch_size`` requests of ``q_len`` tokens each (causal within the
        request) and at most ``max_pages`` pages."""
        import flashinfer

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        inner = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=buf(batch_size + 1), paged_kv_indices_buffer=buf(max_pages),
            paged_kv_last_page_len_buffer=buf(batch_size), backend="fa2")

        def pinned(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, pin_memory=True)

        qo_indptr = torch.arange(batch_size + 1, dtype=torch.int32) * q_len
        return DecodeGraphWrapper(inner, q_len, pinned(batch_size + 1), pinned(batch_size), pinned(max_pages),
                                  buf(max_pages), qo_indptr)

    def _eager_wrapper(self, device: torch.device):
        """The wrapper eager forwards on ``device`` plan and run (one at a time: a forward plans, then runs)."""
        import flashinfer

        if device not in self._eager:
            self._eager[device] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(device), "NHD",
                                                                                 backend="fa2")
        return self._eager[device]

    def plan_attention(self, meta: PagedAttentionMeta, wrapper=None) -> PagedAttentionMeta:
        """Plan FlashInfer from ``meta.host`` (and ``meta.geometry`` when given, at once). A draft block (extra
        keys) needs no plan: its Triton kernel reads every length on the device."""
        if meta.num_extra_keys:
            return meta
        if meta.host is None:
            raise ValueError("flashinfer attention needs the forward's host layout (PagedAttentionMeta.host)")
        host = meta.host
        indptrs = host_indptrs(host.qo_lens, host.kv_lens, host.page_ids, meta.page_size)
        device = meta.seq_lens.device
        plan = FlashInferPlan(wrapper or self._eager_wrapper(device), indptrs, meta.causal,
                              meta.page_size)
        if meta.geometry is not None:
            plan.ensure(meta.geometry)
        return dataclasses.replace(meta, plan=plan)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: PagedAttentionMeta, scale: float, extra_k: torch.Tensor | None = None,
                        extra_v: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D] -> [T, Hq, D]
        if extra_k is not None:
            return self._ops.block_attention(q, k_cache, v_cache, meta.page_table, meta.seq_lens, extra_k, extra_v,
                                             scale, meta.context_window, max_context=meta.max_seq_len)
        meta.plan.ensure(AttentionGeometry(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, scale))
        return meta.plan.run(q, k_cache, v_cache)

    # ---- elementwise --------------------------------------------------------------------------

    write_kv = staticmethod(torch_ref.write_kv)
    sample_exponential_race = staticmethod(torch_ref.sample_exponential_race)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def markov_argmax(self, base: torch.Tensor, low_rank: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._ops.markov_argmax(base, low_rank, weight)

    def qk_norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        return self._ops.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    def rope_and_cache(self, q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, q_index=None,
                       q_rows=0):
        return self._ops.rope_and_cache(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots,
                                        q_index, q_rows)

    def rope_and_cache_kv(self, k, v, k_weight, eps, cos, sin, k_cache, v_cache, slots):
        self._ops.rope_and_cache_kv(k, v, k_weight, eps, cos, sin, k_cache, v_cache, slots)
