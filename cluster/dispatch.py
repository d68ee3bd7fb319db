"""The step's wire format between the driver and a replica's actors: deltas in plain tuples.

A ``ScheduledBatch`` resends every request's whole page list and sampling parameters each step, and pickling
hundreds of small dataclasses dominated the step's round trip at large batches (``benchmarks/dispatch.py``).
Both ends keep what they already exchanged instead:

- the driver's ``BatchEncoder`` sends, per request, the fed tokens and positions, only the pages added since
  the actors last saw it (after how many it expects them to hold), and the parameters and seed once;
- each actor's ``BatchDecoder`` keeps those and rebuilds the ``ScheduledBatch`` the worker runs.

A request's pages only grow until it is released (finished, aborted or preempted: ``released_request_ids``),
which both ends apply first, so a readmitted request starts over from an empty list. After a step that failed
the driver cannot know what the actors applied: its next step resets both ends and resends everything. An actor
that holds a different page count than the driver assumed fails the step loudly (never a silent mismatch). Results come
back as tuples too (``encode_results`` / ``decode_results``).

Both directions cross the compiled graph's channel as one pickled ``bytes`` object: the channel's own serialization
walks nested Python objects slowly, and a round trip to two idle actors on the 2x H200 host's CPU took 0.49 / 1.87 ms
at 64 / 256 requests as tuples against 0.15 / 0.09 ms for a bytes object of the same size (``pickle`` itself takes
0.01-0.05 ms each way; ``benchmarks/dispatch.py``). Driver and actors are one trust domain (Ray pickles between
them anyway).
"""

from __future__ import annotations

import pickle

from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest

WIRE_PROTOCOL = pickle.HIGHEST_PROTOCOL

# one request of a step: (request id, token ids, start position, pages held before, new pages, drafts, sample,
#                         (params, seed) the first time else None, penalty history, prompt-logprob rows,
#                         banned rows, grammar masks, bad words' row bans)
WireRequest = tuple


class BatchEncoder:
    """Driver side: what every actor of the replica holds, and the deltas that bring it up to date."""

    def __init__(self):
        self.pages_sent: dict[str, int] = {}
        self.reset_next = False

    def reset(self) -> None:
        """The last step failed: the next one makes every actor forget and resends each request whole."""
        self.pages_sent, self.reset_next = {}, True

    def encode(self, batch: ScheduledBatch) -> bytes:
        """The step for the channel: the delta tuple (see ``WireRequest``), pickled."""
        return pickle.dumps(self.delta(batch), protocol=WIRE_PROTOCOL)

    def delta(self, batch: ScheduledBatch) -> tuple:
        """What every actor lacks to rebuild ``batch`` (and the bookkeeping that it now holds it)."""
        reset, self.reset_next = self.reset_next, False
        for request_id in batch.released_request_ids:
            self.pages_sent.pop(request_id, None)
        wire = []
        for r in batch.requests:
            held = self.pages_sent.get(r.request_id)
            first = held is None
            held = held or 0
            wire.append((r.request_id, r.token_ids, r.start_position, held, r.page_ids[held:], r.num_drafts,
                         r.sample, (r.params, r.seed) if first else None, r.penalty_history, r.prompt_rows,
                         r.banned, r.token_mask, r.row_bans))
            self.pages_sent[r.request_id] = len(r.page_ids)
        return (wire, batch.num_next_drafts, batch.maintain_draft_context, batch.released_request_ids,
                batch.scrub_page_ids, reset, batch.run_ahead, batch.next_verify_len, batch.packed,
                batch.next_packed, batch.pipelined)


class BatchDecoder:
    """Actor side: the pages, parameters and seeds of every request it has seen, and the batches they rebuild."""

    def __init__(self):
        self.pages: dict[str, list[int]] = {}
        self.params: dict[str, tuple] = {}

    def decode(self, wire: bytes) -> ScheduledBatch:
        requests, num_next_drafts, maintain, released, scrub, reset, run_ahead, next_verify_len, packed, \
            next_packed, pipelined = pickle.loads(wire)
        if reset:
            self.pages.clear()
            self.params.clear()
        for request_id in released:
            self.pages.pop(request_id, None)
            self.params.pop(request_id, None)
        out = []
        for request_id, tokens, start, held, new_pages, drafts, sample, first, history, prompt_rows, banned, mask, \
                bans in requests:
            if first is not None:
                self.params[request_id] = first
                self.pages[request_id] = []
            pages = self.pages.get(request_id)
            if pages is None or len(pages) != held:
                raise RuntimeError(f"dispatch: request {request_id!r}: this actor holds "
                                   f"{None if pages is None else len(pages)} pages, the driver assumed {held}")
            pages.extend(new_pages)
            params, seed = self.params[request_id]
            # the request's own list, not a copy (as the scheduler's entries): it only grows when a later step is
            # decoded, and a step's batch is read only while that step runs
            out.append(ScheduledRequest(request_id, tokens, start, pages, drafts, sample, params, seed, history,
                                        prompt_rows, banned, mask, bans))
        return ScheduledBatch(out, num_next_drafts, maintain, released, scrub, run_ahead=run_ahead,
                              next_verify_len=next_verify_len, packed=packed, next_packed=next_packed,
                              pipelined=pipelined)


def encode_results(results: list[RequestStepResult]) -> bytes:
    return pickle.dumps([(r.request_id, r.token_ids, r.num_accepted, r.next_draft_ids, r.error, r.logprobs,
                          r.next_draft_confidence, r.num_verified, r.prompt_logprobs) for r in results],
                        protocol=WIRE_PROTOCOL)


def decode_results(wire: bytes) -> list[RequestStepResult]:
    return [RequestStepResult(rid, tokens, accepted, drafts, error, logprobs, confidence, verified, prompt_logprobs)
            for rid, tokens, accepted, drafts, error, logprobs, confidence, verified, prompt_logprobs
            in pickle.loads(wire)]


def encode_any(value) -> bytes:
    """Any other step result (a separate drafter's proposals) for the channel."""
    return pickle.dumps(value, protocol=WIRE_PROTOCOL)


def decode_any(wire: bytes):
    return pickle.loads(wire)
