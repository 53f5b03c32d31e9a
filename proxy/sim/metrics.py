"""vLLM-compatible /metrics for the simulated engine (names, types, buckets and labels of vLLM V1).

The only sim module that imports prometheus_client. Every metric lives in the app's own
CollectorRegistry; the gauges read the engine's state when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine
from proxy.sim.sequence import RequestTiming

# vllm/v1/metrics/loggers.py, exactly.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM derives these from its CUDA-graph sizes; a fixed power-of-two ladder serves the sim.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort")


def cache_info(config: SimConfig) -> dict[str, str]:
    """The labels of vllm:cache_config_info (a subset of vLLM's), as vLLM spells them."""
    kv = config.kv_cache
    return {
        "block_size": str(kv.block_size),
        "cache_dtype": kv.cache_dtype,
        "enable_prefix_caching": str(kv.enable),
        "gpu_memory_utilization": str(config.model.gpu_memory_utilization),
        "num_gpu_blocks": str(kv.num_gpu_blocks if kv.enable else 0),
        "swap_space": str(kv.swap_space_gb),
    }


class SimMetrics:
    """Implements proxy.sim.sequence.EngineStats."""

    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}  # vLLM V1 labels every metric with its engine

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**values)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        lat = REQUEST_LATENCY_BUCKETS
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", lat
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", lat
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", lat
        )
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        # Children created up front, so every reason is exposed (at 0) from the first scrape.
        self.success = {r: success.labels(**values, finished_reason=r) for r in FINISHED_REASONS}
        if cache_info is not None:
            # vLLM's info gauge of its CacheConfig: num_gpu_blocks="0" is the sim's KV cache turned off.
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         sorted(cache_info), registry=registry)  # fmt: skip
            info.labels(**cache_info).set(1)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The body and content type for a scrape (OpenMetrics when the scraper asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def bind(self, engine: Engine) -> None:
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.kv_usage.set_function(lambda: engine.kv_usage)

    # -- EngineStats ------------------------------------------------------------------------------

    def step(self, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def tokens(self, prompt: int, generation: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self.generation_tokens.inc(generation)

    def prefix_cache(self, queries: int, hits: int) -> None:
        self.prefix_queries.inc(queries)
        if hits:
            self.prefix_hits.inc(hits)

    def preempted(self) -> None:
        self.preemptions.inc()

    def finished(self, reason: str, timing: RequestTiming | None) -> None:
        self.success[reason].inc()
        if timing is not None:
            self.e2e.observe(timing.e2e)
            self.queue.observe(timing.queue)
            self.prefill.observe(timing.prefill)
            self.decode.observe(timing.decode)
