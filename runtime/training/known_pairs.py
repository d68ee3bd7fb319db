"""Tiny checkpoints of known behaviour, built from scratch: a transformers target (Qwen3, Qwen3-MoE or Llama) with
a byte-level BPE tokenizer, and DeepSpec-format drafters for it. A target whose attention and MLP add nothing
(``residual_scale`` 0) is a pure bigram table (``bigram_table``: its greedy next token is ``argmax table[x]``), and
``make_oracle`` turns a drafter into one that proposes that table's greedy chain: pairs whose acceptance is known by
construction (``dspark bench --drafter-kinds``; the test suite's fixtures).

Drafter tensors are written by name from the checkpoint layout of the design (not from the engine's modules), so
loading them checks the loader against the format, not against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 320
MASK_ID = VOCAB - 1
HIDDEN = 64
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


# (the tools, tool calls and Qwen3's enable_thinking false render only where a request has them: other prompts are as
# they were; the newlines are expressions, which the templates' trim_blocks keeps after a block tag)
CHAT_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}[no-think] {% endif %}"
                 "{% if tools %}[tools] {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ '\\n' }}"
                 "{% endif %}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %} <call {{ c['function']['name'] }} "
                 "{{ c['function']['arguments'] | tojson }}>{% endfor %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def target_config(family: str = "qwen3", **overrides):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if family == "qwen3":
        return Qwen3Config(**{"head_dim": 16, **common})
    if family == "qwen3_moe":  # 8 experts, 2 per token; layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**{"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                                 "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                                 "mlp_only_layers": [1], **common})
    return LlamaConfig(**common)


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def save_target(path: Path, family: str = "qwen3", seed: int = 0, residual_scale: float = 1.0,
                tokenizer: bool = True, **overrides) -> Path:
    """A random-weight target; ``residual_scale`` < 1 shrinks attention/MLP outputs (0 = a pure bigram table)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(family, **overrides)).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            if hasattr(layer.mlp, "experts"):  # an MoE block: a router that tells tokens apart, scaled experts
                layer.mlp.gate.weight.normal_(0, 1.0)
                layer.mlp.experts.gate_up_proj.normal_(0, 0.15)
                layer.mlp.experts.down_proj.normal_(0, 0.15 * residual_scale)
            else:
                layer.mlp.down_proj.weight.mul_(residual_scale)
    model.save_pretrained(str(path))
    if tokenizer:
        save_tokenizer(path)
    return path


def bigram_table(target_dir: Path) -> torch.Tensor:
    """[V, V]: the target's logits when attention and MLP add nothing: lm_head(norm(embed(x)))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir)).float()
    with torch.no_grad():
        return model.lm_head(model.model.norm(model.model.embed_tokens.weight))


def drafter_config(target_dir: Path, *, block_size: int, layer_ids=(0, 2), num_layers: int = 1, markov_rank: int = 16,
                   head_type: str = "vanilla", confidence: bool = True, with_markov: bool = True) -> dict:
    config = json.loads((target_dir / "config.json").read_text())
    config.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=config["num_hidden_layers"],
                  num_hidden_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID,
                  target_layer_ids=list(layer_ids), markov_rank=markov_rank, markov_head_type=head_type,
                  enable_confidence_head=confidence, confidence_head_with_markov=with_markov and markov_rank > 0,
                  num_anchors=512, layer_types=["full_attention"] * num_layers, tie_word_embeddings=False,
                  head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    return config


def drafter_tensors(config: dict, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random tensors named as in a DeepSpec checkpoint (DESIGN.md section 4)."""
    g = torch.Generator().manual_seed(seed)
    d, v, r = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    heads, kv, hd, inter = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], \
        config["intermediate_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {"fc.weight": rand(d, len(config["target_layer_ids"]) * d), "hidden_norm.weight": torch.ones(d),
         "norm.weight": torch.ones(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rand(heads * hd, d), p + "self_attn.k_proj.weight": rand(kv * hd, d),
                  p + "self_attn.v_proj.weight": rand(kv * hd, d), p + "self_attn.o_proj.weight": rand(d, heads * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": rand(inter, d), p + "mlp.up_proj.weight": rand(inter, d),
                  p + "mlp.down_proj.weight": rand(d, inter), p + "input_layernorm.weight": torch.ones(d),
                  p + "post_attention_layernorm.weight": torch.ones(d)})
    if r > 0:
        t["markov_head.markov_w1.weight"] = rand(v, r) * 5
        t["markov_head.markov_w2.weight"] = rand(v, r) * 5
        if config["markov_head_type"] == "gated":
            t["markov_head.gate_proj.weight"], t["markov_head.gate_proj.bias"] = rand(r, d + r), rand(r)
        if config["markov_head_type"] == "rnn":
            t["markov_head.joint_proj.weight"], t["markov_head.joint_proj.bias"] = rand(3 * r, 2 * r + d), rand(3 * r)
    if config["enable_confidence_head"]:
        t["confidence_head.proj.weight"] = rand(1, d + (r if config["confidence_head_with_markov"] else 0))
        t["confidence_head.proj.bias"] = torch.zeros(1)
    # DeepSpec checkpoints carry copies of the target's embedding and LM head; the engine ignores them.
    t["embed_tokens.weight"], t["lm_head.weight"] = rand(v, d), rand(v, d)
    return t


def make_oracle(tensors: dict[str, torch.Tensor], config: dict, table: torch.Tensor) -> None:
    """Turn a drafter into one that proposes argmax(table[x_{k-1}]) at every slot.

    The final norm is zeroed so the backbone's logits U_k vanish, and the Markov head (rank = V,
    W1 = identity) adds exactly ``table[x_{k-1}]``: the drafts are the greedy chain of a bigram target.
    """
    v, kind = config["vocab_size"], config["markov_head_type"]
    assert config["markov_rank"] == v
    tensors["norm.weight"] = torch.zeros(config["hidden_size"])
    tensors["markov_head.markov_w1.weight"] = torch.eye(v)
    tensors["markov_head.markov_w2.weight"] = table.T.contiguous()
    if kind == "gated":  # gate ~ 1 whatever h_k: sigmoid(20) * e
        tensors["markov_head.gate_proj.weight"].zero_()
        tensors["markov_head.gate_proj.bias"].fill_(20.0)
    if kind == "rnn":  # o = 20 * e (tanh ~ e), g and c irrelevant
        w = torch.zeros(3 * v, 2 * v + config["hidden_size"])
        w[2 * v:, v:2 * v] = 20 * torch.eye(v)
        tensors["markov_head.joint_proj.weight"], tensors["markov_head.joint_proj.bias"] = w, torch.zeros(3 * v)


def save_drafter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
