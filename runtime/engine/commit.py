"""Committing a step's verdicts: tokens appended, stops and grammars applied, a request's own fault ending
it alone, and the outputs returned to the caller."""

from __future__ import annotations

import logging
import time

from runtime.engine.outputs import RequestOutput
from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.sequence import Sequence
from runtime.scheduling.step_io import RequestStepResult, ScheduledRequest
from runtime.spec.history import next_history

log = logging.getLogger(__name__)


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


class StepCommit:
    """``Engine``'s commit of a step (a mixin: it reads and writes the engine's own state)."""

    def _commit_step(self, scheduled: list[ScheduledRequest], results: list[RequestStepResult]) -> list[RequestOutput]:
        outputs, drafted, accepted = [], 0, 0
        verifies = [] if self.guard is not None else None  # (request, verified, accepted) for the guard, in order
        for entry, result in zip(scheduled, results):
            seq = self.sequences[entry.request_id]
            if self.verification_log is not None and entry.num_drafts and seq.draft_confidence is not None \
                    and result.error is None:
                self.verification_log.append((seq.draft_confidence[:entry.num_drafts], result.num_accepted))
            try:
                fault = self._mask_faults.pop(entry.request_id, None)
                if fault is not None:
                    raise RequestFault(f"its grammar's token masks failed: {type(fault).__name__}: {fault}")
                if result.error is not None:
                    constraints = constraints_of(seq.params)
                    if constraints:  # every token masked: (-inf logits everywhere) the request asked the impossible
                        raise RequestFault(f"no token satisfies this request's constraints together ("
                                           f"{', '.join(constraints)}) after {len(seq.output_token_ids)} generated "
                                           "tokens", code="unsatisfiable_constraints")
                    raise RequestFault(result.error)
                kept = self._commit(seq, entry, result)
                if verifies is not None and entry.sample and entry.num_drafts:
                    verifies.append((seq.request_id, entry.num_drafts if result.num_verified is None
                                     else result.num_verified, result.num_accepted))
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
        if verifies:
            self.guard.observe_verifies(verifies)
        self.gate.record(drafted, accepted)
        if self.confidence is not None and self._decided:
            self._learn_acceptance(scheduled, results)
        if self.gate.closed:  # drafts already proposed are dropped too: from now on, plain decoding
            for seq in self.scheduler.running:
                seq.draft_ids = []
        return outputs

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
