"""Running decode steps ahead. The engine's side (``ScheduledBatch.run_ahead``): it says so only when the next step
should be the same requests decoding one token more, and it keeps that step as it was launched (an arrival joins
the step after). The worker's side (``GraphedTargetForward.decode_greedy``) over a fake one-token graph on the CPU:
what the step launched ahead is fed (the tokens decided on the device, the next positions and slots), when it is
used and when dropped. With a drafter, the same for the next greedy verify of full blocks: the engine's condition
(two more full blocks fit every request) and the worker's ``GraphedTargetForward.launch_verify_ahead`` over a fake
verify graph (anchor and drafts fed on the device, used when scheduled as launched, else dropped). The real
graphs, pinned read-back and stream order: tests/gpu."""

import time

import pytest
import torch

from configs import LLMConfig
from runtime.engine.core import Engine
from runtime.engine.executor import ExecutorBase
from runtime.engine.host_work import HostWork, run_step
from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch
from runtime.spec.history import next_history
from runtime.worker.transfer import finish


class RecordingExecutor(ExecutorBase):
    """Answers at once (token 7 for every sampled request) and records every batch; it can run steps ahead."""

    runs_ahead = verifies_ahead = True

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        self.batches.append(batch)
        return [RequestStepResult(r.request_id, [7] if r.sample else [], 0, []) for r in batch.requests]

    def describe(self) -> list[dict]:
        return [{}]

    def shutdown(self) -> None:
        pass


def engine(tmp_path, max_num_seqs: int = 8) -> tuple[Engine, RecordingExecutor]:
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=4096).save_pretrained(tmp_path)
    config = LLMConfig(model=str(tmp_path), num_pages=256, page_size=16, max_num_seqs=max_num_seqs, device="cpu",
                       dtype="float32")
    executor = RecordingExecutor(config.num_pages)
    return Engine(config, executor), executor


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def serve(eng: Engine, *requests: tuple[list[int], SamplingParams]) -> None:
    """Add ``requests`` (prompt, params) and step the engine until every one has finished."""
    for prompt, params in requests:
        eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()


def test_steady_greedy_decoding_runs_ahead_until_a_request_reaches_its_limit(tmp_path):
    eng, ex = engine(tmp_path)
    serve(eng, (list(range(10, 30)), greedy(6)), (list(range(40, 45)), greedy(4)))
    hints = [(len(b.requests), [len(r.token_ids) for r in b.requests], b.run_ahead) for b in ex.batches]
    assert hints[0][2] is False  # the prefill step: the next one is the first decode, not "one token more"
    # decode steps (each request's tokens 2, 3, 4, then the first's 5 and 6 alone) run ahead while the next step is
    # the same requests one token on: not the step after which the second has its 4 tokens (it finishes there),
    # nor the one after which the first has its 6
    assert [h[:2] for h in hints[1:]] == [(2, [1, 1])] * 3 + [(1, [1])] * 2
    assert [h[2] for h in hints[1:]] == [True, True, False, True, False]


@pytest.mark.parametrize("drafter", [False, True])
def test_an_arrival_waits_one_step_when_the_step_was_launched_ahead(tmp_path, drafter):
    """A decode step (or with a drafter, a verify of full blocks) launched ahead is the running requests' alone."""
    eng, ex = spark_engine(tmp_path) if drafter else engine(tmp_path)
    eng.add_request(list(range(10, 30)), greedy(20))
    eng.step()  # prefill
    eng.step()  # the first decode step: the next one may be launched ahead
    assert ex.batches[-1].run_ahead
    late = eng.add_request(list(range(50, 60)), greedy(3))  # arrives while that next step runs
    eng.step()  # the step launched ahead: the running request alone, and it no longer runs ahead (a request waits)
    assert [r.request_id for r in ex.batches[-1].requests] != [late] and len(ex.batches[-1].requests) == 1
    assert not ex.batches[-1].run_ahead
    eng.step()  # now the arrival joins
    assert late in [r.request_id for r in ex.batches[-1].requests]


def test_a_full_batch_runs_ahead_while_requests_wait(tmp_path):
    """Under a steady load requests always wait; while the batch is full nobody can join the next step, so it is
    still the same requests one token on: launched ahead, except before a step after which one finishes (then the
    one waiting joins)."""
    eng, ex = engine(tmp_path, max_num_seqs=2)
    first, second, third = (eng.add_request(prompt, greedy(n)) for prompt, n in
                            ((list(range(10, 30)), 6), (list(range(40, 45)), 4), (list(range(50, 55)), 2)))
    while eng.has_unfinished():
        eng.step()
    hints = [([r.request_id for r in b.requests], b.run_ahead) for b in ex.batches]
    # the prefill, then decodes of the first two (tokens 2, 3, 4: the second finishes after the third) while the
    # third waits, then the third joins (its prefill beside the first's decode)
    assert [ids for ids, _ in hints[:4]] == [[first, second]] * 4 and third in hints[4][0]
    assert [ahead for _, ahead in hints[1:4]] == [True, True, False]  # a request waited throughout


@pytest.mark.parametrize("drafter", [False, True])
def test_sampled_requests_never_run_ahead(tmp_path, drafter):
    eng, ex = spark_engine(tmp_path) if drafter else engine(tmp_path)
    serve(eng, (list(range(10, 30)), SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)))
    assert not any(b.run_ahead for b in ex.batches)


# ---- the worker's side, on the CPU: GraphedTargetForward.decode_greedy over a fake one-token graph ---------------

class _Read:
    """``runtime.kernels.transfer.PinnedReadBack`` on the CPU: the copy happens when queued (the CPU's order is the
    stream's)."""

    def queue(self, tensor: torch.Tensor) -> None:
        self.value = tensor.clone()

    def wait(self) -> torch.Tensor:
        return self.value


class _FakeGraph:
    """A one-token decode graph that decides token (id * 3 + position) % 97 for each row of the inputs it holds
    when replayed (-1 for token 13: a broken row). Replays run at once: the CPU's order is the stream's."""

    def __init__(self, forward, batch: int):
        self.forward, self.batch = forward, batch
        self.verdict = torch.zeros(batch, dtype=torch.int64)
        self.fed: list[tuple[list[int], list[int], list[int]]] = []  # (ids, positions, slots) of every replay

    def replay(self) -> None:
        ids, positions, slots = (row[:self.batch].clone() for row in self.forward.inputs)
        self.fed.append((ids.tolist(), positions.tolist(), slots.tolist()))
        decided = (ids * 3 + positions) % 97
        self.verdict.copy_(torch.where(ids == 13, -1, decided))


def _forward(batch: int, page_size: int = 4):
    from runtime.worker.graphs import GraphedTargetForward

    forward = object.__new__(GraphedTargetForward)  # the decode path's state only: no CUDA graphs captured
    forward.buckets, forward.page_size, forward.scratch_page = [batch], page_size, 99
    forward.inputs = torch.zeros(3, batch, dtype=torch.int64)
    forward.plan_ahead = forward.run_ahead = True
    forward.planned, forward.plans_skipped, forward.replays = {}, 0, 0
    forward._verdict_reads = [_Read(), _Read()]
    forward._next_slot, forward._ahead, forward._ahead_verify = 0, None, None
    forward.steps_run_ahead = forward.steps_ahead_dropped = 0
    planned = []
    forward._plan = lambda layout, b, q, columns=0: (planned.append(layout),
                                                   forward.planned.__setitem__(forward._key(b, q, columns), layout))
    g = _FakeGraph(forward, batch)
    forward.graphs = {(batch, 1): type("G", (), {"graph": g, "verdict": g.verdict, "context": None})()}
    return forward, g, planned


