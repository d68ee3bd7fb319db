"""On CUDA: the engine matches its CPU output; TP=2 over NCCL and a separate drafter on a second GPU match
the single-GPU output (fp32, random-weight models); a graphed TP=1 replica matches one process. Skipped without a
GPU (without Ray for the replica tests, and two GPUs for the TP=2 and separate ones)."""

import pytest
import torch

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
ENGINE = dict(dtype="float32", num_pages=256, page_size=16)


def spec(drafter, **kw):
    return DSparkDecodingConfig(speculative_model=str(drafter), **kw)


@pytest.mark.parametrize("rejection", [False, True])
def test_cuda_matches_cpu(near_bigram_target, make_drafter, rejection):
    drafter = make_drafter(near_bigram_target, 4, "gated", oracle=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(near_bigram_target), speculative_config=spec(drafter, use_rejection_sampling=rejection),
                  device=device, **ENGINE)
        outs[device] = ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
                        [o.token_ids for o in llm.generate(PROMPTS, SEEDED)], llm.get_metrics())
    assert outs["cuda"][0] == outs["cpu"][0]
    assert outs["cuda"][2]["mean_acceptance_length"] > 2
    same = sum(a == b for a, b in zip(outs["cuda"][1], outs["cpu"][1]))
    assert same >= 2  # fp32 on two devices: sampled paths may part after a near-tie, rarely


