"""DSparkDecodingConfig: the reference page's fields, bounds, choices, validators and methods."""

import pickle
import typing
import warnings

import pytest
from pydantic import ValidationError

from configs import AdvancedSamplingMode, DSparkDecodingConfig, SpeculativeDecodingMode

MOE_BACKENDS = ["AUTO", "CUTLASS", "CUTEDSL", "CUTEDSL_FC12", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA",
                "TRITON", "MARLIN", "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"]
PAGE_FIELDS = {
    "max_draft_len": None, "max_total_draft_tokens": None, "speculative_model": None, "moe_backend": None,
    "max_concurrency": None, "draft_len_schedule": None, "load_format": None,
    "acceptance_rate_window_size": None, "acceptance_rate_threshold": None, "use_rejection_sampling": False,
    "allow_advanced_sampling": False, "advanced_sampling_mode": AdvancedSamplingMode.FULL,
    "enable_penalty": False, "mask_token_id": None, "target_layer_ids": None, "block_size": None,
    "markov_rank": None, "markov_head_type": None, "decoding_type": "DSpark", "attention_backend": "AUTO",
}
EXTENSIONS = {"confidence_threshold": None, "revision": None}
# TensorRT-LLM 1.4's confidence-scheduling fields (not on the reference page, named as TRT-LLM names them)
EXTENSIONS.update(enable_confidence_scheduling=False, confidence_cost_table_path=None,
                  confidence_calibration_path=None, confidence_min_predicted_gain=0.04)
EXTENSIONS.update(speculation_guard=True)


def make(**kw):
    return DSparkDecodingConfig(**kw)


def test_fields_and_defaults_match_the_reference_page():
    fields = DSparkDecodingConfig.model_fields
    assert set(fields) == set(PAGE_FIELDS) | set(EXTENSIONS)
    for name, default in {**PAGE_FIELDS, **EXTENSIONS}.items():
        assert fields[name].default == default, name
        assert fields[name].description, f"{name} has no description"
    # Defaults: no drafter, nothing resolved, not embedded.
    cfg = make()
    assert cfg.max_draft_len is None and cfg.max_total_draft_tokens is None
    assert cfg.draft_is_embedded_in_target is False


def test_literal_choices_are_exactly_the_pages():
    fields = DSparkDecodingConfig.model_fields
    moe = typing.get_args(typing.get_args(fields["moe_backend"].annotation)[0])
    assert list(moe) == MOE_BACKENDS
    assert list(typing.get_args(fields["attention_backend"].annotation)) == ["AUTO", "VANILLA", "TRTLLM", "CUTEDSL"]
    head = typing.get_args(typing.get_args(fields["markov_head_type"].annotation)[0])
    assert list(head) == ["vanilla", "gated", "rnn"]
    assert [m.value for m in AdvancedSamplingMode] == ["FULL", "NO_TOPK", "NO_TOPP", "NO_TOPK_NO_TOPP"]


@pytest.mark.parametrize("name", MOE_BACKENDS)
def test_every_moe_backend_is_accepted(name):
    assert make(max_draft_len=2, moe_backend=name).moe_backend == name


@pytest.mark.parametrize("field,bad,allowed", [
    ("moe_backend", "FAST", "CUTLASS"),
    ("attention_backend", "FLASH", "VANILLA"),
    ("markov_head_type", "lstm", "gated"),
    ("advanced_sampling_mode", "NO_MINP", "NO_TOPK_NO_TOPP"),
    ("decoding_type", "Eagle", "DSpark"),
])
def test_bad_choice_names_field_and_allowed_values(field, bad, allowed):
    with pytest.raises(ValidationError) as err:
        make(max_draft_len=2, **{field: bad})
    text = str(err.value)
    assert field in text and allowed in text


@pytest.mark.parametrize("field,ok,bad", [
    ("max_draft_len", 0, -1),
    ("max_concurrency", 1, 0),
    ("acceptance_rate_window_size", 0, -1),
    ("acceptance_rate_threshold", 0.0, -0.01),
    ("acceptance_rate_threshold", 1.0, 1.01),
    ("block_size", 1, 0),
    ("markov_rank", 0, -1),
    ("mask_token_id", 0, -5),
    ("confidence_threshold", 1.0, 1.5),
    ("confidence_threshold", 0.0, -0.5),
])
def test_bounds(field, ok, bad):
    base = {"max_draft_len": 1} if field != "max_draft_len" else {}
    if field == "block_size":
        base = {"max_draft_len": ok}
    assert getattr(make(**base, **{field: ok}), field) == ok
    with pytest.raises(ValidationError, match=field):
        make(**base, **{field: bad})


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        make(max_draft_len=2, num_speculative_tokens=3)
    with pytest.raises(ValidationError, match="sa_config"):
        make(max_draft_len=2, sa_config={})


def test_frozen():
    cfg = make(max_draft_len=2)
    with pytest.raises(ValidationError):
        cfg.max_draft_len = 3


def test_max_total_draft_tokens_defaults_to_max_draft_len_and_must_equal_it():
    cfg = make(max_draft_len=5)
    assert cfg.max_total_draft_tokens == 5 and cfg.is_linear_tree
    assert make(max_draft_len=5, max_total_draft_tokens=5).is_linear_tree
    with pytest.raises(ValidationError, match="max_total_draft_tokens"):
        make(max_draft_len=5, max_total_draft_tokens=8)


def test_block_size_must_equal_max_draft_len():
    assert make(max_draft_len=4, block_size=4).block_size == 4
    assert make(block_size=6).max_draft_len == 6
    assert make(max_draft_len=3).block_size == 3
    with pytest.raises(ValidationError, match="block_size"):
        make(max_draft_len=4, block_size=7)


