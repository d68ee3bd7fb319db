"""What the engine learns from each step once it ran: its time (the confidence scheduler's step-cost table,
the speculation guard's prices) and its verdicts (acceptance per request and per position)."""

from __future__ import annotations

from runtime.scheduling.step_io import RequestStepResult, ScheduledRequest
from runtime.spec.decision import Decision
from runtime.worker.graph_layout import graphed_q_len


class StepLearning:
    """``Engine``'s learning from its steps (a mixin: it reads and writes the engine's own state)."""

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
        """The step's wall time, schedule to commit (what the startup profile times: ``runtime.engine.step_profile``), into
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