@pytest.fixture(scope="module")
def ray_local():
    """A Ray cluster of this test module's own on this host's GPUs."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def ray_gpus(ray_local):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, drafter="colocated"),
                                    dict(tensor_parallel_size=1, drafter="separate")], ids=["tp2-nccl", "separate"])
def test_replica_on_two_gpus_matches_one_gpu(ray_gpus, near_bigram_target, make_drafter, layout):
    from cluster import LLM as ClusterLLM

    drafter = make_drafter(near_bigram_target, 4, "vanilla", oracle=True)
    single = LLM(str(near_bigram_target), speculative_config=spec(drafter), device="cuda", **ENGINE)
    expected = [o.token_ids for o in single.generate(PROMPTS, GREEDY)]
    with ClusterLLM(str(near_bigram_target), speculative_config=spec(drafter), device="cuda", **layout,
                    **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        info = llm.rank_info()
        assert all(i["device"].startswith("cuda") for i in info) and len({i["pid"] for i in info}) == 2


@pytest.fixture(scope="module")
def wide_target(checkpoints):
    """head_dim 128 (FlashInfer's kernels), 4 layers, in bf16; 2 key/value heads split over 2 ranks."""
    from tests import builders

    return builders.save_target(checkpoints / "wide-qwen3-tp", "qwen3", seed=11, residual_scale=0.6, hidden_size=512,
                                intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def test_tp2_cuda_graphs_equal_the_eager_replica(ray_gpus, wide_target, make_drafter):
    """TP=2 over NCCL with FlashInfer in bf16: each rank captures its graphs (all-reduces and the LM head's
    max/argmax gather inside), and the graphed replica gives the eager replica's tokens, greedy and sampled (a
    sampled step computes its logits from the graph's hidden states)."""
    pytest.importorskip("flashinfer")
    from cluster import LLM as ClusterLLM

    drafter = spec(make_drafter(wide_target, 4, oracle=True))
    engine = dict(dtype="bfloat16", device="cuda", num_pages=256, page_size=16, kernel_backend="flashinfer",
                  max_num_seqs=8, tensor_parallel_size=2)
    runs = {}
    for eager in (False, True):
        with ClusterLLM(str(wide_target), speculative_config=drafter, enforce_eager=eager, **engine) as llm:
            info = llm.rank_info()
            assert [i["cuda_graphs"] for i in info] == [not eager] * 2
            runs[eager] = ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
                           [o.token_ids for o in llm.generate(PROMPTS, SEEDED)])
            if not eager:
                assert all(i["graph_replays"] == 0 for i in info)  # counted at describe time: before generate
                assert all(i["graph_replays"] > 0 for i in llm.rank_info())
    assert runs[False][0] == runs[True][0]
    assert sum(a == b for a, b in zip(runs[False][1], runs[True][1])) >= 2  # bf16 near-ties may part a sample


def test_tp2_greedy_decoding_runs_ahead_on_every_rank_and_equals_the_eager_replica(ray_gpus, wide_target):
    """An autoregressive TP=2 replica on CUDA graphs: both ranks launch each steady decode step ahead of the driver's
    commit alike (the same steps from the same batches and gathered verdicts, so their all-reduces pair up), and
    its greedy tokens equal the eager replica's."""
    pytest.importorskip("flashinfer")
    from cluster import LLM as ClusterLLM

    engine = dict(dtype="bfloat16", device="cuda", num_pages=256, page_size=16, kernel_backend="flashinfer",
                  max_num_seqs=8, tensor_parallel_size=2)
    runs = {}
    for eager in (False, True):
        with ClusterLLM(str(wide_target), enforce_eager=eager, **engine) as llm:
            assert llm.engine.executor.runs_ahead == (not eager) and not llm.engine.executor.verifies_ahead
            runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            if not eager:
                info = llm.rank_info()
                ahead = [i["steps_run_ahead"] for i in info]
                assert ahead[0] > 0 and ahead[0] == ahead[1], ahead
                assert info[0]["graph_replays"] == info[1]["graph_replays"]
    assert runs[False] == runs[True]


def test_tp2_one_shot_all_reduce_gives_the_nccl_replicas_tokens(ray_gpus, wide_target, make_drafter):
    """allreduce_strategy='ONESHOT': both ranks sum through PyTorch symmetric memory inside their graphs (decode,
    verify and prefill steps), and the replica's greedy tokens equal NCCL's (two bf16 partials sum alike either
    way); each rank says what it chose."""
    pytest.importorskip("flashinfer")
    from cluster import LLM as ClusterLLM

    drafter = spec(make_drafter(wide_target, 4, oracle=True))
    engine = dict(dtype="bfloat16", device="cuda", num_pages=256, page_size=16, kernel_backend="flashinfer",
                  max_num_seqs=8, tensor_parallel_size=2)
    runs = {}
    for strategy in ("NCCL", "ONESHOT"):
        for speculative in (None, drafter):
            with ClusterLLM(str(wide_target), speculative_config=speculative, allreduce_strategy=strategy,
                            **engine) as llm:
                assert [i["allreduce"] for i in llm.rank_info()] == [strategy] * 2
                runs[strategy, speculative is None] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert runs["ONESHOT", True] == runs["NCCL", True] and runs["ONESHOT", False] == runs["NCCL", False]


def test_a_graphed_tp1_replica_runs_ahead_and_equals_one_process(ray_local, wide_target, make_drafter):
    """A TP=1 replica with its drafter colocated, on one GPU, FlashInfer graphs in bf16: the worker launches steady
    steps ahead of the driver's commit (``RayExecutor.runs_ahead``) as one process does, and its tokens equal the
    one-process engine's (the same kernels on the same batches), greedy and seeded."""
    pytest.importorskip("flashinfer")
    from cluster import LLM as ClusterLLM

    drafter = spec(make_drafter(wide_target, 4, oracle=True))
    engine = dict(dtype="bfloat16", device="cuda", num_pages=256, page_size=16, kernel_backend="flashinfer",
                  max_num_seqs=8)
    single = LLM(str(wide_target), speculative_config=drafter, **engine)
    expected = ([o.token_ids for o in single.generate(PROMPTS, GREEDY)],
                [o.token_ids for o in single.generate(PROMPTS, SEEDED)])
    del single
    with ClusterLLM(str(wide_target), speculative_config=drafter, tensor_parallel_size=1, **engine) as llm:
        assert llm.engine.executor.runs_ahead
        got = ([o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
               [o.token_ids for o in llm.generate(PROMPTS, SEEDED)])
        (info,) = llm.rank_info()
        assert info["cuda_graphs"] and info["steps_run_ahead"] > 0
    assert got[0] == expected[0]
    assert sum(a == b for a, b in zip(got[1], expected[1])) >= 2  # (as the TP=2 test: a near-tie may part a sample)


def test_a_pinned_read_back_waits_for_its_copy_alone():
    """``runtime.kernels.transfer.PinnedReadBack``: the rows land on the host as they were when queued, though the
    tensor is overwritten by work queued after (a step launched ahead); the buffer grows for a larger copy."""
    from runtime.kernels.transfer import PinnedReadBack

    read = PinnedReadBack(4)
    rows = torch.arange(6, device="cuda").view(2, 3)
    read.queue(rows)
    rows.fill_(-1)  # queued after the copy, as the next replay is
    assert read.wait().tolist() == [[0, 1, 2], [3, 4, 5]]
    read.queue(torch.ones(3, 5, dtype=torch.int64, device="cuda"))
    assert read.wait().tolist() == [[1] * 5] * 3


ONE_RANK_ONESHOT = """
import datetime, socket, sys
import torch, torch.distributed as dist
from runtime.worker.all_reduce import choose_reducer
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
group = dist.new_group([0])
reducer, chosen = choose_reducer("ONESHOT", group, torch.device("cuda"), torch.bfloat16, "target rank 0")
x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
assert chosen == "ONESHOT" and reducer.serves(x) and not reducer.serves(x.float())
eager = reducer(x)
graph, static = torch.cuda.CUDAGraph(), x.clone()
torch.cuda.synchronize()
with torch.cuda.graph(graph):
    out = reducer(static)
static.mul_(2)
graph.replay()
torch.cuda.synchronize()
assert torch.equal(eager, x) and torch.equal(out, 2 * x), (eager - x).abs().max()
dist.destroy_process_group()
print("one-shot ok")
"""


def test_the_one_shot_reducer_runs_eagerly_and_in_a_cuda_graph_on_this_torch():
    """``runtime.worker.all_reduce.OneShotAllReduce`` on a group of one rank (one GPU suffices): the ranks' choice, the
    symmetric buffer's rendezvous and the operator on this host's torch, eager and replayed in a CUDA graph (a
    group of one sums to its own rows). The sums across two GPUs: the TP=2 test above."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", ONE_RANK_ONESHOT], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "one-shot ok" in done.stdout, done.stderr[-3000:]
