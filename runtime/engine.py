"""``Engine``: scheduler + model runner + stops + counters, stepped by a driver.

``add_request`` validates and queues; ``step`` schedules one batch, runs it, commits tokens
(cutting at stops), updates the counters and the acceptance gate, and returns the requests that
progressed. This is what a driver (``runtime.LLM``, a Ray actor, a Serve replica) wraps.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from configs import LLMConfig
from runtime.kernels import get_backend
from runtime.loader import CheckpointError, load_drafter, load_target
from runtime.metrics import AcceptanceGate, SpecMetrics
from runtime.outputs import RequestOutput
from runtime.pages import PageAllocator
from runtime.runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerLimits
from runtime.sequence import Sequence
from runtime.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest
from runtime.stops import StopCriteria

CPU_KV_DEFAULT_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class Engine:
    def __init__(self, config: LLMConfig):
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        self.spec = config.speculative_config
        kernels = get_backend(config.kernel_backend)
        self.target = load_target(config.model, kernels, dtype, self.device)
        self._check_backends()
        self.drafter = load_drafter(self.spec, self.target, kernels, dtype, self.device) if self.spec else None
        if self.drafter is not None and not 0 <= self.drafter.spec.mask_token_id < self.target.config.vocab_size:
            raise CheckpointError(f"speculative_config.mask_token_id {self.drafter.spec.mask_token_id} is outside the "
                                  f"target vocabulary (0..{self.target.config.vocab_size - 1})")
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = config.max_model_len or int(self.target.config.max_position_embeddings)
        num_pages = self._num_pages(dtype)
        self.runner = ModelRunner(self.target, self.drafter, self.spec, kernels, num_pages, config.page_size,
                                  dtype, self.device)
        self.pages = PageAllocator(num_pages, config.page_size)
        self.scheduler = Scheduler(SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.pages)
        self.stops = StopCriteria(self._eos_token_ids(), self.tokenizer, self.max_model_len)
        self.metrics = SpecMetrics()
        self.gate = AcceptanceGate(self.spec.acceptance_rate_window_size if self.spec else None,
                                   self.spec.acceptance_rate_threshold if self.spec else None)
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)

    # ---- setup --------------------------------------------------------------------------------

    def _check_backends(self) -> None:
        family = self.target.config.model_type
        if self.config.moe_backend != "AUTO":
            raise ValueError(f"moe_backend={self.config.moe_backend!r}: target model_type {family!r} has no MoE "
                             "layers; leave it AUTO")
        if self.spec is None:
            return
        if self.spec.moe_backend not in (None, "AUTO"):
            raise ValueError(f"speculative_config.moe_backend={self.spec.moe_backend!r}: the DSpark drafter has no "
                             "MoE layers; leave it unset")
        if self.spec.attention_backend in ("TRTLLM", "CUTEDSL"):
            why = ("needs FlashInfer's trtllm-gen kernels on SM100/SM103" if self.spec.attention_backend == "TRTLLM"
                   else "is for MLA drafters; this drafter is GQA")
            raise ValueError(f"speculative_config.attention_backend={self.spec.attention_backend!r} cannot run here: "
                             f"it {why}; use AUTO or VANILLA")

    def _load_tokenizer(self):
        path = Path(self.config.tokenizer or self.config.model)
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            if self.config.tokenizer is not None:
                raise CheckpointError(f"tokenizer: no tokenizer files in {path}")
            return None
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(self.config.model, local_files_only=True).eos_token_id
        except OSError:
            eos = getattr(self.target.config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return frozenset(ids)

    def _num_pages(self, dtype: torch.dtype) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * CUDA_KV_FRACTION)
        budget = budget or CPU_KV_DEFAULT_BYTES
        pages = budget // ModelRunner.bytes_per_page(self.target, self.drafter, self.config.page_size, dtype)
        if pages < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV page of {self.config.page_size} tokens")
        return int(pages)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; raises ``ValueError`` naming the problem."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._validate(prompt_token_ids, params)
        seed = params.seed % (1 << 63) if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, arrival=next(self._arrivals))
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.target.config.vocab_size
        if not prompt:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}, so it must "
                             f"have at most {self.max_model_len - 1}")
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if self.pages.pages_for(longest) > self.pages.num_pages:
            raise ValueError(f"prompt + max_tokens ({longest} tokens) exceeds the KV cache ({self.pages.num_pages} "
                             f"pages of {self.pages.page_size}); raise num_pages/kv_cache_memory or lower max_tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; the model directory has none")
        if self.spec is None:
            return
        if params.uses_penalties and not self.spec.enable_penalty:
            raise ValueError("repetition/presence/frequency penalties are disabled: set "
                             "speculative_config.enable_penalty=True to allow them")
        mode = self.spec.advanced_sampling_mode
        for name, used, allowed in (("top_k", params.uses_top_k, mode.allows_top_k),
                                    ("top_p", params.uses_top_p, mode.allows_top_p),
                                    ("min_p", params.uses_min_p, mode.allows_min_p)):
            if used and not allowed:
                raise ValueError(f"SamplingParams.{name} is not available with advanced_sampling_mode={mode.value}")

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and seq.finish_reason is None:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -----------------------------------------------------------------------------

    def draft_len(self) -> int:
        """Block length to draft this step: the schedule at the current batch size, 0 once the gate closed."""
        if self.drafter is None or self.gate.closed or not self.scheduler.running:
            return 0
        return self.spec.draft_len_for_batch_size(len(self.scheduler.running))

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        batch = ScheduledBatch(requests=scheduled, num_next_drafts=self.draft_len(),
                               maintain_draft_context=self.drafter is not None and not self.gate.closed,
                               released_request_ids=self.scheduler.take_released())
        results = self.runner.execute(batch)
        outputs, drafted, accepted = [], 0, 0
        for entry, result in zip(scheduled, results):
            seq = self.sequences[entry.request_id]
            kept = self._commit(seq, entry, result)
            step_drafted, step_accepted = self._counted(entry, result, kept, seq.finish_reason is not None)
            self.metrics.record(step_drafted, step_accepted)
            drafted, accepted = drafted + step_drafted, accepted + step_accepted
            if result.token_ids:
                outputs.append(self.output(seq, result.token_ids[:kept]))
            if seq.finish_reason is not None:
                del self.sequences[seq.request_id]
        self.gate.record(drafted, accepted)
        if self.gate.closed:  # drafts already proposed are dropped too: from now on, plain decoding
            for seq in self.scheduler.running:
                seq.draft_ids = []
        return outputs

    def _commit(self, seq: Sequence, entry: ScheduledRequest, result: RequestStepResult) -> int:
        """Append committed tokens up to the first stop; returns how many were kept."""
        seq.num_computed = entry.end_position - entry.num_drafts + result.num_accepted if entry.sample \
            else entry.end_position
        kept = 0
        for token in result.token_ids:
            seq.output_token_ids.append(token)
            kept += 1
            reason = self.stops.check(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                return kept
        seq.draft_ids = result.next_draft_ids
        return kept

    @staticmethod
    def _counted(entry: ScheduledRequest, result: RequestStepResult, kept: int, finished: bool) -> tuple[int, int]:
        """(drafted, accepted) as counted: a stop inside the accepted drafts ends the count there."""
        if finished and kept <= result.num_accepted:
            return kept, kept
        return entry.num_drafts, result.num_accepted

    def output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """A snapshot; ``text`` is decoded once the request finished (empty before)."""
        text = self.stops.text(seq) if seq.finish_reason is not None else ""
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=list(seq.output_token_ids), text=text,
                             finish_reason=seq.finish_reason, new_token_ids=new_token_ids)

    def get_metrics(self) -> dict:
        return {**self.metrics.as_dict(), "speculation_disabled": self.gate.closed,
                "num_preemptions": self.scheduler.num_preemptions, "num_kv_pages_used": self.pages.num_used,
                "num_kv_pages": self.pages.num_pages}
