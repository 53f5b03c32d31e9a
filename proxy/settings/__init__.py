"""Typed settings: defaults < config.toml < INFERTAP_* environment < command-line flags.

sections.py holds each section's model, upstreams.py an upstream's, loading.py the whole document
and how it loads, public.py what may be shown of it.
"""

from proxy.settings.loading import (
    RELOADABLE,
    ConfigError,
    Settings,
    load_settings,
    parse_upstream_flag,
    with_upstreams,
)
from proxy.settings.public import HIDDEN, display_url, public_config
from proxy.settings.sections import (
    DEFAULT_PROMPT_CLASS_BOUNDS,
    TAOTOKEN_BASE_URL,
    TAOTOKEN_HOST,
    AuthSettings,
    CircuitSettings,
    ClientSettings,
    LoopSettings,
    MetricsSettings,
    PriceSettings,
    RetrySettings,
    ServerSettings,
    SpendSettings,
    TimeoutSettings,
    TracingSettings,
    UISettings,
)
from proxy.settings.upstreams import DnsTarget, UpstreamSettings, dns_target

__all__ = [
    "DnsTarget",
    "dns_target",
    "DEFAULT_PROMPT_CLASS_BOUNDS",
    "HIDDEN",
    "RELOADABLE",
    "TAOTOKEN_BASE_URL",
    "TAOTOKEN_HOST",
    "AuthSettings",
    "CircuitSettings",
    "ClientSettings",
    "ConfigError",
    "LoopSettings",
    "MetricsSettings",
    "PriceSettings",
    "RetrySettings",
    "ServerSettings",
    "Settings",
    "SpendSettings",
    "TimeoutSettings",
    "TracingSettings",
    "UISettings",
    "UpstreamSettings",
    "display_url",
    "load_settings",
    "parse_upstream_flag",
    "public_config",
    "with_upstreams",
]
