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


def test_heads_must_divide(qwen3_target):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the target's num_attention_heads"):
        load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"),
                    ParallelContext(rank=0, world_size=3))
    from runtime.models.target import TargetModel
    from runtime.parallel import apply_tensor_parallel
    from tests import builders

    odd = TargetModel(builders.target_config("qwen3", num_attention_heads=6, num_key_value_heads=3),
                      get_backend("torch"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the target's num_key_value_heads "
                                         r"\(3\), or be a multiple of it"):
        apply_tensor_parallel(odd, ParallelContext(rank=0, world_size=2))


def test_more_ranks_than_kv_heads_replicate_each_kv_head_on_the_ranks_that_read_it(qwen3_target):
    """4 query heads over 2 key/value heads on 4 ranks: rank r holds query head r and key/value head r // 2."""
    full = full_weights(qwen3_target)
    k_full, q_full = full["model.layers.2.self_attn.k_proj.weight"], full["model.layers.2.self_attn.q_proj.weight"]
    for rank in range(4):
        model = load_target(str(qwen3_target), get_backend("torch"), torch.float32, torch.device("cpu"),
                            ParallelContext(rank=rank, world_size=4))
        attn = model.model.layers[2].self_attn
        assert torch.equal(attn.q_proj.weight, q_full[rank * 16:(rank + 1) * 16])
        head = rank // 2
        assert torch.equal(attn.k_proj.weight, k_full[head * 16:(head + 1) * 16])


def test_each_rank_loads_its_slice_of_every_expert_and_the_whole_router(moe_target):
    full = full_weights(moe_target)
    parts = []
    for rank in range(2):
        ctx = ParallelContext(rank=rank, world_size=2)
        model = load_target(str(moe_target), get_backend("torch"), torch.float32, torch.device("cpu"), ctx,
                            moe_backend="VANILLA")
        block = model.model.layers[0].mlp
        assert block.parallel is ctx
        params = dict(model.named_parameters())
        assert torch.equal(params["model.layers.0.mlp.gate.weight"], full["model.layers.0.mlp.gate.weight"])
        parts.append((params["model.layers.0.mlp.experts.3.up_proj.weight"],
                      params["model.layers.0.mlp.experts.3.down_proj.weight"]))
    assert torch.equal(torch.cat([p[0] for p in parts]), full["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(torch.cat([p[1] for p in parts], dim=1), full["model.layers.0.mlp.experts.3.down_proj.weight"])
    from runtime.models.target import TargetModel
    from runtime.parallel import apply_tensor_parallel
    from tests import builders

    odd = TargetModel(builders.target_config("qwen3_moe", moe_intermediate_size=33), get_backend("torch"), "VANILLA")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the target's moe_intermediate_size"):
        apply_tensor_parallel(odd, ParallelContext(rank=0, world_size=2))