def test_schedule_is_sorted_and_checked():
    cfg = make(max_draft_len=4, draft_len_schedule={32: 1, 4: 4, 8: 2})
    assert list(cfg.draft_len_schedule) == [4, 8, 32]
    with pytest.raises(ValidationError, match=">= 1"):
        make(max_draft_len=4, draft_len_schedule={0: 4})
    with pytest.raises(ValidationError, match=">= 0"):
        make(max_draft_len=4, draft_len_schedule={4: 4, 8: -1})
    with pytest.raises(ValidationError, match="0..max_draft_len"):
        make(max_draft_len=4, draft_len_schedule={4: 4, 8: 5})
    with pytest.raises(ValidationError, match="smallest batch-size key"):
        make(max_draft_len=4, draft_len_schedule={4: 3, 8: 2})
    with pytest.raises(ValidationError, match="empty"):
        make(max_draft_len=4, draft_len_schedule={})


def test_schedule_example_from_the_page():
    cfg = make(max_draft_len=4, draft_len_schedule={4: 4, 8: 2, 32: 1})
    expected = {**{b: 4 for b in range(1, 5)}, **{b: 2 for b in range(5, 9)}, **{b: 1 for b in range(9, 33)},
                **{b: 0 for b in range(33, 100)}}
    assert {b: cfg.draft_len_for_batch_size(b) for b in expected} == expected


def test_max_concurrency_gate_and_exclusivity():
    cfg = make(max_draft_len=3, max_concurrency=8)
    assert [cfg.draft_len_for_batch_size(b) for b in (1, 8, 9, 64)] == [3, 3, 0, 0]
    assert make(max_draft_len=3).draft_len_for_batch_size(1000) == 3
    with pytest.raises(ValidationError, match="mutually exclusive"):
        make(max_draft_len=4, max_concurrency=8, draft_len_schedule={4: 4})
    with pytest.raises(ValueError, match="batch_size"):
        cfg.draft_len_for_batch_size(0)


def test_allow_advanced_sampling_warns_and_changes_nothing():
    with pytest.warns(DeprecationWarning, match="allow_advanced_sampling"):
        cfg = make(max_draft_len=2, allow_advanced_sampling=True)
    plain = make(max_draft_len=2)
    assert cfg.model_dump(exclude={"allow_advanced_sampling"}) == plain.model_dump(exclude={"allow_advanced_sampling"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(max_draft_len=2, allow_advanced_sampling=False)


def test_rejection_sampling_is_honoured_as_given():
    assert make(max_draft_len=2, use_rejection_sampling=True).use_rejection_sampling is True
    assert make(max_draft_len=2).use_rejection_sampling is False


def test_target_layer_ids_checks():
    assert make(max_draft_len=2, target_layer_ids=[-1, 3, 7]).target_layer_ids == [-1, 3, 7]
    for bad in ([3, 3], [5, 2], [-2, 1], []):
        with pytest.raises(ValidationError, match="target_layer_ids"):
            make(max_draft_len=2, target_layer_ids=bad)


def test_load_format_choices():
    for ok in ("auto", "safetensors", "dummy"):
        assert make(max_draft_len=1, load_format=ok).load_format == ok
    with pytest.raises(ValidationError, match="load_format"):
        make(max_draft_len=1, load_format="gguf")


def test_methods_and_properties():
    cfg = make(max_draft_len=7, target_layer_ids=[1, 9, 17])
    assert cfg.tokens_per_gen_step == 8
    assert cfg.get_runtime_tokens_per_gen_step(3) == 4
    assert cfg.num_capture_layers() == 3
    assert make().num_capture_layers() == 0
    assert cfg.supports_backend("pytorch") and not cfg.supports_backend("tensorrt")
    assert cfg.spec_dec_mode is SpeculativeDecodingMode.DSPARK
    assert not cfg.spec_dec_mode.support_dynamic_draft_len()
    assert not cfg.uses_external_draft_model and not cfg.needs_separate_draft_weights
    assert not cfg.uses_replacement_heads


def test_pickle_round_trip_keeps_everything():
    cfg = make(max_draft_len=3, draft_len_schedule={2: 3, 9: 1})
    copy = pickle.loads(pickle.dumps(cfg))
    assert copy == cfg and copy.draft_len_for_batch_size(5) == 1


def test_advanced_sampling_mode_filters():
    assert AdvancedSamplingMode.FULL.allows_min_p and AdvancedSamplingMode.FULL.allows_top_k
    assert not AdvancedSamplingMode.NO_TOPK.allows_top_k and AdvancedSamplingMode.NO_TOPK.allows_top_p
    assert not AdvancedSamplingMode.NO_TOPP.allows_top_p and not AdvancedSamplingMode.NO_TOPP.allows_min_p
    mode = AdvancedSamplingMode.NO_TOPK_NO_TOPP
    assert not (mode.allows_top_k or mode.allows_top_p or mode.allows_min_p)


def test_confidence_scheduling_knobs_need_the_switch_and_their_files(tmp_path):
    table = tmp_path / "table.json"
    table.write_text("{}")
    with pytest.raises(ValidationError, match="confidence_cost_table_path is set but enable_confidence_scheduling"):
        make(confidence_cost_table_path=str(table))
    with pytest.raises(ValidationError, match="confidence_calibration_path: .*missing.json is not a file"):
        make(enable_confidence_scheduling=True, confidence_calibration_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValidationError, match="confidence_min_predicted_gain is set but"):
        make(confidence_min_predicted_gain=0.1)
    with pytest.raises(ValidationError, match="both trim the proposal"):
        make(enable_confidence_scheduling=True, confidence_threshold=0.5)
    assert make(enable_confidence_scheduling=True, confidence_cost_table_path=str(table)).enable_confidence_scheduling
