"""Data-parallel training on several workers through Ray Train's ``TorchTrainer``: the drafter
(``runtime.training.drafter_trainer``) or the small target (``runtime.training.target_trainer``)."""

from __future__ import annotations

import json
from pathlib import Path

from configs.training import DrafterTrainConfig, TargetTrainConfig
from runtime.training.data_parallel import STATS_FILE


def train(kind: str, config: DrafterTrainConfig | TargetTrainConfig, progress: bool = True) -> dict:
    """Train in this process (data parallel inside an initialized ``torch.distributed`` group):
    ``kind`` 'drafter' (``train_drafter``) or 'target' (``train_target``)."""
    if kind == "drafter":
        from runtime.training.drafter_trainer import train_drafter

        return train_drafter(config, progress=progress)
    from runtime.training.target_trainer import train_target

    return train_target(config, progress=progress)


def train_on_ray(kind: str, config: DrafterTrainConfig | TargetTrainConfig, num_workers: int,
                 use_gpu: bool | None = None) -> dict:
    """``train(kind, config)`` on ``num_workers`` Ray Train workers (one GPU each when the cluster has enough);
    returns rank 0's statistics."""
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
    payload = {"kind": kind, "config": config.model_copy(update={"device": "cuda" if use_gpu else "cpu"}).model_dump()}
    trainer = TorchTrainer(_worker_loop, train_loop_config=payload,
                           scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu))
    trainer.fit()
    return json.loads((Path(config.out) / STATS_FILE).read_text())


def _worker_loop(payload: dict) -> None:
    model = DrafterTrainConfig if payload["kind"] == "drafter" else TargetTrainConfig
    train(payload["kind"], model(**payload["config"]), progress=False)