def _runner(rank: int, world: int, appends_context: bool):
    """A ``ModelRunner``'s step-path choice only (``_decodes_greedy``): graphs of one bucket of 4, a drafter (every
    rank of a replica has its spec; its context graph, if any, is rank 0's)."""
    from runtime.models.parallel import ParallelContext
    from runtime.worker.runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.parallel, runner.has_drafter = ParallelContext(rank=rank, world_size=world), True
    runner.graphs = type("Graphs", (), {"buckets": [4], "appends_context": lambda self, n: appends_context})()
    return runner


def test_tensor_parallel_ranks_choose_the_decode_path_alike_from_the_batch_alone():
    """The steps a rank replays or launches ahead carry collectives that pair up across ranks: under tensor
    parallelism rank 0 (with the drafter's context graph) and rank 1 (without) both take the graphed greedy decode
    path without a drafter's context to keep, and both the general path while it is kept; one rank alone keeps its
    own rule (the context graph decides)."""
    step = [_decode("a", 40, 7, [5, 6, 7]), _decode("b", 41, 6, [8, 9, 10])]
    for maintain in (False, True):
        batch = ScheduledBatch(step, 0, maintain, [], [])
        assert [_runner(rank, 2, rank == 0)._decodes_greedy(batch) for rank in (0, 1)] == [not maintain] * 2
    kept = ScheduledBatch(step, 0, True, [], [])
    assert _runner(0, 1, True)._decodes_greedy(kept) and not _runner(0, 1, False)._decodes_greedy(kept)
    assert not _runner(0, 2, True)._decodes_greedy(ScheduledBatch(step, 3, False, [], []))  # drafts to make


def _decode(rid: str, token: int, position: int, pages: list[int]):
    from runtime.scheduling.step_io import ScheduledRequest

    return ScheduledRequest(rid, [token], position, pages, 0, True, greedy(100), 0)


def test_a_step_launched_ahead_feeds_the_tokens_decided_before_it_and_is_used_when_scheduled_as_launched():
    forward, g, planned = _forward(batch=2)
    pages = {"a": [5, 6, 7], "b": [8, 9, 10]}  # allotted ahead: a at position 7 (page 6) has page 7 for 8
    step = [_decode("a", 40, 7, pages["a"]), _decode("b", 41, 6, pages["b"])]
    first = finish(forward.decode_greedy(step, run_ahead=True))
    assert first == [(40 * 3 + 7) % 97, (41 * 3 + 6) % 97]
    # launched ahead: the ids decided on the device, the next positions, their slots on the allotted pages
    assert g.fed[-1] == (first, [8, 7], [7 * 4 + 0, 9 * 4 + 3]) and forward.replays == 2
    assert planned[-1].kv_lens == [9, 8]
    nxt = [_decode("a", first[0], 8, pages["a"]), _decode("b", first[1], 7, pages["b"])]
    # exactly the step launched ahead: no launch of its own
    second = finish(forward.decode_greedy(nxt, run_ahead=True))
    assert second == [(first[0] * 3 + 8) % 97, (first[1] * 3 + 7) % 97]
    assert forward.steps_run_ahead == 1 and forward.replays == 3  # one more: the step after, launched ahead
    # b finished (an end of sequence): the step launched ahead is dropped and this one replayed afresh
    third = finish(forward.decode_greedy([_decode("a", second[0], 9, pages["a"])], run_ahead=False))
    assert forward.steps_ahead_dropped == 1 and third == [(second[0] * 3 + 9) % 97]
    assert g.fed[-1][0][:1] == [second[0]] and forward._ahead is None  # run_ahead False: nothing launched


def test_host_work_queued_between_steps_runs_once_after_the_steps_launches_before_its_read_back():
    """The engine's deferred work (``HostWork``: the survival fit's folds) runs while the device computes: after
    this step and the one launched ahead of it were replayed, before the host waits for this step's verdicts."""
    forward, g, _ = _forward(batch=1)
    reads = forward._verdict_reads
    seen, work = [], HostWork()
    work.add(lambda: seen.append((forward.replays, [r.value is not None for r in reads])))
    for r in reads:
        r.value = None
    first = run_step(forward.decode_greedy([_decode("a", 7, 3, [1, 2])], run_ahead=True), work)
    assert seen == [(2, [True, True])] and len(work) == 0  # both launched and queued, not yet read
    run_step(forward.decode_greedy([_decode("a", first[0], 4, [1, 2])], run_ahead=False), work)
    assert len(seen) == 1  # once


def test_host_work_told_the_device_is_done_starts_no_task_until_too_many_wait():
    """A step not launched ahead runs the host work while the device computes it, asking whether its read-back has
    landed: once it has, no task starts (the device would wait for it: the tasks wait for a step with room), unless
    more than ``QUEUED_MOST`` are queued; without ``done`` every call runs one task at least."""
    from runtime.engine.host_work import QUEUED_MOST

    work, ran, device = HostWork(), [], {"done": False}
    for i in range(3):
        work.add(lambda i=i: (ran.append(i), device.update(done=i == 1)))  # the device finishes during task 1
    work.run(done=lambda: device["done"])
    assert ran == [0, 1] and len(work) == 1
    work.run(done=lambda: True)  # done before it began: nothing starts
    assert ran == [0, 1] and len(work) == 1
    work.run()  # a step launched ahead (nothing said): it runs
    assert ran == [0, 1, 2] and len(work) == 0
    for i in range(QUEUED_MOST + 2):
        work.add(lambda i=i: ran.append(10 + i))
    work.run(done=lambda: True)  # past QUEUED_MOST the oldest run regardless, down to the bound
    assert len(work) == QUEUED_MOST and ran[-2:] == [10, 11]


def test_a_step_launched_ahead_is_not_used_for_other_tokens_or_pages_and_a_broken_row_feeds_token_0():
    forward, g, _ = _forward(batch=1)
    step = [_decode("a", 13, 3, [1, 2])]  # token 13 breaks its row: verdict -1
    assert finish(forward.decode_greedy(step, run_ahead=True)) == [-1]
    assert g.fed[-1][0] == [0]  # the step launched ahead fed token 0, not -1 (an embedding index)
    again = finish(forward.decode_greedy([_decode("a", 5, 4, [1, 2])], run_ahead=False))  # not the token decided
    assert forward.steps_ahead_dropped == 1 and again == [(5 * 3 + 4) % 97]
    finish(forward.decode_greedy([_decode("a", 7, 5, [1, 2])], run_ahead=True))
    moved = finish(forward.decode_greedy([_decode("a", (7 * 3 + 5) % 97, 6, [3, 2])],  # other pages
                                              run_ahead=False))
    assert forward.steps_ahead_dropped == 2 and forward.steps_run_ahead == 0 and len(moved) == 1


class _FakeContextGraph:
    """The drafter's context append of a one-token graph: records the positions it appended at when replayed."""

    def __init__(self, forward, batch: int):
        self.forward, self.batch = forward, batch
        self.appended: list[list[int]] = []

    def replay(self) -> None:
        self.appended.append(self.forward.inputs[1, :self.batch].tolist())


