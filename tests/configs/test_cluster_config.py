"""The replica layout's cross-field rules (configs.cluster), named in their errors."""

import pytest

from configs import LLMConfig
from configs.cluster import ParallelConfig, ReplicaConfig


def engine(rejection: bool = False) -> LLMConfig:
    return LLMConfig(model="m", speculative_config={"speculative_model": "d", "use_rejection_sampling": rejection})


def test_a_pipelined_drafter_needs_a_separate_drafter_and_exact_match_verification():
    ReplicaConfig(engine=engine(), parallel=ParallelConfig(drafter="separate", pipeline_drafter=True))
    with pytest.raises(ValueError, match=r"pipeline_drafter=True needs parallel.drafter='separate', got 'colocated'"):
        ReplicaConfig(engine=engine(), parallel=ParallelConfig(pipeline_drafter=True))
    with pytest.raises(ValueError, match="use_rejection_sampling=False"):
        ReplicaConfig(engine=engine(rejection=True), parallel=ParallelConfig(drafter="separate",
                                                                              pipeline_drafter=True))
