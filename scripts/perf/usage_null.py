"""What removing the `"usage":null` that infertap's request for usage added costs per event.

The SSE scanner is fed a 100-token chat stream in vLLM's serialization, one event per feed (as
tokens arrive one by one), three ways, in interleaved rounds:

  plain     the client asked for usage itself: nothing is touched (the stream has `usage`)
  injected  infertap asked: each event loses its `"usage":null`, the usage-only chunk is dropped
  sglang    infertap asked of an engine that writes `"usage":null` unasked: found, left

Prints the median µs per event of each and the range over rounds.
Run: .venv/bin/python scripts/perf/usage_null.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

from proxy.core.sse import SSEScanner
from tests.test_usage_injection import render

WORDS = [f" word{i}" for i in range(100)]


def run(stream: bytes, strip: bool, repeat: int = 200) -> float:
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    start = time.perf_counter()
    for _ in range(repeat):
        scanner = SSEScanner(strip_usage_only=strip)
        feed = scanner.feed
        for e in events:
            feed(e)
    return (time.perf_counter() - start) / (repeat * len(events)) * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    cases = {
        "plain": (render("vllm", True, WORDS, include_usage=True), False),
        "injected": (render("vllm", True, WORDS, include_usage=True), True),
        "sglang": (render("sglang", True, WORDS, include_usage=True), True),
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (stream, strip) in cases.items():
            results[name].append(run(stream, strip))
    for name, values in results.items():
        spread = f"{min(values):.3f}..{max(values):.3f}"
        print(f"{name:9s} {statistics.median(values):.3f} µs/event (rounds {spread})")


if __name__ == "__main__":
    main()
