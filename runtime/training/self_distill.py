"""Self-distillation at scale: the target writes prompts of its own, then answers every prompt several times.

As DeepSpec regenerates its training answers with the target (non-thinking), the drafter learns the target's own
text. ``answer_prompts`` renders each conversation with the target's chat template and answers it once per sampling
setting (greedy, and sampled at a temperature and top-p), keeping exact token ids; ``write_prompts`` has the target
write prompts on random topics (``prompt_sets.write_requests``). Both take a ``runtime.LLM`` (or anything with its
``generate``), so they run on a GPU or a CPU alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.chat import chat_token_ids
from runtime.sampling.sampling_params import SamplingParams
from runtime.training.prompt_sets import usable_prompt, write_requests


@dataclass(frozen=True)
class Sampling:
    """One answer per prompt drawn this way (temperature 0: greedy)."""

    temperature: float
    top_p: float = 1.0

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed)


def write_prompts(llm, kinds: dict[str, tuple[int, int]], sampling: Sampling = Sampling(0.7, 0.9),
                  max_tokens: int = 160) -> dict[str, list[str]]:
    """For each kind (math, code, chat) -> (count, seed): up to ``count`` distinct prompts of that kind written by the
    target itself (its i-th request seeded ``seed + i``), every kind's requests in one generate call (the engine's
    batch drains once, not once a kind)."""
    prompts, params, owners = [], [], []
    for kind, (count, seed) in kinds.items():
        for i, request in enumerate(write_requests(kind, count, seed)):
            prompts.append(chat_token_ids(llm.tokenizer, [{"role": "user", "content": request}]))
            params.append(sampling.params(max_tokens, seed + i))
            owners.append(kind)
    written: dict[str, list[str]] = {kind: [] for kind in kinds}
    seen: dict[str, set[str]] = {kind: set() for kind in kinds}
    for kind, out in zip(owners, llm.generate(prompts, params) if prompts else []):
        text = usable_prompt(out.text) if out.finish_reason == "stop" else None
        if text is not None and text not in seen[kind]:
            seen[kind].add(text)
            written[kind].append(text)
    return written


def answer_prompts(llm, conversations: list[dict], samplings: list[Sampling], max_tokens: int, max_prompt_tokens: int,
                   out: str | Path, seed: int = 0, progress: bool = False) -> dict:
    """Answer every ``{"source", "messages"}`` conversation once per sampling and write JSONL rows
    ``{"prompt_ids", "response_ids", "finished", "source", "temperature"}`` to ``out`` (an answer that ended on EOS
    keeps it). Prompts longer than ``max_prompt_tokens`` are skipped. Returns counts of rows, tokens and skips."""
    prompts, sources = [], []
    skipped = 0
    for conversation in conversations:
        ids = chat_token_ids(llm.tokenizer, conversation["messages"])
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(ids)
        sources.append(conversation["source"])
    # every sampling's requests in one call (sampling-major), so the engine keeps its batch full until the last
    # answers of them all, rather than draining it at the end of each sampling's
    params = [sampling.params(max_tokens, seed + k * len(prompts) + i)
              for k, sampling in enumerate(samplings) for i in range(len(prompts))]
    outputs = llm.generate(prompts * len(samplings), params, use_tqdm=progress) if prompts else []
    rows = tokens = 0
    with Path(out).open("w", encoding="utf-8") as f:
        for j, o in enumerate(outputs):
            i, sampling = j % len(prompts), samplings[j // len(prompts)]
            f.write(json.dumps({"prompt_ids": prompts[i], "response_ids": o.token_ids,
                                "finished": o.finish_reason == "stop", "source": sources[i],
                                "temperature": sampling.temperature}) + "\n")
            rows += 1
            tokens += len(o.token_ids)
    return {"rows": rows, "response_tokens": tokens, "prompts": len(prompts), "skipped_long_prompts": skipped}
