"""OpenAI-compatible request models, response builders and the error shape.

Requests are validated strictly: a parameter we do not implement is refused with a 400 naming it,
never silently ignored. Beyond OpenAI's fields we accept vLLM's common extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``). Tool calls (``tools``,
``tool_choice`` named, ``required`` or ``none``) are answers held to a JSON schema
(``ChatCompletionRequest.tool_schema``) and shaped as OpenAI's calls (``tool_message``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from runtime.sampling.sampling_params import (MAX_BAD_WORDS, MAX_INT32, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP,
                                              MAX_STOP_CHARS, SamplingParams, StructuredOutputs)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # vLLM's: every chunk also carries the usage so far (the request's prompts and the tokens streamed until then)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the output must fit (``strict`` is how it is enforced
    anyway: a grammar allows only fitting tokens)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (anything), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is given with type json_schema, and only then")
        return self

    def structured_outputs(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=json.dumps(self.json_schema.json_schema))
        return None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` request field: exactly one of ``json`` (a JSON schema, as an object or as text),
    ``json_object`` true, ``regex``, ``choice`` (the answer is one of these strings) or ``grammar`` (EBNF)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None

    def structured_outputs(self) -> StructuredOutputs:
        """-> the engine's ``StructuredOutputs`` (``ValueError`` naming ``SamplingParams.structured_outputs`` where
        not exactly one is given or one is malformed)."""
        schema = self.json_schema if self.json_schema is None or isinstance(self.json_schema, str) \
            else json.dumps(self.json_schema)
        return StructuredOutputs(json=schema, json_object=bool(self.json_object), regex=self.regex,
                                 choice=tuple(self.choice) if self.choice is not None else None, grammar=self.grammar)


# what asks for structured outputs, each a field of its own; a request gives at most one (the guided_* fields are
# vLLM's older names, still sent by many clients)
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def structured_given(values: dict, names=STRUCTURED_FIELDS) -> list[str]:
    """Of ``names``, the structured-output fields ``values`` (a request's fields by name) sets: a response_format of
    type text holds the answer to nothing."""
    return [name for name in names if values.get(name) is not None
            and not (name == "response_format" and values[name].type == "text")]


class SamplingFields(BaseModel):
    """The sampling parameters both endpoints share. Strict types: ``true`` is not 1, ``"yes"`` is not true,
    ``1e30`` is not an integer; every integer is bounded (``MAX_INT32``) so nothing overflows inside a step."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)] \
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)] \
        | None = None
    seed: Annotated[int, Field(ge=-MAX_INT32 - 1, le=MAX_INT32)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(max_length=MAX_STOP)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] = 0  # vLLM's: no stop before this many tokens
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    # OpenAI's: {token id as a string: a value in [-100, 100]} added to those tokens' logits
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's: only these tokens may be drawn
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(min_length=1)] | None = None
    # vLLM's: words the output must not contain (runtime.sampling.bad_words)
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: each prompt token's logprob, rank and this many most likely alternatives (``prompt_logprobs_body``)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def prompt_logprobs_are_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs cannot be streamed (as in vLLM): ask without stream")
        return v

    @field_validator(*STRUCTURED_FIELDS[1:])
    @classmethod
    def one_structured_output(cls, v, info: ValidationInfo):
        earlier = structured_given(info.data, STRUCTURED_FIELDS[:STRUCTURED_FIELDS.index(info.field_name)])
        if v is not None and earlier:
            raise ValueError(f"give one of {', '.join(STRUCTURED_FIELDS)}; this request also gives {earlier[0]}")
        return v

    def structured(self) -> StructuredOutputs | None:
        """What the request holds its answer to (one of ``STRUCTURED_FIELDS``), as the engine's
        ``StructuredOutputs``; None: nothing."""
        if self.response_format is not None:
            return self.response_format.structured_outputs()
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_outputs()
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        given = {k: v for k, v in guided.items() if v is not None}
        return StructuredOutputsRequest(**given).structured_outputs() if given else None

    def structured_field(self) -> str:
        """The field that asked for structured outputs (what an error about them names)."""
        return next(iter(structured_given(dict(self))), "response_format")

    @field_validator("logit_bias")
    @classmethod
    def logit_bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        for key in v:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT32):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers in 0..{MAX_INT32}), got {key!r}")
        return v

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the model's, ``Engine.sampling_defaults``) fill the
        sampling fields the request left unset (``max_tokens``: the caller's)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        unset = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        chosen = {name: unset.get(name, getattr(self, name))
                  for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, **chosen,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              seed=self.seed, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, logprobs=self.logprob_count(), n=self.n,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              best_of=self.samples_drawn(), prompt_logprobs=self.prompt_logprob_count(),
                              logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                              structured_outputs=self.structured(),
                              allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids else None,
                              bad_words=tuple(self.bad_words or ()))

    def logprob_count(self) -> int | None:
        """How many alternatives per token the request's logprobs ask for; None: no logprobs."""
        return None

    def samples_drawn(self) -> int | None:
        """best_of: how many samples to draw for the n answered; None: n (chat has no best_of)."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """How many alternatives per prompt token the engine computes; None: no prompt logprobs (``prompt_logprobs``
        asks for them, and a completion that echoes its prompt with logprobs)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(min_length=1)]
