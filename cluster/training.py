"""Data-parallel drafter training on several workers through Ray Train's ``TorchTrainer``."""

from __future__ import annotations

import json
from pathlib import Path

from configs.training import DrafterTrainConfig
from runtime.training.drafter_trainer import STATS_FILE


def train_drafter_on_ray(config: DrafterTrainConfig, num_workers: int, use_gpu: bool | None = None) -> dict:
    """Run ``runtime.training.drafter_trainer.train_drafter`` on ``num_workers`` Ray Train workers (one GPU each
    when the cluster has GPUs); returns rank 0's statistics."""
    try:
        import ray
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        raise ValueError("--num-workers > 1 trains through Ray Train, which is not installed here: "
                         "pip install 'dspark[train]'") from exc
    from cluster.llm import connect_ray

    connect_ray(None)
    if use_gpu is None:
        use_gpu = config.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= num_workers
    device = "cuda" if use_gpu else "cpu"
    payload = config.model_copy(update={"device": device}).model_dump()

    def loop(cfg: dict) -> None:
        from runtime.training.drafter_trainer import train_drafter

        train_drafter(DrafterTrainConfig(**cfg), progress=False)

    trainer = TorchTrainer(loop, train_loop_config=payload,
                           scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu))
    trainer.fit()
    return json.loads((Path(config.out) / STATS_FILE).read_text())
