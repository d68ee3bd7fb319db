"""Self-distillation (the target writes the drafter's training answers) and acceptance evaluation."""

from __future__ import annotations

import json
import random
from pathlib import Path

from configs import DSparkDecodingConfig
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams


def code_prompts(files: list[Path], tokenizer, count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``prompt_tokens`` tokens, starting at random line starts of random files."""
    rng = random.Random(seed)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    prompts: list[list[int]] = []
    while len(prompts) < count:
        text = rng.choice(texts)
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        at = rng.choice(starts)
        ids = tokenizer(text[at:at + 8 * prompt_tokens], add_special_tokens=False)["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts


def regenerate(target: str, prompts: list[list[int]], out: str | Path, max_tokens: int, temperature: float = 0.0,
               seed: int = 0, **engine) -> int:
    """Answer every prompt with the target itself; write JSONL rows of exact token ids. Returns rows written."""
    llm = LLM(target, **engine)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    with Path(out).open("w", encoding="utf-8") as f:
        for prompt, o in zip(prompts, outs):
            f.write(json.dumps({"prompt_ids": prompt, "response_ids": o.token_ids,
                                "finished": o.finish_reason == "stop"}) + "\n")
    return len(outs)


def evaluate(target: str, drafter: str, prompts: list[list[int]], max_draft_len: int, temperature: float,
             max_tokens: int, check_parity: bool = False, **engine) -> dict:
    """Acceptance of ``drafter`` on ``prompts``: tau and per-position rates; with ``check_parity`` (greedy),
    whether speculative output equals plain output token for token."""
    spec = DSparkDecodingConfig(speculative_model=drafter, max_draft_len=max_draft_len)
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
