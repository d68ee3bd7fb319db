"""Pure placement planning: a replica's layout -> bundles, strategy and rank map. No Ray calls.

One bundle per process: TP ranks 0..N-1 first, then a separate drafter. Example: two nodes with
4 GPUs each and ``tensor_parallel_size=2, drafter="separate"`` -> bundles
``[{"GPU": 1, "CPU": 1}] * 3``, strategy ``STRICT_PACK`` (fits one node), ranks ``{0: 0, 1: 1, 2: 2}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs import ParallelConfig


class PlacementError(ValueError):
    """The cluster cannot hold the replica; the message says what is needed and what exists."""


@dataclass(frozen=True)
class NodeResources:
    """What one node offers (Ray's resource names)."""

    node_id: str
    gpus: float = 0.0
    cpus: float = 0.0


@dataclass(frozen=True)
class PlacementPlan:
    bundles: list[dict[str, float]]
    strategy: str
    rank_to_bundle: dict[int, int]  # global rank in the replica's process group -> bundle index
    roles: list[str]  # per global rank: "target" or "drafter"


def plan_placement(parallel: ParallelConfig, speculative: bool, use_gpus: bool,
                   nodes: list[NodeResources], cpus_per_process: float = 1.0) -> PlacementPlan:
    tp = parallel.tensor_parallel_size
    separate = speculative and parallel.drafter == "separate"
    roles = ["target"] * tp + (["drafter"] if separate else [])
    unit = {"GPU": 1.0, "CPU": cpus_per_process} if use_gpus else {"CPU": cpus_per_process}
    bundles = [dict(unit) for _ in roles]
    key, name = ("GPU", "GPUs") if use_gpus else ("CPU", "CPUs")
    per_node = [n.gpus if use_gpus else n.cpus for n in nodes]
    need = len(bundles) * unit[key]
    what = f"tensor_parallel_size={tp}" + (" + a separate drafter" if separate else "")
    if sum(per_node) < need:
        raise PlacementError(f"the replica ({what}) needs {need:g} {name}; the cluster has {sum(per_node):g} "
                             f"across {len(nodes)} node(s)")
    fits_one_node = any(n >= need for n in per_node)
    strategy = parallel.placement_strategy or ("STRICT_PACK" if fits_one_node else "PACK")
    if strategy == "STRICT_PACK" and not fits_one_node:
        raise PlacementError(f"placement_strategy STRICT_PACK needs {need:g} {name} on one node; the largest node "
                             f"has {max(per_node, default=0):g}")
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        raise PlacementError(f"placement_strategy STRICT_SPREAD needs {len(bundles)} nodes; the cluster has "
                             f"{len(nodes)}")
    return PlacementPlan(bundles=bundles, strategy=strategy, rank_to_bundle={r: r for r in range(len(roles))},
                         roles=roles)
