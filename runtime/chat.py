"""Chat prompts: the tokenizer's own chat template, with the generation prompt appended."""

from __future__ import annotations


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> list[int]:
    """messages (``{"role", "content"}`` dicts) -> the prompt's token ids, ready for the assistant's turn (unless
    ``add_generation_prompt`` is False: the messages alone). ``tools``: OpenAI's function definitions, which the
    template renders as the model was trained to see them (a template without tools ignores them).

    Raises ValueError when the model has no tokenizer or its tokenizer has no chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers
