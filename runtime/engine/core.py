"""``Engine``: scheduler + model runner + stops + counters, stepped by a driver.

``add_request`` validates and queues; ``step`` schedules one batch, runs it, commits tokens
(cutting at stops), updates the counters and the acceptance gate, and returns the requests that
progressed. A fault of one request inside a step (non-finite logits in its rows, an error while
committing its tokens) ends that request with ``finish_reason="error"`` and ``error`` set; the other
requests of the step continue with exactly the tokens they would have had. This is what a driver
(``runtime.LLM``, a Ray actor, a Serve replica) wraps.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

from configs import LLMConfig
from configs.checkpoint import read_model_config
from runtime.engine.executor import Executor, LocalExecutor
from runtime.engine.metrics import AcceptanceGate, SpecMetrics
from runtime.engine.outputs import RequestOutput
from runtime.engine.profiling import region
from runtime.models.loader import load_hf_config
from runtime.sampling.bad_words import token_sequences
from runtime.sampling.generation_defaults import model_sampling_defaults
from runtime.sampling.grammar import GrammarBackend
from runtime.sampling.grammar_masks import IDLE_WAIT_S, STEP_WAIT_S, GrammarMaskJobs
from runtime.sampling.sampling_params import SamplingParams
from runtime.sampling.stops import StopCriteria
from runtime.scheduling.pages import PageAllocator
from runtime.scheduling.scheduler import Scheduler, SchedulerLimits
from runtime.scheduling.sequence import Sequence, Status
from runtime.scheduling.step_io import PackedAhead, PackedPlan, RequestStepResult, ScheduledBatch, ScheduledRequest
from runtime.spec.confidence import ConfidenceScheduler, Decision
from runtime.spec.guard import SpeculationGuard
from runtime.spec.history import history_classes, next_history
from runtime.spec.stats import ConfidenceStats
from runtime.spec.step_costs import StepCostTable
from runtime.spec.survival import read_calibration
from runtime.worker.graph_layout import graphed_q_len
from runtime.worker.step_profile import profile_step_costs
from runtime.worker.step_tensors import greedy_only, plain_greedy

log = logging.getLogger(__name__)

# the share of its last step's wall time the host may spend on deferred work (``runtime.worker.transfer.HostWork``) while
# the device computes the step launched ahead: the rest is the engine's own commit, schedule and launch (about a
# third of a 3-ms step at one to four requests, one run's profiles)
HOST_WORK_SHARE = 0.15


class RequestFault(RuntimeError):
    """A failure that belongs to one request (non-finite logits in its rows, its text): only it fails. ``code``:
    "unsatisfiable_constraints" where the request's own constraints left no token to choose (the client's error)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def constraints_of(params: SamplingParams) -> list[str]:
    """The request's options that can leave a row without any token to choose."""
    named = [("allowed_token_ids", params.allowed_token_ids is not None),
             ("structured_outputs", params.structured_outputs is not None), ("bad_words", bool(params.bad_words)),
             ("min_tokens", params.min_tokens > 0)]
    return [name for name, used in named if used]


@dataclass(frozen=True)
class StepPlan:
    """One step as planned (``Engine._plan_step``), kept to learn from once it ran."""

    scheduled: list[ScheduledRequest]
    batch: ScheduledBatch  # what the executor runs
    serial: bool  # an engine that launches steps ahead ran this one in its turn (its time holds the host's work)
    guarded: bool  # the speculation guard planned it (no forced length)

    @property
    def drafted(self) -> bool:
        return self.batch.num_next_drafts > 0


