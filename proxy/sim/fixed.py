"""The fixed-timing lane: requests with a set TTFT/TPOT (x-sim-* headers, [sim] fixed_*).

They skip the scheduler (no queueing, no KV blocks, load does not change them) so tests and
benchmarks can control timing exactly. One call_at timer per token, due times counted from
the first token so they do not drift; they still count as running and report every metric.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from proxy.sim.config import SimConfig
from proxy.sim.sequence import Sequence, State


class FixedLane:
    def __init__(
        self,
        config: SimConfig,
        emit: Callable[[Sequence, float], None],
        prefill_done: Callable[[Sequence], None],
    ) -> None:
        self.config = config
        self.sequences: set[Sequence] = set()
        self._emit = emit
        self._prefill_done = prefill_done
        self._timers: dict[Sequence, asyncio.TimerHandle] = {}

    def start(self, seq: Sequence) -> None:
        sim = self.config.sim
        seq.state = State.RUNNING
        seq.scheduled_at = seq.arrival
        self.sequences.add(seq)
        ttft = seq.spec.ttft_ms if seq.spec.ttft_ms is not None else sim.fixed_ttft_ms
        if ttft is None:  # only the TPOT is fixed: the prefill of this prompt alone
            ttft = sim.prefill_base_ms + sim.prefill_ms_per_token * len(seq.spec.prompt)
        loop = asyncio.get_running_loop()
        due = loop.time() + ttft / 1000
        self._timers[seq] = loop.call_at(due, self._tick, seq, due)

    def discard(self, seq: Sequence) -> None:
        self.sequences.discard(seq)
        timer = self._timers.pop(seq, None)
        if timer is not None:
            timer.cancel()

    def _tick(self, seq: Sequence, due: float) -> None:
        if seq.state is not State.RUNNING:
            return
        if seq.generated == 0:
            seq.computed = seq.target
            self._prefill_done(seq)
        self._emit(seq, time.monotonic())
        if seq.state is not State.RUNNING:
            return
        due += self._tpot_ms(seq) / 1000
        self._timers[seq] = asyncio.get_running_loop().call_at(due, self._tick, seq, due)

    def _tpot_ms(self, seq: Sequence) -> float:
        sim = self.config.sim
        tpot = seq.spec.tpot_ms if seq.spec.tpot_ms is not None else sim.fixed_tpot_ms
        if tpot is not None:
            return tpot
        # Only the TTFT is fixed: a decode step of this sequence alone.
        ms = sim.decode_step_ms + sim.decode_ms_per_running_seq
        if not self.config.kv_cache.enable:
            ms += sim.no_kv_cache_ms_per_context_token * (len(seq.spec.prompt) + seq.generated)
        return ms
