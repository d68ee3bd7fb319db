"""``Worker``: everything one process holds for a replica (torch only; Ray actors wrap it 1:1).

A replica of ``tensor_parallel_size = N`` is N target workers (TP ranks 0..N-1) plus, with
``drafter="separate"``, one drafter worker (global rank N). With ``"colocated"`` the drafter lives
in TP rank 0's worker. Lifecycle: ``join`` (process group, when there is more than one process),
``load`` (weights; returns how many KV pages this process could hold), ``allocate`` (the replica's
page count, the minimum over its workers), then ``execute`` once per step.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch.distributed as dist

from configs import LLMConfig
from runtime.kernels import get_backend
from runtime.kernels.moe import GRAPH_SAFE
from runtime.kernels.profiling import StepProfiler
from runtime.models.loader import (drafter_spec, load_drafter, load_hf_config, load_markov_w2, load_target,
                                   load_vocab_modules)
from runtime.models.moe import sparse_layer_ids
from runtime.models.parallel import SINGLE, ParallelContext, init_distributed
from runtime.models.small_gemm import SmallGemmReport, install_small_gemms
from runtime.scheduling.kv_cache import allocate_caches, bytes_per_page
from runtime.scheduling.step_io import ScheduledBatch
from runtime.worker.all_reduce import choose_reducer
from runtime.worker.cpu_gemm import CpuGemmReport, install_cpu_gemms
from runtime.worker.devices import (check_draft_attention_backend, kv_budget_bytes, resolve_device, resolve_dtype,
                                    resolve_kernel_backend, resolve_moe_backend)
from runtime.worker.draft_channel import LocalDraftChannel, RemoteDraftChannel
from runtime.worker.draft_graphs import DraftGraphs
from runtime.worker.draft_runner import DraftRunner
from runtime.worker.draft_server import DraftServer
from runtime.worker.graph_layout import PREFILL_GRAPH_TOKENS, PREFILL_Q_LENS, batch_buckets
from runtime.worker.graphs import GraphedTargetForward
from runtime.worker.piecewise import PiecewiseTargetForward, token_buckets
from runtime.worker.runner import ModelRunner, attention_geometry
from runtime.worker.transfer import finish

DRAFTER_MODES = ("colocated", "separate")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """This process's role in its replica."""

    role: str  # "target" or "drafter"
    tp_rank: int
    tp_size: int
    drafter: str | None  # "colocated", "separate", or None without speculation

    @property
    def world_size(self) -> int:
        return self.tp_size + (1 if self.drafter == "separate" else 0)

    @property
    def global_rank(self) -> int:
        return self.tp_size if self.role == "drafter" else self.tp_rank

    @property
    def holds_drafter(self) -> bool:
        return self.role == "drafter" or (self.drafter == "colocated" and self.tp_rank == 0)


