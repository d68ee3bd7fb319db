"""Profile an engine's own steps into a ``StepCostTable`` (confidence scheduling's cost model).

For each batch bucket that fits the KV cache (1, 2, 4, ... up to ``max_num_seqs``), that many requests of random
tokens decode together; once every one carries a proposed block, each verify length L = 0..K is forced on all of them
for ``repeats`` steps in each of two passes over the lengths (``PASSES``; ``Engine.forced_verify_len``: the engine
plans and launches each next step ahead at L, as it does at a confidence-scheduled cap, and where a served step at cap
L drafts only L + 1 (a padded step, ``Engine.drafts_follow_cap``) the profile's does too; a packed step of L
columns drafts one past the longest share a request took (``Engine.drafts_follow_columns``), at least L + 1, which
the profile's (every request taking L, its ranking flat) drafts: a cell priced for the shortest block a served step
drafts is chosen, served and so learned at its cost, where one priced whole blocks would never be (a dear cell is
never served: on one run's pair such cells held the drafting off at 64 requests); one run's profile trimmed the
blocks behind its back, so every timed step of a shorter length dropped a verify launched ahead at the full block and
ran it again, 1.5-3 ms too slow) and the median step time of both passes is the table's (batch, batch * (L + 1))
cell, measured at the mean context (KV tokens) its timed steps attended over. Then the same requests decode
plainly (``Engine.forced_draft_len`` 0: nothing drafted, the drafter's context kept, launched ahead as served) for
``PLAIN_UNTIMED`` + ``PASSES`` x ``repeats`` steps, the median of the timed ones the plain steps' (batch, batch)
cell (``StepCostTable.plain``: what the scheduler judges drafting against). K is the block the engine drafts at
that batch size: ``max_draft_len``, or a ``draft_len_schedule``'s length there; a bucket the schedule drafts nothing
for is left out (no step of that size has drafts to choose among). The steps run through the engine as served steps
do (graphs, kernels, the executor's round trip). Afterwards nothing of the profile is left: its requests are aborted,
the counters and the acceptance gate start fresh, the prefix cache forgets its pages.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from runtime.engine.metrics import AcceptanceGate, SpecMetrics
from runtime.sampling.sampling_params import SamplingParams
from runtime.spec.step_costs import StepCostTable
from runtime.worker.graph_layout import batch_buckets

log = logging.getLogger(__name__)
PROFILE_PROMPT_TOKENS = 16
# every length is timed in two passes, shortest first then longest first, and read as the median of both: the
# contexts grow through the profile, and whatever drifts with them (or with the clocks) falls alike on every length
# instead of on the longest (earlier runs timed each length in one run of 3 steps, shortest first, and read
# 7 of 8 tokens a request at 64 requests 1.2x and 1.2x dearer than the whole block timed after it)
PASSES = 2
PLAIN_UNTIMED = 2  # plain steps untimed after the verifies: the last verify, and the first step launched ahead


def timed_steps(engine, ids: list[str], steps: int, untimed: int, times: list[float], contexts: list[int],
                finished: str) -> None:
    """Step ``engine`` ``steps`` times; the seconds of each after the first ``untimed`` onto ``times``, and the
    context its requests ``ids`` attended over before it onto ``contexts``. A request of ``ids`` gone (the token
    bound is wrong) is a RuntimeError saying ``finished``, not a KeyError."""
    for repeat in range(steps):
        live = [engine.sequences.get(i) for i in ids]
        if None in live:
            raise RuntimeError(f"confidence scheduling: {finished}")
        context = sum(seq.num_computed for seq in live)
        began = time.perf_counter()
        engine.step()
        if repeat >= untimed:
            times.append(time.perf_counter() - began)
            contexts.append(context)


def profile_step_costs(engine, repeats: int = 2, max_batch: int | None = None) -> StepCostTable:
    """-> the table of ``engine``'s step times (see the module docstring; ``repeats``: timed steps per length and
    pass); ``engine`` is idle before and after."""
    k = int(engine.spec.max_draft_len)
    steps_per_length = repeats + 1  # one untimed step after each change of length
    largest = min(max_batch or engine.config.max_num_seqs, engine.config.max_num_seqs)
    # the most a request commits, so that none finishes while profiled: a token a step while the batch prefills
    # (chunked at the token budget; verifying nothing) until every request drafted; then each step forced at length
    # L up to L + 1 (a packed step too: ``Engine._packed_ranking``), and the first step after a change of length
    # (launched ahead at the previous one) one more
    # (the steps its chunks need, and a margin: a step too few fails the engine's start; one more costs a token)
    to_first_block = -(-largest * PROFILE_PROMPT_TOKENS // engine.config.max_num_batched_tokens) + 16
    plain_steps = PLAIN_UNTIMED + PASSES * repeats  # then plain decoding: a token a step
    max_tokens = to_first_block + PASSES * (steps_per_length * (k + 1) * (k + 2) // 2 + k + 1) + plain_steps
    pages_per_request = -(-(PROFILE_PROMPT_TOKENS + max_tokens + k + 1) // engine.config.page_size)
    fits = engine.pages.num_pages // pages_per_request
    buckets = [b for b in batch_buckets(largest) if b <= fits]
    if not buckets:
        raise ValueError("confidence scheduling: the KV cache cannot hold one profiling request "
                         f"({pages_per_request} pages); give the engine more pages or a confidence_cost_table_path")
    table = StepCostTable(buckets, sorted({b * (length + 1) for b in buckets for length in range(k + 1)}))
    table.plain = StepCostTable(buckets, buckets)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.gate = AcceptanceGate(None, None)  # random prompts accept little: the gate must not stop the drafts
    profiled = []
    for batch in buckets:
        drafts = engine.spec.draft_len_for_batch_size(batch)  # a draft_len_schedule may draft less, or nothing
        if drafts == 0:  # no step of this size verifies drafts: nothing for the scheduler to choose
            continue
        profiled.append(batch)
        ids = [engine.add_request(torch.randint(3, engine.vocab_size, (PROFILE_PROMPT_TOKENS,),
                                                generator=generator).tolist(), params) for _ in range(batch)]
        engine.forced_verify_len = 0  # the requests drafted first commit a token a step while the rest prefill
        try:
            for _ in range(to_first_block):  # prefill (chunked when the budget is small) until every one drafted
                if all(i in engine.sequences and engine.sequences[i].draft_ids for i in ids):
                    break
                engine.step()
        finally:
            engine.forced_verify_len = None
        if not all(i in engine.sequences and engine.sequences[i].draft_ids for i in ids):
            raise RuntimeError(f"confidence scheduling: profiling {batch} requests never reached a drafted step in "
                               f"{to_first_block} steps")
        times = {length: [] for length in range(drafts + 1)}
        contexts = {length: [] for length in range(drafts + 1)}
        # (a padded step drafts one past its cap, as served; a packed one at least one past its columns)
        follows = engine.drafts_follow_cap(batch) or engine.drafts_follow_columns(batch)
        try:
            for lengths in [range(drafts + 1), range(drafts, -1, -1)][:PASSES]:
                for length in lengths:
                    engine.forced_verify_len = length  # the steps planned (and launched) ahead at it, as served
                    engine.forced_draft_len = min(drafts, length + 1) if follows else None
                    timed_steps(engine, ids, steps_per_length, 1, times[length], contexts[length],
                                f"a profiling request of {batch} finished before its {max_tokens} tokens' bound; "
                                f"profiling at length {length}")
            plain, plain_contexts = [], []
            engine.forced_verify_len, engine.forced_draft_len = 0, 0  # the last block verifies none, then plain
            timed_steps(engine, ids, plain_steps, PLAIN_UNTIMED, plain, plain_contexts,
                        f"a profiling request of {batch} finished before its {max_tokens} tokens' bound; profiling "
                        "plain decoding")
        finally:
            engine.forced_verify_len = engine.forced_draft_len = None
        engine.abort_all()
        for length in range(drafts + 1):
            table.record(batch, batch * (length + 1), 1e3 * statistics.median(times[length]),
                         context=statistics.mean(contexts[length]))
        table.plain.record(batch, batch, 1e3 * statistics.median(plain), context=statistics.mean(plain_contexts))
    engine.metrics, engine.gate = SpecMetrics(), AcceptanceGate(engine.spec.acceptance_rate_window_size,
                                                                engine.spec.acceptance_rate_threshold)
    engine.pages.forget_cached()
    log.info("dspark: profiled step times for batches %s x verify lengths 0..%d, and plain decoding, in %.1f s",
             profiled, k, time.perf_counter() - start)
    return table
