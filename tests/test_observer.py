"""The observer fan-out: `ended` after every terminal hook, so registration order never matters."""

from __future__ import annotations

from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import Observer, ObserverSet


class Setter(Observer):
    name = "setter"

    def finished(self, ex: Exchange) -> None:
        ex.cost = 1.5


class Reader(Observer):
    name = "reader"

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def ended(self, ex: Exchange) -> None:
        self.seen.append(ex.cost)


class Broken(Observer):
    name = "broken"

    def ended(self, ex: Exchange) -> None:
        raise RuntimeError("observer bug")


def test_what_a_terminal_hook_sets_every_ended_sees_in_either_order() -> None:
    for order in ("setter first", "reader first"):
        reader = Reader()
        chain: list[Observer] = [Setter(), Broken(), reader]
        obs = ObserverSet(chain if order == "setter first" else chain[::-1])
        ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions")
        ex.outcome = Outcome.OK
        obs.finished(ex)
        assert reader.seen == [1.5], order


def test_ended_follows_each_terminal_hook_once() -> None:
    reader = Reader()
    obs = ObserverSet([reader])
    for hook in (obs.finished, obs.failed, obs.client_disconnected):
        hook(Exchange("r", "embeddings", "POST", "/v1/embeddings"))
    assert reader.seen == [None, None, None]
