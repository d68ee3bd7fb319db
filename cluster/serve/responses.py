"""The bodies the server answers with, in OpenAI's shapes: completions and chat completions, whole or as stream
chunks, their logprobs, tool calls, usage and errors."""

from __future__ import annotations

import json
import time
import uuid

from runtime.engine.outputs import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, outs, generated: list[int] | None = None) -> dict:
    """OpenAI's usage of a request's finished (or last streamed) ``RequestOutput``s, one per sample (each prompt
    counted once: ``prompt_tokens`` is the request's prompts' tokens; the samples' tokens summed: ``generated`` per
    sample where the outputs were deltas), ``prompt_tokens_details.cached_tokens`` (the prompt tokens the prefix
    cache held when each prompt's first sample was admitted), plus our extension ``dspark``: the drafts the target
    verified and those it accepted (each accepted draft saved a target step; both 0 without a drafter). OpenAI's
    schema requires only the first three fields, so clients ignore the extension."""
    completion_tokens = sum(generated) if generated is not None else sum(len(out.token_ids) for out in outs)
    cached = sum(out.num_cached_tokens for out in outs if out.index == 0)  # each prompt's, as its first sample found
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached},
            "dspark": {"draft_tokens": sum(out.num_draft_tokens for out in outs),
                       "accepted_draft_tokens": sum(out.num_accepted_tokens for out in outs)}}


def completion_body(rid: str, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_body(rid: str, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": logprobs}


def tool_calls_of(mode: str, name: str | None, text: str) -> list[dict] | None:
    """The calls an answer held to ``ChatCompletionRequest.tool_schema`` makes, in OpenAI's shape: ``named``, one call
    of that function with the text as its arguments; ``required``, one per item of the JSON array the text is;
    None where the text is no such array (an answer cut at max_tokens)."""
    if mode == "named":
        return [tool_call(name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i and "parameters" in i
                                              for i in items):
        return None
    return [tool_call(i["name"], json.dumps(i["parameters"])) for i in items]


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_message(mode: str, name: str | None, text: str, finish_reason: str | None,
                 parse=None) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason for an answer that may call tools: the calls (``tool_calls_of``;
    ``auto``: those ``parse``, a tool-call parser of ``cluster.serve.tool_parsers``, finds, beside the text before
    them) finishing "tool_calls" where ``required`` or ``auto`` calls were complete (a named call finishes "stop",
    as OpenAI's forced function call does); an answer that parses as no calls keeps its text as content."""
    if mode == "auto":
        content, found = parse(text)
        if not found:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content,
                "tool_calls": [tool_call(n, a) for n, a in found]}, "tool_calls"
    calls = tool_calls_of(mode, name, text) if finish_reason != "length" or mode == "named" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    finish = "tool_calls" if mode == "required" and finish_reason == "stop" else finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish


class ToolCallDeltas:
    """One streamed chat answer that may call tools (``ChatCompletionRequest.tool_call_mode``): each text delta ->
    the chunk's ``delta`` message. ``named``: the arguments as they come, the call's id and name in the first;
    ``required``: the calls once the array is complete (its text does not stream; cut short, its text as content);
    ``auto``: the text as it comes, held back only where it may begin a call (``parser``, a tool-call parser's
    stream of ``cluster.serve.tool_parsers``), then the calls."""

    def __init__(self, mode: str, function: str | None = None, parser=None):
        self.mode, self.function, self.parser = mode, function, parser
        self.started = False  # named: the call's first delta (its id and name) was sent
        self.text = ""  # required: the answer so far

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """-> (the chunk's delta message, its finish reason: "tool_calls" where required or auto calls ended it)."""
        if self.mode == "named":
            if self.started:
                return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish_reason
            self.started = True
            return {"tool_calls": [{"index": 0, **tool_call(self.function, text)}]}, finish_reason
        if self.mode == "required":
            self.text += text
            if finish_reason is None:
                return {}, None
            whole, finish_reason = tool_message("required", None, self.text, finish_reason)
            if not whole.get("tool_calls"):
                return {"content": self.text}, finish_reason
            return {"tool_calls": [{"index": j, **c} for j, c in enumerate(whole["tool_calls"])]}, finish_reason
        message = {"content": self.parser.feed(text)}
        if finish_reason is not None:
            rest, found = self.parser.finish()
            message["content"] += rest
            if found:
                message["tool_calls"] = [{"index": j, **tool_call(name, arguments)}
                                         for j, (name, arguments) in enumerate(found)]
                finish_reason = "tool_calls"
                if not message["content"]:
                    del message["content"]
        return message, finish_reason


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


# ---- logprobs -------------------------------------------------------------------------------

def token_text(tokenizer, token_id: int) -> str:
    """A token as text: its own decoding (a token that ends mid-character shows the replacement character; its
    ``bytes`` in chat logprobs are that text's UTF-8)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"


def completion_logprobs(tokenizer, entries, text_offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs``: tokens, their logprobs, per token a {token text: logprob} map of the top
    alternatives, and each token's offset in the completion text (from ``text_offset``). An echoed prompt's first
    token has neither (``echoed_prompt``: its entry's logprob and top are None, shown as null)."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {token_text(tokenizer, t): lp for t, lp in e.top}
                             for e in entries],
            "text_offset": offsets}


def echoed_prompt(prompt: list[int], prompt_logprobs: list[TokenLogprob | None], top: int) -> list[TokenLogprob]:
    """An echoing completion's prompt entries for ``completion_logprobs``: the engine's prompt logprobs with ``top``
    alternatives each (the request's ``logprobs``; the engine may have computed more for its ``prompt_logprobs``),
    the first token's (there is none: nothing precedes it) an entry whose logprob and top are None."""
    return [TokenLogprob(prompt[0], None, None),
            *(TokenLogprob(e.token_id, e.logprob, e.top[:top], e.rank) for e in prompt_logprobs[1:])]


def prompt_logprobs_body(tokenizer, prompt_logprobs: list[TokenLogprob | None] | None, top: int) -> list | None:
    """vLLM's ``prompt_logprobs`` of a response (a completion's choice, a chat response): per prompt token a map
    {token id: {logprob, rank, decoded_token}} of the token itself and its ``top`` most likely alternatives (rank 1
    the most likely), the first token's None (nothing precedes it)."""
    if prompt_logprobs is None:
        return None

    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}

    body: list[dict | None] = [None]
    for e in prompt_logprobs[1:]:
        position = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        for place, (token_id, logprob) in enumerate(e.top[:top], start=1):
            position.setdefault(str(token_id), entry(token_id, logprob, place))
        body.append(position)
    return body


def chat_logprobs(tokenizer, entries) -> dict:
    """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and the top alternatives."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def usage_chunk(rid: str, model: str, kind: str, usage: dict) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [], "usage": usage}


# ---- errors ---------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}
