"""The host layout of a graphed step (``runtime.worker.graphs``): ragged requests padded to the graph's Q tokens.

The graphs themselves need CUDA (``tests/gpu``); how their inputs are laid out is plain host work, checked here."""

import torch

from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.step_io import ScheduledRequest
from runtime.worker.graph_buffers import GraphOutputs
from runtime.worker.graph_layout import worth_padding
from runtime.worker.graphs import GraphedTargetForward

PS, SCRATCH = 4, 99


def request(rid, tokens, start, pages, drafts=0):
    return ScheduledRequest(request_id=rid, token_ids=tokens, start_position=start, page_ids=pages,
                            num_drafts=drafts, sample=True, params=SamplingParams(), seed=0)


def layout_of(reqs, batch, q_len):
    forward = object.__new__(GraphedTargetForward)  # only the host side: no graphs captured
    forward.page_size, forward.scratch_page = PS, SCRATCH
    forward.inputs = torch.zeros(3, batch * q_len, dtype=torch.int64)
    return forward._write_inputs(reqs, batch, q_len), forward.inputs


def test_a_short_block_is_padded_after_its_real_tokens_into_the_scratch_page():
    full = request("a", [10, 11, 12], start=5, pages=[7, 8], drafts=2)  # positions 5..7
    short = request("b", [20], start=3, pages=[3])  # position 3: one token of Q = 3
    layout, inputs = layout_of([full, short], batch=4, q_len=3)
    ids, positions, slots = inputs.tolist()
    assert ids[:6] == [10, 11, 12, 20, 0, 0]
    assert positions[:6] == [5, 6, 7, 3, 3, 3]
    # real tokens in their pages; the short request's padding in the scratch page
    assert slots[:6] == [8 * PS + 1, 8 * PS + 2, 8 * PS + 3, 3 * PS + 3, SCRATCH * PS, SCRATCH * PS + 1]
    assert layout.qo_lens == [3, 3, 3, 3]
    # b's key range grows by its 2 padding keys: they spill into a page past its own, the scratch page; causal
    # attention still shows its real row only the keys up to position 3
    assert layout.kv_lens[:2] == [8, 6] and layout.page_ids[:2] == [[7, 8], [3, SCRATCH]]
    assert layout.page_ids[2:] == [[SCRATCH], [SCRATCH]]  # bucket padding requests


def test_row_ends_point_at_each_requests_last_real_row():
    reqs = [request("a", [1, 2, 3], 0, [0]), request("b", [4], 0, [1])]
    rows = torch.zeros(6)
    out = GraphOutputs(rows, rows, rows, rows, None, rows, rows, rows, False, q_len=3)
    assert out.step_tensors(reqs, PS, torch.device("cpu"), with_page_table=False).row_ends == [3, 4]


def test_padding_pays_on_small_steps_and_not_on_ragged_large_ones():
    assert worth_padding(real_tokens=5, padded_tokens=8)  # one request's trimmed block
    assert worth_padding(real_tokens=100, padded_tokens=128)
    assert worth_padding(real_tokens=400, padded_tokens=512)  # 64 requests, a few blocks trimmed
    assert not worth_padding(real_tokens=263, padded_tokens=2048)  # 256 requests, one of them verifying 7 drafts


