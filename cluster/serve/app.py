"""The Ray Serve application: an OpenAI-compatible HTTP front over one dspark replica per Serve replica.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events ending in ``data: [DONE]``), ``GET /health`` (asks every shard and the drafter),
``GET /metrics`` (Prometheus text). Errors use OpenAI's shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import threading
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.executor import ReplicaFailure
from cluster.llm import LLM as ReplicaLLM
from cluster.placement import groups
from cluster.placement.serving import serve_plan
from cluster.serve import drain, protocol, responses
from cluster.serve.access import OPEN_ROUTES, BodyLimit, bearer_matches, default_body_limit, route_of
from cluster.serve.errors import (DRAIN_RETRY_AFTER_S, ApiError, check_unicode, error_param, failure, private_paths,
                                  request_error)
from cluster.serve.metrics import ServerMetrics
from cluster.serve.streaming import ClosingStreamingResponse, first_token_time, gather_or_cancel, sse
from cluster.serve.text import TextStream
from cluster.serve.tool_parsers import PARSER_KINDS
from configs import ReplicaConfig, ServeArgs, validate
from runtime.engine.async_engine import AsyncEngine, Overloaded
from runtime.engine.chat import chat_template_of, chat_token_ids, template_options_error
from runtime.engine.llm import best_samples, sample_params
from runtime.engine.outputs import RequestOutput
from runtime.sampling.sampling_params import SamplingParams

app = FastAPI(title="dspark", description="DSpark speculative decoding, OpenAI-compatible API")
HEALTH_PROBE_TIMEOUT_S = 10.0  # an actor silent this long counts as lost


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(responses.error_body(err.status, redact(err.message), err.param, err.code),
                        status_code=err.status, headers=err.headers)


def redact(message: str) -> str:
    """``message`` without the server's directories (``app.state.private_paths``: the model's, the drafter's, the
    caches'): a library's error about a request may name a file it read, and clients learn nothing of the host."""
    for path, name in getattr(app.state, "private_paths", ()):
        message = message.replace(path, name)
    return message


@app.exception_handler(ApiError)
async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return error_response(err)


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":  # its loc is a character offset, not a parameter
        return error_response(ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}", None, "invalid_json"))
    message = "; ".join(f"{error_param(e.get('loc', ())) or 'body'}: {e['msg']}" for e in errors)
    return error_response(ApiError(400, message, error_param(errors[0].get("loc", ())), "invalid_value"))


def sampling_params(body: protocol.SamplingFields, max_tokens: int, defaults: dict) -> SamplingParams:
    """The request's SamplingParams, the model's ``defaults`` where it set nothing; a 400 for a bad value."""
    try:
        return body.sampling_params(max_tokens, defaults)
    except ValueError as exc:
        raise request_error(exc, "prompt", body.structured_field()) from None


def max_body_bytes() -> int | None:
    return getattr(app.state, "max_body_bytes", None)


app.add_middleware(BodyLimit, limit=max_body_bytes, respond=error_response)


@app.middleware("http")
async def _authenticate(request: Request, call_next):
    """Every route but ``OPEN_ROUTES`` checks the API key (when one is set) before anything reads the body: an
    unauthenticated client learns nothing about the schema from validation errors, nor reaches the tokenizer, the
    chat template or the API's documentation."""
    key = getattr(app.state, "api_key", None)
    api = "/v1/" in request.url.path + "/"
    if key is not None and route_of(request) not in OPEN_ROUTES \
            and not bearer_matches(request.headers.get("authorization"), key):
        return error_response(ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                       code="invalid_api_key"))
    if api and request.method == "POST" and getattr(app.state, "draining", False):
        return error_response(ApiError(503, "the server is shutting down and admits no new requests; retry on "
                                       "another replica or later", code="draining",
                                       headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)}))
    return await call_next(request)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing and body-parsing errors (404, 405, an unreadable body) in OpenAI's shape too."""
    if exc.status_code == 400:  # FastAPI could not parse the body (invalid UTF-8, nesting too deep)
        return error_response(ApiError(400, f"the body is not valid JSON: {exc.detail}", code="invalid_json"))
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(ApiError(exc.status_code, message, code=str(exc.detail).lower().replace(" ", "_"),
                                   headers=getattr(exc, "headers", None)))


