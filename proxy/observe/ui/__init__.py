"""The built-in page at /ui: an observer's bounded rings, served as JSON and drawn by a small
script of our own. See docs/ui.md."""

from proxy.observe.ui.observer import UIObserver
from proxy.observe.ui.routes import UIRoutes

__all__ = ["UIObserver", "UIRoutes"]
