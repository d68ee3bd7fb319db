"""Chat prompts: the tokenizer's own chat template, with the generation prompt appended."""

from __future__ import annotations

import functools

import jinja2
import jinja2.meta


# template variables set through options of their own, never through template_kwargs
TEMPLATE_FIELDS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                             "chat_template"})


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (besides those it sets itself)."""
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def template_options_error(add_generation_prompt: bool, continue_final_message: bool,
                           template_kwargs: dict | None, template: str | None = None) -> tuple[str, str] | None:
    """(the option, what is wrong) where ``chat_token_ids``'s options do not go together; None where they do.
    ``template_kwargs`` may set only variables ``template`` reads (never the tokenizer's options, such as
    ``truncation`` or ``max_length``, which would change the prompt behind the client's back)."""
    if continue_final_message and add_generation_prompt:
        return "continue_final_message", "it continues the last message: it needs add_generation_prompt false"
    clash = sorted(TEMPLATE_FIELDS & set(template_kwargs or {}))
    if clash:
        return "chat_template_kwargs", f"may not set {clash} (options of their own)"
    if template_kwargs and template is not None:
        known = template_variables(template) - TEMPLATE_FIELDS
        unknown = sorted(set(template_kwargs) - known)
        if unknown:
            return "chat_template_kwargs", (f"{unknown} are not variables of this model's chat template; it reads "
                                            f"{sorted(known) or 'none'}")
    return None


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's default chat template (a dict of named templates: its "default")."""
    template = getattr(tokenizer, "chat_template", None)
    return template.get("default") if isinstance(template, dict) else template


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None, continue_final_message: bool = False,
                   template_kwargs: dict | None = None) -> list[int]:
    """messages (``{"role", "content"}`` dicts) -> the prompt's token ids, ready for the assistant's turn (unless
    ``add_generation_prompt`` is False: the messages alone). ``tools``: OpenAI's function definitions, which the
    template renders as the model was trained to see them (a template without tools ignores them).
    ``continue_final_message``: the last message (an assistant's) is left open for the answer to continue (vLLM's
    and transformers' option; not with ``add_generation_prompt``). ``template_kwargs``: more variables for the
    template (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``): only variables the template reads.

    Raises ValueError when the model has no tokenizer or its tokenizer has no chat template, or for
    ``continue_final_message`` with ``add_generation_prompt``."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    refused = template_options_error(add_generation_prompt, continue_final_message, template_kwargs,
                                     chat_template_of(tokenizer))
    if refused is not None:
        raise ValueError(f"{refused[0]}: {refused[1]}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        continue_final_message=continue_final_message,
                                        **({"tools": tools} if tools else {}), **(template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers
