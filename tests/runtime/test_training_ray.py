"""Training on Ray Train workers (tests/conftest.py runs the files that start Ray in one worker, one test after
another)."""

import pytest

from runtime.training.distill import evaluate
from tests.runtime.test_training import ENGINE, config


@pytest.mark.slow
@pytest.mark.ray
def test_two_ray_train_workers(ray_cluster, near_bigram_target, distilled, tmp_path):
    from cluster.training import train_on_ray

    stats = train_on_ray("drafter", config(near_bigram_target, distilled, tmp_path / "ddp", steps=20, device="cpu"),
                         num_workers=2, use_gpu=False)
    assert stats["step"] == 20 and (tmp_path / "ddp" / "model.safetensors").is_file()
    out = evaluate(str(near_bigram_target), str(tmp_path / "ddp"), [[5, 6, 7]], 3, 0.0, 8, check_parity=True, **ENGINE)
    assert out["greedy_equals_plain"]


@pytest.mark.slow
@pytest.mark.ray
def test_target_trains_data_parallel_on_two_ray_train_workers(ray_cluster, tmp_path):
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.training import train_on_ray
    from configs.training import TargetTrainConfig

    cfg = TargetTrainConfig(out=str(tmp_path / "target"), vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, max_len=32, max_corpus_bytes=200_000, batch_size=4, steps=40, lr=1e-2,
                            max_seconds=600, device="cpu")  # max_seconds: the ranks agree on the clock every step
    stats = train_on_ray("target", cfg, num_workers=2, use_gpu=False)
    assert stats["steps"] == 40 and stats["data_parallel_ranks"] == 2
    assert stats["loss"] < math.log(300) - 1.0  # it learned something
    model = AutoModelForCausalLM.from_pretrained(cfg.out)  # rank 0 wrote a loadable checkpoint and tokenizer
    assert len(AutoTokenizer.from_pretrained(cfg.out)) == model.config.vocab_size
