"""Shared fixtures: tiny checkpoints built once per session (see builders.py)."""

from __future__ import annotations

import os

# OpenMP's threads (torch's intra-op pool) spin after each parallel region before they sleep; the suite runs its two
# workers' torch threads and the Ray actors' on two cores, where those spins took the cores from
# the threads with work: two 2-thread training runs side by side took 3.9x their time alone, 1.9x with passive
# waiting (alone 1.25x: the product keeps OpenMP's default). Set before torch loads here, inherited by every process
# the tests start (xdist workers, subprocesses, Ray clusters and their actors).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import builders  # noqa: E402

# Ray Serve kills an HTTP proxy not ready within 5 s; on the suite's two busy cores (a training test's threads
# beside a Ray test) one was killed before it ran and serve.start failed. The clusters the tests start, and the
# `dspark serve` processes they spawn, inherit this environment.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

# ./run-tests spreads the suite over two worker processes (pytest-xdist). Every test that starts a Ray cluster (marked
# ``ray``, in its own process or a child's) starts one of its own (``address="local"``, or its address passed on:
# a cluster already running on the machine is neither joined nor stopped) and lives in one of these files; the files
# run in one worker, one test after another, so two clusters' actors never share the two cores (a TP=4 replica's
# collectives slowed 10x beside other work). Grouped here by path: xdist's own ``xdist_group`` marks do not reach
# pytest 9's node ids.
RAY_FILES = ("tests/cluster/test_replica.py", "tests/cluster/test_serve.py", "tests/cluster/test_two_nodes.py",
             "tests/runtime/test_training_ray.py", "tests/test_bench_ray.py", "tests/test_cli_ray.py",
             "tests/gpu/test_cuda.py")


def pytest_xdist_make_scheduler(config, log):
    """Load scheduling, test by test, except the Ray files: one unit of work, in one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.split("::", 1)[0] in RAY_FILES else nodeid

    return RayFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    stray = [item.nodeid for item in items if "ray" in item.keywords and item.nodeid.split("::", 1)[0] not in RAY_FILES]
    if stray:  # it would run beside the Ray files' tests, in the other worker
        raise pytest.UsageError(f"tests marked ray outside tests/conftest.py's RAY_FILES: {stray}")
    # tests marked last run at the end of their worker's share (the Ray unit's: by then the other worker has finished
    # and idles): four gloo ranks of a TP=4 replica on two cores took 109-132 s each beside the other worker's tests,
    # ~10 s alone (the suite 13.8 min against ~11)
    # and the test marked first (the real demo model end to end, the longest single test) heads the collection:
    # xdist hands the Ray unit (the largest scope) to one worker and the next scope to the other, so it runs beside
    # the Ray unit from the start rather than ending the suite alone
    items.sort(key=lambda item: ("last" in item.keywords, "first" not in item.keywords))  # stable otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (``address="local"``: never one already running on the machine)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def qwen3_target(checkpoints):
    return builders.save_target(checkpoints / "qwen3", "qwen3", seed=1)


@pytest.fixture(scope="session")
def llama_target(checkpoints):
    return builders.save_target(checkpoints / "llama", "llama", seed=2)


@pytest.fixture(scope="session")
def moe_target(checkpoints):
    """qwen3_moe: 8 experts, 2 per token, on layers 0, 2, 3 (layer 1 dense)."""
    return builders.save_target(checkpoints / "qwen3-moe", "qwen3_moe", seed=7, residual_scale=0.8)


@pytest.fixture(scope="session")
def bigram_target(checkpoints):
    """Attention and MLP add nothing: logits depend on the current token only."""
    return builders.save_target(checkpoints / "bigram", "qwen3", seed=3, residual_scale=0.0)


@pytest.fixture(scope="session")
def near_bigram_target(checkpoints):
    """Mostly a bigram table, sometimes overruled by context: an oracle drafter is often but not always right."""
    return builders.save_target(checkpoints / "near-bigram", "qwen3", seed=4, residual_scale=0.6)


@pytest.fixture(scope="session")
def make_drafter(checkpoints):
    counter = itertools.count()
    cache: dict = {}

    def make(target_dir, block_size: int, head_type: str = "vanilla", markov_rank: int = 16, confidence: bool = True,
             oracle: bool = False, seed: int = 0, oracle_scale: float = 1.0, **config_overrides):
        key = (str(target_dir), block_size, head_type, markov_rank, confidence, oracle, seed, oracle_scale,
               tuple(sorted(config_overrides.items())))
        if key not in cache:
            rank = builders.VOCAB if oracle else markov_rank
            config = builders.drafter_config(target_dir, block_size=block_size, markov_rank=rank, head_type=head_type,
                                             confidence=confidence)
            config.update(config_overrides)
            tensors = builders.drafter_tensors(config, seed=seed)
            if oracle:
                builders.make_oracle(tensors, config, oracle_scale * builders.bigram_table(target_dir))
            cache[key] = builders.save_drafter(checkpoints / f"drafter-{next(counter)}", config, tensors)
        return cache[key]

    return make
