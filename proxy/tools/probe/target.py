"""Where `infertap probe` and `infertap compare` send their requests: one `Target`.

A Target (base URL, model, key variable, request params, timeouts, retries) is built from, lowest
to highest precedence: built-in defaults < TAOTOKEN_BASE_URL / TAOTOKEN_API_KEY in the environment
< the seed's client settings.json (`--settings`) < command-line flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"  # `infertap serve`
DEFAULT_KEY_ENV = "TAOTOKEN_API_KEY"
BASE_URL_ENV = "TAOTOKEN_BASE_URL"
# The seed article's prompt: "In about 300 characters, explain the difference between prefill
# and decode in LLM inference, and what KV caching does."
DEFAULT_PROMPT = "请用 300 字解释大模型推理中预填充和解码的区别，并说明 KV Caching 的作用。"
DEFAULT_MAX_TOKENS = 512


T = TypeVar("T")


class ToolError(Exception):
    """A problem with the tool's own input (flags, settings file): exit status 2."""


def run_cli(prog: str, work: Callable[[], T]) -> tuple[T, None] | tuple[None, int]:
    """Runs a command's work: (its result, None), or (None, exit status) after one line on stderr:
    2 for the user's input (ToolError), 130 for ^C, 1 for a bug of ours (a line, not a traceback)."""
    try:
        return work(), None
    except ToolError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None, 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return None, 130
    except Exception as e:
        print(f"{prog}: unexpected error: {type(e).__name__}: {e}", file=sys.stderr)
        return None, 1


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str | None = None
    api_key_env: str | None = DEFAULT_KEY_ENV
    params: Mapping[str, Any] = field(default_factory=dict)  # extra body fields (temperature, top_k, ...)
    max_tokens: int = DEFAULT_MAX_TOKENS
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    max_attempts: int = 3
    backoff_s: float = 2.0
    include_usage: bool = True
    api: str = "chat"  # "chat" (POST /chat/completions) or "responses" (POST /responses)
    # What the run learnt about the server, shared by every copy made with replace() (a server
    # that refuses stream_options is asked without it from then on).
    learned: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @property
    def url(self) -> str:
        """The base URL + /chat/completions (or /responses), as the OpenAI SDK builds it."""
        return self.base_url.rstrip("/") + ("/responses" if self.api == "responses" else "/chat/completions")

    def api_key(self) -> str | None:
        return (os.environ.get(self.api_key_env) or None) if self.api_key_env else None

    def describe(self) -> dict[str, Any]:
        """What may be shown: never the key, only the name of its variable and whether it is set."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "api_key_env": self.api_key_env,
            "api_key_set": self.api_key() is not None,
            "api": self.api,
        }


# -- settings ---------------------------------------------------------------------------------


def load_client_settings(path: str | Path) -> dict[str, Any]:
    """Read the seed's client settings.json; ToolError names the file and the bad field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolError(f"{p}: settings file not found") from None
    except OSError as e:
        raise ToolError(f"{p}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ToolError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ToolError(f"{p}: must hold a JSON object")
    for key, kind in (("default_params", dict), ("timeout", dict), ("retry", dict)):
        if key in data and not isinstance(data[key], kind):
            raise ToolError(f"{p}: {key}: must be an object")
    for key in ("base_url", "api_key_env", "model"):
        if key in data and not isinstance(data[key], str):
            raise ToolError(f"{p}: {key}: must be a string")
    for section, key in (("timeout", "connect"), ("timeout", "read"), ("retry", "backoff_seconds")):
        value = data.get(section, {}).get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise ToolError(f"{p}: {section}.{key}: must be a non-negative number")
    attempts = data.get("retry", {}).get("max_attempts")
    if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1):
        raise ToolError(f"{p}: retry.max_attempts: must be an integer >= 1")
    max_tokens = data.get("default_params", {}).get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ToolError(f"{p}: default_params.max_tokens: must be an integer >= 1")
    return data


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def add_target_arguments(parser: argparse.ArgumentParser, *, base_url_flag: bool = True) -> None:
    g = parser.add_argument_group("target and request (flags override --settings, which overrides the env)")
    if base_url_flag:
        g.add_argument(
            "--base-url",
            help=f"OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (default: ${BASE_URL_ENV} or "
            f"{DEFAULT_BASE_URL})",
        )
    g.add_argument("--model", help="model name (default: from --settings, else the first of GET /models)")
    g.add_argument(
        "--api-key-env",
        metavar="NAME",
        help=f"NAME of the environment variable holding the API key (default: {DEFAULT_KEY_ENV}); "
        "no key is sent when it is unset",
    )
    g.add_argument("--settings", metavar="FILE", help="the seed's client settings.json")
    g.add_argument("--prompt", action="append", help="prompt text; repeat for a prompt set (cycled)")
    g.add_argument(
        "--prompt-file", action="append", metavar="FILE", help="a file whose text is one prompt; repeatable"
    )
    g.add_argument("--max-tokens", type=int, help=f"max_tokens per request (default: {DEFAULT_MAX_TOKENS})")
    g.add_argument(
        "--timeout-connect", type=float, metavar="S", help="connect timeout, seconds (default: 10)"
    )
    g.add_argument(
        "--timeout-read",
        type=float,
        metavar="S",
        help="longest silence while streaming, seconds (default: 120)",
    )
    g.add_argument("--retries", type=int, help="retries after a failed attempt (default: 2, i.e. 3 attempts)")
    g.add_argument(
        "--backoff", type=float, metavar="S", help="first retry delay, doubled each time (default: 2)"
    )
    g.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed GET /models before the first request (then the first TTFT also "
        "holds the client's start-up and connection set-up)",
    )
    g.add_argument(
        "--api",
        choices=("chat", "responses"),
        default="chat",
        help="chat: POST /chat/completions (default); responses: the Responses API, POST /responses",
    )
    g.add_argument(
        "--no-usage",
        action="store_true",
        help="do not ask for stream_options.include_usage (tokens are then counted from content events)",
    )


