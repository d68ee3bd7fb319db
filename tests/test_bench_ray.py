"""``dspark bench`` through a Ray replica (tests/conftest.py runs the files that start Ray in one worker, one test
after another)."""

import pytest


@pytest.mark.ray
def test_the_sweep_runs_through_a_ray_replica_with_a_separate_drafter(tmp_path):
    """``dspark bench --tensor-parallel-size 1 --drafter separate --pipeline-drafter`` on the CPU (two CPUs, as on
    CI): every engine is a Ray replica, the colocated layout is measured in the same run, and the record says the
    layout."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "bench.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--tensor-parallel-size", "1", "--drafter", "separate", "--pipeline-drafter",
                           "--concurrency", "1,2",
                           "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2", "--warmup", "1",
                           "--kv-cache-gib", "0.05", "--ray-address", "local", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["replica"] == "ray" and record["tensor_parallel_size"] == 1 and record["drafter"] == "separate"
    assert record["pipeline_drafter"] is True and record["measurement"] == "sequential"  # two replicas: 2x GPUs
    assert "partial" not in record and record["hardware"] == "cpu" and record["copy_bandwidth_gbs"] is None
    assert sorted(info["role"] for info in record["dspark_rank_info"]) == ["drafter", "target"]
    for row in record["runs"]:
        assert row["ar_tokens_per_s"] > 0 and row["dspark_tokens_per_s"] > 0 and row["colocated_tokens_per_s"] > 0
        assert row["throughput_vs_colocated"] == row["dspark_tokens_per_s"] / row["colocated_tokens_per_s"]
        assert row["throughput_vs_serial"] == row["dspark_tokens_per_s"] / row["serial_tokens_per_s"]
        assert "roofline_fraction" not in row and "verify_step_ms" not in row
    assert "ray TP=1, drafter separate" in proc.stderr