def test_a_decode_step_keeping_the_drafters_context_appends_it_and_so_does_the_step_launched_ahead():
    forward, g, _ = _forward(batch=1)
    graph = forward.graphs[(1, 1)]
    assert not forward.appends_context(1)
    with pytest.raises(RuntimeError, match="no drafter context graph"):
        finish(forward.decode_greedy([_decode("a", 7, 3, [1, 2])], run_ahead=False, append_context=True))
    graph.context = context = _FakeContextGraph(forward, 1)
    assert forward.appends_context(1) and not forward.appends_context(2)
    first = finish(forward.decode_greedy([_decode("a", 7, 3, [1, 2])], run_ahead=True, append_context=True))
    assert context.appended == [[3], [4]]  # this step's, then the one launched ahead's (each behind its replay)
    second = finish(forward.decode_greedy([_decode("a", first[0], 4, [1, 2])], run_ahead=True,
                                               append_context=True))
    assert forward.steps_run_ahead == 1 and context.appended == [[3], [4], [5]]
    # the step launched ahead appended the context: a step that must not append it is not that step
    finish(forward.decode_greedy([_decode("a", second[0], 5, [1, 2])], run_ahead=False))
    assert forward.steps_ahead_dropped == 1 and context.appended == [[3], [4], [5]] and g.fed[-1][1] == [5]


def test_no_step_is_launched_ahead_before_the_scheduler_allots_its_page():
    forward, g, _ = _forward(batch=1)
    finish(forward.decode_greedy([_decode("a", 7, 7, [1, 2])], run_ahead=True))  # position 8 needs a third page
    assert forward._ahead is None and forward.replays == 1


# ---- DSpark: the next verify launched while the drafter drafts (GraphedTargetForward.launch_verify_ahead) --------

class _FakeVerifyGraph:
    """A verify graph of ``batch`` requests x ``q_len`` tokens that records what each replay was fed."""

    def __init__(self, forward, batch: int, q_len: int):
        self.forward, self.rows = forward, batch * q_len
        self.fed: list[tuple[list[int], list[int], list[int]]] = []

    def replay(self) -> None:
        self.fed.append(tuple(row[:self.rows].tolist() for row in self.forward.inputs))


def _verify_forward(batch: int, q_len: int, page_size: int = 4, shorter: int | None = None):
    """A forward with a fake verify graph of ``batch`` x ``q_len`` (and of ``batch`` x ``shorter``, if given)."""
    from runtime.worker.graphs import GraphedTargetForward

    forward = object.__new__(GraphedTargetForward)  # the verify path's host state only: no CUDA graphs captured
    forward.buckets, forward.page_size, forward.scratch_page = [batch], page_size, 99
    forward.inputs = torch.zeros(3, batch * q_len, dtype=torch.int64)
    forward.plan_ahead = forward.run_ahead = True
    forward.planned, forward.plans_skipped, forward.replays = {}, 0, 0
    forward._ahead = forward._ahead_verify = forward._last_run = None
    forward.steps_run_ahead = forward.steps_ahead_dropped = 0
    forward.served_by = {}  # no longer graph replays faster
    forward._plan = lambda layout, b, q, columns=0: forward.planned.__setitem__(forward._key(b, q, columns), layout)
    forward.graphs = {}
    for q in [q_len] + ([shorter] if shorter else []):
        g = _FakeVerifyGraph(forward, batch, q)
        out = torch.zeros(batch * q)
        forward.graphs[(batch, q)] = type("G", (), dict(graph=g, context=None, hidden=out, captured=None, logits=None,
                                                       top=out, argmax=out, verdict=None, block_verdict=None))()
    return forward, forward.graphs[(batch, q_len)].graph


def _verify(rid: str, tokens: list[int], start: int, pages: list[int]):
    from runtime.scheduling.step_io import ScheduledRequest

    return ScheduledRequest(rid, tokens, start, pages, len(tokens) - 1, True, greedy(100), 0)


def test_a_verify_launched_ahead_feeds_anchor_and_drafts_and_is_used_when_scheduled_as_launched():
    forward, g = _verify_forward(batch=2, q_len=3)
    pages = {"a": [5, 6, 7], "b": [8, 9]}  # allotted a block ahead
    step = [_verify("a", [10, 11, 12], 4, pages["a"]), _verify("b", [20, 21, 22], 1, pages["b"])]
    forward.run(step, 3)
    assert len(g.fed) == 1 and g.fed[0][1] == [4, 5, 6, 1, 2, 3]
    # this step committed a's 10, 11 + target token 40 (accepted 2) and b's target token 50 (accepted 0); drafted
    committed = torch.tensor([[11, 12, 40], [50, 0, 0]])
    accepted = torch.tensor([2, 0])
    drafts = torch.tensor([[41, 42], [51, 52]])
    assert forward.launch_verify_ahead([2, 0], committed, accepted, drafts, append_context=False)
    ids, positions, slots = g.fed[1]
    assert ids == [40, 41, 42, 50, 51, 52]  # anchors (the tokens committed last) and drafts, written on the device
    assert positions == [7, 8, 9, 2, 3, 4]  # from the position after the last committed one
    assert slots == [6 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 9 * 4 + 0]
    forward.set_ahead_tokens([(40, 41, 42), (50, 51, 52)])
    following = [_verify("a", [40, 41, 42], 7, pages["a"]), _verify("b", [50, 51, 52], 2, pages["b"])]
    out = forward.run(following, 3)
    assert len(g.fed) == 2 and forward.steps_run_ahead == 1  # no second launch: the outputs are the ahead step's
    assert out.positions.tolist() == positions
    # the next one is launched ahead again, but the engine schedules otherwise (b's block was trimmed): dropped
    assert forward.launch_verify_ahead([0, 1], committed, torch.tensor([0, 1]), drafts, append_context=False)
    forward.set_ahead_tokens([(11, 41, 42), (0, 51, 52)])
    forward.run([_verify("a", [11, 41, 42], 8, pages["a"]), _verify("b", [0, 51], 4, pages["b"])], 3)
    assert len(g.fed) == 4 and forward.steps_ahead_dropped == 1
    assert g.fed[3][0][3:5] == [0, 51]


def test_a_verify_is_not_launched_ahead_past_its_pages_nor_matched_without_its_tokens():
    forward, g = _verify_forward(batch=1, q_len=3)
    forward.run([_verify("a", [10, 11, 12], 5, [5, 6])], 3)  # positions 5..7: its two pages end at 7
    committed, accepted, drafts = torch.tensor([[11, 12, 40]]), torch.tensor([2]), torch.tensor([[41, 42]])
    assert not forward.launch_verify_ahead([2], committed, accepted, drafts, append_context=False)
    assert len(g.fed) == 1 and forward._ahead_verify is None
    forward.run([_verify("a", [10, 11, 12], 1, [5, 6])], 3)
    assert forward.launch_verify_ahead([0], committed, torch.tensor([0]), drafts, append_context=False)
    forward.set_ahead_tokens([None])  # the request faulted: whatever the engine schedules, the step is dropped
    forward.run([_verify("a", [11, 41, 42], 2, [5, 6])], 3)
    assert forward.steps_run_ahead == 0 and forward.steps_ahead_dropped == 1 and len(g.fed) == 4



