"""Where a Serve application's replicas run: each replica's shards and drafter, planned where the app is built."""

from __future__ import annotations

import ray

from cluster.placement import groups
from cluster.placement.plan import NodeResources, PlacementError, PlacementPlan, plan_placement
from configs import ServeArgs


def serve_plan(parsed: ServeArgs) -> PlacementPlan:
    """The placement of each Serve replica's shards and drafter, decided where the app is built. A ``cuda``
    engine declares GPU bundles even when the cluster shows no GPUs yet (workers still starting, or autoscaling
    from zero): Serve then holds the replica until the cluster grants them (PACK unless a strategy is set)."""
    engine, speculative = parsed.engine, parsed.engine.speculative_config is not None
    use_gpus = engine.device.startswith("cuda") or (
        engine.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    try:
        return plan_placement(parsed.parallel, speculative, use_gpus, groups.cluster_nodes())
    except PlacementError:
        if not engine.device.startswith("cuda"):
            raise
        strategy = parsed.parallel.placement_strategy or "PACK"
        pending = parsed.parallel.model_copy(update={"placement_strategy": strategy})
        return plan_placement(pending, speculative, True, [NodeResources("pending", float("inf"), float("inf"))])
