"""Reading a Prometheus exposition in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def scrape(proxy: str, **headers: str) -> str:
    return httpx.get(f"{proxy}/metrics", headers=headers).text
