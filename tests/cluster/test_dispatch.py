"""The step's wire format: deltas the actors turn back into the batch the driver scheduled."""

import pickle

import pytest

from cluster.dispatch import BatchDecoder, BatchEncoder, decode_any, decode_results, encode_any, encode_results
from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.step_io import PackedAhead, RequestStepResult, ScheduledBatch, ScheduledRequest


def request(rid, pages, tokens=(1, 2), start=4, seed=7, params=None):
    return ScheduledRequest(rid, list(tokens), start, list(pages), 1, True, params or SamplingParams(), seed)


def batch(*requests, released=()):
    return ScheduledBatch(list(requests), 3, True, list(released), [])


def through(encoder, decoders, b):
    wire = pickle.loads(pickle.dumps(encoder.encode(b)))  # what crosses the channel
    return [d.decode(wire) for d in decoders]


def test_batches_round_trip_through_deltas_across_steps_releases_and_readmission():
    encoder, decoders = BatchEncoder(), [BatchDecoder(), BatchDecoder()]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    steps = [batch(request("a", [3], params=greedy), request("b", [5, 6], seed=9)),
             batch(request("a", [3], params=greedy), request("b", [5, 6, 8], seed=9)),  # b grew a page
             batch(request("a", [3, 4], params=greedy), released=["b"]),  # b preempted
             batch(request("b", [1], start=0, seed=9), request("a", [3, 4], params=greedy))]  # b readmitted
    for b in steps:
        assert all(got == b for got in through(encoder, decoders, b)), b
    wire = encoder.encode(batch(request("a", [3, 4, 2], params=greedy)))
    assert isinstance(wire, bytes)  # one object for the channel (its own serialization of tuples is slow)
    delta = pickle.loads(wire)
    assert delta[0][0][3:5] == (2, [2]) and delta[0][0][7] is None  # only the new page; parameters sent already


def test_the_run_ahead_mark_and_the_next_verify_length_reach_the_actors():
    """A single-rank replica's worker plans the next verify while the drafter drafts and may launch it ahead: both
    need what the engine said of the next step (before, the wire dropped it: the replica never planned ahead)."""
    encoder, decoder = BatchEncoder(), BatchDecoder()
    b = ScheduledBatch([request("a", [3])], 7, True, [], [], run_ahead=True, next_verify_len=5)
    assert through(encoder, [decoder], b) == [b]
    # a packed verify expected next (its columns and ranking: the worker plans it and may launch it ahead)
    ahead = ScheduledBatch([request("a", [3])], 7, True, [], [], run_ahead=True, next_verify_len=7,
                           next_packed=PackedAhead(3, [1.0] * 7, [[0.1] * 7, [1.2] * 7, [-0.5] * 7], [2]))
    assert through(encoder, [decoder], ahead) == [ahead]
    plain = batch(request("a", [3, 4]))
    got, = through(encoder, [decoder], plain)
    assert got == plain and not got.run_ahead and got.next_verify_len == 0


def test_which_replicas_run_decode_and_verify_steps_ahead():
    """Decode steps: every graphed layout without a separate drafter, tensor-parallel ranks only without a drafter
    (its context is rank 0's alone); verify steps: a single rank with its drafter colocated."""
    from cluster.executor import runs_ahead, verifies_ahead

    assert runs_ahead(True, 1, ["target"], True)  # colocated drafter or none: one process, as in runtime.LLM
    assert runs_ahead(True, 1, ["target"], False) and verifies_ahead(True, 1, ["target"])
    assert not runs_ahead(False, 1, ["target"], False)  # no graphs (CPU): nothing is launched ahead
    assert not verifies_ahead(False, 1, ["target"])
    assert runs_ahead(True, 2, ["target", "target"], False)  # TP without a drafter: every rank decodes ahead
    assert not runs_ahead(True, 2, ["target", "target"], True)
    assert not verifies_ahead(True, 2, ["target", "target"])
    assert not runs_ahead(True, 1, ["target", "drafter"], True)
    assert not verifies_ahead(True, 1, ["target", "drafter"])


def test_a_failed_step_resets_both_ends_and_a_mismatch_is_loud():
    encoder, decoder = BatchEncoder(), BatchDecoder()
    through(encoder, [decoder], batch(request("a", [3])))
    encoder.encode(batch(request("a", [3, 4])))  # a step the actor never applied (it failed on the way)
    with pytest.raises(RuntimeError, match=r"request 'a': this actor holds 1 pages, the driver assumed 2"):
        decoder.decode(encoder.encode(batch(request("a", [3, 4, 5]))))
    encoder.reset()
    b = batch(request("a", [3, 4, 5]))
    assert through(encoder, [decoder], b) == [b]


def test_results_round_trip():
    results = [RequestStepResult("a", [1, 2], 1, [3, 4], next_draft_confidence=[0.5, 0.25]),
               RequestStepResult("b", [], 0, [], "bad logits")]
    wire = encode_results(results)
    assert isinstance(wire, bytes) and decode_results(wire) == results
    assert decode_any(encode_any({"a": ([1, 2], [0.5, 0.25])})) == {"a": ([1, 2], [0.5, 0.25])}


def test_the_engines_host_work_runs_while_the_actors_compute_and_its_error_stays_its_own(monkeypatch):
    """``RayExecutor._run_step`` yields its device wait between dispatching a step and collecting it, where the engine
    runs its deferred host work (``run_step``); a task that raises is the engine's error (not a replica actor's),
    raised once the step's result is read (a compiled graph's result must be), and the tasks after it stay queued."""
    import threading
    import types

    import cluster.executor as executor_module
    from runtime.engine.host_work import HostWork, run_step

    order = []
    executor = object.__new__(executor_module.RayExecutor)
    executor.config = types.SimpleNamespace(parallel=types.SimpleNamespace(step_timeout_s=5.0))
    executor.step_graph = types.SimpleNamespace(execute=lambda wire: (order.append("dispatched"), "ref")[1])
    work = HostWork()
    executor._graph_lock = threading.Lock()  # (idle parking's: the step path takes it)
    monkeypatch.setattr(executor_module.ray, "get", lambda ref, timeout: (order.append("collected"), [ref])[1])
    work.add(lambda: order.append("task"))
    assert run_step(executor._run_step("wire"), work) == ["ref"] and order == ["dispatched", "task", "collected"]

    def broken():
        raise ZeroDivisionError("a fold's bug")

    work.add(broken)
    work.add(lambda: order.append("later"))
    order.clear()
    with pytest.raises(ZeroDivisionError, match="a fold's bug"):
        run_step(executor._run_step("wire"), work)
    assert order == ["dispatched", "collected"] and len(work) == 1  # "later" still queued
    assert not executor._graph_lock.locked()  # the step finished: nothing is left held
    work.run()
    assert order[-1] == "later"
