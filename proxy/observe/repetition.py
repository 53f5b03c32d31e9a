"""Loop detection: an observer that flags responses whose output text repeats itself.

Greedy decoding without a repetition penalty degenerates into a phrase repeated over and over
(the seed article's fault 5). The score is the share of word n-grams in the text that already
occurred earlier in it: varied prose repeats almost no 4-gram, a loop repeats nearly all of them.

The text comes from the core's opt-in capture (`Exchange.capture_output_chars`): the first
`window_chars` characters of the answer. The score is computed once per response, at its end,
in one pass over that bounded window (O(window_chars)); nothing runs per output event here.
What capture costs the SSE scanner per event is measured in docs/doctor.md; it is why
`[loops] enabled` is off by default.

Pure stdlib: the counter lives in proxy/observe/metrics/prometheus.py and is handed in as a callback.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from proxy.core.exchange import Exchange
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.settings import LoopSettings

# Words are whitespace-separated (punctuation stays attached: "sure." and "sure" differ, which
# is fine for spotting repeats). Scripts written without spaces (kana, CJK ideographs, Hangul
# syllables, with their punctuation and fullwidth forms) count one token per character.
# str.split keeps this fast: a regex over every character costs several times more.
_CJK = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef"
_SPLIT_CJK = re.compile(rf"[{_CJK}]|[^{_CJK}]+")
_HAS_CJK = re.compile(rf"[{_CJK}]")
# Routes whose answers are generated text.


def tokens(text: str) -> list[str]:
    out: list[str] = []
    for word in text.lower().split():
        if word.isascii() or _HAS_CJK.search(word) is None:
            out.append(word)
        else:
            out.extend(_SPLIT_CJK.findall(word))
    return out


def repetition_score(text: str, ngram: int = 4, min_tokens: int = 40) -> float | None:
    """Share (0..1) of the text's word n-grams that already occurred earlier in it.

    None when the text has fewer than `min_tokens` tokens: too short to call a loop.
    One pass, one set of n-grams: linear in the length of the text.
    """
    toks = tokens(text)
    if len(toks) < max(min_tokens, ngram + 1):
        return None
    grams = list(zip(*(toks[i:] for i in range(ngram)), strict=False))
    # Every occurrence of an n-gram after its first is a repeat.
    return (len(grams) - len(set(grams))) / len(grams)


class RepetitionDetector(Observer):
    """Counts responses whose captured text scores at or above `threshold`.

    `on_degenerate(ex, score)` is called once for each such response (the metrics observer's
    `degenerate_response` increments `infertap_degenerate_responses_total{model}`).
    """

    name = "loops"

    def __init__(
        self,
        settings: LoopSettings,
        on_degenerate: Callable[[Exchange, float], None] | None = None,
    ) -> None:
        self.window = settings.window_chars
        self.ngram = settings.ngram
        self.threshold = settings.threshold
        self.min_tokens = settings.min_tokens
        self.on_degenerate = on_degenerate

    def request_received(self, ex: Exchange) -> None:
        if route_of(ex.route).generation:
            ex.capture_output_chars = max(ex.capture_output_chars, self.window)

    def ended(self, ex: Exchange) -> None:
        text = ex.output_text
        if not text or not route_of(ex.route).generation:
            return
        # Another observer may have asked for a longer capture: score our window only.
        score = repetition_score(text[: self.window], self.ngram, self.min_tokens)
        if score is None or score < self.threshold:
            return
        ex.scratch[self.name] = score
        if self.on_degenerate is not None:
            self.on_degenerate(ex, score)
