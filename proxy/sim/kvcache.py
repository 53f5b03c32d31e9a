"""Block arithmetic and the prefix cache of the simulated engine.

The prefix cache remembers hashes of full prompt blocks that were prefilled recently (chained,
so a block only matches after the same prefix). It is an approximation of vLLM's: cached blocks
do not share or pin physical blocks, the cache is simply an LRU bounded by num_gpu_blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def block_hashes(tokens: Sequence[str], block_size: int) -> list[int]:
    """One chained hash per FULL block of tokens (a partial last block is never shared)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def hit_tokens(self, hashes: Sequence[int], target: int) -> int:
        """Tokens of the longest cached prefix, leaving at least one token to compute (as vLLM
        does: the last token must run through the model to sample the next one)."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        usable = max(0, (target - 1) // self.block_size)
        return min(hits, usable) * self.block_size

    def touch(self, hashes: Sequence[int], tokens: int) -> None:
        for h in hashes[: tokens // self.block_size]:
            self._blocks.move_to_end(h)

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