def _with_packed_graph(forward, batch: int, q_len: int, columns: int):
    """Give the fake verify forward a fake packed graph of ``columns`` (its ranking buffers too)."""
    g = _FakeVerifyGraph(forward, batch, q_len)
    forward.q_lens = [q_len]
    forward.packed_graphs = {(batch, columns): type("P", (), dict(
        graph=g, context=None, lengths=torch.full((batch,), columns), captured=None,
        block_verdict=torch.zeros(batch, q_len + 2, dtype=torch.int64)))()}
    forward.packed_confidence = torch.zeros(batch, q_len - 1)
    forward.packed_slope, forward.packed_bias = torch.ones(q_len - 1), torch.zeros(2 * q_len - 1, q_len - 1)
    forward.packed_history = torch.zeros(batch, dtype=torch.int64)
    forward.packed_replays = forward.packed_run_ahead = 0
    return g


def test_a_packed_verify_launched_ahead_ranks_the_block_drafted_and_is_used_only_at_its_columns():
    """The next step, a packed verify (``PackedAhead``): launched behind the draft into the packed graph with the
    block's confidences copied on the device and the ranking the engine sent; taken by ``run_packed`` when scheduled
    as launched at the same columns, else dropped (and run from the host's confidences). Each request's history
    class is updated on the device from the step before's verdicts (``next_history``)."""
    from runtime.scheduling.step_io import PackedAhead

    forward, uniform = _verify_forward(batch=2, q_len=3)
    packed = _with_packed_graph(forward, batch=2, q_len=3, columns=1)
    pages = {"a": [5, 6, 7], "b": [8, 9]}
    forward.run([_verify("a", [10, 11, 12], 4, pages["a"]), _verify("b", [20, 21, 22], 1, pages["b"])], 3)
    committed, accepted = torch.tensor([[11, 12, 40], [50, 0, 0]]), torch.tensor([2, 0])
    drafts, confidence = torch.tensor([[41, 42], [51, 52]]), torch.tensor([[0.9, 0.5], [0.8, 0.2]])
    bias = [[0.1, -0.2], [1.2, 1.1], [-0.5, -0.4], [0.3, 0.2], [0.0, 0.5]]  # K = 2: classes none, rejected_at_0..1,
    # accepted_1..2
    ranking = PackedAhead(1, [1.0, 0.5], bias, [0, 1])
    assert forward.launch_verify_ahead([2, 0], committed, accepted, drafts, False, ranking, confidence)
    assert len(uniform.fed) == 1 and len(packed.fed) == 1  # the packed graph ran it, fed as a uniform step
    assert packed.fed[0][0] == [40, 41, 42, 50, 51, 52] and forward.packed_replays == 1
    assert forward.packed_confidence.tolist() == confidence.tolist()
    assert forward.packed_slope.tolist() == [1.0, 0.5]
    assert torch.allclose(forward.packed_bias, torch.tensor(bias))
    # the uniform step before verified 2 drafts each: a accepted both (accepted_2), b none (rejected_at_0)
    assert forward.packed_history.tolist() == [4, 1] == [next_history(h, 2, a, 2) for h, a in [(0, 2), (1, 0)]]
    forward.set_ahead_tokens([(40, 41, 42), (50, 51, 52)])
    following = [_verify("a", [40, 41, 42], 7, pages["a"]), _verify("b", [50, 51, 52], 2, pages["b"])]
    assert not forward.packs(2, 2) and forward.packs(2, 1)
    out = forward.run_packed(following, [[0.9, 0.5], [0.8, 0.2]], [1.0, 0.5], bias, [1, 2], 1)
    assert len(packed.fed) == 1 and forward.steps_run_ahead == forward.packed_run_ahead == 1
    assert out.lengths.tolist() == [1, 1]
    # launched again (nothing accepted: a's pages hold the next block); the uniform step the engine schedules
    # instead (whole blocks chosen after all) drops it
    none = torch.tensor([0, 0])
    # (after a packed step: each request's verified count is the device's; one verified none and keeps its class)
    assert forward.launch_verify_ahead([0, 0], committed, none, drafts, False, ranking, confidence,
                                       torch.tensor([1, 0]))
    assert forward.packed_history.tolist() == [1, 1]  # a: rejected_at_0; b verified none: kept its class
    forward.set_ahead_tokens([(11, 41, 42), (50, 51, 52)])
    forward.run(following, 3)
    assert forward.steps_ahead_dropped == 1 and len(uniform.fed) == 2 and len(packed.fed) == 2
    # and a uniform step launched ahead is never taken by a packed one: it replays from the host's confidences
    assert forward.launch_verify_ahead([0, 0], committed, none, drafts, False)
    forward.set_ahead_tokens([(40, 41, 42), (50, 51, 52)])
    forward.run_packed(following, [[0.3, 0.1], [0.7, 0.6]], [1.0, 1.0], [[0.0, 0.0]] * 5, [2, 0], 1)
    assert forward.steps_ahead_dropped == 2 and len(packed.fed) == 3
    assert torch.allclose(forward.packed_confidence, torch.tensor([[0.3, 0.1], [0.7, 0.6]]))

def test_a_packed_verify_of_a_shorter_block_is_launched_ahead_padded_to_the_packed_graph():
    """A packed step's block drafted shorter than K (``ConfidenceScheduler.packed_draft_len``) is launched ahead
    into the packed graph of K + 1 rows a request: the block's drafts, then padding (token 0 at the last real
    position, proposing nothing: confidence 0), its pages needed only under the block; taken when scheduled so."""
    from runtime.scheduling.step_io import PackedAhead

    forward, uniform = _verify_forward(batch=2, q_len=4, shorter=3)  # K = 3; blocks of 2 drafted
    packed = _with_packed_graph(forward, batch=2, q_len=4, columns=1)
    pages = {"a": [5, 6, 7], "b": [8, 9]}  # a's pages end at position 11, b's at 7
    forward.run([_verify("a", [10, 11, 12], 4, pages["a"]), _verify("b", [20, 21, 22], 1, pages["b"])], 3)
    committed, accepted = torch.tensor([[11, 12, 40], [50, 0, 0]]), torch.tensor([2, 0])
    drafts, confidence = torch.tensor([[41, 42], [51, 52]]), torch.tensor([[0.9, 0.5], [0.8, 0.2]])
    bias = [[0.0] * 3] * 7  # K = 3: 7 verify-history classes
    forward._accepted_pending = 2  # (the accepted counts read back while the drafter drafts: a's 2, b's 0)
    forward._accepted_read = type("Read", (), dict(wait=lambda self: accepted))()
    assert forward.plan_next_verify(3, columns=1) == [2, 0]
    assert forward.planned[("packed", 2, 1)].qo_lens == [4, 4]  # at the packed graph's K + 1 rows, not 3
    assert forward.launch_verify_ahead([2, 0], committed, accepted, drafts, False, PackedAhead(1, [1.0] * 3, bias,
                                                                                                [0, 0]), confidence)
    ids, positions, slots = packed.fed[0]
    assert ids == [40, 41, 42, 0, 50, 51, 52, 0]  # each block padded to K + 1 rows
    assert positions == [7, 8, 9, 9, 2, 3, 4, 4]  # the padding at the last real position
    assert slots[3] // 4 == slots[7] // 4 == 99  # writing the scratch page
    assert forward.packed_confidence.tolist() == torch.tensor([[0.9, 0.5, 0.0], [0.8, 0.2, 0.0]]).tolist()  # the
    # padding proposes nothing
    forward.set_ahead_tokens([(40, 41, 42), (50, 51, 52)])
    following = [_verify("a", [40, 41, 42], 7, pages["a"]), _verify("b", [50, 51, 52], 2, pages["b"])]
    forward.run_packed(following, [[0.9, 0.5], [0.8, 0.2]], [1.0] * 3, bias, [0, 0], 1)
    assert len(packed.fed) == 1 and forward.packed_run_ahead == 1 and len(uniform.fed) == 0


