"""Fields resolved from the drafter checkpoint, in every key style, and the embedded-draft probe."""

import json
import pickle
import shutil

import pytest
from pydantic import ValidationError

from configs import DSparkDecodingConfig

DEEPSPEC = {"model_type": "qwen3", "block_size": 5, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17],
            "num_target_layers": 36, "markov_rank": 256, "markov_head_type": "gated"}
TRT_TOP_LEVEL = {"model_type": "qwen3", "dspark_block_size": 5, "dspark_noise_token_id": 151669,
                 "dspark_target_layer_ids": [1, 9, 17], "dspark_markov_rank": 256, "dspark_markov_head_type": "gated"}
NESTED_DSPARK = {"model_type": "qwen3", "dspark_config": {"block_size": 5, "mask_token_id": 151669,
                 "target_layer_ids": [1, 9, 17], "markov_rank": 256, "markov_head_type": "gated"}}
NESTED_DFLASH = {"model_type": "qwen3", "block_size": 5, "dflash_config": {"mask_token_id": 151669,
                 "target_layer_ids": [1, 9, 17], "markov_rank": 256, "markov_head_type": "gated"}}


def write_checkpoint(path, config=None, index=None, index_name="model.safetensors.index.json", raw_index=None):
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if index is not None:
        (path / index_name).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if raw_index is not None:
        (path / index_name).write_text(raw_index)
    return path


@pytest.mark.parametrize("style", [DEEPSPEC, TRT_TOP_LEVEL, NESTED_DSPARK, NESTED_DFLASH],
                         ids=["deepspec", "trt-top-level", "dspark_config", "dflash_config"])
def test_resolution_from_each_key_style(tmp_path, style):
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "d", style)))
    assert (cfg.max_draft_len, cfg.block_size, cfg.max_total_draft_tokens) == (5, 5, 5)
    assert cfg.mask_token_id == 151669 and cfg.target_layer_ids == [1, 9, 17]
    assert (cfg.markov_rank, cfg.markov_head_type) == (256, "gated")
    assert cfg.is_resolved and cfg.uses_external_draft_model and cfg.needs_separate_draft_weights


def test_nested_sections_win_over_top_level_keys(tmp_path):
    config = {**DEEPSPEC, "dspark_markov_rank": 64, "dspark_config": {"markov_rank": 32}}
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "d", config)))
    assert cfg.markov_rank == 32
    del config["dspark_config"]
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "e", config)))
    assert cfg.markov_rank == 64


def test_explicit_values_win(tmp_path):
    path = str(write_checkpoint(tmp_path / "d", DEEPSPEC))
    cfg = DSparkDecodingConfig(speculative_model=path, mask_token_id=7, target_layer_ids=[0, 2],
                               markov_rank=8, markov_head_type="rnn")
    assert (cfg.mask_token_id, cfg.target_layer_ids, cfg.markov_rank, cfg.markov_head_type) == (7, [0, 2], 8, "rnn")
    assert cfg.max_draft_len == 5
    with pytest.raises(ValidationError, match="block_size"):
        DSparkDecodingConfig(speculative_model=path, max_draft_len=7)


def test_dflash_checkpoint_is_dspark_with_rank_zero(tmp_path):
    config = {"model_type": "qwen3", "block_size": 4, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1]}}
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "d", config)))
    assert cfg.markov_rank == 0 and cfg.markov_head_type is None


def test_markov_head_type_defaults_to_vanilla(tmp_path):
    config = {k: v for k, v in DEEPSPEC.items() if k != "markov_head_type"}
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "d", config)))
    assert cfg.markov_head_type == "vanilla"


def test_layer_ids_checked_against_num_target_layers(tmp_path):
    config = {**DEEPSPEC, "target_layer_ids": [1, 9, 35]}
    with pytest.raises(ValidationError, match="last layer 35"):
        DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "d", config)))


def test_unparsable_drafter_config_names_the_file(tmp_path):
    path = tmp_path / "d"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValidationError, match="config.json"):
        DSparkDecodingConfig(speculative_model=str(path))


def test_missing_checkpoint_leaves_fields_unresolved(tmp_path):
    cfg = DSparkDecodingConfig(speculative_model=str(tmp_path / "absent"))
    assert cfg.max_draft_len is None and not cfg.is_resolved


