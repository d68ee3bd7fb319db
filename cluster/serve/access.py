"""What reaches a route: the API key (every route but the open ones), and the request body's size (a 413 before the
route reads it)."""

from __future__ import annotations

import hmac

from fastapi import Request

from cluster.serve.errors import ApiError


def bearer_matches(header: str | None, key: str) -> bool:
    """``Authorization: Bearer <key>`` (scheme case-insensitive), compared in constant time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


OPEN_ROUTES = frozenset({"/health", "/metrics"})  # what a balancer and a scraper read: no key


def route_of(request: Request) -> str:
    """The request's path within the app (without the prefix the application is served under)."""
    path, prefix = request.url.path, request.scope.get("root_path", "")
    return path[len(prefix):] or "/" if prefix and path.startswith(prefix) else path


def default_body_limit(max_model_len: int) -> int:
    """The largest request body a server takes by default: 16 MiB, or more for a long context (a prompt of
    max_model_len tokens as JSON, ~64 bytes a token with escapes, twice over for messages and tools)."""
    return max(16 << 20, 128 * max_model_len)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over the app's ``max_body_bytes`` gets a 413 (OpenAI's error shape) before the
    route reads it, by its Content-Length or, for a chunked body, as soon as the bytes received pass the limit."""

    def __init__(self, inner, limit, respond):
        """``limit()``: the largest body taken now (None: no limit); ``respond``: the app's error response for an
        ``ApiError``. Both module-level functions of the app's module: they read the state of the app instance
        that module serves (a Serve replica imports it anew)."""
        self.inner, self.limit, self.respond = inner, limit, respond

    async def __call__(self, scope, receive, send):
        limit = self.limit()
        if scope["type"] != "http" or limit is None:
            return await self.inner(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        received, over = 0, False

        async def counted():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # the route's body parsing fails on this; its answer becomes the 413
                    over = True
                    raise BodyTooLarge
            return message

        refused = False

        async def answered(message):
            nonlocal refused
            if not over:
                await send(message)
            elif not refused:
                refused = True
                await self._refuse(scope, receive, send, limit)

        try:
            await self.inner(scope, counted, answered)
        except BodyTooLarge:
            if not refused:
                await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope, receive, send, limit: int) -> None:
        response = self.respond(ApiError(413, f"the request body is larger than this server takes ({limit} bytes, "
                                           "max_body_bytes)", code="request_too_large"))
        await response(scope, receive, send)