# ---- the engine's side with a drafter: ScheduledBatch.run_ahead on steady greedy verify steps --------------------

class DraftingExecutor(RecordingExecutor):
    """Each sampled request commits its first draft and a target token (7s) and gets a full block of 8s; it records
    every batch with each request's output length when it was scheduled."""

    def __init__(self, num_pages: int, timed: bool = False):
        super().__init__(num_pages)
        self.engine, self.timed = None, timed
        self.lengths: list[list[int]] = []

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        self.batches.append(batch)
        self.lengths.append([len(self.engine.sequences[r.request_id].output_token_ids) for r in batch.requests])
        if self.timed:  # a step costs 2 ms plus 0.5 ms a token fed (what the confidence scheduler then learns)
            time.sleep((2.0 + 0.5 * sum(len(r.token_ids) for r in batch.requests)) / 1e3)
        k = batch.num_next_drafts
        return [RequestStepResult(r.request_id, [7] * (min(r.num_drafts, 1) + 1), min(r.num_drafts, 1), [8] * k,
                                  next_draft_confidence=[0.9, 0.1, 0.1, 0.1, 0.1][:k]) if r.sample
                else RequestStepResult(r.request_id, [], 0, []) for r in batch.requests]

    def describe(self) -> list[dict]:  # a graphed target with a confidence head (confidence scheduling's padded steps)
        return [{"role": "target", "draft_confidence_head": True, "graph_q_lens": [1, 2, 3, 4, 5]}]


def spark_engine(tmp_path, block: int = 4, confidence: bool = False, schedule: dict[int, int] | None = None,
                 executor_class: type = DraftingExecutor, guard: bool = False) -> tuple[Engine, DraftingExecutor]:
    """A DSpark engine over ``DraftingExecutor`` (or ``executor_class``); ``confidence``: confidence scheduling, a
    step costing 2 ms plus 0.5 ms a token fed (the executor sleeps as much): of drafts of confidence 0.9, 0.1, ...
    only the first pays; ``schedule``: its ``draft_len_schedule``; ``guard``: the speculation guard on."""
    from configs import DSparkDecodingConfig
    from runtime.spec.step_costs import StepCostTable
    from tests import builders

    target = builders.save_target(tmp_path / "target", "qwen3", seed=0)
    cfg = builders.drafter_config(target, block_size=block, markov_rank=16, head_type="vanilla", confidence=True)
    drafter = builders.save_drafter(tmp_path / "drafter", cfg, builders.drafter_tensors(cfg, seed=0))
    spec = {"draft_len_schedule": schedule} if schedule else {}
    if confidence:
        tokens = [1, 64, 512]
        StepCostTable([1, 64], tokens, [[2.0 + 0.5 * t for t in tokens]] * 2).save(tmp_path / "costs.json")
        spec = {"enable_confidence_scheduling": True, "confidence_cost_table_path": str(tmp_path / "costs.json")}
    # the launch-ahead mechanics of a fixed schedule: the speculation guard off unless asked (it learns the timings)
    config = LLMConfig(model=str(target), speculative_config=DSparkDecodingConfig(speculative_model=str(drafter),
                                                                                  speculation_guard=guard, **spec),
                       num_pages=256, page_size=16, max_num_seqs=8, device="cpu", dtype="float32")
    executor = executor_class(config.num_pages, timed=confidence)
    eng = Engine(config, executor)
    executor.engine = eng
    return eng, executor


def test_steady_greedy_verify_steps_run_ahead_while_two_more_blocks_fit(tmp_path):
    eng, ex = spark_engine(tmp_path)
    serve(eng, (list(range(10, 30)), greedy(30)), (list(range(40, 45)), greedy(24)))
    assert not ex.batches[0].run_ahead  # the prefill: no block to verify yet
    verify = [(b, lengths) for b, lengths in zip(ex.batches, ex.lengths) if b.requests[0].num_drafts]
    assert verify and verify[0][0].run_ahead
    for b, lengths in verify:  # ahead exactly while this step's and the next one's full blocks fit every request
        fits = all(n + 2 * (4 + 1) <= r.params.max_tokens for n, r in zip(lengths, b.requests))
        assert b.run_ahead == (fits and all(r.num_drafts == 4 for r in b.requests)), lengths
    assert not verify[-1][0].run_ahead
    assert_launched_steps_come_as_said(ex.batches)


def test_decode_steps_run_ahead_while_a_schedule_drafts_nothing_and_stop_when_it_drafts_again(tmp_path):
    """A ``draft_len_schedule`` that drafts nothing at this concurrency: the steps are plain greedy decodes that keep
    the drafter's context (the worker appends it in the same graphed step), launched ahead as without a drafter;
    once one request finishes, one request drafts again, and the step before that is not said to run ahead."""
    eng, ex = spark_engine(tmp_path, schedule={1: 4})  # 2 requests: speculation off; 1 request: blocks of 4
    serve(eng, (list(range(10, 30)), greedy(12)), (list(range(40, 45)), greedy(6)))
    decode = [b for b in ex.batches if len(b.requests) == 2 and all(len(r.token_ids) == 1 for r in b.requests)]
    assert len(decode) >= 4 and all(b.maintain_draft_context and not b.num_next_drafts for b in decode)
    ahead = [b.run_ahead for b in decode]
    assert ahead[:-1] == [True] * (len(ahead) - 1) and not ahead[-1]  # not into the step where the second ends
    for b, nxt in zip(ex.batches, ex.batches[1:]):
        if b.run_ahead:  # said: the same requests, one token each, nothing drafted
            assert [r.request_id for r in nxt.requests] == [r.request_id for r in b.requests]
            assert all(len(r.token_ids) == 1 and not r.num_drafts for r in nxt.requests)
    assert any(b.num_next_drafts == 4 for b in ex.batches[ex.batches.index(decode[-1]) + 1:])


class DecodeAheadExecutor(DraftingExecutor):
    """Launches decode steps ahead, never verifies (a tensor-parallel replica: ``Executor.verifies_ahead``)."""

    verifies_ahead = False


def test_an_executor_that_launches_only_decode_steps_ahead_gets_no_verify_marked(tmp_path):
    eng, ex = spark_engine(tmp_path, schedule={1: 4}, executor_class=DecodeAheadExecutor)
    serve(eng, (list(range(10, 30)), greedy(12)), (list(range(40, 45)), greedy(6)))
    verify = [b for b in ex.batches if any(r.num_drafts for r in b.requests)]
    assert verify and not any(b.run_ahead for b in verify)
    assert any(b.run_ahead for b in ex.batches if not b.num_next_drafts)  # the decode steps while it drafts nothing


