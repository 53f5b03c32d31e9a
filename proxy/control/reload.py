"""Reloading the configuration while serving: POST /admin/reload and SIGHUP.

What a reload applies, to new requests only: upstreams and routing, upstream keys, client keys
and tokens ([auth]), timeouts, retries and the circuit settings. A request already in flight
keeps the Upstream objects it started with (their URL, key and timeouts), so a stream finishes
on the settings it began under. Everything is built before anything is swapped: a file that does
not load, or an [auth] whose key variable is unset, is rejected with the field named and the
running configuration stays as it was. The other sections (server, metrics, tracing, ui, ...)
need a restart; a reload names those that changed and leaves them as they run. Observers hear of
it (`Observer.configuration_changed`): /ui shows what new requests follow, and the default `model` allow-list
(the upstreams' patterns) follows the upstreams.

State that outlives a reload: an upstream kept under the same name and base URL keeps its circuit
breaker (unless [circuit] changed) and infertap's memory that it rejects stream_options.

With --workers N the worker that reloads publishes what it loaded, and the others apply it before
their next request (proxy/control/reload_sharing.py), so a reload answered by one worker holds for all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.control.auth import ClientKeys, HeaderNames, bearer_token, header_names
from proxy.control.reload_sharing import Peers
from proxy.core.model_routing import ModelRouter
from proxy.settings import RELOADABLE, ConfigError, Settings

log = logging.getLogger("infertap.reload")


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call what: rebuilt as a whole on reload."""

    client_keys: ClientKeys | None
    client_header: HeaderNames | None
    metrics_token: str | None
    admin_token: str | None

    @classmethod
    def from_settings(cls, settings: Settings) -> Access:
        keys = ClientKeys.from_settings(settings.auth)
        return cls(
            keys,
            header_names(settings.clients, keys),
            bearer_token(settings.auth.metrics_token_env),
            bearer_token(settings.auth.admin_token_env, "auth.admin_token_env"),
        )


@dataclass(frozen=True, slots=True)
class Applied:
    changed: list[str]  # sections applied to new requests
    restart_needed: list[str]  # sections that changed in the file but run on until a restart


def changed_sections(old: Settings, new: Settings) -> list[str]:
    return [name for name in Settings.model_fields if getattr(old, name) != getattr(new, name)]


def carry_state(
    old: ModelRouter, new: ModelRouter, circuit_changed: bool, no_stream_options: set[str]
) -> None:
    """What a kept upstream knew goes on (breaker, stream_options rejection); a changed one starts anew."""
    before = {up.name: up for up in old.upstreams}
    for up in new.upstreams:
        prev = before.get(up.name)
        same = prev is not None and prev.base_url == up.base_url
        if same and prev is not None and not circuit_changed:
            up.breaker = prev.breaker
        if not same:
            no_stream_options.discard(up.name)
    for name in before.keys() - {up.name for up in new.upstreams}:
        no_stream_options.discard(name)


class Target(Protocol):
    """What a reload swaps: the app."""

    settings: Settings

    @property
    def routing(self) -> ModelRouter: ...

    def swap(self, settings: Settings, access: Access, routing: ModelRouter) -> None: ...

    def stream_options_memory(self) -> set[str]: ...


def merged(current: Settings, loaded: Settings) -> tuple[Settings, list[str], list[str]]:
    """`current` with the reloadable sections of `loaded`; and which sections changed (applied,
    and needing a restart)."""
    if not loaded.upstreams:
        # The running upstreams came from elsewhere (the embedded engine): they stay.
        loaded = loaded.model_copy(update={"upstreams": current.upstreams})
    changed = changed_sections(current, loaded)
    applied = [name for name in changed if name in RELOADABLE]
    restart = [name for name in changed if name not in RELOADABLE]
    return current.model_copy(update={name: getattr(loaded, name) for name in RELOADABLE}), applied, restart


class Reloader:
    def __init__(self, target: Target, load: Callable[[], Settings]) -> None:
        self.target = target
        self.load = load
        self.peers: Peers | None = None  # the other workers, with --workers N
        self._previous_hup: Any = None

    def reload(self) -> Applied:
        """Raises ConfigError (the field named) and changes nothing, here or in another worker, when
        the new file is bad."""
        loaded = self.load()
        result = self.apply(loaded)
        if self.peers is not None:
            self.peers.publish(loaded.model_dump_json())
        return result

    def catch_up(self) -> None:
        """Apply what another worker published (it loaded and applied it without error)."""
        assert self.peers is not None
        try:
            self.apply(Settings.model_validate_json(self.peers.take()))
        except (ConfigError, ValueError, OSError) as e:  # not expected (same file, same environment)
            log.error("another worker's reload was NOT applied here (the running configuration stays): %s", e)

    def apply(self, loaded: Settings) -> Applied:
        settings, applied, restart = merged(self.target.settings, loaded)
        access = Access.from_settings(settings)
        try:
            routing = ModelRouter.from_settings(settings)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"invalid configuration (upstreams): {e}") from None
        carry_state(self.target.routing, routing, "circuit" in applied, self.target.stream_options_memory())
        self.target.swap(settings, access, routing)
        if applied or restart:
            log.warning(
                "configuration reloaded: applied %s%s",
                ", ".join(applied) or "nothing",
                f"; changed but needing a restart: {', '.join(restart)}" if restart else "",
            )
        return Applied(applied, restart)

    # -- SIGHUP -----------------------------------------------------------------------------
    def install(self) -> None:
        """SIGHUP reloads, in the main thread's loop (a server run in a thread has no signals)."""
        if threading.current_thread() is not threading.main_thread():
            return
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_hup)

    def uninstall(self) -> None:
        if threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    def _on_hup(self) -> None:
        try:
            self.reload()
        except ConfigError as e:
            log.error("SIGHUP: the configuration was NOT reloaded (the running one stays): %s", e)
