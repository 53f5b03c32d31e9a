"""`infertap sim`: run the simulated OpenAI-compatible engine."""

from __future__ import annotations

import argparse
import asyncio
import errno
import socket
import sys
import threading
from typing import Any

import uvicorn

from proxy.sim.admin import install_sighup
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig, SimConfigError, load_sim_config, slowed, with_overrides

# `infertap serve` parses this line (with the real port) from the child's stdout: keep it exact.
READY = "infertap-sim listening on http://{host}:{port}/v1"

EPILOG = """\
examples:
  infertap sim                                     # http://127.0.0.1:8000/v1, the seed's defaults
  infertap sim --config config.toml --port 0       # the engine config.toml of the seed article
  infertap sim --no-kv-cache                       # the seed's A/B: watch TPOT climb with context
  infertap sim --ttft-ms 300 --tpot-ms 25          # fixed timings for every request

  curl -N http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"sim-model","stream":true,"messages":[{"role":"user","content":"hi"}]}'

Models: it serves [model] name (default sim-model) and [sim] served_model_names, or the --model
names; any other model gets OpenAI's 404 model_not_found, unless --accept-any-model (which
`infertap serve` gives its embedded engine).

Tools: with `tools` in a chat or Responses request, it answers with a function call when
tool_choice is "required" or names a function, and with "auto" (the default) decides by a seeded
draw (the same request always gets the same kind of answer; after a tool result it answers in
text). Chat streams `tool_calls` deltas (id and name, then argument fragments) and ends with
finish_reason "tool_calls"; the Responses API streams a function_call item and
response.function_call_arguments.delta events. The arguments fit the tool's JSON schema.

Per-request test hooks (headers): x-sim-output-tokens, x-sim-ttft-ms, x-sim-tpot-ms.

Change the timing while it runs (rehearse an alert under live traffic; no restart):
  curl http://127.0.0.1:8000/admin/timing                    # what is in effect
  curl -X POST http://127.0.0.1:8000/admin/timing -H 'content-type: application/json' \
    -d '{"sim": {"prefill_ms_per_token": 0.075}, "batching": {"max_num_seqs": 4}}'
  kill -HUP PID        # re-read the timing keys of --config ([sim] step costs, batch limits)
Endpoints: /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /health,
/admin/timing, /metrics (vLLM names: vllm:time_to_first_token_seconds, vllm:num_preemptions_total, ...).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infertap sim",
        description="Run a simulated OpenAI-compatible inference engine whose timing follows the "
        "prefill/decode/KV-cache model: TTFT grows with prompt length and queueing, TPOT with batch "
        "size (and with context length when the KV cache is off). No GPU or model needed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--config", metavar="PATH", help="engine config.toml ([model], [kv_cache], ... and [sim])")
    p.add_argument("--seed", type=int, help="seed of the generated text ([sim] seed)")
    p.add_argument("--ttft-ms", type=float, metavar="MS", help="fixed time to first token for every request")
    p.add_argument(
        "--tpot-ms", type=float, metavar="MS", help="fixed time per output token for every request"
    )
    p.add_argument(
        "--no-kv-cache", action="store_true", help="turn the KV cache off ([kv_cache] enable=false)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, metavar="N", help="concurrent sequences ([batching] max_num_seqs)"
    )
    p.add_argument(
        "--output-tokens", type=int, metavar="N", help="answer length ([sim] default_output_tokens)"
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="a model name to serve (repeat for several; default [model] name and [sim] served_model_names)",
    )
    p.add_argument(
        "--accept-any-model",
        action="store_true",
        help="answer any model name instead of 404 model_not_found ([sim] accept_any_model)",
    )
    p.add_argument(
        "--slowdown",
        type=float,
        metavar="X",
        help="multiply every step cost of [sim] (prefill and decode) by X: one replica of a fleet on "
        "a slower or sick GPU (2 = twice as slow)",
    )
    # For `infertap serve`, which holds the other end of our stdin: stop when it goes away.
    p.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve_config(args: argparse.Namespace) -> SimConfig:
    config = load_sim_config(args.config)
    overrides: dict[str, dict[str, Any]] = {"sim": {}, "kv_cache": {}, "batching": {}}
    if args.seed is not None:
        overrides["sim"]["seed"] = args.seed
    if args.ttft_ms is not None:
        overrides["sim"]["fixed_ttft_ms"] = args.ttft_ms
    if args.tpot_ms is not None:
        overrides["sim"]["fixed_tpot_ms"] = args.tpot_ms
    if args.output_tokens is not None:
        overrides["sim"]["default_output_tokens"] = args.output_tokens
    if args.no_kv_cache:
        overrides["kv_cache"]["enable"] = False
    if args.max_num_seqs is not None:
        overrides["batching"]["max_num_seqs"] = args.max_num_seqs
    if args.model:
        overrides["model"] = {"name": args.model[0]}
        overrides["sim"]["served_model_names"] = args.model[1:]
    if args.accept_any_model:
        overrides["sim"]["accept_any_model"] = True
    config = with_overrides(config, overrides)
    if args.slowdown is not None:
        config = slowed(config, args.slowdown)
    return config


def _url_host(sock: socket.socket) -> str:
    host = str(sock.getsockname()[0])
    return f"[{host}]" if sock.family == socket.AF_INET6 else host


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here rather than by uvicorn: a port that is taken or out of
    range then gets one clear line instead of uvicorn's log and traceback."""
    if not 0 <= port <= 65535:
        raise OSError(f"--port must be between 0 and 65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why = "the port is in use (choose another --port, or 0 for a free one)"
        raise OSError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket, config: SimConfig, path: str | None) -> None:
    install_sighup(config, path)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():  # failed to bind: uvicorn has logged why
            await task
            return
        await asyncio.sleep(0.01)
    sock = server.servers[0].sockets[0]
    print(READY.format(host=_url_host(sock), port=sock.getsockname()[1]), flush=True)
    await task


def _exit_on_stdin_eof(server: uvicorn.Server) -> None:
    def wait() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        server.should_exit = True

    threading.Thread(target=wait, name="infertap-sim-stdin-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve_config(args)
    except SimConfigError as e:
        print(f"infertap sim: {e}", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(f"infertap sim: {e}", file=sys.stderr)
        return 2
    app = create_sim_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",  # no access log: a line per request would drown a benchmark
            lifespan="on",
            timeout_graceful_shutdown=3,  # open streams get 3 s, then go (serve kills us after 5)
        )
    )
    if args.exit_with_stdin:
        _exit_on_stdin_eof(server)
    try:
        asyncio.run(_serve(server, sock, config, args.config))
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        return 130
    return 0