def test_decode_steps_do_not_run_ahead_while_the_drafter_drafts(tmp_path):
    eng, ex = spark_engine(tmp_path, schedule={2: 4})
    serve(eng, (list(range(10, 30)), greedy(12)), (list(range(40, 45)), greedy(6)))
    assert all(b.num_next_drafts == 4 for b in ex.batches)
    assert not any(b.run_ahead and not b.next_verify_len for b in ex.batches)


def assert_launched_steps_come_as_said(batches: list[ScheduledBatch]) -> None:
    """Whenever the engine said the next step runs ahead (``next_verify_len`` n), the next step is the same requests
    each verifying n drafts (nothing here ends a request early)."""
    said = [(b, nxt) for b, nxt in zip(batches, batches[1:]) if b.run_ahead]
    assert said
    for b, nxt in said:
        assert [r.request_id for r in nxt.requests] == [r.request_id for r in b.requests]
        assert all(r.num_drafts == b.next_verify_len for r in nxt.requests), b.next_verify_len


def test_confidence_scheduled_verifies_run_ahead_with_the_cap_already_chosen(tmp_path):
    """The padded layout's cap for the next step is chosen from this step's confidences: the step launched ahead
    verifies that many drafts of each block (here fewer than the block)."""
    eng, ex = spark_engine(tmp_path, confidence=True)
    serve(eng, (list(range(10, 30)), greedy(40)), (list(range(40, 45)), greedy(40)))
    assert_launched_steps_come_as_said(ex.batches)
    assert {b.next_verify_len for b in ex.batches if b.run_ahead} == {1}


def test_a_padded_confidence_scheduled_step_drafts_one_past_the_cap_it_will_verify_at(tmp_path):
    """Drafts of confidence 0.9, 0.1, ...: only the first pays, so the cap is 1 and each step drafts 2 of the
    block of 4 (the second draft's confidence keeps that position in view), until a decision explores (whole
    blocks, drafted whole); the first step, before any cap, drafts the whole block."""
    eng, ex = spark_engine(tmp_path, confidence=True)
    execute, drafted = ex.execute, []

    def recording(batch):  # the cap the engine chose for the next step, beside what it drafts for it
        drafted.append((batch.num_next_drafts, eng.confidence.cap))
        return execute(batch)

    ex.execute = recording
    serve(eng, (list(range(10, 30)), greedy(60)), (list(range(40, 45)), greedy(60)))
    capped = [(n, cap) for n, cap in drafted if n and cap is not None]
    assert capped and all(n == min(4, cap + 1) for n, cap in capped)
    assert sum(n == 2 for n, _ in capped) > len(capped) // 2
    assert drafted[0][0] == 4  # no cap yet: the whole block
    assert_launched_steps_come_as_said(ex.batches)


def test_a_packed_confidence_scheduled_step_drafts_one_past_the_longest_share_at_its_columns(tmp_path):
    """Drafts of confidence 0.9, 0.1, ...: only first drafts pay, so the packed steps verify one column, each request
    takes its first draft of the block, and the engine drafts 2 of the block of 4 for them (blocks padded to 4 in
    the packed graph); a decision that explores verifies, and so drafts, whole blocks; before any decision, whole
    blocks. The step launched ahead verifies the block as drafted."""
    eng, packed = spark_engine(tmp_path, confidence=True, executor_class=PackingExecutor)
    assert eng.confidence.layout == "packed" and eng.drafts_follow_columns(2) and not eng.drafts_follow_columns(1)
    execute, drafted = packed.execute, []

    def recording(batch):  # what the engine drafts for the next step, beside the columns and length it chose
        drafted.append((len(batch.requests), batch.num_next_drafts, eng.confidence.columns,
                        eng.confidence.packed_draft_len))
        return execute(batch)

    packed.execute = recording
    serve(eng, (list(range(10, 30)), greedy(60)), (list(range(40, 45)), greedy(60)))
    both = [(n, columns, length) for requests, n, columns, length in drafted if requests == 2 and n]
    assert both[0][0] == 4  # no decision yet: the whole block
    chosen = [(n, columns, length) for n, columns, length in both if columns is not None]
    assert chosen and all(n == (4 if length is None else min(4, length)) for n, _, length in chosen)
    assert all(length is None for _, columns, length in chosen if columns >= 4)  # exploring: whole blocks
    assert sum(n == 2 and columns == 1 for n, columns, _ in chosen) > len(chosen) // 2
    assert any(b.packed is not None and b.requests[0].num_drafts == 2 for b in packed.batches)
    assert_launched_steps_come_as_said(packed.batches)


def test_only_verify_steps_launched_ahead_teach_the_cost_table_and_the_others_the_serial_excess(tmp_path):
    """On an engine that launches steps ahead, the startup profile times steps launched ahead; a step that was not
    (the first verify after the prefill, the step before a request's last) adds the host's step work, so it
    teaches ``MixedStepCosts``' excess, and the next decision is priced through it."""
    eng, ex = spark_engine(tmp_path, confidence=True)
    execute = ex.execute

    def execute_serial_dearer(batch):  # a step not launched ahead waits 4 ms more: the host's work before it
        if not (ex.batches and ex.batches[-1].run_ahead):
            time.sleep(4e-3)
        return execute(batch)

    ex.execute = execute_serial_dearer
    scheduler, observed, priced = eng.confidence, [], []
    observe, allot = scheduler.observe_step, eng._allot_verify_lengths

    def spy_observe(batch, tokens, seconds, context, other_tokens, serial=False):
        observed.append((len(ex.batches) - 1, other_tokens, serial))
        observe(batch, tokens, seconds, context, other_tokens, serial)

    def spy_allot(group, kind):
        priced.append((len(ex.batches), scheduler.serial))
        allot(group, kind)

    scheduler.observe_step, eng._allot_verify_lengths = spy_observe, spy_allot
    serve(eng, (list(range(10, 30)), greedy(40)), (list(range(40, 45)), greedy(40)))
    launched_ahead = [False] + [b.run_ahead for b in ex.batches[:-1]]  # each step: said by the step before it
    assert observed and all(serial == (not launched_ahead[i]) for i, _, serial in observed)
    ahead = [i for i, other, serial in observed if not serial and not other]
    serial = [i for i, other, serial in observed if serial and not other]
    assert ahead and serial  # steady verifies ran ahead; the first verify after the prefill did not
    assert scheduler.costs.observations == len(ahead)
    assert scheduler.mixed_costs.observations == len(observed) - len(ahead)
    assert eng.get_metrics()["confidence_scheduling"]["serial_steps"] == len(observed) - len(ahead)
    assert all(was_serial == (not launched_ahead[i]) for i, was_serial in priced)  # priced as the step runs
    scheduler.mixed_costs.flush()
    scheduler.serial = True  # a serial verify step is the table's cell plus the excess learned (the host's work)
    excess = scheduler.mixed_costs.excess_ms(2, 0)
    assert excess > 1.0 and scheduler.predict_ms_list(2, (4,), 0, 0)[0] == pytest.approx(scheduler.costs.predict_ms(2, 4) + excess)



class PackingExecutor(DraftingExecutor):
    def describe(self) -> list[dict]:  # a graphed target whose packed graphs serve steps of 2 requests on
        return [{**super().describe()[0], "graph_packed_columns": [1, 2, 3], "graph_packed_from": 2}]


