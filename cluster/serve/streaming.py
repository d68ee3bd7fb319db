"""Streamed responses: server-sent events, and the sample streams of a request closed however its response ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from fastapi.responses import StreamingResponse

from runtime.engine.outputs import RequestOutput


async def gather_or_cancel(awaitables: Iterable[Awaitable]) -> list:
    """``asyncio.gather`` of ``awaitables`` as tasks; when one fails, or the caller is cancelled, the others are
    cancelled and awaited before the error propagates: none is left running a request's sample stream (a stream still
    running cannot be closed, and its request would generate on until garbage collection)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its request's sample streams however it ends: finished, failed, or cut by a
    client gone before or while its body was sent. (Starlette cancels the send of a client that disconnected
    without closing a body iterator it never started: that request's samples would generate on until garbage
    collection.)"""

    def __init__(self, content: AsyncIterator[str], close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def first_token_time(outputs: list[RequestOutput]) -> float | None:
    """When the engine committed the first token of any of a request's samples (time.monotonic), if it has."""
    times = [out.first_token_time for out in outputs if out.first_token_time is not None]
    return min(times) if times else None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
