"""The TP transform: each rank holds (and reads) exactly its slice of every weight."""

import pytest
import torch
from safetensors import safe_open

from runtime.kernels import get_backend
from runtime.models.loader import load_target
from runtime.models.parallel import ParallelContext, shard_range


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
    from runtime.models.parallel import apply_tensor_parallel
    from runtime.models.target import TargetModel
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
    from runtime.models.parallel import apply_tensor_parallel
    from runtime.models.target import TargetModel
    from tests import builders

    odd = TargetModel(builders.target_config("qwen3_moe", moe_intermediate_size=33), get_backend("torch"), "VANILLA")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the target's moe_intermediate_size"):
        apply_tensor_parallel(odd, ParallelContext(rank=0, world_size=2))


def _top_argmax_rank(rank: int, world: int, port: int, x, weight, queue) -> None:
    import torch.distributed as dist
    from torch import nn

    from runtime.models.parallel import ParallelLMHead

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        full = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head = ParallelLMHead(full, ParallelContext(rank, world, dist.group.WORLD))
        a, b = shard_range(weight.shape[0], head.ctx)
        with torch.no_grad():
            head.weight.zero_()
            head.weight[:b - a] = weight[a:b]
            logits = head(x).float()
            top, index = head.top_argmax(x)
        gathered = logits.max(dim=-1)
        # plain lists: a tensor crosses a queue as a shared-memory handle the parent can only open while this
        # process still lives, and it may have exited by then
        queue.put((rank, (gathered.values.tolist(), gathered.indices.tolist()), (top.tolist(), index.tolist())))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_argmax_equals_the_gathered_logits_max():
    """Three ranks over a vocabulary of 10 (the last shard half padding, whose zero logits must never win): the
    reduced (max, argmax) equals the gathered logits' for rows with ties across ranks, all-negative logits and a
    NaN."""
    import socket

    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=gen)
    weight[:, :5] /= weight[:, :5].norm(dim=1, keepdim=True)  # unit rows over the first five features
    weight[:, 5] = 1.0  # a constant feature: x[:, 5] shifts every logit of a row
    weight[7] = weight[2]  # tokens 2 (rank 0) and 7 (rank 1) always tie
    x = 0.1 * torch.randn(5, 6, generator=gen)
    x[1, :5], x[1, 5] = 5.0 * weight[2, :5], 0.0  # the max is the tie (Cauchy-Schwarz): the lower token wins
    x[2, 5] = -100.0  # every logit negative: the last shard's padding zeros must not win
    x[3, 0] = float("nan")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_top_argmax_rank, args=(r, 3, port, x, weight, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    want = (x @ weight.T).max(dim=-1)
    assert want.indices[1] == 2 and want.values[2] < 0
    rows = [0, 1, 2, 4]
    for _, (gathered_top, gathered_index), (top, index) in results:
        gathered_top, gathered_index, top, index = (torch.tensor(v) for v in (gathered_top, gathered_index, top,
                                                                             index))
        assert torch.equal(index, gathered_index) and torch.equal(index[rows], want.indices[rows])
        assert torch.allclose(top[rows], gathered_top[rows]) and top[3].isnan() and gathered_top[3].isnan()


class _MarkingReducer:
    """Serves tensors of at most 4 elements and marks its sums (x 100), so a test tells the two paths apart."""

    def serves(self, x: torch.Tensor) -> bool:
        return x.numel() <= 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 100


def _choose_rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from runtime.worker.all_reduce import choose_reducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group, cpu, where = dist.group.WORLD, torch.device("cpu"), f"target rank {rank}"
        chosen = [choose_reducer(strategy, group, cpu, torch.float32, where)[1] for strategy in ("NCCL", "AUTO")]
        try:
            choose_reducer("ONESHOT", group, cpu, torch.float32, where)
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        ctx = ParallelContext(rank, world, group, _MarkingReducer())
        small, large = ctx.all_reduce(torch.ones(4)), ctx.all_reduce(torch.ones(8))
        queue.put((rank, chosen, refused, small.tolist(), large.tolist()))
    finally:
        dist.destroy_process_group()


def test_the_ranks_choose_how_they_sum_together_and_a_one_shot_reducer_takes_the_messages_it_serves():
    """``runtime.worker.all_reduce.choose_reducer`` over gloo (two CPU ranks): NCCL is the process group's all-reduce;
    AUTO takes it on every rank and says why; ONESHOT is an error naming the rank. ``ParallelContext.all_reduce``
    sends the messages a reducer serves through it, the rest through the process group."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_choose_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, chosen, refused, small, large in results:
        assert chosen == ["NCCL", "NCCL (AUTO: ONESHOT cannot run: it needs CUDA devices, this rank runs on cpu)"]
        assert refused == f"target rank {rank}: allreduce_strategy='ONESHOT' cannot run: it needs CUDA devices, " \
                          "this rank runs on cpu"
        assert small == [100.0] * 4 and large == [2.0] * 8
