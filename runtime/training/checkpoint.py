"""Writing a trained drafter in the DeepSpec layout (what ``runtime.models.loader`` reads back)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from runtime.models.drafter import DSparkDrafter


def draft_config(target_config: dict, *, block_size: int, mask_token_id: int, target_layer_ids: list[int],
                 num_draft_layers: int, markov_rank: int, markov_head_type: str, confidence_head: bool,
                 confidence_head_with_markov: bool, num_anchors: int) -> dict:
    """The target's model fields plus DeepSpec's drafter keys."""
    config = {k: v for k, v in target_config.items() if k not in ("architectures", "auto_map", "layer_types")}
    config.update(architectures=["Qwen3DSparkModel"], model_type="qwen3",
                  num_target_layers=target_config["num_hidden_layers"], num_hidden_layers=num_draft_layers,
                  block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=list(target_layer_ids),
                  markov_rank=markov_rank, markov_head_type=markov_head_type, num_anchors=num_anchors,
                  enable_confidence_head=confidence_head,
                  confidence_head_with_markov=confidence_head and confidence_head_with_markov and markov_rank > 0,
                  layer_types=["full_attention"] * num_draft_layers, tie_word_embeddings=False)
    return config


def save_drafter(out: Path, drafter: DSparkDrafter, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
