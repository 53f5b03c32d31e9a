#!/usr/bin/env bash
# The headless browser that tests/test_ui_browser.py drives: Debian's chromium and
# chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver), and selenium in .venv.
# Idempotent and quick when everything is there. Nothing is downloaded at test time: selenium
# is pointed at the system chromedriver, never at its own browser manager.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_install.sh
PY=.venv/bin/python
[ -x "$PY" ] || { echo "install_browser: no .venv (run scripts/bootstrap first)" >&2; exit 1; }

missing_apt=()
command -v chromium >/dev/null || missing_apt+=(chromium)
[ -x /usr/bin/chromedriver ] || command -v chromedriver >/dev/null || missing_apt+=(chromium-driver)
if [ ${#missing_apt[@]} -gt 0 ]; then
  apt_install "the browser test" "${missing_apt[@]}"
fi

if ! "$PY" -c 'import selenium' 2>/dev/null; then
  echo "==> pip install selenium" >&2
  "$PY" -m pip install -q 'selenium>=4.20'
fi

if command -v chromium >/dev/null; then
  echo "==> browser: $(chromium --version 2>/dev/null | head -1); $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2); selenium $("$PY" -c 'import selenium; print(selenium.__version__)')" >&2
fi
