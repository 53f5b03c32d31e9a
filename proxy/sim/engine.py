"""The simulated engine: a continuous-batching scheduler whose timing follows the seed's model.

One asyncio task runs the whole engine. Each iteration is one "step" (a forward pass): it picks
the work (a decode token for every running sequence, prefill chunks for new ones), sleeps for
what that step would cost on a GPU (see SimSection), then hands every sequence its token. So
TTFT grows with prompt length and with queueing, TPOT with the batch size (and, with the KV
cache off, with context length), and hundreds of streams cost one timer per step, not per token.

Requests with a fixed TTFT/TPOT (x-sim-* headers or [sim] fixed_*) skip the scheduler: see
proxy.sim.fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque

from proxy.sim.config import SimConfig
from proxy.sim.fixed import FixedLane
from proxy.sim.kvcache import PrefixCache, block_hashes, blocks_for
from proxy.sim.sampling import TextSource, derive_seed
from proxy.sim.sequence import EngineStats, Finished, NullStats, RequestSpec, RequestTiming, Sequence, State

log = logging.getLogger("infertap.sim")


class Engine:
    def __init__(self, config: SimConfig, stats: EngineStats | None = None) -> None:
        self.config = config
        self.stats: EngineStats = stats or NullStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.fixed = FixedLane(config, self._emit, self._prefill_done)
        self.preemptions = 0
        self._submitted = 0
        self._kv = config.kv_cache.enable
        self._prefix = PrefixCache(config.kv_cache.block_size, config.kv_cache.num_gpu_blocks)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- public ---------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.fixed.sequences)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return sum(s.blocks for s in self.running) / self.config.kv_cache.num_gpu_blocks

    def submit(self, spec: RequestSpec) -> Sequence:
        self._submitted += 1
        key = spec.seed_key if spec.seed_key is not None else ("request", self._submitted)
        rng = random.Random(derive_seed(self.config.sim.seed, key))
        hashes = block_hashes(spec.prompt, self.config.kv_cache.block_size) if self._kv else []
        seq = Sequence(spec, TextSource(rng, looping=spec.looping), hashes, time.monotonic())
        seq.target = len(spec.prompt)
        sim = self.config.sim
        if any(v is not None for v in (spec.ttft_ms, spec.tpot_ms, sim.fixed_ttft_ms, sim.fixed_tpot_ms)):
            self.fixed.start(seq)
            return seq
        self.waiting.append(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="infertap-sim-engine")
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """The client went away: free the slot and blocks at once."""
        if seq.state is State.FINISHED:
            return
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        self.stats.finished("abort", None)
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._abort_all()

    def _abort_all(self) -> None:
        for seq in [*self.waiting, *self.running, *self.fixed.sequences]:
            self.abort(seq)
            seq.events.put_nowait(Finished("abort"))

    # -- the scheduler ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                work, step_ms = self._plan()
                if not work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await asyncio.sleep(step_ms / 1000)
                self._commit(work)
        except Exception:
            # A bug here would otherwise hang every open stream: end them, say why, and let the
            # next request start a fresh loop.
            log.exception("simulated engine loop failed; aborting its sequences")
            self._abort_all()

    def _plan(self) -> tuple[list[tuple[Sequence, int]], float]:
        """Choose this step's work: (sequence, tokens to compute) pairs, and the step's cost."""
        cfg = self.config
        budget = cfg.batching.max_num_batched_tokens
        prefill_left = cfg.prefill.max_prefill_tokens
        total_blocks = cfg.kv_cache.num_gpu_blocks
        work: list[tuple[Sequence, int]] = []
        if not cfg.batching.enable_continuous_batching and not self.running:
            # Static batching: a new batch forms only once the previous one has fully finished.
            while self.waiting and len(self.running) < cfg.batching.max_num_seqs:
                seq = self.waiting.popleft()
                self._admit(seq, self._prefix_hits(seq))
        used = sum(s.blocks for s in self.running)
        prefilling = 0  # prefill tokens scheduled so far in this step
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            if seq.decoding:
                n = 1 if budget > 0 else 0
            else:
                n = self._take(seq.target - seq.computed, budget, prefill_left, first=not prefilling)
            if n == 0:
                continue
            extra = self._blocks(seq.computed + n) - seq.blocks
            while used + extra > total_blocks and seq.state is State.RUNNING:
                victim = self.running[-1]  # the newest; vLLM's recompute preemption
                used -= victim.blocks
                self._preempt(victim)
                preempted = True
            if seq.state is not State.RUNNING:
                break
            seq.blocks += extra
            used += extra
            work.append((seq, n))
            budget -= n
            if not seq.decoding:
                prefill_left -= n
                prefilling += n
        # As in vLLM, no new sequence starts in a step that had to preempt one.
        while cfg.batching.enable_continuous_batching and not preempted and self.waiting:
            if len(self.running) >= cfg.batching.max_num_seqs:
                break
            seq = self.waiting[0]
            hits = self._prefix_hits(seq)
            n = self._take(seq.target - hits, budget, prefill_left, first=not prefilling)
            need = self._blocks(hits + n)
            if n == 0 or used + need > total_blocks:
                break
            self.waiting.popleft()
            self._admit(seq, hits)
            seq.blocks = need
            used += need
            work.append((seq, n))
            budget -= n
            prefill_left -= n
            prefilling += n
        return work, self._cost_ms(work)

    def _cost_ms(self, work: list[tuple[Sequence, int]]) -> float:
        sim = self.config.sim
        decoding = [seq for seq, _ in work if seq.decoding]
        prefill = sum(n for seq, n in work if not seq.decoding)
        ms = 0.0
        if decoding:
            ms += sim.decode_step_ms + sim.decode_ms_per_running_seq * len(decoding)
            if not self._kv:
                ms += sim.no_kv_cache_ms_per_context_token * sum(s.computed + 1 for s in decoding)
        if prefill:
            ms += sim.prefill_base_ms + sim.prefill_ms_per_token * prefill
        return ms

    def _commit(self, work: list[tuple[Sequence, int]]) -> None:
        now = time.monotonic()
        self.stats.step(sum(n for _, n in work))
        for seq, n in work:
            if seq.state is not State.RUNNING:  # aborted while the step ran
                continue
            was_decoding = seq.decoding
            seq.computed += n
            if not seq.decoding:
                continue
            if not was_decoding:
                self._prefill_done(seq)
            self._emit(seq, now)

    def _take(self, remaining: int, budget: int, prefill_left: int, *, first: bool) -> int:
        """Prefill tokens a sequence may compute this step."""
        if self.config.prefill.chunked_prefill:
            return max(0, min(remaining, budget, prefill_left))
        # Unchunked, a prompt is prefilled whole; the first one of a step always goes, so a
        # prompt larger than the budget still runs (and stalls everyone else's decode).
        return remaining if first or remaining <= min(budget, prefill_left) else 0

    def _blocks(self, tokens: int) -> int:
        return blocks_for(tokens, self.config.kv_cache.block_size) if self._kv else 0

    def _prefix_hits(self, seq: Sequence) -> int:
        return self._prefix.hit_tokens(seq.hashes, seq.target) if self._kv else 0

    def _admit(self, seq: Sequence, hits: int) -> None:
        seq.state = State.RUNNING
        seq.computed = hits
        seq.cached = hits
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        self.running.append(seq)
        if self._kv:
            self._prefix.touch(seq.hashes, hits)
            self.stats.prefix_cache(seq.target, hits)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute preemption: the K/V are dropped; prompt and output so far are prefilled again.
        self.running.remove(seq)
        seq.state = State.WAITING
        seq.computed = seq.blocks = 0
        seq.target = len(seq.spec.prompt) + seq.generated
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.stats.preempted()

    def _prefill_done(self, seq: Sequence) -> None:
        if self._kv:
            self._prefix.insert(seq.hashes)
        if seq.generated == 0:
            self.stats.tokens(len(seq.spec.prompt), 0)

    # -- tokens out -----------------------------------------------------------------------------

    def _emit(self, seq: Sequence, now: float) -> None:
        """Sample one token into the sequence's stream (or end it, when it is complete)."""
        spec = seq.spec
        if seq.generated >= spec.max_new:
            self._finish(seq, spec.final_reason, now)
            return
        text = seq.source.next()
        seq.generated += 1
        if seq.last_token_at is None:
            seq.first_token_at = now
            self.stats.first_token(now - seq.arrival)
        else:
            self.stats.inter_token(now - seq.last_token_at)
        seq.last_token_at = now
        self.stats.tokens(0, 1)
        if spec.stop:
            window = seq.tail + text
            found = [i for i in (window.find(s) for s in spec.stop) if i >= 0]
            if found:
                piece = window[len(seq.tail) : min(found)]
                if piece:
                    seq.events.put_nowait(piece)
                self._finish(seq, "stop", now)
                return
            keep = max(len(s) for s in spec.stop) - 1
            seq.tail = window[-keep:] if keep else ""
        seq.events.put_nowait(text)
        if seq.generated >= spec.max_new:
            self._finish(seq, spec.final_reason, now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self._release(seq)
        seq.events.put_nowait(Finished(reason))
        scheduled = seq.scheduled_at if seq.scheduled_at is not None else seq.arrival
        first = seq.first_token_at if seq.first_token_at is not None else now
        last = seq.last_token_at if seq.last_token_at is not None else now
        self.stats.finished(
            reason, RequestTiming(now - seq.arrival, scheduled - seq.arrival, first - scheduled, last - first)
        )

    def _release(self, seq: Sequence) -> None:
        if seq.state is State.RUNNING:
            if seq in self.fixed.sequences:
                self.fixed.discard(seq)
            else:
                self.running.remove(seq)
        seq.state = State.FINISHED
        seq.blocks = 0
