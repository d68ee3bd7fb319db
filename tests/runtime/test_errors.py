"""Bad checkpoints, configs and requests fail with errors that name the problem; nothing is left queued."""

import json

import pytest

from configs import ConfigError, DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.kernels import KernelBackendUnavailable
from runtime.models.loader import CheckpointError
from tests import builders


def drafter_dir(checkpoints, name, target, mutate_config=None, mutate_tensors=None, **kwargs):
    config = builders.drafter_config(target, block_size=kwargs.pop("block_size", 3), **kwargs)
    if mutate_config:
        mutate_config(config)
    tensors = builders.drafter_tensors(config)
    if mutate_tensors:
        mutate_tensors(tensors)
    return builders.save_drafter(checkpoints / name, config, tensors)


def llm(target, drafter, **spec):
    return LLM(str(target), speculative_config={"speculative_model": str(drafter), **spec}, dtype="float32",
               device="cpu", num_pages=64, page_size=4)


def test_unknown_drafter_layout(checkpoints, qwen3_target):
    path = checkpoints / "not-a-drafter"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                  "block_size": 3}))
    with pytest.raises(CheckpointError, match="not a DSpark/DFlash drafter"):
        llm(qwen3_target, path)


@pytest.mark.parametrize("field,value", [("vocab_size", 400), ("hidden_size", 32)])
def test_vocab_or_hidden_size_mismatch(checkpoints, qwen3_target, field, value):
    path = drafter_dir(checkpoints, f"bad-{field}", qwen3_target, mutate_config=lambda c: c.update({field: value}))
    with pytest.raises(CheckpointError, match=f"{field} {value} does not match the target"):
        llm(qwen3_target, path)


def test_block_size_must_equal_max_draft_len(checkpoints, qwen3_target, make_drafter):
    with pytest.raises(ConfigError, match="block_size"):
        llm(qwen3_target, make_drafter(qwen3_target, 4), max_draft_len=3)


def test_target_layer_ids_naming_the_last_layer(checkpoints, qwen3_target, make_drafter):
    with pytest.raises(ConfigError, match="last layer 3"):  # num_target_layers is in the checkpoint
        llm(qwen3_target, make_drafter(qwen3_target, 3), target_layer_ids=[0, 3])
    no_count = drafter_dir(checkpoints, "no-num-target-layers", qwen3_target, layer_ids=(0, 3),
                           mutate_config=lambda c: c.pop("num_target_layers"))
    with pytest.raises(ValueError, match="last layer 3"):  # caught when the target is loaded
        llm(qwen3_target, no_count)


def test_target_layer_ids_out_of_range(checkpoints, qwen3_target):
    path = drafter_dir(checkpoints, "far-layer", qwen3_target, layer_ids=(0, 9),
                       mutate_config=lambda c: c.pop("num_target_layers"))
    with pytest.raises(ValueError, match="out of range"):
        llm(qwen3_target, path)


def test_missing_or_misshaped_tensors_are_named(checkpoints, qwen3_target):
    missing = drafter_dir(checkpoints, "missing-fc", qwen3_target, mutate_tensors=lambda t: t.pop("fc.weight"))
    with pytest.raises(CheckpointError, match="fc.weight"):
        llm(qwen3_target, missing)

    def shrink(tensors):
        tensors["markov_head.markov_w1.weight"] = tensors["markov_head.markov_w1.weight"][:, :8]

    bad_shape = drafter_dir(checkpoints, "bad-markov", qwen3_target, mutate_tensors=shrink)
    with pytest.raises(CheckpointError, match="markov_head.markov_w1.weight"):
        llm(qwen3_target, bad_shape)


def test_trtllm_tensor_aliases_load(checkpoints, qwen3_target):
    def rename(tensors):
        tensors["markov_w1.weight"] = tensors.pop("markov_head.markov_w1.weight")
        tensors["confidence_proj.weight"] = tensors.pop("confidence_head.proj.weight")
    path = drafter_dir(checkpoints, "aliases", qwen3_target, mutate_tensors=rename)
    out = llm(qwen3_target, path).generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4


def test_an_index_that_claims_an_embedded_drafter_the_tensors_lack_is_named(checkpoints, qwen3_target):
    path = drafter_dir(checkpoints, "embedded", qwen3_target)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"mtp.0.fc.weight": "x"}}))
    with pytest.raises(CheckpointError, match=r"names shard files that are not there: \['x'\]"):
        llm(qwen3_target, path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "mtp.0.fc.weight": "model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"no mtp.<s>.\* tensors, so no embedded drafter"):
        llm(qwen3_target, path)


def test_prompt_longer_than_max_model_len(qwen3_target, make_drafter):
    engine = LLM(str(qwen3_target), speculative_config=DSparkDecodingConfig(
        speculative_model=str(make_drafter(qwen3_target, 3))), dtype="float32", device="cpu", max_model_len=16,
        num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="prompt has 20 tokens; max_model_len is 16"):
        engine.generate([[1, 2], list(range(20))], SamplingParams(max_tokens=4))
    assert not engine.engine.has_unfinished()  # the valid first prompt was not left queued


def test_request_that_can_never_fit_the_cache(qwen3_target):
    small = LLM(str(qwen3_target), dtype="float32", device="cpu", num_pages=2, page_size=4)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        small.generate([[1, 2, 3]], SamplingParams(max_tokens=20))


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"seed": 1.5}, "seed"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_sampling_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=f"SamplingParams.{needle} must be"):
        SamplingParams(**kwargs)


def test_engine_options_are_validated(qwen3_target):
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(qwen3_target), dtype="int8")
    with pytest.raises(ConfigError, match="page_size"):
        LLM(str(qwen3_target), page_size=0)
    with pytest.raises(ValueError, match="moe_backend='CUTLASS'.*no MoE layers"):
        LLM(str(qwen3_target), moe_backend="CUTLASS", device="cpu")
    with pytest.raises(KernelBackendUnavailable, match="'flashinfer' runs on CUDA devices only"):
        LLM(str(qwen3_target), kernel_backend="flashinfer", device="cpu")


def test_unsupported_attention_backend_is_named(qwen3_target, make_drafter):
    with pytest.raises(ValueError, match="attention_backend='TRTLLM' cannot run here"):
        llm(qwen3_target, make_drafter(qwen3_target, 3), attention_backend="TRTLLM")


def test_bad_prompts(qwen3_target):
    engine = LLM(str(qwen3_target), dtype="float32", device="cpu", num_pages=16, page_size=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="0..319"):
        engine.generate([[5, 400]])
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        engine.generate([[5]], [SamplingParams(), SamplingParams()])