# ---- the probe -------------------------------------------------------------------------------------

MTP = {"model.embed_tokens.weight": "a.safetensors", "mtp.0.attn.wq.weight": "b.safetensors"}
NO_MTP = {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.weight": "a.safetensors"}
V4 = {"model_type": "deepseek_v4"}
QWEN = {"model_type": "qwen3"}


@pytest.mark.parametrize("case,kwargs,expected", [
    ("mtp keys", dict(config=QWEN, index=MTP), True),
    ("no mtp keys but deepseek_v4", dict(config=V4, index=NO_MTP), False),
    ("mtp key not at start", dict(config=QWEN, index={"model.mtp.0.x": "a"}), False),
    ("mtp without a stage number", dict(config=QWEN, index={"mtp.head.weight": "a"}), False),
    ("bin index with mtp keys", dict(config=QWEN, index=MTP, index_name="pytorch_model.bin.index.json"), True),
    ("bin index without", dict(config=V4, index=NO_MTP, index_name="pytorch_model.bin.index.json"), False),
    ("no index, deepseek_v4", dict(config=V4), True),
    ("no index, another type", dict(config=QWEN), False),
    ("unparsable index, deepseek_v4", dict(config=V4, raw_index="{broken"), True),
    ("unparsable index, another type", dict(config=QWEN, raw_index="{broken"), False),
    ("index without weight_map", dict(config=V4, raw_index='{"metadata": {}}'), True),
    ("nothing at all", dict(), False),
])
def test_probe_cases(tmp_path, case, kwargs, expected):
    path = write_checkpoint(tmp_path / "m", **kwargs)
    cfg = DSparkDecodingConfig(speculative_model=str(path), max_draft_len=3)
    assert cfg.draft_is_embedded_in_target is expected, case
    assert cfg.uses_external_draft_model is (not expected)


def test_safetensors_index_is_tried_before_the_bin_index(tmp_path):
    path = write_checkpoint(tmp_path / "m", config=QWEN, index=NO_MTP)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": MTP}))
    assert not DSparkDecodingConfig(speculative_model=str(path), max_draft_len=3).draft_is_embedded_in_target


def test_probe_without_model_is_false():
    assert DSparkDecodingConfig(max_draft_len=3).draft_is_embedded_in_target is False


def test_embedded_target_resolves_dspark_keys(tmp_path):
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 61, "dspark_block_size": 5,
              "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [58, 59, 60], "dspark_markov_rank": 512}
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "v4", config, index=MTP)))
    assert cfg.draft_is_embedded_in_target and cfg.max_draft_len == 5 and cfg.markov_rank == 512
    assert not cfg.needs_separate_draft_weights


def test_probe_is_memoized_and_travels_with_pickles(tmp_path):
    path = write_checkpoint(tmp_path / "m", config=QWEN, index=MTP)
    cfg = DSparkDecodingConfig(speculative_model=str(path), max_draft_len=3)
    assert cfg.draft_is_embedded_in_target is True
    blob = pickle.dumps(cfg)
    shutil.rmtree(path)
    assert cfg.draft_is_embedded_in_target is True
    copy = pickle.loads(blob)
    assert copy.draft_is_embedded_in_target is True and copy.uses_external_draft_model is False


def test_probe_reads_the_filesystem_once(tmp_path, monkeypatch):
    import configs.speculative as spec

    calls = []
    real = spec.probe_draft_is_embedded
    monkeypatch.setattr(spec, "probe_draft_is_embedded", lambda m: calls.append(m) or real(m))
    cfg = DSparkDecodingConfig(speculative_model=str(write_checkpoint(tmp_path / "m", config=QWEN, index=MTP)),
                               max_draft_len=3)
    for _ in range(3):
        assert cfg.draft_is_embedded_in_target and cfg.uses_external_draft_model is False
    pickle.loads(pickle.dumps(cfg)).draft_is_embedded_in_target
    from configs import LLMConfig, ReplicaConfig

    nested = ReplicaConfig.model_validate({"engine": LLMConfig(model="m", speculative_config=cfg)})
    assert nested.engine.speculative_config.draft_is_embedded_in_target
    assert len(calls) == 1  # nesting the object into other configs does not probe again
