"""What a step drafts and verifies: the draft length at a batch size, the speculation guard's and the
confidence scheduler's per-request verify lengths, the packed layout, and whether the next step is launched
ahead (a steady decode or verify) or pipelined."""

from __future__ import annotations

from runtime.scheduling.sequence import Sequence, Status
from runtime.scheduling.step_io import PackedAhead, PackedPlan, ScheduledRequest
from runtime.spec.history import history_classes
from runtime.worker.step_tensors import greedy_only, plain_greedy


class SpeculationPlanning:
    """``Engine``'s speculation planning (a mixin: it reads and writes the engine's own state)."""

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
        elif mixed and self.host_work is not None and self.confidence.layout != "ragged":
            # a mixed step is neither packed nor launched ahead: the device waits for the host's work between steps,
            # so only the cap chosen earlier is applied now, the rest of the decision runs while it computes
            num, bucket, step = len(seqs), self.confidence.bucket(len(self.scheduler.running)), self._step_index
            lengths = self.confidence.allot_deferred(
                confidences, others, other_tokens, context, [s.verify_history for s in seqs],
                self.host_work, then=lambda: self._record_decision(num, bucket, step, mixed=True))
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
