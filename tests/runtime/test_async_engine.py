"""AsyncEngine: outputs stream to asyncio callers; a failing step fails what is in flight and recovers;
a caller that goes away aborts its request."""

import asyncio
import time

import pytest

from runtime import LLM, SamplingParams
from runtime.engine.async_engine import AsyncEngine


@pytest.fixture
def llm(near_bigram_target):
    return LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=128, page_size=4)


async def collect(engine, prompt, params):
    return [out async for out in engine.generate(prompt, params)]


def test_streams_match_the_engine(llm):
    expected = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    engine = AsyncEngine(lambda: llm.engine)
    try:
        outs = asyncio.run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=10, temperature=0)))
        assert outs[-1].finished and outs[-1].token_ids == expected
        assert [t for o in outs for t in o.new_token_ids] == expected
        with pytest.raises(ValueError, match="prompt is empty"):
            asyncio.run(collect(engine, [], SamplingParams()))
    finally:
        engine.shutdown()


def test_a_failing_step_fails_in_flight_requests_then_recovers(llm):
    recovered = []
    engine = AsyncEngine(lambda: llm.engine, recover=recovered.append)
    real_step, calls = llm.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("actor died")
        return real_step()

    llm.engine.step = flaky_step
    try:
        with pytest.raises(RuntimeError, match="actor died"):
            asyncio.run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=20, temperature=0)))
        deadline = time.monotonic() + 10  # callers are failed first, then the engine thread recovers
        while not recovered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [str(e) for e in recovered] == ["actor died"] and not llm.engine.has_unfinished()
        outs = asyncio.run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=5, temperature=0)))
        assert len(outs[-1].token_ids) == 5
    finally:
        engine.shutdown()


def test_a_caller_that_goes_away_aborts_and_frees_pages(llm):
    engine = AsyncEngine(lambda: llm.engine)

    async def first_then_leave():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        first = await anext(stream)
        await stream.aclose()
        return first

    try:
        assert not asyncio.run(first_then_leave()).finished
        deadline = time.monotonic() + 10
        while llm.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.has_unfinished() and llm.engine.pages.num_used == 0
    finally:
        engine.shutdown()


def test_a_serving_engine_keeps_the_collector_off_its_startup_objects(llm):
    """Once serving starts, full garbage collections skip the models, graphs and tokenizer (runtime.engine.heap): they
    walk only what the loop made since; shutting down hands them back, so a dropped engine's cycles can go."""
    import gc

    engine = AsyncEngine(lambda: llm.engine)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # at least the engine's modules and everything imported
        scanned = len(gc.get_objects())  # what a full collection walks now
        outs = asyncio.run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=10, temperature=0)))
        assert outs[-1].finished
        assert scanned < frozen
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_frozen_step_shows_as_a_stall_and_ends_when_the_step_does(llm):
    """``stalled_s`` (what /health compares with stall_timeout_s) grows while a step hangs; idle or stepping it
    stays near zero."""
    import threading

    engine = AsyncEngine(lambda: llm.engine)
    real_step, release = llm.engine.step, threading.Event()

    def frozen_step():
        release.wait(timeout=30)
        return real_step()

    try:
        time.sleep(0.3)
        assert engine.stalled_s() < 0.25  # idle: the thread comes round every IDLE_WAIT_S
        llm.engine.step = frozen_step

        async def run():
            task = asyncio.ensure_future(collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0)))
            await asyncio.sleep(1.0)
            stalled = engine.stalled_s()
            release.set()
            return stalled, await task

        stalled, outs = asyncio.run(run())
        assert stalled > 0.8 and outs[-1].finished
        time.sleep(0.2)
        assert engine.stalled_s() < 0.25
    finally:
        release.set()
        llm.engine.step = real_step
        engine.shutdown()


def test_a_grammar_slow_to_compile_delays_only_its_own_request(llm, monkeypatch):
    """A structured request's grammar compiles off the engine's thread: a plain request runs meanwhile, and the
    compile that outlasts ``grammar_timeout_s`` fails its own request with a message naming the limit."""
    import threading

    from runtime.sampling.sampling_params import StructuredOutputs

    began = threading.Event()

    def slow_compile(params):
        began.set()
        time.sleep(3)
        raise AssertionError("the request should have timed out before its grammar compiled")

    monkeypatch.setattr(llm.engine, "compile_grammar", slow_compile)
    engine = AsyncEngine(lambda: llm.engine, grammar_timeout_s=1.0)
    structured = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputs(regex="a+"))

    async def run():
        slow = asyncio.ensure_future(collect(engine, [5, 6, 7], structured))
        while not began.is_set():
            await asyncio.sleep(0.01)
        start = time.monotonic()
        plain = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
        plain_s = time.monotonic() - start
        with pytest.raises(ValueError, match=r"did not compile within 1 s .*grammar_compile_timeout_s"):
            await slow
        return plain, plain_s

    try:
        plain, plain_s = asyncio.run(run())
        assert plain[-1].finished and len(plain[-1].token_ids) == 8 and plain_s < 1.0
        assert not llm.engine.has_unfinished()
    finally:
        engine.shutdown()