class DSparkServer:
    """One Serve replica: owns a dspark replica (its placement group, shards and drafter) and its engine loop."""

    def __init__(self, args: ServeArgs):
        self.args = args
        app.state.api_key = args.api_key  # one deployment per Serve replica process
        self.llm = ReplicaLLM.from_config(ReplicaConfig(engine=args.engine, parallel=args.parallel))
        app.state.private_paths = private_paths(self.llm.engine.config)
        self.engine = AsyncEngine(lambda: self.llm.engine, self.llm.rebuild, args.deployment.max_waiting_requests,
                                  probe=lambda: self.llm.health(timeout_s=HEALTH_PROBE_TIMEOUT_S),
                                  grammar_timeout_s=args.grammar_compile_timeout_s)
        self.metrics = ServerMetrics(lambda: self.llm.engine, self.llm.rank_info())
        self.tokenizer = self.llm.tokenizer
        # the most characters one token decodes to (a bound that makes a text's length a lower bound of its tokens)
        self._longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1) \
            if self.tokenizer is not None else 1
        app.state.max_body_bytes = args.max_body_bytes or default_body_limit(self.llm.engine.max_model_len)
        app.state.draining = False
        self._watcher = threading.Thread(target=self._watch_drain, name="dspark-drain", daemon=True)
        self._watcher.start()

    def _watch_drain(self) -> None:
        """Poll the app's drain flag; report what this replica still holds (see ``cluster.serve.drain``)."""
        context = serve.get_replica_context()
        app_name, replica = context.app_name, str(context.replica_id.unique_id)
        stopped = False
        while not self.engine.stopped:
            app.state.draining = drain.is_draining(app_name)
            if app.state.draining and not stopped and drain.is_stopping(app_name):
                stopped = True
                self.engine.stop_all("the server is stopping and its drain time ended before this request finished")
            drain.report(app_name, replica, self.engine.num_in_flight)
            time.sleep(drain.POLL_S)

    # ---- routes -------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> dict:
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        """OpenAI's model object, with vLLM's ``root`` (the name served) and ``max_model_len`` (clients size their
        prompts by it)."""
        return {"id": self.args.model_name, "object": "model", "created": 0, "owned_by": "dspark",
                "root": self.args.model_name, "max_model_len": self.llm.engine.max_model_len}

    @app.get("/version")
    async def version(self) -> dict:
        return {"version": importlib.metadata.version("dspark")}

    @app.post("/tokenize")
    async def tokenize(self, body: protocol.TokenizeRequest) -> dict:
        """vLLM's: ``{"count", "max_model_len", "tokens"}`` of a prompt or a chat."""
        if body.model is not None:
            self._check_model(body.model)
        if body.messages is not None:
            ids = await asyncio.to_thread(self._chat_prompt, body)
        else:
            ids = await asyncio.to_thread(self._encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.llm.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, body: protocol.DetokenizeRequest) -> dict:
        """vLLM's: ``{"prompt"}``, the tokens' text."""
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self._tokenizer("tokens")
        vocab = self.llm.engine.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(400, f"tokens must be ids in 0..{vocab - 1} (this model's vocabulary)", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(self) -> dict:
        """vLLM's: the tokenizer's class, special tokens, chat template and the longest sequence served (what
        lm-evaluation-harness's remote tokenizer reads)."""
        tokenizer = self._tokenizer(None)
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": self.llm.engine.max_model_len}

    @app.post("/v1/completions")
    async def completions(self, body: protocol.CompletionRequest, request: Request):
        self._check_model(body.model)
        sent = body.prompts()
        # tokenized off the event loop: a long prompt delays only itself, not every stream this replica serves
        prompts = [p if isinstance(p, list) else await asyncio.to_thread(self._encode, p) for p in sent]
        # echo: each prompt as sent (token ids: their text)
        echoes = [p if isinstance(p, str) else self._prompt_text(ids) for p, ids in zip(sent, prompts)] \
            if body.echo else None
        defaults = self.llm.engine.sampling_defaults
        # max_tokens unset: the model's max_new_tokens if it sets one, else OpenAI's 16
        budget = defaults["max_tokens"] if "max_tokens" in defaults and "max_tokens" not in body.model_fields_set \
            else body.max_tokens
        if "max_tokens" in body.model_fields_set:
            self._check_budget(prompts, budget, "max_tokens")
        return await self._respond(body, prompts, sampling_params(body, budget, defaults), "prompt", chat=False,
                                   echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: protocol.ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        if body.tool_call_mode() == "auto" and self.args.tool_call_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default when tools are given) needs a tool-call parser to '
                           "tell the model's calls from its text, and this server has none (dspark serve "
                           '--tool-call-parser hermes or llama3_json); pass tool_choice "required", "none" or '
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
        prompt = await asyncio.to_thread(self._chat_prompt, body)
        defaults, room = self.llm.engine.sampling_defaults, max(self.llm.engine.max_model_len - len(prompt), 1)
        # unset: the model's max_new_tokens if it sets one (within the context left), else the context left
        budget = body.token_budget(min(defaults.get("max_tokens", room), room))
        asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens" if body.max_tokens else None
        if asked is not None:
            self._check_budget([prompt], budget, asked)
        return await self._respond(body, [prompt], sampling_params(body, budget, defaults), "messages", chat=True)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 with every actor's rank, role, device and pid; 503 while the server drains (so balancers stop
        routing to it), while the replica rebuilds, after a rebuild failed, while the engine has not finished a
        step for ``stall_timeout_s`` (hung), or when an actor is dead or silent (the engine thread then rebuilds it
        within seconds)."""
        if getattr(app.state, "draining", False):
            return error_response(ApiError(503, "draining: the server is shutting down and admits no new requests",
                                           code="draining", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)}))
        if self.engine.recovering:
            return error_response(ApiError(503, "unhealthy: the replica is rebuilding", code="rebuilding",
                                           headers={"Retry-After": "5"}))
        if self.engine.recovery_failed is not None:
            return error_response(ApiError(503, f"unhealthy: rebuilding the replica failed: "
                                           f"{self.engine.recovery_failed}", code="unhealthy"))
        stalled = self.engine.stalled_s()
        if stalled > self.args.stall_timeout_s:
            return error_response(ApiError(503, f"unhealthy: the engine has not finished a step in {stalled:.1f} s "
                                           f"(stall_timeout_s {self.args.stall_timeout_s:g})", code="stalled"))
        try:
            ranks = await asyncio.to_thread(self.llm.health, HEALTH_PROBE_TIMEOUT_S)
        except (ReplicaFailure, RuntimeError) as exc:
            return error_response(ApiError(503, f"unhealthy: {exc}", code="unhealthy"))
        return JSONResponse({"status": "ok", "ranks": [{k: r[k] for k in ("rank", "role", "device", "pid")}
                                                       for r in ranks]})

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_health(self) -> None:
        """Serve's periodic check. A dead actor is rebuilt in place by the engine thread (within seconds, traffic or
        not), so only a failed rebuild is reported: then Serve replaces this whole replica."""
        if self.engine.recovery_failed is not None:
            raise RuntimeError(f"rebuilding the dspark replica failed: {self.engine.recovery_failed}")

    def __del__(self) -> None:
        engine, llm = getattr(self, "engine", None), getattr(self, "llm", None)
        if engine is not None:
            engine.shutdown()
        if llm is not None:
            llm.shutdown()

    # ---- helpers ------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.args.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.args.model_name!r}",
                           "model", "model_not_found")

    def _tokenizer(self, param: str | None):
        """The model's tokenizer, or a 400 (naming ``param``) for a model without one."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param)
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (in a worker thread); a text too long for the context by its length alone is refused
        before it is tokenized."""
        self._tokenizer("prompt")
        self._check_length(len(text), "prompt")
        check_unicode(text, "prompt")
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as exc:  # the tokenizer refused this text: the request's fault, nobody else's
            raise ApiError(400, f"the tokenizer cannot encode this prompt: {exc}", "prompt") from None

    def _check_budget(self, prompts: list[list[int]], budget: int, param: str) -> None:
        """A 400 (context_length_exceeded, as OpenAI and vLLM answer) where a prompt and the tokens the client asked
        for exceed the context: the engine would otherwise stop at the context's end, short of what was asked."""
        longest = max(len(p) for p in prompts)
        limit = self.llm.engine.max_model_len
        if longest < limit < longest + budget:  # (a prompt that alone fills the context: its own 400 names it)
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request asks for "
                           f"{longest + budget} ({longest} in the prompt, {budget} to generate): set {param} to at "
                           f"most {max(limit - longest, 0)}", param, "context_length_exceeded")

    def _check_length(self, chars: int, param: str) -> None:
        """A 400 (context_length_exceeded) for a text of ``chars`` characters that cannot fit the context whatever it
        says: every token is at most ``_longest_token`` characters, so it is at least chars / that many tokens."""
        least = chars // self._longest_token
        if least > self.llm.engine.max_model_len:
            raise ApiError(400, f"{param}: {chars} characters are at least {least} tokens, more than this model's "
                           f"context (max_model_len {self.llm.engine.max_model_len})", param,
                           "context_length_exceeded")

    def _chat_prompt(self, body) -> list[int]:
        """``body.messages`` through the chat template with the request's template options and tools (a chat
        request's or /tokenize's: both have them); a 400 naming what it cannot render. (In a worker thread.)"""
        self._check_length(sum(len(m.content) for m in body.messages if isinstance(m.content, str)), "messages")
        messages = [m.for_template() for m in body.messages]
        for i, message in enumerate(messages):
            for key in ("content", "name"):
                if key in message:
                    check_unicode(message[key], f"messages.{i}.{key}")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        refused = template_options_error(body.add_generation_prompt, body.continue_final_message,
                                         body.chat_template_kwargs, chat_template_of(self.tokenizer))
        if refused is not None:
            raise ApiError(400, f"{refused[0]}: {refused[1]}", refused[0])
        try:
            return chat_token_ids(self.tokenizer, messages, body.add_generation_prompt, tools,
                                  body.continue_final_message, body.chat_template_kwargs)
        except ValueError as exc:
            raise ApiError(400, f"{exc}; use /v1/completions", "messages") from None
        except Exception as exc:  # a template or tokenizer error about these messages
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", "messages") from None

    def _prompt_text(self, prompt: list[int]) -> str:
        """Token ids as text (without a tokenizer, each token's ``token_text``)."""
        if self.tokenizer is None:
            return "".join(responses.token_text(None, t) for t in prompt)
        return self.tokenizer.decode(prompt)

    async def _respond(self, body, prompts: list[list[int]], params, prompt_field: str, chat: bool,
                       echoes: list[str] | None = None):
        """Serve one request's prompts' samples, whole or streamed (choice ``p * n + i``: prompt p's sample i).
        ``echoes`` (a completion that echoes its prompts): each prompt's text, which its choices' text (and, with
        logprobs, their logprobs) start with."""
        for name, value in (("n", params.n), ("best_of", params.best_of or 0)):
            if value > self.args.max_n:
                raise ApiError(400, f"{name} must be at most {self.args.max_n} on this server (max_n), got {value}",
                               name)
        samples = sample_params(params)
        # a chat answer held to a tool call's schema: its text becomes the message's tool calls
        tool_mode = body.tool_call_mode() if chat else None
        most = self.args.deployment.max_waiting_requests
        if len(prompts) * len(samples) > most:  # could never be admitted at once: a 429 would be retried forever
            raise ApiError(400, f"{len(prompts)} prompts x {len(samples)} samples exceed the {most} requests this "
                           f"server queues (deployment.max_waiting_requests): send fewer prompts a request",
                           prompt_field)
        rid = responses.new_id("chatcmpl" if chat else "cmpl")
        arrival = time.monotonic()
        # n samples: n engine requests with their own seeds; the later ones wait for the first to compute the
        # prompt and start from its cached pages. A stream's outputs carry only each step's new tokens and logprobs;
        # a whole response needs only the finished output (no O(length) copy a step, no wake-up a step)
        kind = "delta" if body.stream else "final_only"
        ids = [f"{rid}/{i}" if len(prompts) == 1 else f"{rid}/{p}/{i}" for p in range(len(prompts))
               for i in range(len(samples))]  # (stream j: prompt j // samples, sample j % samples)
        streams = [self.engine.generate(prompt, dataclasses.replace(sample, output_kind=kind),
                                        ids[p * len(samples) + i], ids[p * len(samples)] if i else None, i)
                   for p, prompt in enumerate(prompts) for i, sample in enumerate(samples)]
        try:
            # validation errors surface here, before any byte is sent
            firsts = list(await gather_or_cancel(anext(s) for s in streams))
        except BaseException as exc:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            if isinstance(exc, ValueError):
                raise request_error(exc, prompt_field, body.structured_field()) from None
            if isinstance(exc, Overloaded):
                raise ApiError(429, f"server overloaded: {exc}; retry later", code="overloaded",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, Exception):
                raise failure(exc) from None
            raise
        timing = {"arrival": arrival, "first": first_token_time(firsts)}
        if body.stream:
            chunks = self._stream(body, rid, prompts, firsts, streams, chat, timing, echoes, params.skip_special_tokens)

            async def close() -> None:
                await chunks.aclose()
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

            return ClosingStreamingResponse(chunks, close, media_type="text/event-stream")

        async def last_of(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
            last = first
            async for out in outputs:
                last = out
            return last

        try:
            lasts = await gather_or_cancel(last_of(f, s) for f, s in zip(firsts, streams))
        except Exception as exc:
            raise failure(exc) from None
        finally:  # a cancelled handler (client gone) aborts its requests now, not at GC
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        timing["first"] = first_token_time(lasts)
        for last in lasts:
            self.metrics.observe(timing["arrival"], timing["first"], time.monotonic(), len(last.token_ids))
        # every sample drawn counts, best_of's discarded ones too
        usage = responses.usage(sum(len(p) for p in prompts), lasts)
        choice = responses.chat_choice if chat else responses.completion_choice
        choices, drawn, shown = [], len(samples), body.prompt_logprobs
        for p, prompt in enumerate(prompts):
            for out in best_samples(lasts[p * drawn:(p + 1) * drawn], params):
                entries = out.logprobs if echoes is None else self._echoed(prompt, out, out.logprobs, body.logprobs)
                choices.append(choice(p * params.n + out.index, out.text if echoes is None else echoes[p] + out.text,
                                      out.finish_reason, self._logprobs(entries, chat)))
                if shown is not None and not chat:  # vLLM's: each choice its prompt's
                    choices[-1]["prompt_logprobs"] = responses.prompt_logprobs_body(self.tokenizer,
                                                                                   out.prompt_logprobs, shown)
                if tool_mode is not None:
                    choices[-1]["message"], choices[-1]["finish_reason"] = responses.tool_message(
                        tool_mode, self._called(body), out.text, out.finish_reason, self._tool_parser()[0])
        build = responses.chat_body if chat else responses.completion_body
        response = build(rid, body.model, choices, usage)
        if shown is not None and chat:  # vLLM's: the chat's one prompt, beside the choices
            response["prompt_logprobs"] = responses.prompt_logprobs_body(self.tokenizer, lasts[0].prompt_logprobs, shown)
        return response

    def _tool_parser(self) -> tuple:
        """The server's tool-call parser (``ServeArgs.tool_call_parser``): (whole answer's, streamed answer's);
        (None, None) without one (``auto`` is then refused before any answer)."""
        return PARSER_KINDS.get(self.args.tool_call_parser, (None, None))

    @staticmethod
    def _called(body) -> str | None:
        """The named tool choice's function name (None for other requests)."""
        function = body.called_function() if isinstance(body, protocol.ChatCompletionRequest) else None
        return function.name if function is not None else None

    @staticmethod
    def _echoed(prompt: list[int], out: RequestOutput, entries, top: int):
        """``entries`` (an output's logprobs) after the echoed prompt's, ``top`` alternatives each (None when the
        request asked for no logprobs)."""
        if entries is None:
            return None
        return responses.echoed_prompt(prompt, out.prompt_logprobs, top) + entries

    def _logprobs(self, entries, chat: bool, text_offset: int = 0) -> dict | None:
        """The response's ``logprobs`` for ``entries`` (None when the request asked for none)."""
        if entries is None:
            return None
        if chat:
            return responses.chat_logprobs(self.tokenizer, entries)
        return responses.completion_logprobs(self.tokenizer, entries, text_offset)

    async def _stream(self, body, rid: str, prompts: list[list[int]], firsts: list[RequestOutput],
                      streams: list[AsyncIterator[RequestOutput]], chat: bool, timing: dict,
                      echoes: list[str] | None = None, skip_special_tokens: bool = True) -> AsyncIterator[str]:
        """Server-sent chunks of every sample as its steps commit tokens (``index`` says whose: stream j is choice
        j, prompt j // n's sample), an error event and ``[DONE]`` if anything fails, the usage chunk when asked for,
        then ``[DONE]``. ``echoes``: each sample's first chunk starts with its prompt's text (and its logprobs, which
        arrive with the first tokens). ``skip_special_tokens``: the requests' (their text streams as the engine
        decodes it)."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        n = len(streams)
        samples = n // len(prompts)  # each prompt's (a stream never draws more than it answers: no best_of)
        texts = [TextStream(self.tokenizer, body.stop, skip_special_tokens) for _ in range(n)]
        text_offsets, generated = [0] * n, [0] * n  # per sample: completion text its logprobs cover, tokens
        echoed = [False] * n  # per sample: its first chunk (the echoed prompt) was made
        prompt_tokens = sum(len(p) for p in prompts)
        lasts = list(firsts)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in streams[i]:
                    merged.put_nowait((i, out))
            except Exception as exc:  # forwarded to the stream's reader
                merged.put_nowait((i, exc))

        # a chat answer that may call tools streams as tool calls (ChatCompletionRequest.tool_call_mode)
        tool_mode = body.tool_call_mode() if chat else None
        calls = [responses.ToolCallDeltas(tool_mode, self._called(body),
                                         self._tool_parser()[1]() if tool_mode == "auto" else None)
                 for _ in range(n)] if tool_mode is not None else None

        def chunk(i: int, out: RequestOutput) -> str | None:
            if timing["first"] is None:
                timing["first"] = out.first_token_time
            generated[i] += len(out.token_ids)  # delta outputs: this step's tokens
            delta = texts[i].delta(out)
            reason = out.finish_reason if out.finished else None
            # each chunk carries the logprobs of the tokens committed since the last one (the delta output's):
            # concatenated, a sample's streamed logprobs are its non-streamed ones
            new = out.logprobs
            if echoes is not None and not echoed[i]:  # this sample's first chunk
                echoed[i], delta = True, echoes[i // samples] + delta
                new = self._echoed(prompts[i // samples], out, new, body.logprobs)
            logprobs = self._logprobs(new, chat, text_offsets[i]) if new else None
            if new:
                if not chat:
                    text_offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            message = {"content": delta}
            if calls is not None:
                message, reason = calls[i].delta(delta, reason)
            says = bool(message.get("content")) if "content" in message else bool(message)  # (text, or calls)
            if not (says or reason or logprobs):
                return None
            payload = responses.chat_chunk(rid, body.model, message, reason, logprobs, i) if chat \
                else responses.completion_chunk(rid, body.model, delta, reason, logprobs, i)
            if body.continuous_usage:
                payload["usage"] = responses.usage(prompt_tokens, lasts, generated)
            return sse(payload)

        pumps = [asyncio.create_task(pump(i)) for i in range(n) if not firsts[i].finished]
        try:
            if chat:
                for i in range(n):
                    yield sse(responses.chat_chunk(rid, body.model, {"role": "assistant", "content": ""}, None,
                                                  index=i))
            for i, first in enumerate(firsts):
                text = chunk(i, first)
                if text:
                    yield text
            while not all(last.finished for last in lasts):
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                lasts[i] = item
                text = chunk(i, item)
                if text:
                    yield text
        except Exception as exc:  # an error event and [DONE]: a stream never just stops
            err = failure(exc)
            yield sse(responses.error_body(err.status, redact(err.message), err.param, err.code))
            yield "data: [DONE]\n\n"
            return
        finally:  # a client that disconnected aborts its requests (frees their pages) right away
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        for count in generated:
            self.metrics.observe(timing["arrival"], timing["first"], time.monotonic(), count)
        if body.include_usage:
            yield sse(responses.usage_chunk(rid, body.model, kind, responses.usage(prompt_tokens, lasts, generated)))
        yield "data: [DONE]\n\n"


DSparkDeployment = serve.deployment(name="dspark")(serve.ingress(app)(DSparkServer))


def build_app(args: dict | ServeArgs):
    """The Serve application for ``args`` (a dict validated as ``configs.ServeArgs``); usable as a KubeRay
    RayService ``import_path: cluster.serve:build_app``."""
    parsed = args if isinstance(args, ServeArgs) else validate(ServeArgs, args, "serve args")
    d = parsed.deployment
    # Serve-native placement: the deployment declares each replica's bundles (the replica itself, then its shards
    # and drafter), so Serve's scheduler and autoscaler see the GPUs; the replica's actors go into that group
    plan = serve_plan(parsed)
    parsed = parsed.model_copy(update={"parallel": parsed.parallel.model_copy(
        update={"placement_group": "enclosing"})})
    options = dict(max_ongoing_requests=d.max_ongoing_requests, max_queued_requests=d.max_queued_requests,
                   graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
                   health_check_period_s=d.health_check_period_s, health_check_timeout_s=d.health_check_timeout_s,
                   ray_actor_options=dict(d.ray_actor_options),
                   placement_group_bundles=groups.serve_bundles(plan, d.ray_actor_options),
                   placement_group_strategy=plan.strategy)
    if d.autoscaling is not None:
        options["autoscaling_config"] = d.autoscaling.model_dump()
    else:
        options["num_replicas"] = d.num_replicas
    return DSparkDeployment.options(**options).bind(parsed)
