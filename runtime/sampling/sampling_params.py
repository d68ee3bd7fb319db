"""``SamplingParams``: per-request decoding settings (vLLM's names), validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_INT32 = 2**31 - 1  # bound of every integer parameter: token counts, top_k and token ids fit a device int32
MAX_LOGPROBS = 20  # most alternatives ``logprobs`` may ask for per token (OpenAI's top_logprobs bound)
MAX_N = 128  # most samples ``n`` may ask for per prompt (OpenAI's bound; servers configure a lower one)
MAX_LOGIT_BIAS = 1024  # most tokens ``logit_bias`` may bias per request
MAX_BAD_WORDS = 128  # most words ``bad_words`` may ban per request
MAX_STOP = 128  # most ``stop`` strings (each checked against every step's text) and ``stop_token_ids`` per request
MAX_STOP_CHARS = 1024  # the longest ``stop`` string
MAX_CHOICES = 1024  # most strings ``StructuredOutputs.choice`` may choose among
MAX_STRUCTURED_CHARS = 65_536  # a schema, regex or grammar, or all of a choice's strings: what a grammar is built from
SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (vLLM's rule): 1/T would overflow the logits
OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind, lower-cased


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What a request's output must be (vLLM's ``StructuredOutputsParams``): ``json``, a JSON schema (as text);
    ``json_object`` True, any JSON object; ``regex``, text matching a regular expression; ``choice``, exactly one
    of these strings; ``grammar``, an EBNF grammar (xgrammar's GBNF dialect, ``root ::= ...``). Exactly one;
    enforced by xgrammar (``runtime.sampling.grammar``), which also refuses a regex or grammar it cannot compile."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [self.json is not None, self.json_object is True, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if not isinstance(self.json_object, bool) or sum(given) != 1:
            raise ValueError("SamplingParams.structured_outputs must give exactly one of json (a JSON schema), "
                             "json_object=True, regex, choice or grammar")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value and _encodable(value)):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and not (0 < len(self.choice) <= MAX_CHOICES and all(
                isinstance(c, str) and c and _encodable(c) for c in self.choice)):
            raise ValueError(f"SamplingParams.structured_outputs.choice must be 1..{MAX_CHOICES} non-empty strings")
        size = sum(len(v) for v in (self.json, self.regex, self.grammar) if isinstance(v, str)) + \
            sum(len(c) for c in self.choice or () if isinstance(c, str))
        if size > MAX_STRUCTURED_CHARS:
            field = next(n for n in ("json", "regex", "grammar", "choice") if getattr(self, n) is not None)
            raise ValueError(f"SamplingParams.structured_outputs.{field} is {size:,} characters; at most "
                             f"{MAX_STRUCTURED_CHARS:,} compile into a grammar")
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else None
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise ValueError("SamplingParams.structured_outputs.json must be a JSON schema object, as text")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request decodes.

    ``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy. ``top_k`` 0 or -1, ``top_p`` 1 and
    ``min_p`` 0 disable their filters; a ``top_k`` above the vocabulary keeps every token. Every integer is
    at most ``MAX_INT32`` and every float finite, so no value can overflow inside a step. Penalties follow
    vLLM: ``repetition_penalty`` divides positive / multiplies negative logits of every token seen in the
    prompt or output; ``presence_penalty`` and ``frequency_penalty`` subtract from output tokens' logits.
    ``stop`` strings end the output before the string; ``stop_token_ids`` and EOS (unless ``ignore_eos``) end
    it after the token. ``min_tokens`` (vLLM's field, at most ``max_tokens``): until that many tokens are out, the
    stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are never drawn (their logits are -inf) and
    stop strings do not end the output. ``include_stop_str_in_output`` keeps the stop string that ended the output
    in its text; ``skip_special_tokens`` False keeps special tokens in the text (and in what stop strings are looked
    for in). ``logit_bias`` ({token id: value in [-100, 100]}, OpenAI's field) is added to those tokens'
    logits before penalties, temperature and filters (-100 all but bans a token, +100 all but forces it); the
    engine checks the ids against its vocabulary. ``allowed_token_ids`` (vLLM's field) lets only those tokens be
    drawn (every other logit -inf; the stop tokens too, unless listed). ``bad_words`` (vLLM's field, at most
    ``MAX_BAD_WORDS`` non-empty strings) are never generated: where the output so far ends with all of a word's tokens
    but the last, that last one is banned (``runtime.sampling.bad_words``). ``structured_outputs`` (``StructuredOutputs``)
    holds the output to a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar: at each
    position only the tokens the grammar allows can be drawn, and the output ends ("stop") once the grammar is
    complete. ``logprobs`` N (0..``MAX_LOGPROBS``) returns, for every generated token, its log-probability and the N
    most likely tokens' (the engine's ``logprobs_mode`` says of which distribution); None returns none. ``prompt_logprobs`` N (vLLM's field, 0..``MAX_LOGPROBS``) returns, for every prompt token
    after the first, its log-probability under the target given the tokens before it and the N most likely tokens'
    (always the raw distribution: no temperature, filter or penalty applies to a prompt; the first token has none,
    so ``RequestOutput.prompt_logprobs[0]`` is None); its rows are computed, never taken from the prefix cache.
    ``n`` samples of one prompt decode as ``n`` requests that share its prefill
    (``runtime.engine.llm.sample_params``: sample i has seed ``seed + i``, or its own random seed); with ``best_of``
    (>= n), that many are drawn and the n with the highest log-probability (the sum of their tokens' raw
    logprobs) are returned, best first. ``output_kind`` (vLLM's ``RequestOutputKind``) says what the engine's
    per-step outputs of the request hold: ``"cumulative"`` every token so far (a copy of the whole list each step),
    ``"delta"`` only the tokens (and logprobs) this step committed, so that concatenating the outputs gives the
    cumulative one (``text`` stays "" until the last output, which has all of it), ``"final_only"`` one output, when
    the request finishes. ``LLM.generate`` returns finished outputs whatever it says (and asks for final_only).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, value), ids ascending
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        bias = self.logit_bias or ()
        if isinstance(bias, dict):  # (a dict as given: kept sorted by id, as a tuple of pairs: params stay hashable)
            bias = sorted(bias.items(), key=lambda item: item[0] if _integer(item[0]) else -1)
        if isinstance(bias, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in bias):
            object.__setattr__(self, "logit_bias", tuple((t, v) for t, v in bias))
        checks = [
            ("max_tokens", _integer(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32,
             f"an integer in 1..{MAX_INT32}"),
            ("min_tokens", _integer(self.min_tokens) and 0 <= self.min_tokens <= max(self.max_tokens, 0)
             if _integer(self.max_tokens) else False, "an integer in 0..max_tokens"),
            ("temperature", _number(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _integer(self.top_k) and -1 <= self.top_k <= MAX_INT32,
             f"-1 or 0 (disabled) or an integer in 1..{MAX_INT32}"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", _number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", _number(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
             "in [0.01, 100]"),
            ("presence_penalty", _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or (_integer(self.seed) and -MAX_INT32 - 1 <= self.seed <= MAX_INT32),
             f"None or an integer in {-MAX_INT32 - 1}..{MAX_INT32}"),
            ("stop", len(self.stop) <= MAX_STOP and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                        and _encodable(s) for s in self.stop),
             f"at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters of valid Unicode (no lone "
             "surrogates)"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP
             and all(_integer(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
             f"at most {MAX_STOP} token ids in 0..{MAX_INT32}"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a boolean"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "a boolean"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "a boolean"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                isinstance(self.allowed_token_ids, tuple) and 0 < len(self.allowed_token_ids) <= MAX_LOGIT_BIAS
                and all(_integer(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids)),
             f"None or 1..{MAX_LOGIT_BIAS} token ids in 0..{MAX_INT32}"),
            ("bad_words", isinstance(self.bad_words, tuple) and len(self.bad_words) <= MAX_BAD_WORDS
             and all(isinstance(w, str) and w.strip() and _encodable(w) for w in self.bad_words),
             f"at most {MAX_BAD_WORDS} strings, each with something besides whitespace (valid Unicode)"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputs), "None or a StructuredOutputs"),
            ("logit_bias", _logit_bias(self.logit_bias),
             f"a mapping of at most {MAX_LOGIT_BIAS} distinct token ids (0..{MAX_INT32}) to numbers in [-100, 100]"),
            ("logprobs", self.logprobs is None or (_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or an integer in 0..{MAX_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_integer(self.prompt_logprobs)
                                                                 and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"None or an integer in 0..{MAX_LOGPROBS}"),
            ("n", _integer(self.n) and 1 <= self.n <= MAX_N, f"an integer in 1..{MAX_N}"),
            ("best_of", self.best_of is None or (_integer(self.best_of) and _integer(self.n)
                                                 and self.n <= self.best_of <= MAX_N),
             f"None or an integer in n..{MAX_N}"),
            ("output_kind", self.output_kind in OUTPUT_KINDS, f"one of {list(OUTPUT_KINDS)}"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0 and not self.greedy

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1 and not self.greedy

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0 and not self.greedy

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _number(x: object) -> bool:
    """A real number that is finite as a float (huge ints and inf/nan are not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _logit_bias(bias: object) -> bool:
    """(token id, value) pairs of distinct ids, each value a finite number in [-100, 100]."""
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        return False
    if not all(isinstance(x, tuple) and len(x) == 2 and _integer(x[0]) and 0 <= x[0] <= MAX_INT32 and _number(x[1])
               and -100 <= x[1] <= 100 for x in bias):
        return False
    return len({t for t, _ in bias}) == len(bias)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
