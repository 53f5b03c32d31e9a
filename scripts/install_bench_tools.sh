#!/usr/bin/env bash
# What `infertap bench` uses besides infertap: nginx (Debian's nginx-light), the reference row that
# every table compares infertap with (proxy/tools/bench/nginx.py). Without it the bench still runs,
# and says that the nginx row is missing. Idempotent. Debian's package would start nginx on port 80
# where an init system runs; policy-rc.d keeps it from starting, and none is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_install.sh
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
  echo "==> nginx: $( (nginx -v || /usr/sbin/nginx -v) 2>&1 | head -1)" >&2
  exit 0
fi
apt_install "infertap bench's nginx row" nginx-light
if [ -x /usr/sbin/nginx ]; then echo "==> nginx: $(/usr/sbin/nginx -v 2>&1 | head -1)" >&2; fi
