# Sourced by the install_*.sh scripts: `apt_install WHAT PKG...` installs Debian packages as root,
# without starting the services some of them ship (policy-rc.d says no; where an init system ignores
# it, the service is stopped again), or says what will skip when it cannot (not root, no apt-get).
apt_install() {
  local what=$1; shift
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "==> cannot install $* here (not root or no apt-get): $what will skip" >&2
    return 0
  fi
  echo "==> apt-get install $*" >&2
  local policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
      --no-install-recommends "$@" >/dev/null || rc=$?
  [ "$created" = 1 ] && rm -f "$policy"
  if command -v service >/dev/null; then
    local pkg
    for pkg in "$@"; do service "${pkg%-light}" stop >/dev/null 2>&1 || true; done
  fi
  return $rc
}
