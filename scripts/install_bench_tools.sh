#!/usr/bin/env bash
# What `infertap bench` uses besides infertap: nginx (Debian's nginx-light), the reference row that
# every table compares infertap with (proxy/tools/bench/nginx.py), and vLLM's own router
# (`vllm-router` from PyPI, a Rust binary in a wheel: proxy/tools/bench/vllm_router.py) in a venv of
# its own, .bench-tools/vllm-router/, so that its pinned dependencies never meet infertap's. Without
# either the bench still runs, and says which row is missing. Idempotent. Debian's package would start
# nginx on port 80 where an init system runs; policy-rc.d keeps it from starting, and none is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_install.sh
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
  echo "==> nginx: $( (nginx -v || /usr/sbin/nginx -v) 2>&1 | head -1)" >&2
else
  apt_install "infertap bench's nginx row" nginx-light
  if [ -x /usr/sbin/nginx ]; then echo "==> nginx: $(/usr/sbin/nginx -v 2>&1 | head -1)" >&2; fi
fi

VLLM_ROUTER_VERSION=0.1.17
venv=.bench-tools/vllm-router
if [ -x "$venv/bin/vllm-router" ] && "$venv/bin/pip" show vllm-router 2>/dev/null | grep -qx "Version: $VLLM_ROUTER_VERSION"; then
  echo "==> vllm-router $VLLM_ROUTER_VERSION: $venv" >&2
  exit 0
fi
python=$(command -v python3.11 || command -v python3 || true)
# A failure here is not the suite's: the bench and its test skip the rows, saying why.
if [ -z "$python" ] || ! "$python" -m venv "$venv" >/dev/null 2>&1 \
  || ! "$venv/bin/pip" install -q "vllm-router==$VLLM_ROUTER_VERSION" >/dev/null 2>&1; then
  echo "==> vllm-router: could not install vllm-router==$VLLM_ROUTER_VERSION into $venv (no wheel for this" \
    "platform, or no index); infertap bench skips its rows" >&2
  rm -rf "$venv"
  exit 0
fi
echo "==> vllm-router $VLLM_ROUTER_VERSION: $venv" >&2
