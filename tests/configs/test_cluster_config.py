"""The replica layout's cross-field rules (configs.cluster), named in their errors."""

import pytest

from configs import LLMConfig
from configs.cluster import ParallelConfig, ReplicaConfig


def engine(rejection: bool = False) -> LLMConfig:
    return LLMConfig(model="m", speculative_config={"speculative_model": "d", "use_rejection_sampling": rejection})


def test_a_pipelined_drafter_needs_a_separate_drafter_and_exact_match_verification():
    ReplicaConfig(engine=engine(), parallel=ParallelConfig(drafter="separate", pipeline_drafter=True))
    ReplicaConfig(engine=engine(), parallel=ParallelConfig(drafter="separate", pipeline_drafter=True,
                                                           pipeline_drafter_min_batch=8))
    with pytest.raises(ValueError, match=r"pipeline_drafter_min_batch is read with pipeline_drafter=True only"):
        ReplicaConfig(engine=engine(), parallel=ParallelConfig(drafter="separate", pipeline_drafter_min_batch=8))
    with pytest.raises(ValueError, match="pipeline_drafter_min_batch"):
        ParallelConfig(pipeline_drafter_min_batch=0)
    with pytest.raises(ValueError, match=r"pipeline_drafter=True needs parallel.drafter='separate', got 'colocated'"):
        ReplicaConfig(engine=engine(), parallel=ParallelConfig(pipeline_drafter=True))
    with pytest.raises(ValueError, match="use_rejection_sampling=False"):
        ReplicaConfig(engine=engine(rejection=True), parallel=ParallelConfig(drafter="separate",
                                                                              pipeline_drafter=True))


def test_a_one_shot_all_reduce_needs_ranks_to_sum_over_and_cuda():
    plain = LLMConfig(model="m")
    ReplicaConfig(engine=plain, parallel=ParallelConfig(tensor_parallel_size=2, allreduce_strategy="ONESHOT"))
    ReplicaConfig(engine=plain, parallel=ParallelConfig(allreduce_strategy="AUTO"))  # (AUTO: NCCL where it must)
    with pytest.raises(ValueError, match=r"allreduce_strategy='ONESHOT' needs tensor_parallel_size > 1"):
        ReplicaConfig(engine=plain, parallel=ParallelConfig(allreduce_strategy="ONESHOT"))
    with pytest.raises(ValueError, match=r"allreduce_strategy='ONESHOT' runs on CUDA devices, engine.device is 'cpu'"):
        ReplicaConfig(engine=LLMConfig(model="m", device="cpu"),
                      parallel=ParallelConfig(tensor_parallel_size=2, allreduce_strategy="ONESHOT"))
    with pytest.raises(ValueError, match="allreduce_strategy"):
        ParallelConfig(allreduce_strategy="TWOSHOT")
