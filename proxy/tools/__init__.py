"""Client-side tools behind the `infertap` command: probe, compare, engine-args (and more).

Each command module has `main(argv: list[str]) -> int`. Shared pieces: `client` (settings,
one streamed request measured, N requests at concurrency C) and `stats` (percentiles,
bootstrap confidence intervals). Pure stdlib plus httpx.
"""
