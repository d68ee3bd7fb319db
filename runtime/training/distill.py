"""Self-distillation (the target writes the drafter's training answers) and acceptance evaluation."""

from __future__ import annotations

import json
import random
from pathlib import Path

from configs import DSparkDecodingConfig
from runtime.engine.chat import chat_token_ids
from runtime.engine.llm import LLM
from runtime.sampling.sampling_params import SamplingParams


def code_prompts(files: list[Path], tokenizer, count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``prompt_tokens`` tokens, starting at random line starts of random files."""
    rng = random.Random(seed)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    line_starts: dict[int, list[int]] = {}  # per file, computed once
    prompts: list[list[int]] = []
    while len(prompts) < count:
        index = rng.choice(range(len(texts)))  # the same draw as rng.choice(texts)
        text = texts[index]
        if index not in line_starts:
            line_starts[index] = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        at = rng.choice(line_starts[index])
        ids = tokenizer(text[at:at + 8 * prompt_tokens], add_special_tokens=False)["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts


def dataset_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Prompts from a JSONL file (the first ``limit`` rows), one per row, as token ids:

    ``{"prompt_ids": [...]}`` as given; ``{"prompt": "text"}`` tokenized as the engine tokenizes text;
    ``{"messages": [{"role", "content"}, ...]}`` rendered with the tokenizer's chat template, trailing
    assistant turns dropped (they are the answers the target rewrites). A bad row raises ValueError naming
    its line.
    """
    path = Path(path)
    prompts: list[list[int]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if line.strip():
            prompts.append(row_prompt(line, tokenizer, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def row_prompt(line: str, tokenizer, where: str) -> list[int]:
    """One JSONL row of ``dataset_prompts`` -> its prompt's token ids."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict) or not {"prompt_ids", "prompt", "messages"} & row.keys():
        raise ValueError(f"{where}: each row needs 'prompt_ids' (token ids), 'prompt' (text) or 'messages' "
                         "(a chat: [{'role', 'content'}, ...])")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        return list(ids)
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be non-empty text")
        return list(tokenizer(row["prompt"])["input_ids"])
    messages = row["messages"]
    if not (isinstance(messages, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                               for m in messages)):
        raise ValueError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError(f"{where}: 'messages' holds no turn before the assistant's")
    try:
        return chat_token_ids(tokenizer, messages)
    except ValueError as exc:
        raise ValueError(f"{where}: 'messages' needs a chat template, and {exc}") from None


def regenerate(llm, prompts: list[list[int]], out: str | Path, max_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> int:
    """Answer every prompt with the target itself (``llm``: a ``runtime.LLM`` or ``cluster.LLM`` over it);
    write JSONL rows of exact token ids (an answer that ended on EOS keeps it). Returns rows written."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    with Path(out).open("w", encoding="utf-8") as f:
        for prompt, o in zip(prompts, outs):
            f.write(json.dumps({"prompt_ids": list(prompt), "response_ids": o.token_ids,
                                "finished": o.finish_reason == "stop"}) + "\n")
    return len(outs)


def evaluate(target: str, drafter: str, prompts: list[list[int]], max_draft_len: int, temperature: float,
             max_tokens: int, check_parity: bool = False, **engine) -> dict:
    """Acceptance of ``drafter`` on ``prompts``: tau and per-position rates; with ``check_parity`` (greedy),
    whether speculative output equals plain output token for token."""
    # every block verified whole (no speculation guard): acceptance at max_draft_len
    spec = DSparkDecodingConfig(speculative_model=drafter, max_draft_len=max_draft_len, speculation_guard=False)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM(target, speculative_config=spec, **engine)
    outs = llm.generate(prompts, params)
    m = llm.get_metrics()
    drafts = max(m["num_drafts"], 1)
    result = {"mean_acceptance_length": m["mean_acceptance_length"],
              "acceptance_per_position": [n / drafts for n in m["num_accepted_tokens_per_pos"]],
              "num_drafts": m["num_drafts"], "max_draft_len": max_draft_len, "temperature": temperature,
              "prompts": len(prompts), "max_tokens": max_tokens}
    if check_parity:
        plain = LLM(target, **engine).generate(prompts, params)
        result["greedy_equals_plain"] = [o.token_ids for o in outs] == [o.token_ids for o in plain]
    return result