class AcceptingExecutor(PackingExecutor):
    """A drafter the target always agrees with: every verified draft is accepted; a packed step verifies what the
    device would choose (``runtime.worker.packed_verify``) from the ranking it was given. Confidences vary by request, so a
    ranking by them would give the surest request more than its share."""

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        from runtime.worker.packed_verify import select_lengths, survivals

        self.batches.append(batch)
        k, verified = batch.num_next_drafts, [r.num_drafts for r in batch.requests]
        if batch.packed is not None:
            plan = batch.packed
            survival = survivals(torch.tensor(plan.confidences), torch.tensor(plan.slope), torch.tensor(plan.bias),
                                 torch.tensor(plan.history))
            verified = select_lengths(survival, plan.budget).tolist()
        out = []
        for i, (r, n) in enumerate(zip(batch.requests, verified)):
            if not r.sample:
                out.append(RequestStepResult(r.request_id, [], 0, []))
                continue
            confidence = [0.99 - 0.1 * i] * k  # the first request the surest
            out.append(RequestStepResult(r.request_id, [7] * (n + 1), n, [8] * k, next_draft_confidence=confidence,
                                         num_verified=n if batch.packed is not None else None))
        return out


def test_the_step_profile_never_lets_a_request_finish_even_when_every_draft_is_accepted(tmp_path):
    """The profile's requests are sized to what its steps can commit (``runtime.engine.step_profile``); a request that
    finished mid-profile was a KeyError at startup (packed steps ranked by confidence gave the surest
    request every draft of its block at any budget). While profiling, a packed step of c columns verifies c drafts
    of every request, and the requests drafted first verify none while the rest prefill."""
    from runtime.engine.step_profile import profile_step_costs

    eng, ex = spark_engine(tmp_path)  # block 4
    accepting = AcceptingExecutor(ex.num_pages)
    accepting.engine, eng.executor = eng, accepting
    eng._packed_from = 2
    table = profile_step_costs(eng, repeats=2, max_batch=8)
    assert table.batch_sizes == [1, 2, 4, 8] and not eng.sequences
    rows = table.to_json()["step_ms"]
    assert all(rows[i][table.token_counts.index(b * (q + 1))] is not None
               for i, b in enumerate(table.batch_sizes) for q in range(5))  # every length of every bucket timed
    packed = [b for b in accepting.batches if b.packed is not None]
    assert {b.packed.columns for b in packed} == {1, 2, 3}
    # every request verifies `columns` drafts (of blocks drafted one longer)
    assert all(b.packed.slope == [0.0] * len(b.packed.confidences[0]) for b in packed)


def test_packed_verifies_run_ahead_at_the_columns_already_chosen(tmp_path):
    """The packed layout: the next step's columns are chosen from this step's confidences, so the step launched
    ahead is a packed verify of the blocks drafted now (``next_verify_len`` the block, as long as the columns let a
    request take: ``packed_draft_len``; ``next_packed`` its columns and ranking), and the next step is exactly that
    (the same requests, their blocks as drafted, packed at those columns)."""
    eng, ex = spark_engine(tmp_path, confidence=True)
    packing = PackingExecutor(ex.num_pages, timed=True)
    packing.engine, eng.executor = eng, packing
    eng.confidence = eng._confidence_scheduler()
    assert eng.confidence.layout == "packed" and eng.confidence.packed_from == 2
    serve(eng, (list(range(10, 30)), greedy(40)), (list(range(40, 45)), greedy(40)))
    ahead = [(b, nxt) for b, nxt in zip(packing.batches, packing.batches[1:]) if b.run_ahead and b.next_packed]
    assert ahead  # of drafts of confidence 0.9, 0.1, ..., one column pays
    assert {b.next_verify_len for b, _ in ahead} == {2}  # one column: a request takes one draft, two are drafted
    for b, nxt in ahead:
        assert b.next_verify_len == b.num_next_drafts and b.next_packed.columns == 1
        assert [r.request_id for r in nxt.requests] == [r.request_id for r in b.requests]
        assert all(r.num_drafts == 2 for r in nxt.requests)  # the blocks fed; the device picks what it verifies
        assert nxt.packed is not None and nxt.packed.columns == 1 and nxt.packed.budget == len(nxt.requests)
        # the block's ranking: the survival fit's slope per position, its bias per history class and position
        assert len(b.next_packed.slope) == 2 and [len(r) for r in b.next_packed.bias] == [2] * 9  # 2K + 1 classes
        # the classes sent ahead are b's requests' before b; the device updates them from b's verdicts (each
        # request verifies its block and accepts 1 here) to what the engine then ranks nxt by
        assert nxt.packed.history == [next_history(h, r.num_drafts, 1, 4)
                                      for h, r in zip(b.next_packed.history, b.requests)]
    assert {h for _, nxt in ahead for h in nxt.packed.history} == {2}  # rejected_at_1

def test_a_verify_served_by_a_faster_longer_graph_is_launched_ahead_padded_and_taken():
    """Where the graph of a longer verify replays faster (7 tokens a request at 64 requests 7.95 ms, 8
    tokens 6.63), a step of the shorter blocks feeds them padded to it (``served_by``): launched ahead into that
    graph, each request's anchor and drafts followed by a padding row at its last position, and taken when the
    engine schedules the blocks as launched."""
    forward, g = _verify_forward(batch=2, q_len=3, shorter=2)
    forward.served_by = {(2, 2): 3}
    assert forward.served_length(2, 2) == 3 and forward.served_length(1, 2) == 3 and forward.served_length(2, 3) == 3
    pages = {"a": [5, 6, 7], "b": [8, 9]}
    forward.run([_verify("a", [10, 11, 12], 4, pages["a"]), _verify("b", [20, 21, 22], 1, pages["b"])], 3)
    committed, accepted = torch.tensor([[11, 12, 40], [50, 0, 0]]), torch.tensor([2, 0])
    assert forward.launch_verify_ahead([2, 0], committed, accepted, torch.tensor([[41, 42], [51, 52]])[:, :1],
                                       append_context=False)
    short = forward.graphs[(2, 2)].graph
    assert len(short.fed) == 0 and len(g.fed) == 2  # the 3-token graph ran it
    assert g.fed[1][0][:6] == [40, 41, 0, 50, 51, 0] and g.fed[1][1][:6] == [7, 8, 8, 2, 3, 3]
    forward.set_ahead_tokens([(40, 41), (50, 51)])
    forward.run([_verify("a", [40, 41], 7, pages["a"]), _verify("b", [50, 51], 2, pages["b"])], 3)
    assert forward.steps_run_ahead == 1 and len(g.fed) == 2  # taken, not replayed again


