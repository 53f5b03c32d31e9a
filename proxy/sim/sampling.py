"""Token counting and deterministic pseudo-text for the simulated engine.

The tokenizer is a regex, not a real model's: runs of up to 6 ASCII letters, runs of up to 3
digits, and every other non-space character (punctuation, CJK) are one token each. That is
close to ~4 characters per token for English prose, counts Chinese text per character, and
(the property that matters) the sim's own output re-tokenizes to exactly the number of tokens
it was generated as, because every generated word is 2 to 6 letters.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Iterable, Sequence

_TOKEN = re.compile(r"[A-Za-z]{1,6}|[0-9]{1,3}|\S")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def chat_prompt_tokens(messages: Iterable[tuple[str, str]]) -> list[str]:
    """Tokens of (role, text) messages after a ChatML-like template: 2 per message + 1."""
    tokens: list[str] = []
    for role, text in messages:
        tokens.append(f"<|{role}|>")
        tokens += tokenize(text)
        tokens.append("<|end|>")
    tokens.append("<|assistant|>")
    return tokens


def derive_seed(*parts: object) -> int:
    """A stable 64-bit seed from parts (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _build_vocabulary() -> tuple[str, ...]:
    rng = random.Random(7)
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "n", "s", "r", "l", "m"]
    words = {"the", "of", "and", "to", "in", "is", "it", "that", "on", "with", "as", "for", "at", "by"}
    while len(words) < 512:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 2)))
        word += rng.choice(codas)
        if 2 <= len(word) <= 6:
            words.add(word)
    return tuple(sorted(words))


VOCABULARY = _build_vocabulary()


class TextSource:
    """Yields one token's text at a time.

    Varied pseudo-sentences normally; when `looping`, a short phrase over and over, which is
    what greedy decoding without a repetition penalty degenerates into (the seed's fault 5).
    """

    def __init__(self, rng: random.Random, *, looping: bool) -> None:
        self._rng = rng
        self._count = 0
        self._previous = ""
        self._phrase: list[str] | None = None
        if looping:
            self._phrase = [rng.choice(VOCABULARY) for _ in range(rng.randint(3, 5))] + ["."]

    def next(self) -> str:
        if self._phrase is not None:
            word = self._phrase[self._count % len(self._phrase)]
        elif self._count >= 3 and self._previous != "." and self._rng.random() < 0.08:
            word = "."
        else:
            word = self._rng.choice(VOCABULARY)
        self._count += 1
        self._previous = word
        return word if self._count == 1 or word == "." else " " + word


def is_looping(temperature: float, repetition_penalty: float) -> bool:
    # Greedy decoding with no penalty against repeats (1.0 is neutral, below 1 rewards repeats)
    # loops; a penalty above 1.0 or any sampling temperature keeps the text varied.
    return temperature == 0 and repetition_penalty <= 1.0


def embedding(tokens: Sequence[str], dim: int, seed: int) -> list[float]:
    """A deterministic unit vector for a token sequence."""
    rng = random.Random(derive_seed(seed, "embedding", tuple(tokens)))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]
