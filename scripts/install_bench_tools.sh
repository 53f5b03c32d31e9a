#!/usr/bin/env bash
# What `infertap bench` uses besides infertap: nginx (Debian's nginx-light), the reference row that
# every table compares infertap with (proxy/tools/bench/nginx.py). Without it the bench still runs,
# and says that the nginx row is missing. Idempotent. Debian's package would start nginx on port 80
# where an init system runs; policy-rc.d keeps it from starting, and none is left running.
set -euo pipefail
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
  echo "==> nginx: $( (nginx -v || /usr/sbin/nginx -v) 2>&1 | head -1)" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "==> apt-get install nginx-light" >&2
  export DEBIAN_FRONTEND=noninteractive
  policy=/usr/sbin/policy-rc.d
  created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
  fi
  trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends nginx-light >/dev/null
  if command -v service >/dev/null; then service nginx stop >/dev/null 2>&1 || true; fi
  echo "==> nginx: $(/usr/sbin/nginx -v 2>&1 | head -1)" >&2
else
  echo "==> cannot install nginx here (not root or no apt-get): infertap bench will skip the nginx row" >&2
fi
