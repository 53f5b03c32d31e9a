"""`infertap serve`'s options, and how they resolve into Settings: the file, the environment, the
flags, TaoToken's key."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from urllib.parse import urlsplit

from pydantic import ValidationError

from proxy import __version__
from proxy.settings import (
    TAOTOKEN_BASE_URL,
    ConfigError,
    ServerSettings,
    Settings,
    UpstreamSettings,
    load_settings,
    parse_upstream_flag,
    with_upstreams,
)

log = logging.getLogger("infertap")

EPILOG = """\
examples:
  infertap serve                                   # embedded simulated engine, no GPU or key needed
  infertap serve --upstream http://127.0.0.1:8000/v1               # in front of a local vLLM
  TAOTOKEN_API_KEY=sk-... infertap serve           # in front of TaoToken (https://taotoken.net/api)
  infertap serve --config config.toml --workers 4

Then point any OpenAI client at http://HOST:PORT/v1 (only base_url changes).
Settings: defaults < config.toml (--config or $INFERTAP_CONFIG) < INFERTAP_* env (nested with __,
e.g. INFERTAP_SERVER__PORT=9000) < flags. See config.example.toml.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infertap serve",
        description="Run the infertap proxy: an OpenAI-compatible endpoint that relays every request "
        "to an upstream and measures TTFT, TPOT, tokens and failures.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; 0 picks a free one)")
    p.add_argument("--config", metavar="PATH", help="config.toml (default: $INFERTAP_CONFIG)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an upstream's OpenAI base URL, e.g. vllm=http://127.0.0.1:8000/v1 (repeatable; "
        "replaces the config's upstreams; the first one is the default route)",
    )
    p.add_argument(
        "--forward-header",
        action="append",
        default=[],
        metavar="NAME",
        help="a client header the --upstream upstreams get beyond the default allow-list, e.g. "
        "openai-organization or x-custom-* (repeatable; like forward_headers in [[upstreams]])",
    )
    p.add_argument("--workers", type=int, help="worker processes (default 1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--version", action="version", version=f"infertap {__version__}")
    return p


# Flags that set a [server] field; validated like the file, and errors name the flag.
_SERVER_FLAGS = {"host": "--host", "port": "--port", "workers": "--workers", "log_level": "--log-level"}


def _server_flags(settings: Settings, args: argparse.Namespace) -> None:
    changes = {f: getattr(args, f) for f in _SERVER_FLAGS if getattr(args, f) is not None}
    if not changes:
        return
    try:
        settings.server = ServerSettings.model_validate({**settings.server.model_dump(), **changes})
    except ValidationError as e:
        err = e.errors()[0]
        flag = _SERVER_FLAGS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise ConfigError(f"{flag} {err['input']}: {err['msg']}") from None


def _upstream_flags(values: list[str]) -> list[UpstreamSettings]:
    """Bare URLs on one host would share its name: those take host:port (then a number) instead."""
    ups = [parse_upstream_flag(v) for v in values]
    taken: set[str] = set()
    for up, value in zip(ups, values, strict=True):
        if up.name in taken and "=" not in value.split("://", 1)[0]:
            parts = urlsplit(up.base_url)
            name = f"{up.name}:{parts.port}" if parts.port else up.name
            n = 2
            while name in taken:
                name, n = f"{up.name}-{n}", n + 1
            up.name = name
        taken.add(up.name)
    return ups


def resolve_settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    _server_flags(settings, args)
    if args.upstream:
        ups = _upstream_flags(args.upstream)
        for up in ups:
            up.forward_headers = [h.strip().lower() for h in args.forward_header]
        settings = with_upstreams(settings, ups)
    if not settings.upstreams and os.environ.get("TAOTOKEN_API_KEY"):
        base = os.environ.get("TAOTOKEN_BASE_URL") or TAOTOKEN_BASE_URL
        settings.upstreams = [
            UpstreamSettings(name="taotoken", base_url=base, api_key_env="TAOTOKEN_API_KEY")
        ]
        log.info("no upstream configured and TAOTOKEN_API_KEY is set: routing to TaoToken")
    return settings


def reloader(argv: list[str]) -> Callable[[], Settings]:
    """What POST /admin/reload and SIGHUP apply: the command line resolved again (the file, the
    environment, the flags)."""

    def load() -> Settings:
        return resolve_settings(build_parser().parse_args(argv))

    return load
