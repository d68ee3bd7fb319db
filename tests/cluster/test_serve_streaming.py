"""A streamed response closes its request's sample streams however the client leaves, and a failed sample cancels
its siblings: no request is left generating for a client that is gone (the server's side of a disconnect, without
Ray: the same classes the app uses)."""

import asyncio

import pytest

from cluster.serve.streaming import ClosingStreamingResponse, gather_or_cancel


def body(started: list):
    async def chunks():
        started.append(True)
        yield "data: {}\n\n"
        await asyncio.sleep(30)  # a long generation
        yield "data: [DONE]\n\n"

    return chunks()


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
@pytest.mark.parametrize("leaves", ["before the headers", "after the first chunk"])
def test_a_client_gone_before_or_during_the_body_closes_the_samples(spec_version, leaves):
    closed, started, sent = [], [], []

    async def close():
        closed.append(True)

    async def receive():  # the client is gone: a disconnect, at once or after the first chunk
        if leaves == "after the first chunk":
            while len(sent) < 2:
                await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if leaves == "before the headers" or (spec_version == "2.4" and len(sent) > 1):
            raise OSError("connection reset")  # (ASGI 2.4: sending to a gone client raises)

    async def run():
        response = ClosingStreamingResponse(body(started), close, media_type="text/event-stream")
        try:
            await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": spec_version}}, receive,
                                            send), timeout=10)
        except Exception:  # (Starlette's ClientDisconnect, or the reset itself)
            pass

    asyncio.run(run())
    assert closed == [True]


def test_a_sample_that_fails_cancels_the_others():
    running = []

    async def sample(i: int):
        running.append(i)
        try:
            if i == 0:
                await asyncio.sleep(0.05)
                raise ValueError("sample 0 failed")
            await asyncio.sleep(30)
        finally:
            running.remove(i)

    async def run():
        with pytest.raises(ValueError, match="sample 0 failed"):
            await gather_or_cancel(sample(i) for i in range(4))
        return list(running)

    assert asyncio.run(run()) == []