def test_the_vectorized_layout_equals_the_token_by_token_one():
    """Random steps (ragged or full blocks, owned pages or not, padding requests) laid out both ways."""
    import random

    from runtime.worker.graph_layout import graph_inputs

    rng = random.Random(0)
    for trial in range(300):
        ps, q_len = rng.choice([4, 16]), rng.choice([1, 3, 8, 16])
        reqs = []
        for i in range(rng.randint(1, 40)):
            fed = q_len if rng.random() < 0.5 else rng.randint(1, q_len)  # full blocks, or ragged
            start = rng.randint(0, 60)
            owned = -(-(start + fed) // ps) + rng.randint(0, 2)  # pages for its real tokens, sometimes more
            pages = rng.sample(range(500), owned)
            reqs.append(request(str(i), [rng.randint(1, 300) for _ in range(fed)], start, pages, drafts=fed - 1))
        batch = len(reqs) + rng.randint(0, 4)
        want, want_layout = graph_inputs(reqs, batch, q_len, ps, 999, vectorized=False)  # the loop: checked above
        for vectorized in (True, None):
            inputs, layout = graph_inputs(reqs, batch, q_len, ps, 999, vectorized)
            assert inputs.tolist() == want.tolist() and layout == want_layout, (trial, vectorized)


def test_the_next_decode_layout_is_the_one_the_next_step_lays_out():
    """Planning ahead: after a one-token step, the layout of the step where every request decodes one more token
    (the pages the scheduler allotted a token ahead) is what that step's own layout will be; a request whose pages
    do not cover its next key yet gives no prediction."""
    from runtime.worker.graph_layout import next_decode_layout

    pages = {"a": [7, 8, 9], "b": [3]}
    now = [request("a", [10], start=7, pages=pages["a"]), request("b", [20], start=2, pages=pages["b"])]
    layout, _ = layout_of(now, batch=4, q_len=1)
    upcoming = next_decode_layout(layout, [r.page_ids for r in now], PS)
    after = [request("a", [11], start=8, pages=pages["a"]), request("b", [21], start=3, pages=pages["b"])]
    assert upcoming == layout_of(after, batch=4, q_len=1)[0]
    at_boundary = [request("b", [21], start=3, pages=[3])]  # its next key (position 4) needs a page it lacks
    assert next_decode_layout(layout_of(at_boundary, batch=1, q_len=1)[0], [[3]], PS) is None


def test_the_next_verify_layout_is_the_one_the_next_verify_step_lays_out():
    """Planning a verify step while the drafter drafts: from the accepted counts alone, the layout of the step in
    which each request verifies a block as long from its next position (pages allotted a block ahead) is what that
    step's own layout will be, padding requests and pages past a request's own (the scratch page) included; an
    invalid count (a faulted row) gives no prediction."""
    from runtime.worker.graph_layout import next_verify_layout

    pages = {"a": [7, 8, 9, 10], "b": [3, 4, 5]}
    now = [request("a", [10, 11, 12, 13], start=5, pages=pages["a"], drafts=3),
           request("b", [20, 21, 22, 23], start=2, pages=pages["b"], drafts=3)]
    for accepted in ([3, 0], [0, 2], [1, 3]):
        upcoming = next_verify_layout(now, accepted, 4, 4, 4, PS, SCRATCH)
        after = [request(r.request_id, [30, 31, 32, 33], start=r.start_position + a + 1, pages=pages[r.request_id],
                         drafts=3) for r, a in zip(now, accepted)]
        assert upcoming == layout_of(after, batch=4, q_len=4)[0], accepted
    # a shorter next block (a confidence scheduler's cap): the layout of that step's graph
    after = [request(r.request_id, [30, 31], start=r.start_position + 1, pages=pages[r.request_id], drafts=1)
             for r in now]
    assert next_verify_layout(now, [0, 0], 4, 2, 4, PS, SCRATCH) == layout_of(after, batch=4, q_len=2)[0]
    # a block trimmed to its anchor (a request one token from its limit): the padding keys spill past its one page
    short = [request("c", [1, 2, 3, 4], start=0, pages=[6], drafts=3)]
    predicted = next_verify_layout(short, [2], 4, 4, 1, PS, SCRATCH)
    assert predicted == layout_of([request("c", [5], start=3, pages=[6])], 1, 4)[0]
    assert predicted.page_ids == [[6, SCRATCH]]
    # after a prompt's last chunk (no drafts): the first verify starts at the token that chunk sampled
    chunk = [request("d", [1, 2, 3, 4, 5], start=0, pages=[3, 4, 5])]
    assert next_verify_layout(chunk, [0], 8, 4, 1, PS, SCRATCH) == \
        layout_of([request("d", [6, 7, 8, 9], start=5, pages=[3, 4, 5], drafts=3)], 1, 4)[0]
    assert next_verify_layout(now, [-1, 0], 4, 4, 4, PS, SCRATCH) is None
    assert next_verify_layout(now, [4, 0], 4, 4, 4, PS, SCRATCH) is None


def test_a_verify_graphs_greedy_verdicts_equal_the_eager_verification():
    """``block_verdicts`` (what a verify graph computes after its LM head) on a real padded layout: blocks of 3, 1
    and 0 drafts in a Q = 4 graph of 4 requests. Its accepted counts equal ``commit_by_match`` over each request's
    own drafts, its candidates are the rows' argmax, and a NaN row faults its request only where the row is
    verified (a padding row's NaN is not that request's)."""
    from runtime.sampling.verify import block_verdicts, commit_by_match

    reqs = [request("a", [10, 11, 12, 13], start=8, pages=[5, 6, 7], drafts=3),
            request("b", [20, 21], start=3, pages=[2, 3], drafts=1),
            request("c", [30], start=6, pages=[1, 4], drafts=0)]
    q_len, batch = 4, 4
    _, inputs = layout_of(reqs, batch, q_len)
    ids, positions = inputs[0], inputs[1]
    argmax = torch.tensor([11, 12, 99, 7,  # a: d1, d2 accepted, d3 rejected (13 != 99)
                           21, 5, 5, 5,  # b: its one draft accepted; rows 2-3 are padding
                           4, 30, 30, 30,  # c: no drafts (its padding rows must not count as drafts)
                           0, 0, 0, 0])
    top = torch.zeros(batch * q_len)
    top[6] = float("nan")  # b's padding row: not b's fault
    top[15] = float("inf")  # a padding request's row: dropped
    got = block_verdicts(ids, positions, top, argmax, q_len)
    assert got.shape == (batch, q_len + 2) and got.dtype == torch.int64
    for b, r in enumerate(reqs):
        drafts = torch.tensor([r.token_ids[1:] + [0] * (q_len - 1 - r.num_drafts)])
        committed, accepted = commit_by_match(drafts, torch.tensor([r.num_drafts]), argmax.view(batch, q_len)[b:b + 1])
        assert got[b, :q_len].tolist() == committed[0].tolist() and got[b, q_len].item() == accepted.item()
    assert got[:3, q_len].tolist() == [2, 1, 0] and got[:3, q_len + 1].tolist() == [0, 0, 0]
    top[9] = float("nan")  # c's padding row: still not its fault
    top[8] = float("nan")  # c's anchor row: its verdict is broken
    top[2] = float("-inf")  # a's second draft row
    assert block_verdicts(ids, positions, top, argmax, q_len)[:3, q_len + 1].tolist() == [1, 0, 1]


def test_the_read_back_parses_graph_packed_rows_as_it_parses_eager_ones():
    """A verify graph's verdict rows go to the host as they lie (committed in Q columns, accepted, fault) beside the
    drafter's packed block (drafts, length, confidences as c * 2^24): each request's committed tokens, next drafts
    and confidences equal those of the eager path's separate tensors, and a faulted request commits nothing."""
    from runtime.spec.wire import confidence_as_ints
    from runtime.worker.draft_channel import Proposal
    from runtime.worker.runner import ModelRunner, Verified

    reqs = [request("a", [10, 11, 12, 13], start=8, pages=[5, 6, 7], drafts=3),
            request("b", [20, 21], start=3, pages=[2, 3], drafts=1)]
    q_len = 5  # the graph's block is wider than this step's (k_max + 1 = 4): its extra column is never read
    rows = torch.tensor([[11, 12, 50, 0, 0, 2, 0],  # a: 2 accepted, then its correction 50
                         [21, 9, 0, 0, 0, 1, 1]])  # b: faulted
    tokens = torch.tensor([[60, 61, 62], [70, 71, 72]])
    lengths = torch.tensor([3, 2])
    confidence = torch.tensor([[0.875, 0.5, 0.25], [0.75, 0.125, 0.0]])  # exact in float32 and in c * 2^24
    block = torch.cat([tokens, lengths[:, None], confidence_as_ints(confidence)], dim=1)
    proposal = Proposal(tokens, lengths, None, confidence, block)
    packed = Verified(rows[:, :4], rows[:, q_len], rows[:, q_len + 1], None, rows)
    eager = Verified(rows[:, :4], rows[:, q_len], rows[:, q_len + 1].bool(), None)
    got = [ModelRunner._results(reqs, reqs, v, proposal) for v in (packed, eager)]
    assert got[0] == got[1]
    # read back apart (through pinned memory, when the next step runs ahead): the same results from the same rows
    assert ModelRunner._results(reqs, reqs, packed, proposal, host=ModelRunner._packed(packed, proposal)[0].tolist()) \
        == got[0]
    a, b = got[0]
    assert a.token_ids == [11, 12, 50] and a.num_accepted == 2 and a.next_draft_ids == [60, 61, 62]
    assert a.next_draft_confidence == [0.875, 0.5, 0.25] and a.error is None
    assert b.token_ids == [] and b.error is not None


def test_which_graph_a_step_replays_prefill_chunks_included():
    """A step replays the graph of the smallest captured length holding its longest request: a verify length (every
    bucket), else a prefill chunk length whose bucket x length is within the cap; never one padded past
    ``worth_padding``, nor a batch past the largest bucket."""
    from runtime.worker.graph_layout import PREFILL_Q_LENS, graphed_q_len

    verify, cap = [1, 8], 512
    assert graphed_q_len([1, 1], verify, 64) == 1 and graphed_q_len([8, 3], verify, 64) == 8
    assert graphed_q_len([12], verify, 64) is None  # no prefill graphs: a 12-token chunk runs eagerly
    assert graphed_q_len([12], verify, 64, PREFILL_Q_LENS, cap) == 16
    assert graphed_q_len([300], verify, 64, PREFILL_Q_LENS, cap) == 384  # within 1.5x of its tokens
    assert graphed_q_len([20, 1, 1], verify, 64, PREFILL_Q_LENS, cap) == 24  # bucket 4 x 24 = 96 tokens
    assert graphed_q_len([12] * 40, verify, 64, PREFILL_Q_LENS, cap) is None  # bucket 48 x 16 > the cap
    assert graphed_q_len([600], verify, 64, PREFILL_Q_LENS, cap) is None  # longer than every prefill graph
    assert graphed_q_len([1] * 65, verify, 64, PREFILL_Q_LENS, cap) is None  # past the largest bucket
    assert all(b / a <= 1.5 for a, b in zip(PREFILL_Q_LENS, PREFILL_Q_LENS[1:]))  # a chunk pads by at most 1.5x


def test_a_length_goes_to_a_longer_graph_only_where_it_replays_faster():
    """One run's verify graphs at 64 requests (an H200, a 2.7B target): 5 and 7 tokens a request replay slower than
    6 and 8. Each goes to the fastest longer graph, past a margin; none where no longer graph is faster enough."""
    from runtime.worker.graph_layout import faster_lengths

    measured = {2: 3.50, 3: 4.22, 4: 4.30, 5: 6.10, 6: 5.56, 7: 7.95, 8: 6.63}
    times = {(64, q): ms for q, ms in measured.items()} | {(16, q): 1.0 + 0.01 * q for q in measured}
    assert faster_lengths(times, 0.03) == {(64, 5): 6, (64, 7): 8}
    assert faster_lengths(times, 0.15) == {(64, 7): 8}  # 5.56 is 9% under 6.10: within a 15% margin
    assert faster_lengths({(64, 3): 2.0, (64, 4): 1.5, (64, 8): 1.2}, 0.03) == {(64, 3): 8, (64, 4): 8}


def test_piecewise_token_buckets_end_at_the_step_budget():
    import pytest

    from runtime.worker.graph_layout import bucket_of
    from runtime.worker.piecewise import PIECEWISE_MAX_TOKENS, token_buckets

    assert token_buckets(2048)[-1] == 2048 and token_buckets(2048)[:4] == [16, 32, 64, 128]
    assert token_buckets(500) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 500]  # the budget itself is the last
    assert token_buckets(8) == [8]
    assert token_buckets(8192)[-1] == PIECEWISE_MAX_TOKENS  # longer steps run eagerly: device-bound anyway
    buckets = token_buckets(2048)
    assert bucket_of(buckets, 1) == 16 and bucket_of(buckets, 472) == 512 and bucket_of(buckets, 512) == 512
    assert bucket_of(buckets, 513) == 640 and bucket_of(buckets, 2049) is None
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        token_buckets(0)