def test_a_verify_launched_ahead_at_a_confidence_cap_replays_the_shorter_graph():
    """Under confidence scheduling the step launched ahead verifies the first ``cap`` drafts of each new block:
    the graph of that length, fed the anchor and those drafts, used when the engine schedules them."""
    forward, g = _verify_forward(batch=2, q_len=3, shorter=2)
    short = forward.graphs[(2, 2)].graph
    pages = {"a": [5, 6, 7], "b": [8, 9]}
    forward.run([_verify("a", [10, 11, 12], 4, pages["a"]), _verify("b", [20, 21, 22], 1, pages["b"])], 3)
    committed, accepted = torch.tensor([[11, 12, 40], [50, 0, 0]]), torch.tensor([2, 0])
    assert forward.launch_verify_ahead([2, 0], committed, accepted, torch.tensor([[41, 42], [51, 52]])[:, :1],
                                       append_context=False)
    assert len(g.fed) == 1 and short.fed[0][0][:4] == [40, 41, 50, 51] and short.fed[0][1][:4] == [7, 8, 2, 3]
    forward.set_ahead_tokens([(40, 41), (50, 51)])
    forward.run([_verify("a", [40, 41], 7, pages["a"]), _verify("b", [50, 51], 2, pages["b"])], 2)
    assert forward.steps_run_ahead == 1 and len(short.fed) == 1


def test_the_step_profile_plans_and_launches_each_verify_length_as_served(tmp_path):
    """The confidence scheduler's startup profile forces each verify length through the engine
    (``forced_verify_len``), so the engine plans and launches the next step ahead at that length, as it does at a
    confidence-scheduled cap. One run's profile trimmed the blocks behind the engine's back: every step of a length
    short of the block dropped a verify launched ahead at the full block and ran it again (1.5-3 ms a step too slow
    on the GPU, and the scheduler never trimmed). Now only the first step of a new length (untimed) finds the step
    before it launched at the old one."""
    from runtime.engine.step_profile import profile_step_costs

    eng, ex = spark_engine(tmp_path)  # block 4
    eng._graph_q_lens = ex.describe()[0]["graph_q_lens"]  # (as Engine._confidence_scheduler reads it, then profiles)
    table = profile_step_costs(eng, repeats=2, max_batch=2)
    assert eng.forced_verify_len is None and eng.forced_draft_len is None and not eng.sequences
    said = [(b, nxt) for b, nxt in zip(ex.batches, ex.batches[1:]) if b.run_ahead
            and [r.request_id for r in nxt.requests] == [r.request_id for r in b.requests]]
    wrong = [b for b, nxt in said if any(r.num_drafts != b.next_verify_len for r in nxt.requests)]
    # buckets 1 and 2, each changing length 1 -> 2 -> 3 -> 4 in the first pass (0 does not run ahead), then
    # 4 -> 3 -> 2 -> 1 -> 0 in the second (the last step at 1 launched the next at 1)
    assert len(wrong) <= 2 * (3 + 4)
    # every drafted length runs ahead, and so do the plain decode steps after them (0: nothing drafted)
    assert {b.next_verify_len for b, _ in said} == {0, 1, 2, 3, 4}
    assert all(not b.num_next_drafts and all(len(r.token_ids) == 1 for r in nxt.requests)
               for b, nxt in said if not b.next_verify_len)
    assert table.batch_sizes == [1, 2] and None not in table.to_json()["step_ms"][0][:5]  # 1 x (0..4 + 1) tokens
    assert table.plain.batch_sizes == [1, 2] and table.plain.predict_ms(2, 2) > 0  # plain decoding, 1 and 2
    # each length L's steps draft L + 1 (the padded steps served at cap L do: Engine.drafts_follow_cap)
    verifying = [b for b in ex.batches if b.num_next_drafts and len({r.num_drafts for r in b.requests}) == 1
                 and b.requests[0].num_drafts >= 1]
    assert {b.requests[0].num_drafts for b in verifying} == {1, 2, 3, 4}
    assert all(b.num_next_drafts == min(4, b.requests[0].num_drafts + 1) for b in verifying)


def test_the_step_profile_times_packed_steps_where_packed_graphs_serve_them(tmp_path):
    """With packed graphs (from 2 requests here), the profile's steps of that many requests verify columns 1..K-1
    packed, as the packed layout serves them (whole blocks fed, the budget columns x requests), launched ahead like
    any other length; one request's steps are trimmed (padded) as before, and 0 and K are uniform steps."""
    from runtime.engine.step_profile import profile_step_costs

    eng, ex = spark_engine(tmp_path)  # block 4
    packing = PackingExecutor(ex.num_pages)
    packing.engine, eng.executor = eng, packing
    eng._packed_from = 2  # what _confidence_scheduler reads from the graphs' rank info before it profiles
    eng._graph_q_lens = packing.describe()[0]["graph_q_lens"]
    table = profile_step_costs(eng, repeats=2, max_batch=2)
    drafted = [b for b in packing.batches if any(r.num_drafts for r in b.requests)]
    pairs = [b for b in drafted if len(b.requests) == 2]
    assert {b.packed.columns for b in pairs if b.packed} == {1, 2, 3}  # the lengths short of the block: packed
    # packed at L columns of blocks drafted L + 1 (every request takes L under the profile's flat ranking: the
    # shortest block a served packed step drafts, Engine.drafts_follow_columns), but for the first (untimed) step
    # of each new length, whose blocks were drafted for the length before
    packed = [b for b in pairs if b.packed]
    wrong = [b for b in packed if any(r.num_drafts != b.packed.columns + 1 for r in b.requests)]
    assert {b.packed.columns for b in packed if b not in wrong} == {1, 2, 3} and len(wrong) <= 2 * 3
    assert all(b.packed is None for b in drafted if len(b.requests) == 1)
    # every length drafts one past itself, packed (two requests: the columns verified) or padded (one)
    assert all(b.num_next_drafts == min(4, (b.packed.columns if b.packed else b.requests[0].num_drafts) + 1)
               for b in drafted if b.num_next_drafts)
    ahead = {b.next_packed.columns for b in pairs if b.run_ahead and b.next_packed}
    assert ahead == {1, 2, 3}  # each packed length planned and launched ahead as served
    row = dict(zip(table.token_counts, table.to_json()["step_ms"][1]))
    assert table.batch_sizes == [1, 2] and all(row[2 * (length + 1)] is not None for length in range(5))


def test_the_guard_prices_plain_decoding_only_on_steady_steps_launched_ahead_and_launching_ahead(tmp_path):
    """On an engine that launches plain steps ahead, a plain step between drafting steps pays the host's work a run
    of plain steps hides: the guard's plain price takes only steps launched ahead that launch the next ahead, and
    its exploration is four plain plans so that one of them is."""
    eng, ex = spark_engine(tmp_path, guard=True)
    seen = []
    observe = eng.guard.observe_step

    def record(batch, drafted, verified_drafts, seconds, steady=True, prompt=False, whole=True):
        if not prompt:
            seen.append((len(ex.batches) - 1, drafted, verified_drafts, steady))
        observe(batch, drafted, verified_drafts, 1.0 if not drafted else 2.0, steady, prompt, whole)

    eng.guard.observe_step = record
    serve(eng, (list(range(10, 30)), greedy(60)), (list(range(40, 45)), greedy(60)))
    assert eng.guard.exploration_len == 4 and eng.guard.stats.explorations >= 1
    plain = [(i, steady) for i, drafted, verified, steady in seen if not drafted and not verified]
    assert any(steady for _, steady in plain) and not all(steady for _, steady in plain)
    for i, steady in plain:  # steady: launched ahead by the step before, launching the next one ahead
        assert steady == (ex.batches[i - 1].run_ahead and ex.batches[i].run_ahead), i
    assert eng.guard.buckets[2].plain_s == 1.0
