"""Refusing, at start-up, to listen beyond loopback without client keys.

Without client keys anyone who reaches the port uses the upstreams' keys (and their bill), and
only the edge's limits bound what they can take. Listening on loopback only is safe by default;
anything else needs client keys, or the operator saying that the proxy is open on purpose
(`[auth] open = true`: a port published on loopback only, a NetworkPolicy, a firewall).
"""

from __future__ import annotations

import ipaddress

from proxy.settings import ConfigError, Settings


def is_loopback(host: str) -> bool:
    """Whether `host` listens on this machine's loopback interface only. A name other than
    `localhost` may resolve anywhere: not loopback."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_open_beyond_loopback(settings: Settings) -> None:
    """Raises ConfigError when `settings` would serve anyone who reaches a non-loopback address
    without a client key, and the file does not say `[auth] open = true`."""
    auth, host = settings.auth, settings.server.host
    if auth.keys_env or auth.keys_file or auth.open or is_loopback(host):
        return
    raise ConfigError(
        f"refusing to listen on {host or 'every interface'} without client keys: anyone who reaches "
        "that address could use the upstreams' keys. Set client keys ([auth] keys_env or keys_file, "
        "docs/security.md), or listen on loopback only (--host 127.0.0.1), or, where something else "
        "already limits who reaches the port (a port published on 127.0.0.1 only, a NetworkPolicy, "
        "a firewall), say so with `[auth] open = true` (INFERTAP_AUTH__OPEN=true)"
    )
