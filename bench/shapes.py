"""Model shapes the bench builds with random weights, and their synthetic checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

MODEL_SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 MoE layers of 128 experts, 8 per token (norm_topk_prob), 3.3B parameters read per token
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=False),
    "tiny-moe": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


DRAFT_LAYER_IDS = {"qwen3-8b": [1, 17, 33], "qwen3-30b-a3b": [1, 23, 45], "tiny": [0], "tiny-moe": [0]}


MOE_SHAPES = {"qwen3-30b-a3b", "tiny-moe"}  # written as qwen3_moe; their 1-layer-per-depth drafters stay dense


def write_shape(root: Path, shape: str, draft_layers: int, block_size: int) -> tuple[Path, Path]:
    """config.json-only target and drafter directories of ``shape`` (loaded with load_format='dummy')."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = MODEL_SHAPES[shape]
    target = root / f"{shape}-target"
    family = Qwen3MoeConfig if shape in MOE_SHAPES else Qwen3Config
    family(**fields, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16").save_pretrained(str(target))
    drafter = root / f"{shape}-drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="qwen3", num_experts=0)  # a dense Qwen3 drafter of the target's width
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=fields["num_hidden_layers"],
                  num_hidden_layers=draft_layers, block_size=block_size, mask_token_id=fields["vocab_size"] - 1,
                  target_layer_ids=DRAFT_LAYER_IDS[shape], markov_rank=256, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True,
                  layer_types=["full_attention"] * draft_layers)
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter
