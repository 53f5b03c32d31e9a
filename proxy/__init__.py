"""infertap: an observability proxy for OpenAI-compatible LLM inference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy import compiled

# Before any other module of the package: a build whose sources changed is not used (proxy/compiled/).
compiled.install()

__version__ = "0.1.0"
__all__ = ["Settings", "__version__", "create_app"]

if TYPE_CHECKING:
    from proxy.app import create_app
    from proxy.settings import Settings


def __getattr__(name: str) -> Any:
    # Lazy so that `import proxy` (e.g. for __version__ in the CLI's --help) stays cheap.
    if name == "create_app":
        from proxy.app import create_app

        return create_app
    if name == "Settings":
        from proxy.settings import Settings

        return Settings
    raise AttributeError(name)
