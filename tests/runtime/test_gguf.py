"""GGUF checkpoints: a tiny llama GGUF written here the way llama.cpp's converter writes one (rotary-permuted query
and key projections, tokenizer and chat template in the metadata) is served from its cached conversion, and its
greedy output equals transformers' own GGUF loading, and (float32 tensors) the original model's."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.models.gguf_checkpoint import GGUFError, converted_dir
from runtime.models.hub import resolve_checkpoint
from tests.builders import CHAT_TEMPLATE, greedy_generate, hf_greedy, save_target

gguf = pytest.importorskip("gguf")
ENGINE = dict(dtype="float32", device="cpu", num_pages=64, page_size=16)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [9]]


def rotary_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a query/key projection's rows (rotate-half pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, quantize: str | None = None, arch: str = "llama") -> Path:
    """The HF llama at ``hf_dir`` as a GGUF file; ``quantize`` stores the 2-D projections as that type (e.g. Q8_0)."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(config["vocab_size"] - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials or t.startswith("[PAD") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
            if rest.startswith("self_attn.q_proj"):
                w = rotary_permute(w, heads)
            elif rest.startswith("self_attn.k_proj"):
                w = rotary_permute(w, kv_heads)
        if quantize and w.ndim == 2 and gname.startswith("blk."):
            qtype = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("llama") / "hf", family="llama", seed=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_gguf_greedy(path: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers' own GGUF loading (dequantized in float32), greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return greedy_generate(model, prompts, max_new_tokens)


def test_a_float32_gguf_serves_the_original_models_greedy_tokens(llama_dir, tmp_path, cache):
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf")
    params = SamplingParams(max_tokens=12, temperature=0)
    outs = LLM(str(path), **ENGINE).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == hf_greedy(llama_dir, PROMPTS, 12)
    folder = Path(converted_dir(path))
    assert folder.parent == cache / "gguf" and json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_a_quantized_gguf_equals_transformers_gguf_loading_and_is_converted_once(llama_dir, tmp_path, cache):
    accelerate = pytest.importorskip("accelerate")  # transformers' own GGUF loading needs it (ours does not)
    del accelerate
    folder = tmp_path / "model"
    folder.mkdir()
    path = write_gguf(llama_dir, folder / "tiny-q8.gguf", quantize="Q8_0")
    llm = LLM(str(folder), **ENGINE)  # a folder holding one GGUF file
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == hf_gguf_greedy(path, PROMPTS, 12)
    converted = Path(converted_dir(path))
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(str(path), "model") == str(converted)  # the second start reads the cache
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a changed file is converted again
    assert resolve_checkpoint(str(path), "model") == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns != stamp


def test_the_tokenizer_and_chat_template_come_from_the_file(llama_dir, tmp_path, cache):
    from transformers import AutoTokenizer

    path = write_gguf(llama_dir, tmp_path / "tiny.gguf")
    llm = LLM(str(path), **ENGINE)
    reference = AutoTokenizer.from_pretrained(str(llama_dir))
    text = "def add(a, b):\n    return a + b\n"
    assert llm.tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "[user] hi\n[assistant] "


def test_an_architecture_or_quantization_the_engine_cannot_serve_is_named(llama_dir, tmp_path, cache):
    with pytest.raises(GGUFError, match=r"model: gpt2\.gguf has architecture 'gpt2'; GGUF architectures served: "
                                        r"llama, qwen3, qwen3moe"):
        converted_dir(write_gguf(llama_dir, tmp_path / "gpt2.gguf", arch="gpt2"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="model: .*bad.gguf is not a readable GGUF file"):
        converted_dir(bad)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(GGUFError, match=r"holds 2 \.gguf files"):
        resolve_checkpoint(str(two), "model")
