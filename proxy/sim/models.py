"""The model names the simulated engine serves: `[model] name` and `[sim] served_model_names`.

A request for another name gets OpenAI's 404 `model_not_found` body, unless `[sim]
accept_any_model` is set (as `infertap serve` sets it for its embedded engine, the stand-in for
whatever model a client asks for); then the requested name is echoed back.
"""

from __future__ import annotations

from typing import Any

from proxy.sim.config import SimConfig
from proxy.sim.protocol import ApiError


class ServedModels:
    def __init__(self, config: SimConfig, created: int) -> None:
        names = [config.model.name, *config.sim.served_model_names]
        self.names = list(dict.fromkeys(names))  # in order, once each
        self.accept_any = config.sim.accept_any_model
        self.max_model_len = config.model.max_model_len
        self.created = created

    def check(self, requested: str | None) -> str:
        """The name to answer with: the requested one when served, the first name when none."""
        if not requested:
            return self.names[0]
        if requested in self.names or self.accept_any:
            return requested
        message = f"The model `{requested}` does not exist or you do not have access to it."
        body = {
            "message": message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        raise ApiError(404, {"error": body})

    def cards(self) -> list[dict[str, Any]]:
        root = self.names[0]
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "infertap-sim",
                 "root": root, "parent": None, "max_model_len": self.max_model_len}
                for name in self.names]  # fmt: skip
