"""Placement planning as data: no cluster needed."""

import pytest

from cluster.placement.plan import NodeResources, PlacementError, plan_placement
from configs import ParallelConfig

ONE_NODE = [NodeResources("a", gpus=8, cpus=64)]
TWO_NODES = [NodeResources("a", gpus=2, cpus=32), NodeResources("b", gpus=2, cpus=32)]
GPU = {"GPU": 1.0, "CPU": 1.0}


def plan(nodes, speculative=True, gpus=True, **parallel):
    return plan_placement(ParallelConfig(**parallel), speculative, gpus, nodes)


def test_one_node_separate_drafter():
    p = plan(ONE_NODE, tensor_parallel_size=2, drafter="separate")
    assert (p.bundles, p.strategy, p.rank_to_bundle, p.roles) == (
        [GPU, GPU, GPU], "STRICT_PACK", {0: 0, 1: 1, 2: 2}, ["target", "target", "drafter"])


def test_colocated_drafter_has_no_bundle():
    p = plan(ONE_NODE, tensor_parallel_size=4, drafter="colocated")
    assert p.bundles == [GPU] * 4 and p.roles == ["target"] * 4 and p.strategy == "STRICT_PACK"
    assert plan(ONE_NODE, speculative=False, drafter="separate").roles == ["target"]


def test_two_nodes_pack_across():
    p = plan(TWO_NODES, tensor_parallel_size=4, drafter="colocated")
    assert p.strategy == "PACK" and len(p.bundles) == 4
    p = plan(TWO_NODES, tensor_parallel_size=2, drafter="separate")
    assert p.strategy == "PACK" and len(p.bundles) == 3  # 3 GPUs: no node has them all


def test_not_enough_gpus_is_a_clear_error():
    with pytest.raises(PlacementError, match=r"tensor_parallel_size=4 \+ a separate drafter\) needs 5 GPUs; the "
                                             r"cluster has 4 across 2 node\(s\)"):
        plan(TWO_NODES, tensor_parallel_size=4, drafter="separate")
    with pytest.raises(PlacementError, match="needs 1 GPUs; the cluster has 0"):
        plan([NodeResources("cpu-only", cpus=8)])


def test_strategy_override_is_checked():
    assert plan(ONE_NODE, tensor_parallel_size=2, placement_strategy="SPREAD").strategy == "SPREAD"
    with pytest.raises(PlacementError, match="STRICT_PACK needs 3 GPUs on one node"):
        plan(TWO_NODES, tensor_parallel_size=2, drafter="separate", placement_strategy="STRICT_PACK")
    with pytest.raises(PlacementError, match="STRICT_SPREAD needs 3 nodes"):
        plan(TWO_NODES, tensor_parallel_size=2, drafter="separate", placement_strategy="STRICT_SPREAD")


def test_cpu_only_bundles_for_tests():
    p = plan([NodeResources("laptop", cpus=4)], gpus=False, tensor_parallel_size=2, drafter="separate")
    assert p.bundles == [{"CPU": 1.0}] * 3 and p.strategy == "STRICT_PACK"
