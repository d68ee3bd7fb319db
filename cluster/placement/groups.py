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


def enclosing(plan: PlacementPlan) -> PlacementGroup:
    """The placement group this process runs in (a Serve replica's), checked to hold the replica's own bundle
    plus ``plan``'s bundles (raises ``PlacementError`` otherwise)."""
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    if group is None:
        raise PlacementError("parallel.placement_group='enclosing' needs a process that runs in a placement group "
                             "(a Serve replica deployed with placement_group_bundles: cluster.serve.build_app)")
    bundles = list(placement_group_table(group).get("bundles", {}).values())
    if len(bundles) < 1 + len(plan.bundles) or any(
            bundle.get(k, 0) < v for bundle, want in zip(bundles[1:], plan.bundles) for k, v in want.items()):
        raise PlacementError(f"the enclosing placement group's bundles {bundles} do not hold the replica's own "
                             f"bundle plus {plan.bundles}")
    return group


def serve_bundles(plan: PlacementPlan, replica_resources: dict) -> list[dict]:
    """The ``placement_group_bundles`` of a Serve deployment whose replica runs ``plan``: bundle 0 holds the
    Serve replica actor itself (its ``ray_actor_options`` resources), then the plan's bundles."""
    own = {"CPU": float(replica_resources.get("num_cpus", 1))}
    if replica_resources.get("num_gpus"):
        own["GPU"] = float(replica_resources["num_gpus"])
    return [own] + [dict(b) for b in plan.bundles]


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