class Engine:
    """The driver side of serving: owns requests and scheduling; the executor owns the models.

    ``executor`` defaults to a ``LocalExecutor`` (models in this process); the cluster layer passes
    one backed by Ray actors. The engine itself reads only JSON metadata and the tokenizer.
    """

    def __init__(self, config: LLMConfig, executor: Executor | None = None):
        self.config = config
        self.spec = config.speculative_config
        self.model_config = load_hf_config(config.model, "model")
        self.executor = executor if executor is not None else LocalExecutor(config)
        self.has_drafter = self.spec is not None
        self.vocab_size = int(self.model_config.vocab_size)
        self.tokenizer = self._load_tokenizer()
        # the model's default sampling parameters (generation_config auto), checked against this engine at startup
        self.sampling_defaults = model_sampling_defaults(config.model) if config.generation_config == "auto" else {}
        self.max_model_len = config.max_model_len or int(self.model_config.max_position_embeddings)
        self.pages = PageAllocator(self.executor.num_pages, config.page_size, caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.enable_mixed_prefill), self.pages)
        if self.executor.plans_ahead:
            # the next decode step's pages are known when this one is launched (its attention is planned while the
            # GPU runs this step): a token ahead, or with a drafter a whole block (the next verify starts at most
            # max_draft_len + 1 positions on and spans as many)
            self.scheduler.lookahead = int(self.spec.max_draft_len or 0) + 1 if self.has_drafter else 1
        # the worker (this process's graphs) may launch the next step before this one is read back
        # (ScheduledBatch.run_ahead): a steady greedy decode step (GraphedTargetForward.decode_greedy), or with a
        # drafter the next greedy verify of the blocks drafted now, whole or at confidence scheduling's cap
        # (ScheduledBatch.next_verify_len; GraphedTargetForward.launch_verify_ahead)
        self._runs_ahead = self.executor.runs_ahead
        # (a tensor-parallel replica launches decode steps ahead, not verifies: Executor.verifies_ahead)
        self._verifies_ahead = self.executor.verifies_ahead
        self._ran_ahead = False  # the step just scheduled may be launched ahead of its turn
        self.stops = StopCriteria(self._eos_token_ids(), self.tokenizer, self.max_model_len)
        self.scheduler.eos_token_ids = self.stops.eos_token_ids
        self._check_sampling_defaults()
        self.metrics = SpecMetrics()
        self.gate = AcceptanceGate(self.spec.acceptance_rate_window_size if self.spec else None,
                                   self.spec.acceptance_rate_threshold if self.spec else None)
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.confidence: ConfidenceScheduler | None = None
        self.confidence_stats = ConfidenceStats()
        self._decided: list[str] = []  # requests whose verify length the scheduler chose this step (its order)
        self._other_fed = (0, 0, 0)  # (requests, tokens, context) of the last step besides the scheduler's verifies
        self._beside_next = (0, 0, 0)  # of them, those the next step is expected to feed beside its verifies
        # the packed layout (runtime.worker.packed_verify): the columns this step's decided requests verify (0: not packed)
        self._packed_columns = 0
        self._packed: PackedPlan | None = None  # this step's packed verify, if it is one
        self._packed_from = 0  # the fewest requests the target's packed graphs serve (0: none captured)
        self._graph_q_lens: list[int] = []  # tokens per request of the target's graphs (none: eager steps)
        self._graph_prefill = ([], 0)  # the prefill chunk graphs' lengths and token cap (graph_layout.graphed_q_len)
        # profiling (runtime.worker.step_profile): every decoding request verifies at most this many drafts, and the steps
        # are planned and launched ahead at that length as a confidence-scheduled engine's are at its cap
        self.forced_verify_len: int | None = None
        # profiling: the block every step drafts, whatever the schedule (0: plain decoding, the drafter idle)
        self.forced_draft_len: int | None = None
        self._step_index = 0  # the step being scheduled (confidence scheduling's drafting holds count in steps)
        # when a list: every verify appends (the verified drafts' confidences, accepted count) (calibration)
        self.verification_log: list[tuple[list[float], int]] | None = None
        # pipelined drafting (a separate drafter, cluster.RayExecutor): while at least pipeline_min_batch requests
        # run or wait, steps alternate two request groups and each step's results bring the drafter's blocks for the
        # previous step's group; fewer, and each step's requests get their blocks in the same step
        self.pipelined = bool(self.executor.pipelined_drafting)
        self.pipeline_min_batch = int(self.executor.pipeline_min_batch)
        self._turn = 0  # the group the next pipelined step serves
        self.pipelined_steps = 0  # steps that were pipelined (get_metrics)
        self.num_aborted = 0  # requests aborted before they finished (a caller gone, a shutdown)
        self._host_work = None  # the executor's HostWork where confidence scheduling defers its learning there
        self._deferred = False  # the step's decision was deferred (allot_deferred)
        self._judged_bucket = 0  # the batch bucket of the last judgement of drafting (its hold's, _record_decision)
        self._grammar_backend: GrammarBackend | None = None  # structured outputs' compiler (_grammars)
        self._grammar_lock = threading.Lock()  # (compile_grammar runs on other threads too)
        self._mask_jobs: GrammarMaskJobs | None = None  # their token masks, computed off this thread (_grammars)
        self._structured: set[str] = set()  # ids of structured requests, pruned to live ones each step (_mask_grammars)
        # whether speculating pays, per request and per batch (runtime.spec.guard); not while drafting is pipelined
        # (two groups alternate steps: each step drafts the other group's blocks)
        self.guard = SpeculationGuard(int(self.spec.max_draft_len or 0)) \
            if self.spec is not None and self.spec.speculation_guard and not self.pipelined else None
        if self.spec is not None and self.spec.enable_confidence_scheduling:
            self.confidence = self._confidence_scheduler()
            host_work = self.executor.host_work
            if host_work is not None:  # the survival fit learns while the device computes the next step
                self.confidence.defer_learning(host_work)
                self._host_work = host_work  # (its budget follows the steps: step)

    # ---- setup --------------------------------------------------------------------------------

    def _load_tokenizer(self):
        path = Path(self.config.tokenizer or self.config.model)
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            if self.config.tokenizer is not None:
                raise ValueError(f"tokenizer: no tokenizer files in {path}")
            return None
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def _eos_token_ids(self) -> frozenset[int]:
        try:
            eos = GenerationConfig.from_pretrained(self.config.model, local_files_only=True).eos_token_id
        except OSError:
            eos = getattr(self.model_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))

    def _confidence_scheduler(self) -> ConfidenceScheduler:
        """``enable_confidence_scheduling``: the drafter must have a confidence head; temperatures from
        ``confidence_calibration_path`` or the drafter's config; the step-time table from
        ``confidence_cost_table_path`` or profiled now, on this engine's own steps."""
        infos = self.executor.describe()
        if not any(info.get("draft_confidence_head") for info in infos):
            raise ValueError("speculative_config.enable_confidence_scheduling needs a drafter with a confidence head; "
                             f"{self.spec.speculative_model} has none (enable_confidence_head)")
        spec = self.spec
        temperatures = None
        if spec.confidence_calibration_path is not None:
            temperatures = read_calibration(spec.confidence_calibration_path, "confidence_calibration_path")
        else:
            raw = read_model_config(str(spec.speculative_model)) or {}
            if raw.get("confidence_temperatures") is not None:
                temperatures = read_calibration(raw, f"{spec.speculative_model}/config.json confidence_temperatures")
        # the target's steps replayed as CUDA graphs pad each request to the step's longest verify (runtime.worker.graphs);
        # its packed graphs (if captured) serve the steps of packed_from requests on (the profile times those too)
        target = next((i for i in infos if i.get("role") == "target"), {})
        self._graph_q_lens = target.get("graph_q_lens") or []
        self._graph_prefill = (target.get("graph_prefill_q_lens") or [], target.get("graph_prefill_tokens") or 0)
        self._packed_from = (target.get("graph_packed_from") or 0) if target.get("graph_packed_columns") else 0
        graph_batches = target.get("graph_batch_buckets") or None  # the batch sizes the graphs were captured at
        if spec.confidence_cost_table_path is not None:
            costs = StepCostTable.load(spec.confidence_cost_table_path)
        else:
            costs = profile_step_costs(self)
        layout = "packed" if self._packed_from else "padded" if self._graph_q_lens else "ragged"
        log.info("dspark: confidence scheduling on (%s steps), step-time table %s, temperatures %s", layout,
                 spec.confidence_cost_table_path or "profiled at startup", temperatures or "1")
        return ConfidenceScheduler(int(spec.max_draft_len), costs, temperatures, spec.confidence_min_predicted_gain,
                                   layout, packed_from=self._packed_from or 1, graph_batches=graph_batches)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    follows: str | None = None, index: int = 0, grammar=None) -> str:
        """Validate and queue a request; raises ``ValueError`` naming the problem. ``follows``: the id of another
        sample of the same prompt; this one waits in the queue until that one computed the prompt, then starts
        from its cached pages (prefix caching) instead of computing the prompt again. ``index``: the sample's.
        ``grammar``: ``compile_grammar(params)`` made beforehand (off this thread); without it a structured request's
        grammar is compiled here."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        if params.n != 1:
            raise ValueError("SamplingParams.n > 1 is a request for several samples: submit one request per sample "
                             "(runtime.engine.llm.sample_params), as LLM.generate and the server do")
        seed = params.seed % (1 << 63) if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, arrival=next(self._arrivals), index=index)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has no logprob: nothing precedes it
        if params.structured_outputs is not None:  # (a schema xgrammar refuses: ValueError, nothing queued)
            seq.grammar = self._grammars().matcher(params.structured_outputs, grammar)
            self._structured.add(request_id)
            self._mask_jobs.prepare(seq)  # (its first rows: ready by the time its prompt is computed)
        if params.bad_words:  # (a word the tokenizer cannot make ids of this model from: ValueError, nothing queued)
            seq.bad_words = token_sequences(self.tokenizer, params.bad_words, self.vocab_size)
        leader = self.sequences.get(follows) if follows is not None else None
        if leader is not None and leader.prompt_token_ids == seq.prompt_token_ids:
            seq.follows = leader
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured request, for ``add_request(grammar=...)``; callable from any thread
        (a server compiles off the engine's thread, so that a grammar slow to compile delays only its request);
        ``ValueError`` naming the field for one xgrammar refuses."""
        return self._grammars().compile(params.structured_outputs)

    def _grammars(self) -> GrammarBackend:
        """The grammar compiler of structured outputs, built on first use (xgrammar is optional)."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size,
                                                       sorted(self.stops.eos_token_ids))
            if self._mask_jobs is None:
                self._mask_jobs = GrammarMaskJobs(self._grammar_backend)
            return self._grammar_backend

    def _masks_not_ready(self) -> frozenset[str]:
        """The structured requests this step passes over: their token masks (``runtime.sampling.grammar_masks``) are
        still being computed after a bounded wait, so that a grammar slow to mask delays only its own request. When
        no other request could run, the wait is for the first of them (bounded too: the step may then run none).
        Once no structured request is left, a step looks at none (the set of them, pruned to the live ones, is
        empty)."""
        self._structured.intersection_update(self.sequences)
        if self._mask_jobs is None:
            return frozenset()
        self._mask_jobs.keep_only(self._structured)
        if not self._structured:
            return frozenset()
        seqs = [self.sequences[r] for r in self._structured if self.sequences[r].finish_reason is None]
        late = self._mask_jobs.not_ready(seqs, STEP_WAIT_S)
        if late and len(late) == len(self.scheduler.running) + len(self.scheduler.waiting):
            late = self._mask_jobs.not_ready(seqs, IDLE_WAIT_S, first=True)
        return frozenset(late)

    def _mask_grammars(self, scheduled: list[ScheduledRequest]) -> None:
        """Each scheduled structured request's token masks for the rows it commits this step
        (``runtime.sampling.grammar``), ready (``_masks_not_ready``)."""
        for entry in scheduled:
            seq = self.sequences.get(entry.request_id)
            if entry.sample and seq is not None and seq.grammar is not None:
                entry.token_mask = self._mask_jobs.take(seq, entry.num_drafts)

    def _prepare_masks(self) -> None:
        """After a commit: start computing every live structured request's next rows (its tokens and drafts are
        known now), so that they are ready when the next step is planned."""
        for request_id in self._structured:
            seq = self.sequences.get(request_id)
            if seq is not None and seq.finish_reason is None:
                self._mask_jobs.prepare(seq)

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing samples with: the model's defaults (``sampling_defaults``) over the
        engine's own."""
        return SamplingParams(**self.sampling_defaults)

    def _check_sampling_defaults(self) -> None:
        """The model's default sampling parameters must be ones this engine serves (a speculative configuration may
        refuse penalties or filters): else every request that sets nothing would fail."""
        try:
            self.validate_params(self.default_sampling_params())
        except ValueError as exc:
            raise ValueError(f"the model's generation_config.json sets default sampling parameters this engine "
                             f"refuses ({exc}); set generation_config: none, or allow them") from None

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming what makes this request unservable. Reads only immutable engine state,
        so other threads may call it."""
        vocab = self.vocab_size
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
        self.validate_params(params)

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the parameter this engine cannot serve (whatever the prompt)."""
        vocab = self.vocab_size
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; the model directory has none")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer; the model directory has none")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; the model directory has none")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"SamplingParams.allowed_token_ids must be in 0..{vocab - 1} (this model's vocabulary), "
                             f"got {max(params.allowed_token_ids)}")
        if any(token >= vocab for token in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be in 0..{vocab - 1} (this model's vocabulary), "
                             f"got {max(params.stop_token_ids)}")
        if any(token >= vocab for token, _ in params.logit_bias):
            raise ValueError(f"SamplingParams.logit_bias token ids must be in 0..{vocab - 1} (this model's "
                             f"vocabulary), got {max(token for token, _ in params.logit_bias)}")
        if self.spec is None:
            return
        if params.uses_penalties and not self.spec.enable_penalty:
            field = next(f for f, off in (("repetition_penalty", 1), ("presence_penalty", 0), ("frequency_penalty", 0))
                         if getattr(params, f) != off)
            raise ValueError(f"SamplingParams.{field} is refused: repetition/presence/frequency penalties are "
                             "disabled; set speculative_config.enable_penalty=True to allow them")
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
            self.num_aborted += 1

    def abort_all(self) -> int:
        """Abort every request in flight (their pages are freed); returns how many there were."""
        request_ids = list(self.sequences)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -----------------------------------------------------------------------------

    def draft_len(self) -> int:
        """Block length to draft this step: the schedule at the current batch size, 0 once the gate closed or
        while confidence scheduling holds the drafting off at this batch size (drafting did not pay there)."""
        return self._draft_len_at(self._step_index)

    def _drafting_held(self) -> bool:
        """Whether a drafting hold (``ConfidenceScheduler.hold``) is what keeps this step from drafting: the
        schedule would draft, ``draft_len`` says none."""
        return self._draft_len_at(self._step_index, held=False) > 0 and self.draft_len() == 0

    def _draft_len_at(self, step: int, held: bool = True) -> int:
        """``draft_len`` at ``step`` (this one or the next) with the running requests as they are (``held``
        False: as if no drafting hold were on)."""
        if not self.has_drafter or self.gate.closed or not self.scheduler.running:
            return 0
        if self.forced_draft_len is not None:
            return self.forced_draft_len
        if self.guard is not None and not self.guard.drafts(step):
            return 0
        running = len(self.scheduler.running)
        k = self.spec.draft_len_for_batch_size(running)
        if k and held and self.confidence is not None \
                and self.confidence.hold.off(self.confidence.bucket(running), step):
            return 0
        if k and self.confidence is not None and self.confidence.cap is not None and self.drafts_follow_cap(running):
            return min(k, self.confidence.cap + 1)
        if k and self.confidence is not None and self.confidence.packed_draft_len is not None \
                and self.drafts_follow_columns(running):
            return min(k, self.confidence.packed_draft_len)
        return k

    def drafts_follow_cap(self, num: int) -> bool:
        """Whether a step of ``num`` requests drafts only what the next step can verify, one draft more: a padded
        graphed step (confidence scheduling's padded layout, or a packed one's steps below its packed graphs) verifies
        at most the cap already chosen for it (``ConfidenceScheduler.cap``, from an earlier step's confidences), so
        drafts past it are never verified, while the drafter's block costs more the longer it is (one run on an H200,
        4 requests: drafting 7 and verifying none 3.10 ms a step, a plain step 2.31, the tuned schedule's K = 2 step
        2.76); the one draft past the cap keeps that position's confidence in view, so the next cap can rise by a
        column a step, and a decision that explores verifies (and so drafts) whole blocks. A packed step drafts as
        ``drafts_follow_columns`` says."""
        return bool(self._graph_q_lens) and not self._packs_steps_of(num)

    def drafts_follow_columns(self, num: int) -> bool:
        """Whether a step of ``num`` requests drafts only as long a block as the packed step that verifies it can
        use (``ConfidenceScheduler.packed_draft_len``: one past the longest share a request took of the last block
        at the columns already chosen for that step): a packed step, whose device picks the top survivals of the
        blocks as drafted (a packed graph pads a shorter block to K with drafts that propose nothing,
        ``GraphedTargetForward.run_packed``; an eager one ranks the block as it is)."""
        return self._packs_steps_of(num)

    def step(self) -> list[RequestOutput]:
        """One step: schedule the requests and plan their speculation, execute, commit what the target verified,
        learn from the step's time and outcome."""
        group, pipelined = self._take_turn()
        self.executor.arm()  # (before the step is timed)
        began = time.perf_counter()
        with region("dspark.schedule"):
            plan = self._plan_step(group, pipelined)
        with region("dspark.execute"):
            results = self.executor.execute(plan.batch)
        decided, held = self._before_commit(plan)
        with region("dspark.commit"):
            outputs = self._commit_step(plan.scheduled, results)
            if self.pipelined:
                self._take_late_drafts()
            if self._structured:
                self._prepare_masks()
        self._learn_step(plan, decided, held, time.perf_counter() - began)
        self._step_index += 1
        return outputs

    def _take_turn(self) -> tuple[int | None, bool]:
        """(the request group this step serves, whether it is pipelined): with a pipelined drafter the two groups
        take turns while the pipeline pays; otherwise every running request (None)."""
        if not (self.pipelined and self._pipeline_pays()):
            return None, False
        self.scheduler.join_groups()  # (requests admitted while the steps were not pipelined)
        group, self._turn = self._turn, 1 - self._turn
        self.pipelined_steps += 1
        return group, True

    def _plan_step(self, group: int | None, pipelined: bool) -> StepPlan:
        """Schedule the step and plan its speculation: which blocks are verified (the speculation guard, confidence
        scheduling or a forced length), whether it drafts, the grammar masks, the next step's verify and whether that
        one is launched ahead."""
        self._decided, self._packed_columns = [], 0  # this step's choice, made now (if any)
        self._deferred = False  # whether its rest runs while the device computes (allot_deferred)
        # a step the worker may have launched ahead is the running requests' decode: arrivals join the next
        admit = not self._ran_ahead
        # an engine that launches steps ahead, this one not launched ahead: its time holds the host's step work
        serial = self._runs_ahead and not self._ran_ahead
        kind = self.scheduler.next_step_kind(group, admit)  # (prefill apart: prefill or decode; else mixed)
        guarded = self.guard is not None and self.forced_verify_len is None and self.forced_draft_len is None
        if guarded and not self._ran_ahead:
            self._guard_verifiers()
        if self.forced_verify_len is not None:
            self._force_verify_lengths()
        elif self.confidence is not None:
            self.confidence.serial = serial  # (the next step is priced as running as this one does)
            self._allot_verify_lengths(group, kind)
        late = self._masks_not_ready() if self._grammar_backend is not None else frozenset()
        scheduled = self.scheduler.schedule(group, admit, kind, skip=late)
        if guarded and self.scheduler.running:  # this step's drafting, and whose blocks the next step verifies
            running = self.scheduler.running
            self.guard.plan(self._step_index, [s.request_id for s in running],
                            ahead=self._ran_ahead and not any(e.num_drafts for e in scheduled),
                            pinned=frozenset(s.request_id for s in running
                                             if s.params.seed is not None and not s.params.greedy))
        if self.confidence is not None and self.confidence.hold.mixed and admit and scheduled \
                and not self.scheduler.may_admit() and not any(e.feeds_prompt for e in scheduled):
            # a decode step, not launched ahead: a hold a mixed step's judgement began ends (DraftingHold)
            self.confidence.hold.end_mixed(self._step_index)
        if self._grammar_backend is not None:
            self._mask_grammars(scheduled)
        next_verify_len, next_packed = self._next_verify(scheduled) if self.has_drafter and scheduled else (0, None)
        self._ran_ahead = (self._verifies_ahead and self._steady_verify(scheduled, next_verify_len)) \
            if self.has_drafter and next_verify_len else (self._runs_ahead and self._steady_decode(scheduled))
        self._packed = self._packed_plan(scheduled)
        released, scrub = self.scheduler.take_released()
        batch = ScheduledBatch(requests=scheduled, num_next_drafts=self.draft_len(),
                               maintain_draft_context=self.has_drafter and not self.gate.closed,
                               released_request_ids=released, scrub_page_ids=scrub, run_ahead=self._ran_ahead,
                               next_verify_len=next_verify_len, packed=self._packed, next_packed=next_packed,
                               pipelined=pipelined)
        return StepPlan(scheduled, batch, serial, guarded)

    def _before_commit(self, plan: StepPlan) -> tuple[bool, bool]:
        """What the commit clears or changes, kept for learning: (whether the scheduler decided this step's verify
        lengths, whether a drafting hold kept it from drafting)."""
        decided = bool(self._decided)
        held = not plan.drafted and self._drafting_held()
        if held:
            self.confidence_stats.drafting_off_steps += 1
        if self.confidence is not None and plan.scheduled:
            self._note_other_fed(plan.scheduled, plan.drafted)
        return decided, held

    def _learn_step(self, plan: StepPlan, decided: bool, held: bool, seconds: float) -> None:
        """The step's time and outcome into the speculation policy: the guard's prices (pure decode steps) and the
        confidence scheduler's step-time model (deferred with its decision, on a mixed step)."""
        scheduled = plan.scheduled
        if plan.guarded and scheduled and not any(e.feeds_prompt for e in scheduled):
            self.guard.observe_step(len(scheduled), plan.drafted, sum(e.num_drafts for e in scheduled), seconds)
        if self.confidence is None or not scheduled:
            return
        step = (scheduled, seconds, decided, plan.drafted, plan.serial,
                self._packed.columns if self._packed is not None else None, self._other_fed[1], held,
                # (the commit settled the decision, then recorded its outcome)
                self.confidence_stats.last.get("committed_tokens") if decided else None,
                self.confidence.last if decided else None,
                self.confidence_stats.last.get("verified_drafts") if decided else None)
        if self._deferred:  # the step's decision was deferred (a mixed step): so is learning its time
            self._host_work.add(functools.partial(self._learn_step_time, *step))
        else:
            self._learn_step_time(*step)
        if self._host_work is not None:  # the next step's deferred work: what its device time leaves the host
            self._host_work.budget_s = HOST_WORK_SHARE * seconds

    def _steady_decode(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether the step after ``scheduled`` is expected to be the same requests decoding one token more: every
        one a plain greedy decode of one token, all running requests in the step, none at its token limit after it,
        nobody to admit (nothing waits, or the batch is full: under a steady load requests always wait); an end of
        sequence or a stop string can still end one: the worker then drops the step it launched. With a drafter,
        also while it drafts nothing (a ``draft_len_schedule`` stops speculation at this concurrency; the drafter's
        context still follows, appended by the same step) unless drafting is pipelined (the next step is the other
        group's)."""
        if not scheduled or self.scheduler.may_admit() or len(scheduled) != len(self.scheduler.running) \
                or (self.has_drafter and (self.pipelined or self.draft_len()
                                          or self._draft_len_at(self._step_index + 1))):
            return False  # (a drafting hold that ends next step: that step drafts)
        for entry in scheduled:
            if len(entry.token_ids) != 1 or not entry.sample or not plain_greedy(entry):
                return False
            seq = self.sequences[entry.request_id]
            if len(seq.output_token_ids) + 2 > seq.params.max_tokens or entry.end_position + 1 >= self.max_model_len:
                return False
        return True

    def _next_verify(self, scheduled: list[ScheduledRequest]) -> tuple[int, PackedAhead | None]:
        """How many drafts a decoding request feeds next step, and whether that step is a packed verify: the block
        drafted now, or under confidence scheduling's padded layout as many as the cap it already chose for that
        step (0: unknown, the ragged layout), or under the packed layout the whole block, packed at the columns it
        already chose (whole blocks or none: a uniform step), or while profiling the length forced on every step
        (``forced_verify_len``; packed where the packed graphs serve the step). The worker plans that step's
        attention while the drafter drafts, and may launch it ahead (``ScheduledBatch``), with ``scheduled``'s verify
        histories as they stand before this step (the device updates them from this step's verdicts)."""
        k_next = self.draft_len()
        if self.forced_verify_len is not None:
            wanted = self.forced_verify_len
        elif self.confidence is None:
            return k_next, None
        elif self.confidence.layout == "ragged":
            return 0, None
        elif self._packs_steps_of(len(self.scheduler.running)):
            wanted = self.confidence.columns if self.confidence.columns is not None else k_next
        else:
            return min(k_next, self.confidence.cap if self.confidence.cap is not None else k_next), None
        if self._packs(len(self.scheduler.running), wanted, k_next):
            slope, bias = self._packed_ranking(k_next)
            return k_next, PackedAhead(wanted, slope, bias, self._histories(scheduled))
        return min(k_next, wanted), None

    def _packs_steps_of(self, num: int) -> bool:
        """Whether a step of ``num`` requests may be packed: the target's packed graphs serve that many (the
        scheduler's packed layout says from how many; while profiling, before it exists, the graphs do)."""
        if self.confidence is not None:
            packed_from = self.confidence.packed_from if self.confidence.layout == "packed" else 0
        else:
            packed_from = self._packed_from
        return bool(packed_from) and num >= packed_from

    def _packs(self, num: int, columns: int, k: int) -> bool:
        """Whether a step of ``num`` requests verifying ``columns`` of their ``k`` drafts is a packed verify: it may
        be packed, and the columns are neither whole blocks nor none."""
        return self._packs_steps_of(num) and 0 < columns < k

    def _packed_ranking(self, k: int) -> tuple[list[float], list[list[float]]]:
        """The survival fit (slopes [k], biases [H][k]) a packed step ranks its first ``k`` drafts by. While
        profiling, before the scheduler exists, slope 0: every draft at position j survives 0.5^(j+1), so a budget
        of c columns is c drafts of every request (the step's shape is what the profile times, and a request then
        commits at most c + 1 tokens a step: ranked by confidence, a request the drafter is sure of took every
        draft of its block, committed past the profile's token bound and finished mid-profile, earlier runs)."""
        if self.confidence is not None:
            return self.confidence.ranking(k)
        return [0.0] * k, [[0.0] * k for _ in history_classes(int(self.spec.max_draft_len))]

    def _histories(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """[S] each scheduled request's verify-history class, in step order."""
        return [self.sequences[entry.request_id].verify_history for entry in scheduled]

    def _steady_verify(self, scheduled: list[ScheduledRequest], n: int) -> bool:
        """With a drafter: whether the next step is expected to be the same requests each verifying ``n`` drafts of
        the block drafted now (``_next_verify``): every one is a greedy verify of this step's block length (no
        logprobs, penalties or sampling) and all running requests are in the step, neither step can reach a
        request's token limit, nobody can be admitted (nothing waits, or the batch is full: under a steady load
        requests always wait), and drafting is not pipelined. An end of sequence, a stop string, a fault or a
        closing acceptance gate can still end it: the worker then drops the step."""
        if not scheduled or n == 0 or self.scheduler.may_admit() or self.pipelined or self.gate.closed \
                or len(scheduled) != len(self.scheduler.running) or (self.guard is not None
                                                                     and not self.guard.verifies_all()):
            return False
        k = scheduled[0].num_drafts
        if k == 0 or len(scheduled) * (n + 1) > self.config.max_num_batched_tokens:
            return False
        for entry in scheduled:
            if entry.num_drafts != k or len(entry.token_ids) != k + 1 or not entry.sample or not greedy_only(entry):
                return False
            seq = self.sequences[entry.request_id]
            # this step commits up to k + 1 tokens, the next one verifies n drafts and commits up to n + 1 more
            if len(seq.output_token_ids) + (k + 1) + (n + 1) > seq.params.max_tokens \
                    or entry.end_position + (n + 1) + 1 >= self.max_model_len:
                return False
        return True

    def _pipeline_pays(self) -> bool:
        """Whether this step is pipelined: enough requests run or wait (``pipeline_drafter_min_batch``) that two half
        batches verify in about the time of the whole (below, a half batch still reads every weight)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) >= self.pipeline_min_batch

    def _take_late_drafts(self) -> None:
        """Pipelined drafting: the blocks drafted this step for the group the previous step verified. A request
        that finished or was preempted since (its block was drafted from a state it no longer has) drops its own."""
        for request_id, (drafts, confidence) in self.executor.take_late_drafts().items():
            seq = self.sequences.get(request_id)
            if seq is not None and seq.status is Status.RUNNING and seq.is_decoding and not self.gate.closed:
                seq.draft_ids, seq.draft_confidence = drafts, confidence

    def _allot_verify_lengths(self, group: int | None, kind: str) -> None:
        """Confidence scheduling: trim each decoding request's proposed block to what this step verifies (of
        ``group``'s requests when drafting is pipelined; ``kind``: the step's, ``Scheduler.next_step_kind``)."""
        if kind == "prefill":  # (prefill apart: this step verifies nothing, the next one decides)
            return
        members = [s for s in self.scheduler.running if group is None or s.group == group]
        if kind == "decode":  # prefill apart: the decoding requests alone (a prompt's next chunk waits a step)
            members = [s for s in members if s.is_decoding]
        proposes = [bool(s.draft_ids) and s.draft_confidence is not None for s in members]
        seqs = [s for s, block in zip(members, proposes) if block]
        if not seqs:
            return
        others, other_tokens, other_context = self._beside_next
        if kind == "decode":  # beside the verifies only decodes without drafts, a token each
            plain = [s for s, block in zip(members, proposes) if not block]
            others, other_tokens, other_context = len(plain), len(plain), sum(s.num_computed for s in plain)
        context = other_context + sum(s.num_computed for s in seqs)
        self._decided = [s.request_id for s in seqs]
        confidences = [self._feedable_confidence(s) for s in seqs]  # [S][<= K] what the step can feed of each block
        # a step that will feed more than these verifies (a request still prefilling, an arrival to admit) is mixed:
        # it cannot be a packed step, so it verifies under the padded layout's cap (priced as a mixed step). A queue
        # the full batch leaves no room for does not make it mixed: under a steady load, where requests always wait,
        # most steps admit nobody, and they are packed
        admitting = kind == "mixed" and self.scheduler.may_admit() and not self._ran_ahead  # (admit, in step)
        if admitting:
            # the arrivals it admits are priced too: their prefill is most of a mixed step's cost (64
            # requests: such steps were priced as the verifies alone, 7.9 ms, and took 21; the scheduler saw a trim
            # as saving ~3x the share of the step it did, and cut 7 drafts to 5.4)
            budget = self.config.max_num_batched_tokens - other_tokens - sum(1 + len(s.draft_ids) for s in seqs)
            arrivals, arrival_tokens = self.scheduler.expected_admissions(budget)
            others, other_tokens = others + arrivals, other_tokens + arrival_tokens  # (a prompt attends to itself)
        mixed = len(seqs) < len(members) or admitting
        if self._packs_steps_of(len(seqs)) and not mixed:
            # blocks stay whole: the device picks which drafts
            self.confidence.allot_packed(confidences, others, other_tokens, context,
                                         [s.verify_history for s in seqs])
            self._packed_columns = self.confidence.step_columns
            if self._packed_columns == 0:  # no draft pays: every request verifies none (its anchor only)
                for seq in seqs:
                    seq.trim_drafts(0)
        elif mixed and self._host_work is not None and self.confidence.layout != "ragged":
            # a mixed step is neither packed nor launched ahead: the device waits for the host's work between steps,
            # so only the cap chosen earlier is applied now, the rest of the decision runs while it computes
            num, bucket, step = len(seqs), self.confidence.bucket(len(self.scheduler.running)), self._step_index
            lengths = self.confidence.allot_deferred(
                confidences, others, other_tokens, context, [s.verify_history for s in seqs],
                self._host_work, then=lambda: self._record_decision(num, bucket, step, mixed=True))
            for seq, length in zip(seqs, lengths):
                seq.trim_drafts(length)
            self._deferred = True
            return
        else:
            lengths = self.confidence.allot(confidences, others, other_tokens, context,
                                            [s.verify_history for s in seqs])
            if self.confidence.last.budget < self.confidence.last.offered:  # (else every block stays whole)
                for seq, length in zip(seqs, lengths):
                    seq.trim_drafts(length)
        self._record_decision(len(seqs), self.confidence.bucket(len(self.scheduler.running)), self._step_index,
                              mixed)

    def _guard_verifiers(self) -> None:
        """The speculation guard's choice (its last plan): drop the blocks of the requests it left out before they
        are verified (each decodes one token this step instead)."""
        if self.guard.verifies_all():
            return
        for seq in self.scheduler.running:
            if seq.draft_ids and not self.guard.verifies(seq.request_id):
                seq.trim_drafts(0)
                self.guard.stats.trimmed_blocks += 1

    def _feedable_confidence(self, seq: Sequence) -> list[float]:
        """``seq``'s drafts' confidences as far as its limits let the next step feed them (``Scheduler.draft_room``:
        the scheduler cuts a block there), so a decision prices and expects what will be verified, not a block's
        drafts past its end."""
        room, confidence = self.scheduler.draft_room(seq), seq.draft_confidence
        return confidence if len(confidence) <= room else confidence[:max(room, 0)]

    def _record_decision(self, requests: int, bucket: int, step: int, mixed: bool = False) -> None:
        """The scheduler's last decision (``requests`` deciding, at step ``step`` of a batch in ``bucket``; ``mixed``:
        priced as a mixed step, prompt chunks beside its verifies) into the metrics, and its judgement of drafting
        into the hold (from ``step`` on: a decision made at once holds this step's drafting, ``draft_len``; a
        deferred one, made while this step computes, the next step's)."""
        self.confidence_stats.record_decision(self.confidence.last, requests)
        if self.confidence.drafting_pays is not None:
            self.confidence.hold.record(bucket, step, self.confidence.drafting_pays, mixed)
            self._judged_bucket = bucket

    def _packed_plan(self, scheduled: list[ScheduledRequest]) -> PackedPlan | None:
        """The packed layout: this step's packed verify, when it is exactly the requests the scheduler decided for
        (or the profile forced), each verifying a greedy block (of up to K drafts: one cut at its token limit, even
        to none, is padded with drafts that propose nothing); else None, and the step verifies whole blocks (a
        sampled request, a step the scheduler did not schedule as decided: ``ConfidenceStats.unpacked_steps``; a
        step expected to feed a prefill chunk is decided under the padded cap instead, ``_allot_verify_lengths``).
        Columns of whole blocks (or none) are a uniform step's."""
        columns = self._packed_columns
        if not columns or not self._decided:
            return None
        if len(scheduled) != len(self._decided) or {e.request_id for e in scheduled} != set(self._decided):
            self.confidence_stats.unpacked_steps += 1
            return None
        k = max(entry.num_drafts for entry in scheduled)
        if columns >= k:  # whole blocks: a uniform step's graph serves it
            return None
        confidences = []
        for entry in scheduled:
            confidence, n = self.sequences[entry.request_id].draft_confidence, entry.num_drafts
            if len(entry.token_ids) != n + 1 or not entry.sample or not greedy_only(entry) \
                    or (n and (confidence is None or len(confidence) < n)):
                self.confidence_stats.unpacked_steps += 1
                return None
            # a block cut shorter (at its token limit, to nothing at its last token) is padded with drafts that
            # propose nothing (confidence 0)
            confidences.append((list(confidence[:n]) if n else []) + [0.0] * (k - n))
        return PackedPlan(columns * len(scheduled), columns, confidences, *self._packed_ranking(k),
                          self._histories(scheduled))

    def _force_verify_lengths(self) -> None:
        """Profiling: trim every running request's proposed block to ``forced_verify_len`` drafts, or where the
        target's packed graphs serve the step, verify that many columns of whole blocks packed (as served)."""
        running, length = self.scheduler.running, self.forced_verify_len
        k = max((len(s.draft_ids) for s in running), default=0)
        if self._packs(len(running), length, k):
            self._packed_columns, self._decided = length, [s.request_id for s in running]
            return
        for seq in running:
            seq.trim_drafts(length)

    def _note_other_fed(self, scheduled: list[ScheduledRequest], drafted: bool) -> None:
        """What the step fed besides the verifies the scheduler chose (prefill chunks, draft-less decodes:
        ``_other_fed``, the table this step is learned in), and of it what the next step is expected to feed beside
        its verifies (``_beside_next``: the next decision prices its verifies beside as much). A request that
        drafted this step (``drafted``: the step drafted blocks, and it sampled a token) verifies next step: it is
        not beside the verifies (the first decision after a drafting hold would otherwise price every verify
        twice)."""
        decided = set(self._decided)
        others = [e for e in scheduled if e.request_id not in decided]
        self._other_fed = (len(others), sum(len(e.token_ids) for e in others), sum(e.start_position for e in others))
        beside = [e for e in others if not (drafted and e.sample)]
        self._beside_next = (len(beside), sum(len(e.token_ids) for e in beside),
                             sum(e.start_position for e in beside))

    def _learn_step_time(self, scheduled: list[ScheduledRequest], seconds: float, decided: bool,
                         drafted: bool = True, serial: bool = False, packed_columns: int | None = None,
                         other_tokens: int = 0, held: bool = False, committed: int | None = None,
                         decision: Decision | None = None, verified: int | None = None) -> None:
        """The step's wall time, schedule to commit (what the startup profile times: ``runtime.worker.step_profile``), into
        the cost table at the rows the model computed: a graphed verify step at its graph's cell (the batch bucket
        x Q, padding requests included: one run's steps of 60 and 72 requests, timed as the 64 and 96 graphs they
        replayed, sat in the 64 row at 480 and 576 tokens, 11.6 and 15.7 ms, and through the row's non-decreasing
        bound of the time priced whole blocks at 64 requests at 9.9 ms where they took 8.8). The whole step, not
        the executor's part alone: the host's per-step work is paid at every verify length, and a table whose served
        cells lacked it while the profiled ones held it would make the lengths the scheduler chose look cheaper than
        the ones it did not (trims to 4.6 of 7 drafts at 256 requests, predicted to pay, lost 14%). With the
        context the step's requests attended over (the KV tokens before what each fed), which its time grows with.
        ``decided``: the scheduler chose this step's verifies (its metrics set the time beside the prediction).
        A step that drafted nothing (``drafted`` False) is no cell of these tables (they price drafting steps): a
        plain decode step (a token a request, each sampled) teaches the plain steps' table (``StepCostTable.plain``,
        at its graph's rows), a plain step with prompt chunks beside its decodes the plain mixed steps' excess
        (``ConfidenceScheduler.plain_mixed``: a mixed step's plain alternative), others nothing. ``serial``: the
        engine launches steps ahead and did not launch this one ahead, so its time holds the host's whole step work
        besides the device's (a verify step after a prefill, every step of a sampled batch; at 256 requests on an
        H200 ~4 ms of a 30-ms step): it teaches the excess of ``MixedStepCosts`` as a mixed step does, not the
        cells the startup profile timed launched ahead
        (the whole-block cell at 256 requests ended at 35.4 ms where the fixed engine's whole-block steps
        took 30.3, about the host's step work there apart, ~4.4 ms; trims to 6 of 7 columns looked 17% cheaper
        than whole blocks and saved 2%), and no plain step. ``packed_columns``: the columns of the step's packed verify
        (None: not packed); ``other_tokens``: what it fed besides the decided verifies (``_other_fed``, before its
        commit). ``held`` (a drafting hold kept the step from drafting), ``committed`` (the tokens its deciding
        requests committed), ``decision`` (the one that chose its verifies, ``ConfidenceScheduler.last`` as the
        commit left it: its learning settles a deferred decision) and ``verified`` (the drafts those requests
        verified) go to the step trace (``ConfidenceStats.trace``).
        Called after the step, or (a deferred decision's step) as a task of the executor's host work."""
        fed = [len(e.token_ids) for e in scheduled]
        # the prompt chunks' tokens (the trace's): none in a step of plain decodes, nor beside verifies that fed
        # nothing else (other_tokens)
        plain_decodes = not drafted and all(f == 1 for f in fed) and all(e.sample for e in scheduled)
        prompt_tokens = 0 if plain_decodes or (drafted and not other_tokens) else \
            sum(f for f, e in zip(fed, scheduled) if e.feeds_prompt)
        if not drafted:
            if not decided and not serial and plain_decodes:
                plain = self.confidence.costs.plain
                if plain is not None:
                    rows = len(scheduled) if self.confidence.layout == "ragged" else \
                        self.confidence.graph_rows(len(scheduled))
                    plain.observe(rows, rows, seconds, sum(e.start_position for e in scheduled))
            elif not decided and 0 < prompt_tokens < sum(fed):  # prompt chunks beside plain decodes: what a mixed
                # step's plain alternative costs
                self.confidence.observe_plain_mixed_step(len(scheduled), seconds,
                                                         sum(e.start_position for e in scheduled), prompt_tokens)
            self.confidence_stats.record_step(1e3 * seconds, decided, serial, len(scheduled), held, committed,
                                              decision, prompt_tokens, verified)
            return
        requests, tokens, q_len = len(scheduled), sum(fed), None
        if packed_columns is not None:  # a packed graph: an anchor and `columns` drafts a request
            q_len = packed_columns + 1
        elif self.confidence.layout != "ragged":  # a graph pads it
            q_len = graphed_q_len(fed, self._graph_q_lens, self.config.max_num_seqs, *self._graph_prefill)
        if q_len is not None:
            # a pure verify step at its graph's cell, the rows it computed (padding requests too), as the scheduler
            # prices it (ConfidenceScheduler.graph_rows); a mixed one at its own requests
            requests = requests if other_tokens else self.confidence.graph_rows(requests)
            tokens = requests * q_len
        # a step that fed anything besides the decided verifies (a prefill chunk, a decode without drafts, or no
        # verify at all) teaches the mixed steps' excess: what the scheduler prices such steps by
        self.confidence.observe_step(requests, tokens, seconds, sum(e.start_position for e in scheduled), other_tokens,
                                     serial)
        self.confidence_stats.record_step(1e3 * seconds, decided, serial, len(scheduled), held, committed,
                                          decision, prompt_tokens, verified)

    def _commit_step(self, scheduled: list[ScheduledRequest], results: list[RequestStepResult]) -> list[RequestOutput]:
        outputs, drafted, accepted = [], 0, 0
        for entry, result in zip(scheduled, results):
            seq = self.sequences[entry.request_id]
            if self.verification_log is not None and entry.num_drafts and seq.draft_confidence is not None \
                    and result.error is None:
                self.verification_log.append((seq.draft_confidence[:entry.num_drafts], result.num_accepted))
            try:
                if result.error is not None:
                    constraints = constraints_of(seq.params)
                    if constraints:  # every token masked: (-inf logits everywhere) the request asked the impossible
                        raise RequestFault(f"no token satisfies this request's constraints together ("
                                           f"{', '.join(constraints)}) after {len(seq.output_token_ids)} generated "
                                           "tokens", code="unsatisfiable_constraints")
                    raise RequestFault(result.error)
                kept = self._commit(seq, entry, result)
                if self.guard is not None and entry.sample and entry.num_drafts:
                    self.guard.observe_verify(seq.request_id, entry.num_drafts if result.num_verified is None
                                              else result.num_verified, result.num_accepted)
                if self.confidence is not None and entry.sample and entry.num_drafts:  # (the device's rule too)
                    verified = entry.num_drafts if result.num_verified is None else result.num_verified
                    seq.verify_history = next_history(seq.verify_history, verified, result.num_accepted,
                                                      self.confidence.max_draft_len)
                if seq.finish_reason is None:
                    self.scheduler.cache_computed(seq)
                step_drafted, step_accepted = self._counted(entry, result, kept, seq.finish_reason is not None)
                seq.num_draft_tokens += step_drafted
                seq.num_accepted_tokens += step_accepted
                out = self.output(seq, result.token_ids[:kept]) if result.token_ids and (
                    seq.finish_reason is not None or seq.params.output_kind != "final_only") else None
            except Exception as exc:  # this request's own fault (its logits, its text): it alone fails
                outputs.append(self._fail(seq, exc))
                continue
            self.metrics.record(step_drafted, step_accepted)
            drafted, accepted = drafted + step_drafted, accepted + step_accepted
            if out is not None:
                outputs.append(out)
            if seq.finish_reason is not None:
                del self.sequences[seq.request_id]
        self.gate.record(drafted, accepted)
        if self.confidence is not None and self._decided:
            self._learn_acceptance(scheduled, results)
        if self.gate.closed:  # drafts already proposed are dropped too: from now on, plain decoding
            for seq in self.scheduler.running:
                seq.draft_ids = []
        return outputs

    def _learn_acceptance(self, scheduled: list[ScheduledRequest], results: list[RequestStepResult]) -> None:
        """Against the survivals' prediction, what the requests the scheduler chose for committed (metrics), and
        how many drafts each verified and accepted (its online survival fit; -1 for one that left the step,
        failed or did not sample)."""
        order = {request_id: i for i, request_id in enumerate(self._decided)}
        verified, accepted = [-1] * len(order), [-1] * len(order)  # in decision order
        committed = 0
        for entry, result in zip(scheduled, results):
            i = order.get(entry.request_id)
            if i is not None:
                committed += len(result.token_ids)
                if result.error is None and entry.sample:
                    verified[i] = entry.num_drafts if result.num_verified is None else result.num_verified
                    accepted[i] = result.num_accepted
        self.confidence.settle()  # (a deferred decision recorded before its outcome: the metrics pair them)
        self.confidence_stats.record_outcome(committed, sum(v for v in verified if v > 0))
        if self.confidence.learn(verified, accepted):  # refitted, the judgement that drafting did not pay reversed
            self.confidence.hold.record(self._judged_bucket, self._step_index, True)
        self._decided = []

    def _commit(self, seq: Sequence, entry: ScheduledRequest, result: RequestStepResult) -> int:
        """Append committed tokens up to the first stop; returns how many were kept."""
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, entry, result.prompt_logprobs)
        seq.num_computed = entry.end_position - entry.num_drafts + result.num_accepted if entry.sample \
            else entry.end_position
        if seq.first_token_time is None and result.token_ids:
            seq.first_token_time = time.monotonic()
        tokens, complete = result.token_ids, False
        if seq.grammar is not None and tokens:  # (what the grammar took: up to the token that completed it)
            taken, complete = self._grammar_backend.accepted(seq.grammar, tokens)
            tokens = tokens[:taken]
        if not seq.params.stop:  # no stop strings: the cut is found over the step's tokens at once
            kept, reason = self.stops.cut(seq, tokens)
            seq.output_token_ids.extend(tokens[:kept])
        else:  # stop strings: the tail is decoded after each token
            kept, reason = 0, None
            while reason is None and kept < len(tokens):
                seq.output_token_ids.append(tokens[kept])
                kept += 1
                reason = self.stops.check(seq)
        if result.logprobs is not None:
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            seq.output_logprobs.extend(result.logprobs[:kept])
        if reason is None and complete and kept == len(tokens):
            reason = "stop"  # the grammar is complete: nothing may follow
        if reason is not None:
            self.scheduler.finish(seq, reason)
        else:
            seq.draft_ids, seq.draft_confidence = result.next_draft_ids, result.next_draft_confidence
        return kept

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """End ``seq`` with finish_reason "error" (its pages are freed); the others in the step are untouched."""
        message = str(exc) if isinstance(exc, RequestFault) else f"{type(exc).__name__}: {exc}"
        code = exc.code if isinstance(exc, RequestFault) else None
        log.warning("dspark: request %s failed alone: %s", seq.request_id, message)
        self.scheduler.finish(seq, "error", scrub=True)
        # and the graphs' scratch page (the one past the allocator's, on every rank: each holds its own slice of it),
        # which its padding rows may have filled with NaN that other requests' padded key ranges read masked
        self.scheduler.scrub([self.pages.num_pages])
        del self.sequences[seq.request_id]
        committed = [] if seq.params.output_kind == "delta" else list(seq.output_token_ids)  # deltas sent the rest
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=committed, text="", finish_reason="error", new_token_ids=[],
                             error=message, error_code=code, num_draft_tokens=seq.num_draft_tokens,
                             num_accepted_tokens=seq.num_accepted_tokens, index=seq.index,
                             first_token_time=seq.first_token_time)

    @staticmethod
    def _counted(entry: ScheduledRequest, result: RequestStepResult, kept: int, finished: bool) -> tuple[int, int]:
        """(drafted, accepted) as counted: a stop inside the accepted drafts ends the count there."""
        if finished and kept <= result.num_accepted:
            return kept, kept
        return entry.num_drafts, result.num_accepted

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, entry: ScheduledRequest, logprobs: list) -> None:
        """Append a prefill chunk's prompt logprobs (those of ``entry.prompt_rows``) to ``seq.prompt_logprobs``: its
        first row is the prompt position after the last one recorded (a chunk recomputed after a preemption records
        only what was missing: the scheduler asked for no more)."""
        first = entry.start_position + entry.prompt_rows[0] + 1  # the prompt position the chunk's first row predicts
        if first != len(seq.prompt_logprobs):
            raise RuntimeError(f"request {seq.request_id}: prompt logprobs from position {first} arrived with "
                               f"{len(seq.prompt_logprobs)} recorded")
        seq.prompt_logprobs.extend(logprobs)

    def output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """A snapshot (``SamplingParams.output_kind``: every token so far, or with "delta" this step's only);
        ``text`` is decoded once the request finished (empty before)."""
        text = self.stops.text(seq) if seq.finish_reason is not None else ""
        delta = seq.params.output_kind == "delta"
        logprobs = None
        if seq.params.logprobs is not None:
            every = seq.output_logprobs or []
            logprobs = every[len(every) - len(new_token_ids):] if delta else list(every)
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and (not delta or len(seq.output_token_ids) == len(new_token_ids)):
            # (deltas: once, with the first generated tokens). Complete and never changed again once a token is out
            # (a recomputed prompt records nothing twice), so every output shares the one list: no O(prompt) copy
            prompt_logprobs = seq.prompt_logprobs
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=list(new_token_ids) if delta else list(seq.output_token_ids), text=text,
                             finish_reason=seq.finish_reason, new_token_ids=new_token_ids,
                             num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens,
                             logprobs=logprobs, index=seq.index, first_token_time=seq.first_token_time,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=seq.num_cached_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def get_metrics(self) -> dict:
        return {**self.metrics.as_dict(), "speculation_disabled": self.gate.closed,
                "num_preemptions": self.scheduler.num_preemptions, "num_aborted_requests": self.num_aborted,
                "num_kv_pages_used": self.pages.num_used,
                "num_kv_pages": self.pages.num_pages, "prefix_cache_queries": self.pages.num_queried_tokens,
                "prefix_cache_hits": self.pages.num_hit_tokens, "num_kv_pages_cached": self.pages.num_cached,
                **({"confidence_scheduling": self.confidence_stats.as_dict(self.confidence)}
                   if self.confidence is not None else {}),
                **({"pipelined_steps": self.pipelined_steps} if self.pipelined else {}),
                **({"speculation_guard": self.guard.as_dict()} if self.guard is not None else {}),
                **self.executor.stats()}
