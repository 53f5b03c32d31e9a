"""Spend: what each request's tokens cost, from the prices in `[spend]` only (docs/spend.md).

Pure stdlib: it sets `ex.cost` (or `ex.unpriced`) when a request ends, before the metrics, the
access log and the span read it, so all three tell the same figure. No pricing service is called.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.settings import SpendSettings

log = logging.getLogger("infertap.spend")

MAX_FLAGGED = 100  # distinct unpriced models named in the log; the model comes from the client


@dataclass(frozen=True, slots=True)
class Price:
    input: float  # per token
    cached_input: float
    output: float


class Prices:
    """Model -> price: the first entry whose globs match the requested model wins."""

    def __init__(self, spend: SpendSettings) -> None:
        self.entries = [
            (
                tuple(p.models),
                Price(
                    p.input_per_mtok / 1e6,
                    (p.input_per_mtok if p.cached_input_per_mtok is None else p.cached_input_per_mtok) / 1e6,
                    p.output_per_mtok / 1e6,
                ),
            )
            for p in spend.prices
        ]
        self._memo: dict[str, Price | None] = {}

    def __call__(self, model: str | None) -> Price | None:
        if not model:
            return None
        if model in self._memo:
            return self._memo[model]
        price = next(
            (p for globs, p in self.entries if any(fnmatch.fnmatchcase(model, g) for g in globs)), None
        )
        if len(self._memo) < 10_000:  # hostile model names must not grow it without bound
            self._memo[model] = price
        return price


def billed_tokens(ex: Exchange) -> tuple[int, int, int]:
    """(uncached prompt, cached prompt, completion) tokens, the same figures the token counters add."""
    prompt = ex.prompt_tokens if ex.prompt_tokens is not None else ex.estimated_prompt_tokens
    cached = min(ex.cached_tokens or 0, prompt)
    completion = ex.output_tokens if route_of(ex.route).generation else 0
    return prompt - cached, cached, completion


class SpendObserver(Observer):
    """Prices each request that ended `ok` (the requests whose tokens the counters add up)."""

    name = "spend"

    def __init__(self, spend: SpendSettings) -> None:
        self.prices = Prices(spend)
        self.currency = spend.currency
        self.flagged: set[str] = set()

    def finished(self, ex: Exchange) -> None:
        if ex.outcome is not Outcome.OK or ex.model is None:
            return
        price = self.prices(ex.model)
        if price is None:
            ex.unpriced = True
            self._flag(ex.model)
            return
        uncached, cached, completion = billed_tokens(ex)
        ex.cost = uncached * price.input + cached * price.cached_input + completion * price.output

    def _flag(self, model: str) -> None:
        if model in self.flagged or len(self.flagged) > MAX_FLAGGED:
            return
        self.flagged.add(model)
        if len(self.flagged) > MAX_FLAGGED:
            log.warning("spend: more than %d models have no price; no more are named", MAX_FLAGGED)
            return
        log.warning(
            "spend: model %r has no price in [spend.prices]: its tokens are counted in "
            "infertap_unpriced_tokens_total, not in infertap_spend_total",
            model[:200],
        )
