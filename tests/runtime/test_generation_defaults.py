"""The model's default sampling parameters (``generation_config`` auto, vLLM's default): what its
generation_config.json sets fills what a request leaves unset, in Python and on the server's request models; none
keeps the engine's own; a bad or unservable file is an error at startup naming it. (The server's request models:
tests/cluster/test_request_models.py.)"""

import json
import shutil

import pytest

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
PROMPTS = [[5, 6, 7], [9, 10]]


def with_generation_config(target, tmp_path, **values):
    model = tmp_path / "model"
    shutil.copytree(target, model)
    path = model / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **values}))
    return model


def test_the_models_defaults_fill_what_a_request_leaves_unset(near_bigram_target, tmp_path):
    model = with_generation_config(near_bigram_target, tmp_path, temperature=0.0, max_new_tokens=5, top_k=3,
                                   do_sample=True)
    llm = LLM(str(model), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5, top_k=3)
    greedy = LLM(str(near_bigram_target), **ENGINE).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
    assert [o.token_ids for o in llm.generate(PROMPTS)] == [o.token_ids for o in greedy]  # the model's: greedy, 5
    own = LLM(str(model), generation_config="none", **ENGINE)
    assert own.get_default_sampling_params() == SamplingParams()
    assert all(len(o.token_ids) <= 16 for o in own.generate(PROMPTS)) and own.generate(PROMPTS)[0].token_ids
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 3, "max_tokens": 5}  # (what the server reads)


def test_a_bad_or_unservable_generation_config_is_an_error_at_startup(near_bigram_target, make_drafter, tmp_path):
    bad = with_generation_config(near_bigram_target, tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.top_p must be in \(0, 1\].*"
                                         r"generation_config: none"):
        LLM(str(bad), **ENGINE)
    assert LLM(str(bad), generation_config="none", **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=2))
    penalized = with_generation_config(near_bigram_target, tmp_path / "p", repetition_penalty=1.1)
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(near_bigram_target, 3)))
    with pytest.raises(ValueError, match="generation_config.json sets default sampling parameters this engine "
                                         "refuses .*repetition_penalty"):
        LLM(str(penalized), speculative_config=spec, **ENGINE)
