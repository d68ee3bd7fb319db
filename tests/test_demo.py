"""`dspark demo build` on a fresh cache: within 5 minutes on this machine class, tau >= 2.0 at K=4 greedy on
held-out code prompts, and speculative greedy output equal to plain greedy output on the demo pair."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_build_on_a_fresh_cache(tmp_path):
    env = {**os.environ, "DSPARK_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "build"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(line) == {"target", "drafter", "mean_acceptance_length", "build_seconds"}
    assert line["build_seconds"] <= 300 and line["mean_acceptance_length"] >= 2.0
    record = json.loads((tmp_path / "cache" / "demo-v1" / "demo.json").read_text())
    assert record["greedy_equals_plain"] is True and record["max_draft_len"] == 4
    again = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "build"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == line  # found in the cache, not rebuilt
