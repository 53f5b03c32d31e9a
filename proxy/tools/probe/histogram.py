"""Compact text histograms for the terminal, shared by `infertap probe` and `infertap compare`.

One block per metric: a row per bin, a horizontal bar per series drawn with unicode eighth
blocks, and the count. Several series (compare's A and B) share the bins and the bar scale,
so they can be read against each other:

    TTFT (s)       kv-on (n=20)              kv-off (n=20)
    0.022–0.039    ████████████████▍     9   ████████████████████ 11
    0.039–0.057
    0.057–0.074    ██████████████▌       8   █████████▏            5
    ...

Plain stdlib; the bin count follows Sturges' rule (ceil(log2 n) + 1, at most 12), the bins
span min..max linearly, and the edges get as many decimals as it takes to tell them apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Index = eighths of a character cell: " ▏▎▍▌▋▊▉█".
_EIGHTHS = " \u258f\u258e\u258d\u258c\u258b\u258a\u2589\u2588"
FULL = _EIGHTHS[8]
MAX_BINS = 12
MAX_DECIMALS = 6


def bar(fraction: float, width: int) -> str:
    """A bar of `fraction` (0..1) of `width` cells, padded to `width`; any non-zero fraction shows."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    if fraction > 0:
        eighths = max(eighths, 1)
    full, part = divmod(eighths, 8)
    return (FULL * full + (_EIGHTHS[part] if part else "")).ljust(width)


def bin_count(n: int, max_bins: int = MAX_BINS) -> int:
    """Sturges' rule, ceil(log2 n) + 1, within 1..max_bins."""
    if n <= 1:
        return 1
    return max(1, min(max_bins, math.ceil(math.log2(n)) + 1))


def bin_edges(lo: float, hi: float, bins: int) -> list[float]:
    if hi <= lo:
        return [lo, hi]
    return [lo + (hi - lo) * i / bins for i in range(bins)] + [hi]


def bin_counts(values: Sequence[float], edges: Sequence[float]) -> list[int]:
    """Counts per bin; every bin is [left, right) except the last, which also holds its right edge."""
    bins = len(edges) - 1
    lo, hi = edges[0], edges[-1]
    counts = [0] * bins
    for v in values:
        i = 0 if hi <= lo else int((v - lo) / (hi - lo) * bins)
        counts[max(0, min(bins - 1, i))] += 1
    return counts


def edge_decimals(width: float, digits: int) -> int:
    """At least `digits` decimals, more when the bins are so narrow that edges would look alike."""
    if width <= 0 or not math.isfinite(width):
        return digits
    return max(digits, min(MAX_DECIMALS, math.ceil(-math.log10(width)) + 1))


@dataclass(frozen=True)
class _Block:
    title: str
    labels: list[str]  # one per bin
    counts: list[list[int]]  # per series, per bin
    heads: list[str]  # per series: "label (n=N)"

    @property
    def top(self) -> int:
        return max(max(c) for c in self.counts)


def _block(title: str, series: Sequence[tuple[str, Sequence[float]]], digits: int) -> _Block | None:
    finite = [[v for v in values if math.isfinite(v)] for _, values in series]
    everything = [v for values in finite for v in values]
    if len(everything) < 2:
        return None
    lo, hi = min(everything), max(everything)
    bins = bin_count(len(everything)) if hi > lo else 1
    edges = bin_edges(lo, hi, bins)
    decimals = edge_decimals((hi - lo) / bins, digits)
    if hi > lo:
        labels = [f"{edges[i]:.{decimals}f}–{edges[i + 1]:.{decimals}f}" for i in range(bins)]
    else:
        labels = [f"{lo:.{decimals}f}"]
    return _Block(
        title=title,
        labels=labels,
        counts=[bin_counts(values, edges) for values in finite],
        heads=[f"{label} (n={len(values)})" for (label, _), values in zip(series, finite, strict=True)],
    )


def histograms(
    blocks: Sequence[tuple[str, Sequence[tuple[str, Sequence[float]]], int]],
    *,
    bar_width: int | None = None,
) -> list[list[str]]:
    """Several histogram blocks, (title, series, digits) each, with their columns lined up.

    `series` is (label, values) pairs drawn side by side over the block's shared bins; `digits`
    is the smallest number of decimals for the bin edges. A block whose series together hold
    fewer than two values comes back as [].
    """
    built = [_block(title, series, digits) for title, series, digits in blocks]
    present = [b for b in built if b is not None]
    if not present:
        return [[] for _ in built]
    width = bar_width or (30 if max(len(b.counts) for b in present) == 1 else 20)
    label_width = max(len(text) + 2 for b in present for text in (b.title, *b.labels))
    count_width = max(len(str(b.top)) for b in present)
    column = max(width + 1 + count_width, *(len(h) for b in present for h in b.heads))

    out: list[list[str]] = []
    for b in built:
        if b is None:
            out.append([])
            continue
        lines = [(f"{b.title:<{label_width}}" + "   ".join(f"{h:<{column}}" for h in b.heads)).rstrip()]
        for i, label in enumerate(b.labels):
            cells = []
            for c in b.counts:
                count = f"{c[i]:>{count_width}}" if c[i] else " " * count_width
                cells.append(f"{bar(c[i] / b.top, width) + ' ' + count:<{column}}")
            lines.append((f"{label:<{label_width}}" + "   ".join(cells)).rstrip())
        out.append(lines)
    return out


def histogram(
    title: str,
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    digits: int = 3,
    bar_width: int | None = None,
) -> list[str]:
    """The lines of one histogram block (see `histograms`); [] for fewer than two values in all."""
    return histograms([(title, series, digits)], bar_width=bar_width)[0]