def test_a_graphs_page_table_holds_the_padding_of_a_request_at_the_end_of_its_context():
    """A request near its context's end padded to a long prefill graph's Q addresses scratch pages past its own
    (as does a padding request): the graph's page table holds them (here max_model_len 10, pages of 4: 4 pages a
    request, a 16-token graph's padding reaches 3 more)."""
    forward = object.__new__(GraphedTargetForward)
    forward.page_size, forward.scratch_page, forward.pages_per_seq = PS, SCRATCH, -(-(10 + 1) // PS) + 1
    late = request("a", [5], start=9, pages=[1, 2, 3])  # its 10th token, padded to 16
    layout, _ = layout_of([late], batch=2, q_len=16)
    assert sum(len(pages) for pages in layout.page_ids) == 7 + 4  # its 7, the padding request's 4
    assert sum(len(pages) for pages in layout.page_ids) <= forward._max_pages(2, 16)


def test_prefill_graphs_stop_at_the_first_length_that_holds_a_whole_context():
    from types import SimpleNamespace

    from runtime.worker.worker import Worker

    worker = object.__new__(Worker)
    worker.target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))
    worker.config = SimpleNamespace(max_model_len=94, max_num_batched_tokens=512)
    assert worker.prefill_q_lens == [16, 24, 32, 48, 64, 96]  # (a chunk is at most 94 tokens)
    worker.config = SimpleNamespace(max_model_len=None, max_num_batched_tokens=100)
    assert worker.prefill_q_lens == [16, 24, 32, 48, 64, 96]  # (the step's budget)
