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
their next request (proxy/control/reload_sharing.py), so a reload answered by one worker holds for
all; SIGHUP goes to the supervisor, which loads, checks and publishes the file the same way
(proxy/server/workers.py). A worker that starts later adopts what was published last.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
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
    generation: int | None = None  # what it was published as, with --workers N


@dataclass(frozen=True, slots=True)
class Built:
    """What a reload swaps in, built before anything is swapped."""

    settings: Settings
    access: Access
    routing: ModelRouter
    applied: list[str]
    restart_needed: list[str]


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
        if prev is not None and prev.replicas is not None:
            if up.replicas is not None:
                up.replicas.adopt(prev.replicas, fresh_breakers=circuit_changed)
            else:
                prev.replicas.retire()
    for name in before.keys() - {up.name for up in new.upstreams}:
        no_stream_options.discard(name)
        gone = before[name].replicas
        if gone is not None:
            gone.retire()


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


def build(current: Settings, loaded: Settings) -> Built:
    """Everything `loaded` would run on, checked: raises ConfigError (the field named) when it cannot."""
    settings, applied, restart = merged(current, loaded)
    access = Access.from_settings(settings)  # first: a broken key setting is named as such
    opened = _opens(current, settings)
    if opened and not settings.auth.open:
        raise ConfigError(
            f"the reloaded configuration turns {opened} off, which opens the proxy: the running "
            "configuration stays. Say so with `[auth] open = true` if that is what you want"
        )
    try:
        routing = ModelRouter.from_settings(settings)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"invalid configuration (upstreams): {e}") from None
    return Built(settings, access, routing, applied, restart)


def _opens(current: Settings, new: Settings) -> str | None:
    """What protection `new` drops that `current` has: client keys, or the admin token."""
    if (current.auth.keys_env or current.auth.keys_file) and not (new.auth.keys_env or new.auth.keys_file):
        return "client keys ([auth] keys_env / keys_file)"
    if current.auth.admin_token_env and not new.auth.admin_token_env:
        return "the admin token ([auth] admin_token_env)"
    return None


def adopt_published(start: Settings, peers: Peers) -> Settings:
    """A worker that starts (uvicorn replaces one that died): the settings the others run, that is
    the last reload published, or the start-up settings when none was. Never the file as it is
    now: broken, it would leave this worker on the start-up settings, undoing the reloads the
    others applied; edited since, it would set this worker apart."""
    if not peers.behind():
        return start
    try:
        settings = build(start, Settings.model_validate_json(peers.take())).settings
    except Exception as e:  # not expected: another worker applied it in the same environment
        log.error("the last reload could NOT be adopted at start (the start-up configuration runs): %s", e)
        return start
    peers.ack()
    return settings


def publish_reload(peers: Peers, start: Settings, load: Callable[[], Settings]) -> tuple[int, Built]:
    """SIGHUP to the supervisor (--workers N): load the file and check it as a worker's reload
    would, then publish it for the workers to apply (the supervisor runs no proxy itself); the
    new generation, and what it changes. Raises ConfigError (the field named), publishing nothing."""
    with peers.locked():
        loaded = load()
        current = start  # what the workers run: the start-up settings, or the last reload published
        if peers.generation:
            current = merged(start, Settings.model_validate_json(peers.take()))[0]
        built = build(current, loaded)
        return peers.publish(loaded.model_dump_json()), built


class Reloader:
    def __init__(self, target: Target, load: Callable[[], Settings]) -> None:
        self.target = target
        self.load = load
        self.peers: Peers | None = None  # the other workers, with --workers N
        self._previous_hup: Any = None

    def reload(self) -> Applied:
        """Raises ConfigError (the field named) and changes nothing, here or in another worker, when
        the new file is bad. With --workers N the file is read under the shared lock and published
        before it is released: of two reloads at once, the one that read the file last is applied
        last, everywhere."""
        peers = self.peers
        if peers is None:
            return self.apply(self.load())
        with peers.locked():
            loaded = self.load()
            result = self.apply(loaded)
            generation = peers.publish(loaded.model_dump_json())
        return replace(result, generation=generation)

    def catch_up(self) -> None:
        """Apply what another worker published (it loaded and applied it without error), and say so
        in this worker's slot. Whatever fails, the running configuration stays and it is said once."""
        peers = self.peers
        assert peers is not None
        try:
            self.apply(Settings.model_validate_json(peers.take()))
        except (ConfigError, ValueError, OSError) as e:  # not expected (same file, same environment)
            log.error("another worker's reload was NOT applied here (the running configuration stays): %s", e)
            return
        except Exception:
            log.exception("another worker's reload was NOT applied here (the running configuration stays)")
            return
        peers.ack()

    def apply(self, loaded: Settings) -> Applied:
        built = build(self.target.settings, loaded)
        applied, restart = built.applied, built.restart_needed
        carry_state(
            self.target.routing, built.routing, "circuit" in applied, self.target.stream_options_memory()
        )
        self.target.swap(built.settings, built.access, built.routing)
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