class Worker:
    def __init__(self, config: LLMConfig, plan: WorkerPlan):
        if plan.drafter is not None and plan.drafter not in DRAFTER_MODES:
            raise ValueError(f"drafter must be one of {list(DRAFTER_MODES)}, got {plan.drafter!r}")
        self.config, self.plan, self.spec = config, plan, config.speculative_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kernel_backend = resolve_kernel_backend(config.kernel_backend, self.device, self.dtype)
        self.kernels = get_backend(self.kernel_backend)
        if config.kernel_backend == "auto":
            log.info("dspark: kernel_backend auto -> %s on %s", self.kernel_backend, self.device)
        self.graphs: GraphedTargetForward | None = None
        self.piecewise: PiecewiseTargetForward | None = None  # the steps no whole-step graph serves (one GPU)
        self.step_profiler = StepProfiler()  # idle until the driver starts a profile of this rank's steps
        self.parallel: ParallelContext = SINGLE
        self.allreduce: str | None = None  # how the TP ranks sum (join), None on one rank
        self.target = self.drafter = self.vocab = self.draft_w2 = None
        self.engine_part: ModelRunner | DraftServer | None = None
        self.draft_runner: DraftRunner | None = None  # this process's drafter (colocated or separate), once allocated
        self.moe_backend = self.draft_moe_backend = None
        self.small_gemms: SmallGemmReport | None = None
        self.cpu_gemms: CpuGemmReport | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def join(self, init_method: str, backend: str, timeout_s: float, allreduce_strategy: str = "NCCL") -> None:
        """Join the replica's process group (world = TP ranks + a separate drafter) and its TP subgroup; the TP ranks
        then choose together how they sum (``runtime.worker.all_reduce.choose_reducer``: NCCL, ONESHOT or AUTO)."""
        init_distributed(backend, init_method, self.plan.world_size, self.plan.global_rank, timeout_s)
        group = dist.new_group(list(range(self.plan.tp_size)))
        if self.plan.role == "target" and self.plan.tp_size > 1:
            reducer, self.allreduce = choose_reducer(allreduce_strategy, group, self.device, self.dtype,
                                                     f"target rank {self.plan.tp_rank}")
            self.parallel = ParallelContext(self.plan.tp_rank, self.plan.tp_size, group, reducer)

    def load(self) -> int:
        """Load this process's weights; returns the KV pages its memory budget holds."""
        target_config = load_hf_config(self.config.model, "model")
        draft_spec = drafter_spec(self.spec) if self.spec is not None else None  # checked before any weights load
        if self.spec is not None:
            check_draft_attention_backend(self.spec)
        layers = []
        rank = f"target rank {self.plan.tp_rank}" if self.plan.role == "target" else "the drafter process"
        if self.plan.role == "target":
            self.moe_backend = resolve_moe_backend(self.config.moe_backend, self.device, self.dtype,
                                                   bool(sparse_layer_ids(target_config)), "moe_backend", rank)
            if self.moe_backend != "none":
                log.info("dspark: %s: moe_backend %s -> %s", rank, self.config.moe_backend, self.moe_backend)
            self.target = load_target(self.config.model, self.kernels, self.dtype, self.device, self.parallel,
                                      self.config.load_format, self.moe_backend)
            self.target.fuse_projections()
            layers += list(self.target.model.layers)
            if self.spec is not None and self.plan.tp_rank == 0:
                self.target.set_capture(self.spec.target_layer_ids)
            if self.spec is not None and self.spec.use_rejection_sampling and (self.spec.markov_rank or 0) > 0 \
                    and not (self.plan.holds_drafter and self.plan.tp_size == 1):
                self.draft_w2 = load_markov_w2(self.spec, target_config.vocab_size, self.dtype, self.device)
        if self.spec is not None:
            # a standalone DeepSpec drafter is dense: "none" whatever the target's (asking for one is an error);
            # an embedded drafter's MoE stages inherit the target's moe_backend unless the spec names one
            sparse = bool(draft_spec.sparse_stages)
            inherit = self.spec.moe_backend is None and sparse
            self.draft_moe_backend = resolve_moe_backend(
                self.config.moe_backend if inherit else self.spec.moe_backend, self.device, self.dtype, sparse,
                "moe_backend (inherited by the drafter)" if inherit else "speculative_config.moe_backend", rank)
        if self.plan.holds_drafter and self.spec is not None:
            self.drafter = load_drafter(self.spec, target_config, self.kernels, self.dtype, self.device, draft_spec,
                                        self.draft_moe_backend)
            self.drafter.fuse_projections()
            layers += list(self.drafter.layers)
            if self.target is None or self.parallel.is_parallel:
                self.vocab = load_vocab_modules(self.config.model, target_config, self.dtype, self.device,
                                                self.config.load_format)
        if self.kernel_backend == "flashinfer":  # few-row GEMMs: cuBLAS or Triton, whichever measures faster here;
            # the graphs' many-row GEMMs padded where cuBLAS measures faster on more rows
            models = [m for m in (self.target, self.drafter, self.vocab) if m is not None]
            graphed = self.uses_cuda_graphs or self.drafter_uses_cuda_graphs
            self.small_gemms = install_small_gemms(models, self.device, self.dtype,
                                                   self.graph_gemm_rows() if graphed else ())
        elif self.device.type == "cpu":  # few-row GEMMs: F.linear or (W @ x^T)^T, whichever MKL runs faster here
            self.cpu_gemms = install_cpu_gemms([m for m in (self.target, self.drafter, self.vocab) if m is not None])
        per_page = bytes_per_page(layers, self.config.page_size, self.dtype)
        return max(kv_budget_bytes(self.config, self.device) // per_page, 0)

    def allocate(self, num_pages: int) -> None:
        """Allocate ``num_pages`` KV pages and wire the step machinery for this role."""
        page_size = self.config.page_size
        if self.device.type == "cuda":  # RoPE rows gathered from a table (RotaryEmbedding.cache): every position a
            # request's page table can address
            for model in (self.target, self.drafter):
                if model is not None and getattr(model, "rotary", None) is not None:
                    model.rotary.cache(self.pages_per_seq * page_size, self.device, self.dtype)
        draft_runner = None
        if self.drafter is not None:
            embed = self.vocab.embed_tokens if self.vocab is not None else self.target.model.embed_tokens
            lm_head = self.vocab.lm_head if self.vocab is not None else self.target.lm_head
            caches = allocate_caches(self.drafter.layers, num_pages + 1, page_size, self.dtype, self.device)
            draft_runner = DraftRunner(self.drafter, embed, lm_head, caches, self.kernels,
                                       self.spec.use_rejection_sampling, self.spec.confidence_threshold, self.device)
            if self.uses_cuda_graphs or self.drafter_uses_cuda_graphs:
                draft_runner.graphs = DraftGraphs(draft_runner, self.draft_lengths, self.config.max_num_seqs,
                                                  self.pages_per_seq, num_pages)
        self.draft_runner = draft_runner
        if self.plan.role == "drafter":
            self.engine_part = DraftServer(draft_runner, self.drafter.fc.in_features, page_size, self.dtype,
                                           self.device)
            return
        channel = None
        if self.plan.tp_rank == 0 and self.spec is not None:
            channel = (LocalDraftChannel(draft_runner) if self.plan.drafter == "colocated" else RemoteDraftChannel(
                self.plan.tp_size, self.target.config.hidden_size, int(self.spec.markov_rank or 0), self.dtype,
                self.device))
        w2 = self.draft_w2
        if w2 is None and self.drafter is not None and self.drafter.markov_head is not None:
            w2 = self.drafter.markov_head.markov_w2
        # one page more than the scheduler hands out: the scratch page padding rows of CUDA graphs write into
        caches = allocate_caches(self.target.model.layers, num_pages + 1, page_size, self.dtype, self.device)
        if self.uses_cuda_graphs:
            q_lens = [1] + [k + 1 for k in self.verify_lengths]
            local = isinstance(channel, LocalDraftChannel)  # the drafter's context append joins the graphs
            self.graphs = GraphedTargetForward(self.target, caches, self.kernels, attention_geometry(self.target),
                                               page_size, num_pages, self.config.max_num_seqs, self.pages_per_seq,
                                               q_lens, self.device,
                                               draft_runner.append_context if local else None,
                                               plan_ahead=True,
                                               prefill_q_lens=self.prefill_q_lens,
                                               prefill_tokens=PREFILL_GRAPH_TOKENS,
                                               # confidence scheduling packs large steps (runtime.worker.packed_verify)
                                               packed_columns=range(1, int(self.spec.max_draft_len))
                                               if self.spec is not None and self.spec.enable_confidence_scheduling
                                               and not self.parallel.is_parallel else (),
                                               # a step of Q tokens served by a longer graph that replays faster
                                               time_lengths=not self.parallel.is_parallel)
            if self.config.piecewise_cuda_graphs and not self.parallel.is_parallel:
                self.piecewise = PiecewiseTargetForward(self.target, caches, attention_geometry(self.target),
                                                        page_size, num_pages, self.config.max_num_batched_tokens,
                                                        self.device, draft_runner.append_context if local else None)
        self.engine_part = ModelRunner(self.target, self.spec, self.kernels, caches, page_size, self.device,
                                       self.parallel, channel, w2, self.graphs, self.config.logprobs_mode,
                                       self.piecewise)

    @property
    def verify_lengths(self) -> list[int]:
        """Every number of drafts a step may verify per request, each a graph's q_len - 1: the drafted lengths
        (``draft_lengths``; under confidence scheduling every length from 1, since its padded layout verifies
        ``min(proposed, cap)`` drafts, the cap any of them, and a step padded past its length's graph, or refused
        padding and run eagerly, would cost what the scheduler's table does not predict)."""
        return self.draft_lengths

    @property
    def draft_lengths(self) -> list[int]:
        """Every block length a step may draft (and verify): ``max_draft_len`` and the schedule's other lengths, and
        under confidence scheduling every length from 1 (a padded step drafts one past the cap it will verify at,
        ``Engine.drafts_follow_cap``; a packed one one past the longest share of the last block at its columns,
        ``Engine.drafts_follow_columns``)."""
        if self.spec is None:
            return []
        if self.spec.enable_confidence_scheduling:
            return list(range(1, int(self.spec.max_draft_len) + 1))
        lengths = {int(self.spec.max_draft_len)} | set((self.spec.draft_len_schedule or {}).values())
        return sorted(k for k in lengths if k > 0)

    @property
    def prefill_q_lens(self) -> list[int]:
        """The tokens a request of the prefill graphs feeds: ``PREFILL_Q_LENS`` a step's token budget allows, up to
        the first that holds a whole ``max_model_len`` (a longer chunk than that is never fed)."""
        max_len = self.config.max_model_len or int(self.target.config.max_position_embeddings)
        fits = [q for q in PREFILL_Q_LENS if q <= self.config.max_num_batched_tokens]
        return [q for i, q in enumerate(fits) if i == 0 or fits[i - 1] < max_len]

    def graph_gemm_rows(self) -> set[int]:
        """The row counts this worker's graphs feed their GEMMs (``install_small_gemms`` pads some): every batch
        bucket times every token count a request of a verify, packed or draft graph feeds (1 to K + 1), the prefill
        graphs' chunks, the piecewise graphs' token buckets."""
        buckets = batch_buckets(self.config.max_num_seqs)
        longest = int(self.spec.max_draft_len) + 1 if self.spec is not None else 1
        rows = {b * q for b in buckets for q in range(1, longest + 1)}
        rows |= {b * q for b in buckets for q in self.prefill_q_lens if b * q <= PREFILL_GRAPH_TOKENS}
        if self.config.piecewise_cuda_graphs and not self.parallel.is_parallel:
            rows |= set(token_buckets(self.config.max_num_batched_tokens))
        return rows

    @property
    def pages_per_seq(self) -> int:
        """Most pages one request's table holds: max_model_len plus a verify block, rounded up, plus one."""
        max_len = self.config.max_model_len or int(self.target.config.max_position_embeddings)
        block = int(self.spec.max_draft_len) + 1 if self.spec is not None else 1
        return -(-(max_len + block) // self.config.page_size) + 1

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need the flashinfer kernels (host-planned attention), a GPU, an MoE backend a graph can capture
        (VANILLA reads expert choices back to the host), and under tensor parallelism NCCL (its all-reduces and
        the LM head's max/argmax gather are captured inside the graphs; every rank captures and replays the same
        graphs in the same order; validated on two H200s by tests/gpu/test_cuda.py). A separate drafter's process:
        ``drafter_uses_cuda_graphs``. On one GPU the steps no whole-step graph serves replay piecewise graphs
        (``LLMConfig.piecewise_cuda_graphs``, ``runtime.worker.piecewise``); under tensor parallelism they run eagerly."""
        collectives_ok = self.plan.tp_size == 1 or dist.get_backend(self.parallel.group) == "nccl"
        return (self.plan.role == "target" and self.kernel_backend == "flashinfer" and not self.config.enforce_eager
                and self.device.type == "cuda" and collectives_ok
                and all(b in (None, "none") or b in GRAPH_SAFE for b in (self.moe_backend, self.draft_moe_backend)))

    @property
    def drafter_uses_cuda_graphs(self) -> bool:
        """A separate drafter's process replays its block drafts as CUDA graphs (``runtime.worker.draft_graphs``: greedy
        blocks; sampled ones run eagerly, as everywhere) on the target's terms: the flashinfer kernels, a GPU, a
        graph-safe MoE backend. Its context append stays eager (the captured states arrive over NCCL first)."""
        return (self.plan.role == "drafter" and self.kernel_backend == "flashinfer" and not self.config.enforce_eager
                and self.device.type == "cuda" and self.draft_moe_backend in (None, "none", *GRAPH_SAFE))

    def execute_steps(self, batch: ScheduledBatch):
        """One step as a generator that yields at its device waits (``runtime.worker.transfer.DeviceWait``: the
        engine in this process runs its deferred host work there) and returns its results (a target's
        ``RequestStepResult`` list, a separate drafter's blocks)."""
        self.step_profiler.before_step()
        run = self.engine_part.execute(batch)
        results = (yield from run) if inspect.isgenerator(run) else run
        self.step_profiler.after_step()
        return results

    def execute(self, batch: ScheduledBatch):
        """One step, its device waits passed without host work (a Ray actor's: no engine runs in its process)."""
        return finish(self.execute_steps(batch))

    def start_profile(self, steps: int, trace: str | None = None) -> None:
        """Profile this process's next ``steps`` steps (torch profiler; ``trace``: also a Chrome trace there)."""
        self.step_profiler.start(steps, trace)

    def profile_result(self) -> dict | None:
        """The summary of the last profile this process finished (``runtime.kernels.profiling.summarize``), or None."""
        return self.step_profiler.result

    def info(self) -> dict:
        return {"rank": self.plan.global_rank, "role": self.plan.role, "tp_rank": self.plan.tp_rank,
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "moe_backend": self.moe_backend, "draft_moe_backend": self.draft_moe_backend,
                "allreduce": self.allreduce,
                "kernel_backend": self.kernel_backend, "cuda_graphs": self.graphs is not None,
                "graph_capture_s": round(self.graphs.capture_seconds, 2) if self.graphs is not None else None,
                "graph_capture_mib": round(self.graphs.capture_bytes / 2**20, 1) if self.graphs is not None else None,
                "graph_replays": self.graphs.replays if self.graphs is not None else 0,
                "graph_q_lens": self.graphs.q_lens if self.graphs is not None else [],
                "graph_batch_buckets": self.graphs.buckets if self.graphs is not None else [],
                # prefill chunks graphed too: these lengths, at the buckets whose batch x length is within the cap
                "graph_prefill_q_lens": self.graphs.prefill_q_lens if self.graphs is not None else [],
                "graph_prefill_tokens": self.graphs.prefill_tokens if self.graphs is not None else 0,
                # packed verify graphs: their columns, and the fewest requests a step needs to be served by one
                "graph_packed_columns": self.graphs.packed_columns if self.graphs is not None else [],
                "graph_packed_from": self.graphs.packed_from if self.graphs is not None else 0,
                # verify lengths a longer graph serves where it replays faster: "batch x Q" -> its Q
                "graph_served_by": {f"{b} x {q}": to for (b, q), to in sorted(self.graphs.served_by.items())}
                if self.graphs is not None else {},
                "graph_packed_replays": self.graphs.packed_replays if self.graphs is not None else 0,
                "graph_packed_run_ahead": self.graphs.packed_run_ahead if self.graphs is not None else 0,
                # per graph, the attention kernel it bakes in and the timings that chose it
                "plan_ahead": self.graphs is not None and self.graphs.plan_ahead,
                "plans_made_ahead": self.graphs.plans_skipped if self.graphs is not None else 0,
                # plain greedy decode steps launched before the engine scheduled them: used, and dropped
                "steps_run_ahead": self.graphs.steps_run_ahead if self.graphs is not None else 0,
                "steps_ahead_dropped": self.graphs.steps_ahead_dropped if self.graphs is not None else 0,
                # steps no whole-step graph serves, replayed piece by piece around eager attention (one GPU)
                "piecewise_graphs": self.piecewise.as_dict() if self.piecewise is not None else None,
                "small_gemms": self.small_gemms.as_dict() if self.small_gemms is not None else None,
                "cpu_gemms": self.cpu_gemms.as_dict() if self.cpu_gemms is not None else None,
                "draft_graphs": self.draft_runner is not None and self.draft_runner.graphs is not None,
                "holds_drafter": self.plan.holds_drafter and self.spec is not None,
                "draft_confidence_head": bool(self.drafter is not None and self.drafter.confidence_head is not None),
                "draft_flavour": None if self.spec is None else
                ("embedded" if self.spec.draft_is_embedded_in_target else "standalone")}

    def shutdown(self) -> None:
        self.engine_part = None
        if dist.is_initialized():
            dist.destroy_process_group()
