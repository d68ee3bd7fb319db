"""Requests coming in: validation, queueing, aborts, and structured outputs' grammars (compiled off the
engine's thread where a server asks, their token masks computed off it: ``runtime.sampling.grammar_masks``)."""

from __future__ import annotations

from runtime.sampling.bad_words import token_sequences
from runtime.sampling.grammar import GrammarBackend
from runtime.sampling.grammar_masks import IDLE_WAIT_S, STEP_WAIT_S, GrammarMaskJobs
from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.sequence import Sequence
from runtime.scheduling.step_io import ScheduledRequest


class RequestIntake:
    """``Engine``'s request side (a mixin: it reads and writes the engine's own state)."""

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
        (``runtime.sampling.grammar``), ready (``_masks_not_ready``). A request whose mask job failed is noted in
        ``_mask_faults``: its commit fails it alone (nothing of the step is kept for it)."""
        self._mask_faults.clear()  # (a step that never committed leaves none behind)
        for entry in scheduled:
            seq = self.sequences.get(entry.request_id)
            if entry.sample and seq is not None and seq.grammar is not None:
                try:
                    entry.token_mask = self._mask_jobs.take(seq, entry.num_drafts)
                except Exception as exc:  # (the grammar library's own failure, on this request's matcher)
                    self._mask_faults[entry.request_id] = exc

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
