"""Reading Prometheus expositions for `infertap doctor`: parse, subtract, sum and take quantiles.

A small parser of the text format (and of OpenMetrics, which differs in ways that do not matter
here), so the client tools need no prometheus_client. Engine names are normalised: a scrape in
OpenMetrics may spell vLLM's `vllm:foo` as `vllm_foo`; both become `vllm:foo`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
# Suffixes of cumulative series: over a window they are differences; anything else is a gauge.
CUMULATIVE = ("_total", "_bucket", "_sum", "_count")


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition."""


def normalise(name: str) -> str:
    return "vllm:" + name[5:] if name.startswith("vllm_") else name


def _labels(text: str) -> Labels:
    body = text[1:-1].strip()
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise ExpositionError(f"bad label set {text!r}")
        value = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        out.append((m.group(1), value))
        pos = m.end()
    return tuple(sorted(out))


def parse(text: str) -> Samples:
    """Samples of a text-format (or OpenMetrics) exposition; `_created` series are skipped."""
    values: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ExpositionError(f"not a Prometheus exposition line: {line[:120]!r}")
        name = normalise(m.group(1))
        if name.endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            raise ExpositionError(f"bad sample value in {line[:120]!r}") from None
        key = (name, _labels(m.group(2)) if m.group(2) else ())
        values[key] = values.get(key, 0.0) + value
    return Samples(values)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative buckets (upper bound, count), summed over the series that matched."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """As PromQL's histogram_quantile: linear within the bucket that holds the rank."""
        if not self.buckets or self.count <= 0:
            return None
        total = self.buckets[-1][1]
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for upper, cum in self.buckets:
            if cum >= rank:
                if math.isinf(upper):
                    return lower  # the highest finite bound, as Prometheus does
                if cum == below:
                    return upper
                return lower + (upper - lower) * (rank - below) / (cum - below)
            lower, below = upper, cum
        return lower

    def share_at_most(self, bound: float) -> float | None:
        """Share of the observations in buckets whose upper bound is <= `bound`."""
        if not self.buckets or self.buckets[-1][1] <= 0:
            return None
        within = max((cum for upper, cum in self.buckets if upper <= bound), default=0.0)
        return within / self.buckets[-1][1]


@dataclass(slots=True)
class Samples:
    """Sample values by (name, sorted labels)."""

    values: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def series(self, name: str, match: dict[str, str] | None = None) -> Iterator[tuple[Labels, float]]:
        for (n, labels), v in self.values.items():
            if n != name:
                continue
            if match:
                d = dict(labels)
                if any(d.get(k) != want for k, want in match.items()):
                    continue
            yield labels, v

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.values)

    def total(self, name: str, **match: str) -> float:
        return sum(v for _, v in self.series(name, match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self.series(name, match):
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, base: str, **match: str) -> Histogram | None:
        """The histogram `base` (its _bucket, _sum and _count), summed over the matching series."""
        per_le: dict[float, float] = {}
        for labels, v in self.series(base + "_bucket", match):
            le = dict(labels).get("le")
            if le is None:
                continue
            bound = float(le)
            per_le[bound] = per_le.get(bound, 0.0) + v
        if not per_le:
            return None
        buckets = tuple(sorted(per_le.items()))
        return Histogram(buckets, self.total(base + "_sum", **match), self.total(base + "_count", **match))

    def gauge(self, name: str) -> float | None:
        """The gauge summed over its series (e.g. vLLM's engines), or None when absent."""
        found = list(self.series(name))
        return sum(v for _, v in found) if found else None


def delta(before: Samples, after: Samples) -> Samples:
    """What happened between two scrapes: cumulative series are subtracted (a series that went
    down was reset, so its later value is what happened since), gauges keep their later value."""
    out: dict[tuple[str, Labels], float] = {}
    for key, v in after.values.items():
        if key[0].endswith(CUMULATIVE):
            prev = before.values.get(key, 0.0)
            out[key] = v - prev if v >= prev else v
        else:
            out[key] = v
    return Samples(out)


def from_vector(name: str, result: Iterable[dict[str, object]]) -> dict[tuple[str, Labels], float]:
    """Samples of `name` from a Prometheus instant-vector API result."""
    out: dict[tuple[str, Labels], float] = {}
    for item in result:
        metric = item.get("metric")
        value = item.get("value")
        if not isinstance(metric, dict) or not isinstance(value, list) or len(value) != 2:
            continue
        labels = tuple(sorted((str(k), str(v)) for k, v in metric.items() if k != "__name__"))
        try:
            number = float(value[1])
        except (TypeError, ValueError):
            continue
        if math.isnan(number):
            continue
        key = (normalise(name), labels)
        out[key] = out.get(key, 0.0) + number
    return out
