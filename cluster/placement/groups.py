"""The one module that creates and removes Ray placement groups."""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from cluster.placement.plan import NodeResources, PlacementError, PlacementPlan


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the connected Ray cluster and their total GPUs / CPUs."""
    return [NodeResources(node_id=n["NodeID"], gpus=n["Resources"].get("GPU", 0.0), cpus=n["Resources"].get("CPU", 0.0))
            for n in ray.nodes() if n.get("Alive")]


def create(plan: PlacementPlan, name: str, timeout_s: float) -> PlacementGroup:
    """Reserve the plan's bundles; raises ``PlacementError`` if they are not granted within ``timeout_s``."""
    group = placement_group(plan.bundles, strategy=plan.strategy, name=name)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(f"placement group {name!r} ({plan.strategy}, bundles {plan.bundles}) was not granted "
                             f"within {timeout_s:g}s: the cluster lacks free resources (busy, or autoscaling that "
                             "never came)") from None
    return group


def remove(group: PlacementGroup | None, wait_s: float = 30.0) -> None:
    """Remove ``group`` and wait (up to ``wait_s``) until Ray reports it gone and its resources free."""
    if group is None:
        return
    remove_placement_group(group)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if placement_group_table(group).get("state") == "REMOVED":
            return
        time.sleep(0.05)
