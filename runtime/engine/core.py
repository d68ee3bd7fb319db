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
from runtime.engine.commit import StepCommit
from runtime.engine.executor import Executor, LocalExecutor
from runtime.engine.host_work import HostWork, run_step
from runtime.engine.metrics import AcceptanceGate, SpecMetrics
from runtime.engine.outputs import RequestOutput
from runtime.engine.requests import RequestIntake
from runtime.engine.speculation_plan import SpeculationPlanning
from runtime.engine.step_learning import StepLearning
from runtime.engine.step_profile import profile_step_costs
from runtime.kernels.profiling import region
from runtime.models.loader import load_hf_config
from runtime.sampling.generation_defaults import model_sampling_defaults
from runtime.sampling.grammar import GrammarBackend
from runtime.sampling.grammar_masks import GrammarMaskJobs
from runtime.sampling.stops import StopCriteria
from runtime.scheduling.pages import PageAllocator
from runtime.scheduling.scheduler import Scheduler, SchedulerLimits
from runtime.scheduling.sequence import Sequence
from runtime.scheduling.step_io import PackedPlan, ScheduledBatch, ScheduledRequest
from runtime.spec.confidence import ConfidenceScheduler
from runtime.spec.guard import SpeculationGuard
from runtime.spec.stats import ConfidenceStats
from runtime.spec.step_costs import StepCostTable
from runtime.spec.survival import read_calibration

log = logging.getLogger(__name__)

# the share of its last step's wall time the host may spend on deferred work (``runtime.engine.host_work``) while
# the device computes the step launched ahead: the rest is the engine's own commit, schedule and launch (about a
# third of a 3-ms step at one to four requests, one run's profiles)
HOST_WORK_SHARE = 0.15


@dataclass(frozen=True)
class StepPlan:
    """One step as planned (``Engine._plan_step``), kept to learn from once it ran."""

    scheduled: list[ScheduledRequest]
    batch: ScheduledBatch  # what the executor runs
    serial: bool  # an engine that launches steps ahead ran this one in its turn (its time holds the host's work)
    guarded: bool  # the speculation guard planned it (no forced length)
    whole: bool = True  # it verifies every block drafted for it (the guard left nobody out)

    @property
    def drafted(self) -> bool:
        return self.batch.num_next_drafts > 0


class Engine(RequestIntake, SpeculationPlanning, StepLearning, StepCommit):
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
        # profiling (runtime.engine.step_profile): every decoding request verifies at most this many drafts, and the
        # steps are planned and launched ahead at that length as a confidence-scheduled engine's are at its cap
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
        self.host_work: HostWork | None = None  # deferred work, run at the steps' device waits (confidence scheduling)
        self._deferred = False  # the step's decision was deferred (allot_deferred)
        self._judged_bucket = 0  # the batch bucket of the last judgement of drafting (its hold's, _record_decision)
        self._grammar_backend: GrammarBackend | None = None  # structured outputs' compiler (_grammars)
        self._grammar_lock = threading.Lock()  # (compile_grammar runs on other threads too)
        self._mask_jobs: GrammarMaskJobs | None = None  # their token masks, computed off this thread (_grammars)
        self._mask_faults: dict[str, Exception] = {}  # this step's requests whose mask job failed: they fail alone
        self._structured: set[str] = set()  # ids of structured requests, pruned to live ones each step (_mask_grammars)
        # whether speculating pays, per request and per batch (runtime.spec.guard); not while drafting is pipelined
        # (two groups alternate steps: each step drafts the other group's blocks)
        self.guard = SpeculationGuard(int(self.spec.max_draft_len or 0), runs_ahead=self._runs_ahead) \
            if self.spec is not None and self.spec.speculation_guard and not self.pipelined else None
        if self.spec is not None and self.spec.enable_confidence_scheduling:
            self.confidence = self._confidence_scheduler()
            if self.executor.yields_device_waits:  # the survival fit learns while the device computes the next step
                self.host_work = HostWork()  # (its budget follows the steps: _learn_step)
                self.confidence.defer_learning(self.host_work)

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

    def step(self) -> list[RequestOutput]:
        """One step: schedule the requests and plan their speculation, execute, commit what the target verified,
        learn from the step's time and outcome."""
        group, pipelined = self._take_turn()
        self.executor.arm()  # (before the step is timed)
        began = time.perf_counter()
        with region("dspark.schedule"):
            plan = self._plan_step(group, pipelined)
        with region("dspark.execute"):
            results = run_step(self.executor.execute(plan.batch), self.host_work)
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
        whole = not guarded or self.guard.verifies_all()  # (the last plan's choice: whose blocks this step verifies)
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
        return StepPlan(scheduled, batch, serial, guarded, whole)

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
        if plan.guarded and scheduled and not all(e.feeds_prompt for e in scheduled):  # (a step that decodes)
            # (steady: as a run of plain steps runs, each launched ahead by the one before: see the guard's prices)
            steady = not self._runs_ahead or (not plan.serial and plan.batch.run_ahead)
            self.guard.observe_step(len(scheduled), plan.drafted, sum(e.num_drafts for e in scheduled), seconds,
                                    steady, any(e.feeds_prompt for e in scheduled), plan.whole)
        if self.confidence is None or not scheduled:
            return
        step = (scheduled, seconds, decided, plan.drafted, plan.serial,
                self._packed.columns if self._packed is not None else None, self._other_fed[1], held,
                # (the commit settled the decision, then recorded its outcome)
                self.confidence_stats.last.get("committed_tokens") if decided else None,
                self.confidence.last if decided else None,
                self.confidence_stats.last.get("verified_drafts") if decided else None)
        if self._deferred:  # the step's decision was deferred (a mixed step): so is learning its time
            self.host_work.add(functools.partial(self._learn_step_time, *step))
        else:
            self._learn_step_time(*step)
        if self.host_work is not None:  # the next step's deferred work: what its device time leaves the host
            self.host_work.budget_s = HOST_WORK_SHARE * seconds

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def confidence_tables(self) -> dict:
        """Confidence scheduling's learned step-time tables as JSON ({} without it): ``costs`` (a step's time by batch
        size and tokens fed, ``runtime.spec.step_costs``), ``mixed`` (mixed steps' excess over it), ``plain_mixed``
        (a plain mixed step's, or None)."""
        confidence = self.confidence
        if confidence is None:
            return {}
        return {"costs": confidence.costs.to_json(), "mixed": confidence.mixed_costs.to_json(),
                "plain_mixed": None if confidence.plain_mixed is None else confidence.plain_mixed.to_json()}

    def reset_speculation_stats(self) -> None:
        """Start confidence scheduling's statistics over (``get_metrics()["confidence_scheduling"]``, the survival
        fit's skill), keeping everything it learned: a benchmark's figures per load."""
        if self.confidence is not None:
            self.confidence_stats = ConfidenceStats()
            self.confidence.correction.reset_skill()

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
