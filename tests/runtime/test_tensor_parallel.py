"""The TP transform: each rank holds (and reads) exactly its slice of every weight."""

import pytest
import torch
from safetensors import safe_open

from runtime.kernels import get_backend
from runtime.loader import load_target
from runtime.parallel import ParallelContext, shard_range


def full_weights(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_loads_its_slice(qwen3_target, world):
    full = full_weights(qwen3_target)
    for rank in range(world):
        ctx = ParallelContext(rank=rank, world_size=world)  # loading needs no process group
        model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"), ctx)
        params = dict(model.named_parameters())
        q = params["model.layers.0.self_attn.q_proj.weight"]
        a, b = shard_range(full["model.layers.0.self_attn.q_proj.weight"].shape[0], ctx)
        assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][a:b])
        down = params["model.layers.1.mlp.down_proj.weight"]
        a, b = shard_range(full["model.layers.1.mlp.down_proj.weight"].shape[1], ctx)
        assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"][:, a:b])
        emb = params["model.embed_tokens.weight"]
        a, b = shard_range(320, ctx)
        assert torch.equal(emb[:b - a], full["model.embed_tokens.weight"][a:b])
        assert torch.equal(params["model.layers.0.input_layernorm.weight"], full["model.layers.0.input_layernorm.weight"])
        heads = q.shape[0] // model.model.layers[0].self_attn.head_dim
        assert heads == 4 // world


@pytest.mark.parametrize("world,field", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_heads_must_divide(qwen3_target, world, field):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={world} must divide the target's {field}"):
        load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"),
                    ParallelContext(rank=0, world_size=world))
