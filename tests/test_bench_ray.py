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
                           "--pipeline-drafter-min-batch", "1", "--concurrency", "1,2",
                           "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2", "--warmup", "1",
                           "--kv-cache-gib", "0.05", "--ray-address", "local", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["replica"] == "ray" and record["tensor_parallel_size"] == 1 and record["drafter"] == "separate"
    assert record["pipeline_drafter"] is True and record["measurement"] == "sequential"  # two replicas: 2x GPUs
    assert record["pipeline_min_batch"] == 1
    # min batch 1: every timed step of the pipelined engine was pipelined, none of the serial one's
    assert all(row["dspark_pipelined_step_fraction"] == 1.0 for row in record["runs"])
    assert all("serial_pipelined_step_fraction" not in row for row in record["runs"])
    assert "partial" not in record and record["hardware"] == "cpu" and record["copy_bandwidth_gbs"] is None
    assert sorted(info["role"] for info in record["dspark_rank_info"]) == ["drafter", "target"]
    for row in record["runs"]:
        assert row["ar_tokens_per_s"] > 0 and row["dspark_tokens_per_s"] > 0 and row["colocated_tokens_per_s"] > 0
        assert row["throughput_vs_colocated"] == row["dspark_tokens_per_s"] / row["colocated_tokens_per_s"]
        assert row["throughput_vs_serial"] == row["dspark_tokens_per_s"] / row["serial_tokens_per_s"]
        assert "roofline_fraction" not in row and "verify_step_ms" not in row
    assert "ray TP=1, drafter separate" in proc.stderr


@pytest.mark.ray
def test_a_replica_is_measured_beside_its_one_process_twin_in_alternating_rounds(tmp_path):
    """``dspark bench --tensor-parallel-size 1 --beside-single-process`` on the CPU: the AR and DSpark replicas are
    each measured beside the same engine in the driver's process, in alternating rounds, and the record carries the
    twins' rows and the replica-over-one-process step ratios (from the median rounds and per round)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "bench.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--tensor-parallel-size", "1", "--beside-single-process", "--concurrency", "2",
                           "--e2e-prompts", "2", "--e2e-tokens", "6",
                           "--rounds", "3", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2", "--warmup",
                           "1", "--kv-cache-gib", "0.05", "--ray-address", "local", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["replica"] == "ray" and record["measurement"].startswith("sequential; the AR and DSpark replicas")
    assert [info["role"] for info in record["single_ar_rank_info"]] == ["target"]
    (row,) = record["runs"]
    for kind in ("ar", "dspark"):
        assert len(row[f"{kind}_tokens_per_s_rounds"]) == len(row[f"single_{kind}_tokens_per_s_rounds"]) == 3
        assert row[f"ray_vs_single_process_{kind}_step"] == row[f"{kind}_step_ms"] / row[f"single_{kind}_step_ms"]
        per_round = sorted(s / r for s, r in zip(row[f"single_{kind}_tokens_per_s_rounds"],
                                                 row[f"{kind}_tokens_per_s_rounds"]))
        assert row[f"ray_vs_single_process_{kind}_step_paired"] == per_round[1]
    assert "replica / one process, step: AR" in proc.stderr
    # fp32 on the CPU: the replica's greedy outputs are one process's, token for token
    agree = record["end_to_end"]["replica_vs_single_process"]
    assert agree == {kind: {"identical_fraction": 1.0, "first_difference": [None, None]} for kind in ("ar", "dspark")}

