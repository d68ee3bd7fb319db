"""``dspark generate`` and ``dspark serve`` as subprocesses that start their own local Ray (tests/conftest.py runs
these files in one worker, one test after another)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def dspark(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


MODEL_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "128"]


@pytest.mark.ray
@pytest.mark.slow
def test_generate_streams_the_greedy_completion(near_bigram_target, make_drafter):
    from runtime import LLM, SamplingParams

    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    proc = dspark("generate", "def add(a, b):", "--model", str(near_bigram_target), "--speculative-model",
                  str(drafter), "--max-tokens", "12", *MODEL_FLAGS, "--ray-address", "local")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    expected = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter)}, dtype="float32",
                   device="cpu", max_model_len=128).generate(["def add(a, b):"],
                                                            SamplingParams(max_tokens=12, temperature=0))[0]
    assert out == expected.text + "\n"
    counters = json.loads(err.strip().splitlines()[-1])
    assert counters["num_drafts"] > 0 and counters["mean_acceptance_length"] > 1
    assert counters["request"] == {"completion_tokens": len(expected.token_ids),
                                   "draft_tokens": expected.num_draft_tokens,
                                   "accepted_draft_tokens": expected.num_accepted_tokens}


@pytest.mark.ray
@pytest.mark.slow
def test_serve_answers_then_stops_on_sigint(near_bigram_target, make_drafter):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    # a cluster of this test's own, both servers told its address: a Ray cluster already running on the machine
    # (a developer's) is neither joined nor stopped
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    proc = dspark("serve", "--model", str(near_bigram_target), "--speculative-model", str(drafter), "--host",
                  "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", *MODEL_FLAGS, "--max-model-len",
                  "4096", "--ray-address", address, "--drain-timeout", "4", start_new_session=True)
    lines, ready = [], threading.Event()

    def drain():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("dspark: serving"):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(timeout=150), "".join(lines[-30:])
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # a second server joining the same Ray cluster is refused, naming the app, its route and its port
        second = dspark("serve", "--model", str(near_bigram_target), "--port", str(port + 1), *MODEL_FLAGS,
                        "--ray-address", address)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert f"already listens on port {port} for the dspark app 'dspark' at route '/'" in err
        assert "--ray-address local" in err
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # the first one is intact
        # Ctrl-C drains: requests in flight finish, new ones get 503 + Retry-After; what the drain time (4 s) cannot
        # finish ends with an error its client receives; then the process exits 0, within the drain time + 5 s
        results, endless, stream_lines = [], [], []
        long = {"model": "tiny", "prompt": "x", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        workers = [threading.Thread(target=lambda: results.append(httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json=long, timeout=120))) for _ in range(6)]
        too_long = {**long, "max_tokens": 4000, "temperature": 1.0}  # (sampled: the oracle's drafts often fail)

        def stream():
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**too_long, "stream": True},
                              timeout=120) as s:
                stream_lines.extend(line for line in s.iter_lines() if line)

        workers += [threading.Thread(target=lambda: endless.append(httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json=too_long, timeout=120))), threading.Thread(target=stream)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        refused, deadline = None, time.monotonic() + 20
        while refused is None and time.monotonic() < deadline:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "y"}, timeout=60)
            refused = r if r.status_code == 503 else None
        for w in workers:
            w.join(timeout=120)
        assert refused is not None and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "draining"
        assert [r.status_code for r in results] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 100 for r in results)
        (cut,) = endless
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down", cut.text
        assert stream_lines[-1] == "data: [DONE]" and "shutting_down" in stream_lines[-2], stream_lines[-3:]
        assert proc.wait(timeout=90) == 0
        assert time.monotonic() - signalled < 4 + 5 + 3  # (3 s: this 2-core machine's slack)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        ray.shutdown()  # the cluster this test started, and only it
