"""The server's errors in OpenAI's shape: what a refused or failed request answers, which parameter it names, and which
of the server's directories an error must not show."""

from __future__ import annotations

import os
import re

from cluster.executor import ReplicaFailure
from runtime.engine.async_engine import RequestFailed, StepFailed, Stopping

SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
DRAIN_RETRY_AFTER_S = 5


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


UNION_BRANCHES = re.compile(r"^(constrained-)?(str|int|float|bool|list|dict|none)$|\[")  # pydantic's union tags


def error_param(loc) -> str | None:
    """The parameter a validation error names: its field path without 'body' or union-branch tags."""
    return ".".join(str(p) for p in loc if p != "body" and not UNION_BRANCHES.search(str(p))) or None


def failure(exc: BaseException) -> ApiError:
    """The OpenAI-shaped error for a request that failed after admission: 500 when it failed alone, 503 when the
    replica failed (every request in flight failed and the replica is rebuilt)."""
    if isinstance(exc, RequestFailed) and exc.code == "unsatisfiable_constraints":  # the client's own options
        return ApiError(400, str(exc), code=exc.code)
    if isinstance(exc, RequestFailed):
        return ApiError(500, f"this request failed: {exc}", code="request_failed")
    if isinstance(exc, Stopping):
        return ApiError(503, str(exc), code="shutting_down", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
    if isinstance(exc, (ReplicaFailure, StepFailed)):
        return ApiError(503, f"the replica failed: {exc}", code="replica_failure")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def check_unicode(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800"), naming where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param) from None


def request_error(exc: ValueError, prompt_field: str, structured_field: str = "response_format") -> ApiError:
    """A request the engine refuses: 400 naming the parameter (``structured_field``: the API's name for what asked
    for structured outputs, ``response_format`` or, for tool calls, ``tool_choice``)."""
    text = str(exc)
    field = SAMPLING_FIELD.search(text)
    param = field.group(1) if field else (prompt_field if text.startswith("prompt") else None)
    param = {"structured_outputs": structured_field}.get(param, param)  # (the API's name for it)
    return ApiError(400, text, param, "context_length_exceeded" if "max_model_len" in text else "invalid_value")


def private_paths(engine_config) -> list[tuple[str, str]]:
    """(directory, what an error shows instead), longest first (a cache inside a model directory goes first)."""
    spec = engine_config.speculative_config
    named = [(engine_config.model, "<model>"), (spec.speculative_model if spec is not None else None, "<drafter>"),
             (os.environ.get("HF_HOME"), "<cache>"), (os.environ.get("HF_HUB_CACHE"), "<cache>")]
    out = set()
    for path, name in named:
        if path and os.path.isabs(os.path.expanduser(str(path))) and len(str(path)) > 1:
            for form in {str(path), os.path.realpath(os.path.expanduser(str(path)))}:
                out.add((form.rstrip("/"), name))
    return sorted(out, key=lambda item: -len(item[0]))
