"""``LLM``: offline batched generation in one process (the engine's simplest driver)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from configs import DSparkDecodingConfig, LLMConfig, validate
from runtime.engine.chat import chat_token_ids
from runtime.engine.core import Engine
from runtime.engine.outputs import RequestOutput
from runtime.models.hub import resolve_hub_ids
from runtime.sampling.sampling_params import SamplingParams

Prompts = Seq[str] | Seq[Seq[int]] | Seq[dict]  # text, token ids, or vLLM's {"prompt"} / {"prompt_token_ids"}


def per_prompt_params(num_prompts: int, sampling_params: SamplingParams | Seq[SamplingParams] | None,
                      default: SamplingParams | None = None) -> list:
    """One SamplingParams per prompt: ``sampling_params`` (one for all, or one each), or ``default`` (the engine's
    ``default_sampling_params``: the model's defaults) when None."""
    params = sampling_params if sampling_params is not None else (default or SamplingParams())
    per_prompt = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != num_prompts:
        raise ValueError(f"sampling_params has {len(per_prompt)} entries for {num_prompts} prompts")
    return per_prompt


def token_ids(engine: Engine, prompt: str | Seq[int] | dict) -> list[int]:
    """A prompt's token ids: text (tokenized with the model's tokenizer), token ids, or vLLM's prompt dicts
    (``TextPrompt`` ``{"prompt": text}``, ``TokensPrompt`` ``{"prompt_token_ids": ids}``; no other keys)."""
    if isinstance(prompt, dict):
        if len(prompt) != 1 or not ({"prompt", "prompt_token_ids"} & set(prompt)):
            raise ValueError(f"a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids', got "
                             f"{sorted(prompt)}")
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"a prompt dict's value must be text or a list of token ids, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("string prompts need a tokenizer; the model directory has none (pass token ids)")
        return list(engine.tokenizer(prompt)["input_ids"])
    return list(prompt)


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The per-sample params of a request for ``params.n`` samples (``best_of`` of them when set): n = 1 each,
    sample i seeded ``seed + i`` (each its own noise stream; unseeded samples get their own random seeds);
    with ``best_of``, every sample computes its logprobs (``best_samples`` ranks them). Greedy samples are
    identical."""
    drawn = params.best_of or params.n
    if drawn == 1:
        return [params]
    ranked = params.best_of is not None and params.best_of > params.n
    return [dataclasses.replace(params, n=1, best_of=None, seed=None if params.seed is None else params.seed + i,
                                logprobs=params.logprobs if params.logprobs is not None or not ranked else 0)
            for i in range(drawn)]


def best_samples(outputs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The ``params.n`` of one prompt's finished samples to return: all of them in order, or with ``best_of`` the
    n whose tokens have the highest summed logprob, best first, re-indexed (logprobs dropped unless asked for)."""
    if params.best_of is None or params.best_of == params.n:
        return outputs
    ranked = sorted(outputs, key=lambda o: -sum(e.logprob for e in o.logprobs or []))[:params.n]
    keep = params.logprobs is not None
    return [dataclasses.replace(o, index=i, logprobs=o.logprobs if keep else None) for i, o in enumerate(ranked)]


def rank_info(engine: Engine) -> list[dict]:
    """One dict per process of the replica (``Worker.info``); with confidence scheduling, target rank 0's also has
    the engine's step-time model as it stands: the verify steps' table (profiled or loaded, then learned from every
    such step served), the mixed steps' excess over it (learned from the steps that fed more than verifies) and,
    where plain steps were profiled, the plain mixed steps' excess (a drafting hold's steps with prompt chunks)."""
    infos = engine.executor.describe()
    if engine.confidence is not None:
        leader = next((i for i in infos if i.get("role") == "target" and i.get("tp_rank") == 0), None)
        if leader is not None:
            costs = engine.confidence.costs
            leader["confidence_cost_table"] = {**costs.to_json(), "observations": costs.observations}
            leader["confidence_mixed_step_costs"] = engine.confidence.mixed_costs.to_json()
            if engine.confidence.plain_mixed is not None:  # (a drafting hold's mixed steps: the plain alternative)
                leader["confidence_plain_mixed_step_costs"] = engine.confidence.plain_mixed.to_json()
    return infos


def generate(engine: Engine, prompts: Prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
    """Queue every prompt (all or none: a bad one aborts those already queued), step until all finish. A prompt
    asking for ``n`` samples yields n outputs in a row (``index`` 0..n-1); its samples share its prefill.
    ``use_tqdm``: a progress bar of the requests finished (vLLM's option; on stderr)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    params = per_prompt_params(len(prompts), sampling_params, engine.default_sampling_params())
    ids, groups = [], []  # groups: per prompt, the request ids of its samples
    try:
        for prompt, p in zip(prompts, params):
            ids_of_prompt, group = token_ids(engine, prompt), []
            groups.append(group)
            for i, sample in enumerate(sample_params(p)):
                sample = dataclasses.replace(sample, output_kind="final_only")  # no per-step snapshots to copy
                group.append(engine.add_request(ids_of_prompt, sample, follows=group[0] if group else None, index=i))
                ids.append(group[-1])
    except Exception:
        for request_id in ids:
            engine.abort(request_id)
        raise
    finished: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
        while len(finished) < len(ids):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update()
    return [out for group, p in zip(groups, params) for out in best_samples([finished[i] for i in group], p)]


def chat_prompts(engine: Engine, messages, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """vLLM's ``LLM.chat`` input: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them ->
    each one's prompt token ids through the model's chat template (with ``tools``, OpenAI's function definitions,
    where the template renders them; the options as ``runtime.engine.chat.chat_token_ids`` takes them). A model without a
    chat template, a malformed conversation or options that do not go together are a ``ValueError`` naming
    ``messages``."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages or [])
    if not conversations or not all(isinstance(c, list) and c and all(isinstance(m, dict) and "role" in m for m in c)
                                    for c in conversations):
        raise ValueError("messages: one conversation (a non-empty list of {\"role\", \"content\"} dicts) or a "
                         "non-empty list of them")
    try:
        return [chat_token_ids(engine.tokenizer, c, add_generation_prompt, tools, continue_final_message,
                               chat_template_kwargs) for c in conversations]
    except ValueError as exc:
        raise ValueError(f"messages: {exc}") from None


class LLM:
    """Generate with a target model, speculatively when ``speculative_config`` names a DSpark drafter.

    Keyword arguments are the fields of ``configs.LLMConfig`` (``dtype``, ``device``, ``max_model_len``,
    ``page_size``, ``num_pages`` or ``kv_cache_memory``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``moe_backend``, ``kernel_backend``, ``seed``); a bad one raises ``configs.ConfigError`` naming it.
    """

    def __init__(self, model: str, speculative_config: DSparkDecodingConfig | dict | None = None, **kwargs):
        config = validate(LLMConfig, {"model": str(model), "speculative_config": speculative_config, **kwargs}, "LLM")
        self.config = resolve_hub_ids(config)  # Hub ids -> local snapshots, once
        self.engine = Engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings (tokenized with the target's tokenizer), token-id
        lists or vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``); ``sampling_params`` is
        one for all or one per prompt; ``use_tqdm`` shows the requests finishing (vLLM's option, off here: a library
        call prints nothing unasked)."""
        return generate(self.engine, prompts, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one output per conversation (one, or a list of them), each rendered by the model's
        chat template (``chat_prompts``) and generated as ``generate`` does."""
        return generate(self.engine, chat_prompts(self.engine, messages, tools, add_generation_prompt,
                                                  continue_final_message, chat_template_kwargs), sampling_params,
                        use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams (vLLM's name): the model's
        generation_config.json defaults (``generation_config`` auto) over the engine's own."""
        return self.engine.default_sampling_params()

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def rank_info(self) -> list[dict]:
        return rank_info(self.engine)

    def shutdown(self) -> None:
        """Abort whatever is in flight and release the models' memory (the engine's executor); idempotent."""
        self.engine.abort_all()
        self.engine.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
