"""Fixtures the training test files share."""

import json

import pytest
import torch

from runtime.engine.llm import LLM
from runtime.training.distill import regenerate

TRAINING_ENGINE = dict(dtype="float32", device="cpu", num_pages=512, page_size=8)


@pytest.fixture(scope="module")
def distilled(near_bigram_target, tmp_path_factory):
    """The target's own greedy answers to random prompts (self-distillation)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 300, (96, 8), generator=g).tolist()
    path = tmp_path_factory.mktemp("distill") / "rows.jsonl"
    assert regenerate(LLM(str(near_bigram_target), **TRAINING_ENGINE), prompts, path, max_tokens=32) == 96
    row = json.loads(path.read_text().splitlines()[0])
    assert set(row) == {"prompt_ids", "response_ids", "finished"} and len(row["prompt_ids"]) == 8
    return path