Prompts = Annotated[list[str], Field(min_length=1)] | Annotated[list[PromptIds], Field(min_length=1)]  # a batch


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them (OpenAI's four forms): choice p * n + i is prompt p's
    # sample i
    prompt: str | PromptIds | Prompts
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] = 16
    echo: bool = False  # the choice's text (and logprobs) start with the prompt's
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @field_validator("best_of")
    @classmethod
    def best_of_covers_n_and_is_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < info.data.get("n", 1):
            raise ValueError(f"best_of ({v}) must be at least n ({info.data.get('n', 1)})")
        if v is not None and v > info.data.get("n", 1) and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed (the best samples are known only at the end)")
        return v

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each text or token ids (a single prompt: a batch of one)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def samples_drawn(self) -> int | None:
        return self.best_of

    def prompt_logprob_count(self) -> int | None:
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None  # (each shown with its own count: echoed_prompt, prompt_logprobs_body)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A tool call an assistant message made (OpenAI's shape), sent back in a later request's history."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # an assistant message that made tool calls may have none
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="after")
    def content_and_tool_fields_fit_the_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only a tool message has it")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: the fields set, a tool call's JSON arguments as an object (as
        models' templates render them; text that is no JSON object stays text)."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls", ()):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                continue
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None  # (the arguments are held to the schema either way: a grammar allows nothing else)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: ToolChoiceFunction


MAX_TOOLS = 128  # functions a request may offer
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the chat template's generation prompt, the last (assistant) message continued instead, and more
    # variables for the template (e.g. Qwen3's enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def each_tool_once(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"each function name once, got {names}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def tool_choice_names_an_offered_tool(cls, v, info: ValidationInfo):
        tools = info.data.get("tools")
        names = [t.function.name for t in tools or ()]
        if v is not None and v != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"tool_choice names {v.function.name!r}, which tools do not offer ({names})")
        forms = structured_given(info.data)
        if tools and v != "none" and forms:
            raise ValueError(f"tool calls and {forms[0]} each fix the answer's form: give one of them")
        return v

    def structured_field(self) -> str:
        return "tool_choice" if self.tool_schema() is not None else super().structured_field()

    def tool_call_mode(self) -> str | None:
        """How the answer may call tools: None (no tools, or ``tool_choice`` none), ``named`` (that function,
        once), ``required`` (one or more of the tools), ``auto`` (OpenAI's default with tools: text or calls)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def called_function(self) -> FunctionDefinition | None:
        """The named tool choice's function."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)

    def tool_schema(self) -> dict | None:
        """The JSON schema the answer is held to under ``tool_call_mode``: the named function's arguments, or for
        ``required`` an array of {name, parameters} calls of the offered functions (one call unless
        ``parallel_tool_calls``); None otherwise."""
        mode = self.tool_call_mode()
        if mode == "named":
            return self.called_function().parameters or {"type": "object"}
        if mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        return {"type": "array", "minItems": 1, **({} if self.parallel_tool_calls else {"maxItems": 1}),
                "items": {"anyOf": calls}}

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, defaults)
        if self.tool_call_mode() == "auto":  # a parser reads the calls from the text: their tags must be in it
            return dataclasses.replace(params, skip_special_tokens=False)
        schema = self.tool_schema()
        if schema is None:
            return params
        return dataclasses.replace(params, structured_outputs=StructuredOutputs(json=json.dumps(schema)))

    @field_validator("top_logprobs")
    @classmethod
    def top_logprobs_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self, default: int) -> int:
        """max_completion_tokens, else max_tokens, else ``default``."""
        return self.max_completion_tokens or self.max_tokens or default


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt's token ids (``add_special_tokens`` as the completions endpoint encodes:
    True), or a chat's through the chat template with chat completions' template options (``add_generation_prompt``
    True, ``continue_final_message``, ``chat_template_kwargs``, ``tools``): the ids a chat request would feed."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None

    @model_validator(mode="after")
    def prompt_or_messages(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either prompt or messages")
        if self.messages is None and (self.tools or self.continue_final_message or self.chat_template_kwargs):
            raise ValueError("tools, continue_final_message and chat_template_kwargs go with messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize``: token ids as text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_INT32)]]


# ---- responses ------------------------------------------------------------------------------
