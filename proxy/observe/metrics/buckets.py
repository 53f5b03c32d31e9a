"""Histogram bucket boundaries: where infertap's latency and size histograms can tell values apart.

Pure data (no prometheus_client): prometheus.py beside it builds its histograms on these, the
tests and docs/metrics.md hold them to their resolution.
"""

from __future__ import annotations

# Resolution: histogram_quantile interpolates linearly inside the bucket that holds the quantile, and
# the true quantile lies in that same bucket, so its relative error is below (upper / lower - 1) of
# that bucket. Boundaries at most 1.1x apart bound the error of any quantile to 10%, whatever the
# distribution: docs/metrics.md states the ranges where they are. Every vLLM boundary is kept, so
# infertap's and the engine's histograms line up, and so are the SLO points the rules use (0.5, 2, 3 s).
MAX_BUCKET_RATIO = 1.1
# One decade of boundaries, each at most 1.1x the one before; it holds vLLM's mantissas (1, 1.5, 2,
# 2.5, 5, 6, 7.5, 8) so a dense range never needs a boundary off this ladder.
_LADDER = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.75, 1.9, 2.0, 2.2, 2.3, 2.5, 2.75, 3.0, 3.3, 3.6, 3.9,
           4.2, 4.6, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.7, 9.3)  # fmt: skip


def dense_buckets(low: float, high: float) -> tuple[float, ...]:
    """The ladder's boundaries from the last one below `low` to the first one at or above `high`:
    every value in [low, high] falls in a bucket whose bounds are at most 1.1x apart."""
    out: list[float] = []
    for exponent in range(-4, 5):
        for mantissa in _LADDER:
            out.append(round(mantissa * 10.0**exponent, 10))
    first = max(i for i, b in enumerate(out) if b < low)
    last = min(i for i, b in enumerate(out) if b >= high)
    return tuple(out[first : last + 1])


# vLLM's boundaries (TTFT and ITL), as vllm/v1/metrics/loggers.py has them.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)  # fmt: skip
# The ranges where the 10% bound holds (docs/metrics.md): where prefill and decode usually are.
TTFT_DENSE = (0.05, 10.0)
ITL_DENSE = (0.005, 0.2)
TTFT_BUCKETS = tuple(sorted({*VLLM_TTFT_BUCKETS, 0.2, 0.3, 1.5, 2.0, 3.0, *dense_buckets(*TTFT_DENSE)}))
# Plus 1 and 2.5 ms below the dense range: local engines can decode faster than 5 ms a token.
ITL_BUCKETS = tuple(sorted({*VLLM_ITL_BUCKETS, 0.001, 0.0025, *dense_buckets(*ITL_DENSE)}))
# vLLM's e2e boundaries plus sub-0.3 s ones for short and non-generation requests.
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# infertap's own overhead and the loop's lag: tens of microseconds when all is well, milliseconds
# when its core is taken away, seconds when something blocks the loop.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5)  # fmt: skip
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
