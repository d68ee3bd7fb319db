"""configs.load: YAML/JSON files into a validated LLMConfig, errors that name the field."""

import json

import pytest

from configs import ConfigError, LLMConfig, load


def test_yaml_and_json_load_the_same(tmp_path):
    data = {"model": "some/dir", "dtype": "float32", "device": "cpu", "max_num_seqs": 8,
            "speculative_config": {"speculative_model": "d", "max_draft_len": 3, "draft_len_schedule": {4: 3, 16: 1}}}
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "a.yaml").write_text("model: some/dir\ndtype: float32\ndevice: cpu\nmax_num_seqs: 8\n"
                                     "speculative_config:\n  speculative_model: d\n  max_draft_len: 3\n"
                                     "  draft_len_schedule: {4: 3, 16: 1}\n")
    from_json, from_yaml = load(tmp_path / "a.json"), load(tmp_path / "a.yaml")
    assert from_json == from_yaml
    assert isinstance(from_yaml, LLMConfig) and from_yaml.speculative_config.draft_len_for_batch_size(10) == 1


@pytest.mark.parametrize("text,needles", [
    ("model: m\ndtype: fp8\n", ["dtype", "'float32'", "'bfloat16'"]),
    ("model: m\nspeculative_config: {speculative_model: d, max_draft_len: 2, moe_backend: FAST}\n",
     ["speculative_config.moe_backend", "'CUTLASS'"]),
    ("model: m\nspeculative_config: {speculative_model: d, markov_head_type: lstm, max_draft_len: 2}\n",
     ["speculative_config.markov_head_type", "'gated'"]),
    ("model: m\nunknown_knob: 1\n", ["unknown_knob", "Extra inputs"]),
    ("dtype: float32\n", ["model", "required"]),
    ("model: m\ndevice: tpu\n", ["device", "cuda:N", "'tpu'"]),
    ("model: m\nnum_pages: 4\nkv_cache_memory: 100\n", ["num_pages and kv_cache_memory"]),
    ("model: m\nspeculative_config: {max_draft_len: 2}\n", ["speculative_model"]),
    ("model: m\npage_size: 0\n", ["page_size", "greater than 0"]),
])
def test_errors_name_the_field_and_allowed_values(tmp_path, text, needles):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(path)
    for needle in needles:
        assert needle in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("name,text,needle", [
    ("c.toml", "model = 1", ".yaml, .yml or .json"),
    ("c.yaml", "- a\n- b\n", "mapping"),
    ("c.yaml", "model: [unclosed\n", "not valid YAML"),
    ("c.json", "{", "not valid JSON"),
])
def test_unreadable_files(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.yaml")
