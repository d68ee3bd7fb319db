"""Running Triton kernels on the CPU under Triton's interpreter (it must be switched on before triton is imported,
so each check runs in a fresh Python)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, marker: str) -> None:
    """Run ``script`` in a fresh Python under Triton's CPU interpreter from the checkout root and expect it to print
    ``marker``."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0 and marker in run.stdout, run.stderr[-3000:]
