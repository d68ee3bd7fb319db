"""`dspark demo build` is deterministic: fixed steps, seeds, corpus and thread count, no time box.

The full build on a fresh cache reaches the acceptance recorded in ``runtime.training.demo`` (greedy, K=4,
held-out code prompts) and speculative greedy output equals plain greedy output; a miniature build run twice
(with different ambient torch thread counts) writes byte-identical weights."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.training.demo import BUILD_THREADS, EXPECTED_ACCEPTANCE, VERSION, DemoPlan, build_demo

ROOT = Path(__file__).resolve().parents[1]
NICE = 10  # the full build's scheduling priority (see test_demo_build_on_a_fresh_cache)
TINY = DemoPlan(target_steps=12, drafter_steps=12, distill_prompts=16, distill_tokens=12, eval_prompts=4,
                eval_tokens=12)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.first  # the longest test: it starts the other worker's share (tests/conftest.py)
def test_demo_build_on_a_fresh_cache(tmp_path):
    env = {**os.environ, "DSPARK_CACHE": str(tmp_path / "cache")}
    # at a lower priority (the build is deterministic however slowly it runs): ./run-tests runs it beside the Ray
    # tests, whose actors crawled beside its two busy threads (the Serve fixture's start 313 s where ~70 alone).
    # With one thread now: niced it took 502 s (342 alone) and the suite 840 s; at the default priority 423 s and
    # the suite 856 s, the Ray tests slower; in the background from the first test to the last (its worker free)
    # every multi-rank gloo test of the Ray files slowed 5-15x and the suite took 860-919 s. The suite is bound by
    # its work on two cores, not by where the build sits.
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "demo", "build"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    finally:
        proc.kill()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(line) == {"target", "drafter", "mean_acceptance_length", "build_seconds"}
    # The build is bit-exact on one CPU kind; another kind's vector units round differently (same torch).
    assert line["mean_acceptance_length"] == pytest.approx(EXPECTED_ACCEPTANCE, abs=0.15)
    record = json.loads((tmp_path / "cache" / f"demo-{VERSION}" / "demo.json").read_text())
    assert record["greedy_equals_plain"] is True and record["max_draft_len"] == 4
    assert record["target_training"]["steps"] == 700 and record["drafter_training"]["step"] == 1000
    again = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "build"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == line  # found in the cache, not rebuilt


@pytest.mark.slow
def test_the_same_plan_builds_the_same_pair(tmp_path):
    before = torch.get_num_threads()
    records = []
    try:
        for threads, name in ((2, "a"), (3, "b")):  # the ambient thread count (not BUILD_THREADS) must not matter
            torch.set_num_threads(threads)
            records.append(build_demo(progress=False, plan=TINY, root=tmp_path / name))
            assert torch.get_num_threads() == threads  # restored after the build
    finally:
        torch.set_num_threads(before)
    first, second = records
    for model in ("target", "drafter"):
        assert digest(Path(first[model]) / "model.safetensors") == digest(Path(second[model]) / "model.safetensors")
    assert (tmp_path / "a" / "distill.jsonl").read_bytes() == (tmp_path / "b" / "distill.jsonl").read_bytes()
    assert first["mean_acceptance_length"] == second["mean_acceptance_length"]
    assert first["plan"] == second["plan"] and first["threads"] == BUILD_THREADS


def test_a_damaged_corpus_is_an_error(tmp_path, monkeypatch):
    from runtime.training import demo_corpus

    bad = tmp_path / "corpus.json.xz"
    bad.write_bytes(demo_corpus.CORPUS_PATH.read_bytes()[:-10])
    monkeypatch.setattr(demo_corpus, "CORPUS_PATH", bad)
    with pytest.raises(ValueError, match="sha256"):
        demo_corpus.unpack_corpus(tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()