def target_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, notes: list[str] | None = None
) -> Target:
    """Merge defaults < environment < settings.json < flags into a Target (ToolError if invalid).

    Things worth telling the user (a setting overruled, say) are appended to `notes`.
    """
    env = os.environ if env is None else env
    s = load_client_settings(args.settings) if args.settings else {}
    params: dict[str, Any] = dict(s.get("default_params", {}))
    if params.pop("stream", True) is not True and notes is not None:
        notes.append(
            "settings default_params.stream is not true: requests stream anyway (TTFT needs a stream)"
        )
    params.pop("stream_options", None)
    params.pop("model", None)
    params.pop("messages", None)
    max_tokens = params.pop("max_tokens", DEFAULT_MAX_TOKENS)
    timeout, retry = s.get("timeout", {}), s.get("retry", {})

    base_url = (
        getattr(args, "base_url", None) or s.get("base_url") or env.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    )
    target = Target(
        base_url=base_url,
        model=args.model or s.get("model"),
        api_key_env=args.api_key_env or s.get("api_key_env") or DEFAULT_KEY_ENV,
        params=params,
        max_tokens=args.max_tokens if args.max_tokens is not None else max_tokens,
        connect_timeout=_pick(args.timeout_connect, timeout.get("connect"), 10.0),
        read_timeout=_pick(args.timeout_read, timeout.get("read"), 120.0),
        max_attempts=args.retries + 1 if args.retries is not None else int(retry.get("max_attempts", 3)),
        backoff_s=_pick(args.backoff, retry.get("backoff_seconds"), 2.0),
        include_usage=not args.no_usage,
        api=args.api,
    )
    return validate_target(target)


def _pick(flag: float | None, setting: Any, default: float) -> float:
    if flag is not None:
        return float(flag)
    return float(setting) if setting is not None else default


def validate_target(t: Target) -> Target:
    parts = urlsplit(t.base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ToolError(f"base URL must be an http:// or https:// URL, got {t.base_url!r}")
    if t.max_tokens < 1:
        raise ToolError("--max-tokens must be at least 1")
    if t.connect_timeout <= 0 or t.read_timeout <= 0:
        raise ToolError("timeouts must be positive")
    if t.max_attempts < 1:
        raise ToolError("--retries must be 0 or more")
    if t.backoff_s < 0:
        raise ToolError("--backoff must be 0 or more")
    return t


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            prompts.append(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ToolError(f"{path}: cannot read prompt file: {e.strerror}") from None
    if any(not p.strip() for p in prompts):
        raise ToolError("a prompt is empty")
    return prompts or [DEFAULT_PROMPT]
