#!/usr/bin/env bash
# The JavaScript clients that tests/test_js_clients.py and tests/test_js_client_errors.py run with
# node: the official `openai` package, the Vercel AI SDK (`ai`, `@ai-sdk/openai`) and LangChain
# (`@langchain/openai`, `@langchain/core`), at the exact versions of tests/js/package-lock.json
# (`npm ci` into tests/js/node_modules).
# Quick when they are installed: npm runs only when package.json or package-lock.json changed since
# the last install. Without Node.js >= 20 and npm it says so and exits 0 (those tests then skip);
# under CI=true that is a failure.
set -euo pipefail
cd "$(dirname "$0")/../tests/js"

without() {
  if [ "${CI:-}" = true ]; then
    echo "install_js_clients: $1, and CI runs the JavaScript client tests: install Node.js >= 20 with npm" >&2
    exit 1
  fi
  echo "==> JavaScript clients: $1; tests/test_js_clients.py will skip (install Node.js >= 20 with npm)" >&2
  exit 0
}
command -v node >/dev/null || without "node is not installed"
command -v npm >/dev/null || without "npm is not installed"
major="$(node -p 'process.versions.node.split(".")[0]')"
[ "$major" -ge 20 ] || without "node $(node --version) is older than 20"

# tests/test_js_clients.py computes the same stamp to tell a stale node_modules from a fresh one.
want="$(cat package.json package-lock.json | sha256sum | cut -c1-16)"
stamp=node_modules/.infertap-installed
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "==> JavaScript clients: installed (node $(node --version))" >&2
  exit 0
fi
echo "==> npm ci in tests/js (node $(node --version), npm $(npm --version))" >&2
npm ci --no-audit --no-fund --loglevel=error
echo "$want" > "$stamp"
