"""The JavaScript clients through infertap, run by node as their users run them: the official `openai`
package, the Vercel AI SDK (its chat provider `openai.chat(...)` and its default, the Responses API
`openai(...)`) and LangChain's `ChatOpenAI`/`OpenAIEmbeddings`, at the versions pinned in
tests/js/package-lock.json (installed by scripts/install_js_clients.sh).

One simulated engine (`python -m proxy sim`, fixed fast timings) and one `python -m proxy serve` in
front of it serve the whole module. Each test runs one scenario of tests/js/<client>.mjs against
infertap; the script prints what the client saw as JSON. What the engine answers is deterministic
(a request's `seed`, or greedy decoding), so the test asks the engine directly for the same answer
and compares; then it checks infertap's `infertap_requests_total` moved by exactly the requests
the script made, with the route, stream flag and outcome they must have.

What they show when an upstream fails mid-stream or answers an engine's own error body:
tests/test_js_client_errors.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from tests.conftest import serve_process, wait_until
from tests.promtext import samples, scrape, value

JS = Path(__file__).resolve().parent / "js"
CLIENTS = {"openai": "openai_sdk.mjs", "ai-sdk": "ai_sdk.mjs", "langchain": "langchain.mjs"}
MODEL = "sim-model"
OUTPUT_TOKENS = 12  # the engine's answer length (--output-tokens)
PROMPT = "Explain prefill and decode in one sentence."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
TOOL_RESULT = "sunny, 21 degrees"  # what tests/js/common.mjs's runTool answers
USER = {"role": "user", "content": PROMPT}
# With tools and tool_choice "auto", the engine answers this prompt (under its default seed, with no
# request seed) with a call: so a text answer in an agent loop's second step comes from the tool's
# result being the last input, which makes the engine answer in text.
TOOL_PROMPT = "What is the weather in Paris?"
TOOL_USER = {"role": "user", "content": TOOL_PROMPT}

Key = tuple[str, str, str]  # (route, stream, outcome) of infertap_requests_total


def _require(what: str) -> NoReturn:
    """Skip when the JavaScript side is missing; under CI=true, where scripts/test installs it, fail."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} in CI, where scripts/install_js_clients.sh installs the JavaScript clients")
    pytest.skip(f"{what}: run scripts/install_js_clients.sh (the JavaScript clients need Node.js >= 20)")


@pytest.fixture(scope="module")
def node() -> str:
    return find_node()


def find_node() -> str:
    """node's path, once the clients pinned in tests/js are installed (else skip, or fail in CI)."""
    path = shutil.which("node")
    if path is None:
        _require("node is not installed")
    major = subprocess.run(
        [path, "-p", "process.versions.node.split('.')[0]"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if int(major) < 20:
        _require(f"node {major} is older than 20")
    stamp = JS / "node_modules" / ".infertap-installed"
    want = hashlib.sha256((JS / "package.json").read_bytes() + (JS / "package-lock.json").read_bytes())
    if not stamp.exists():
        _require("tests/js/node_modules is missing (or was not installed by scripts/install_js_clients.sh)")
    if stamp.read_text().strip() != want.hexdigest()[:16]:
        _require("tests/js/node_modules does not match tests/js/package-lock.json")
    return path


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m proxy sim` on a port of the OS's choosing, with fixed fast timings; its base URL."""
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    args = ["--port", "0", "--ttft-ms", "2", "--tpot-ms", "1", "--output-tokens", str(OUTPUT_TOKENS)]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "proxy", "sim", *args], stdout=out, stderr=out)
    ready = "infertap-sim listening on "
    try:
        wait_until(lambda: ready in log.read_text() or proc.poll() is not None, 30, "the simulated engine")
        text = log.read_text()
        assert ready in text, f"infertap sim exited with {proc.returncode}: {text}"
        yield text.split(ready, 1)[1].split()[0]  # http://127.0.0.1:PORT/v1
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def infertap(sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m proxy serve --upstream sim=...`, as a user runs it; its base URL (no /v1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERTAP_", "TAOTOKEN_"))}
    env["INFERTAP_SERVER__DRAIN_DELAY"] = "0"  # nothing to drain at the end: stop at once
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process("--upstream", f"sim={sim}", "--forward-header", "x-sim-*", env=env, log=log) as (
        base,
        _,
    ):
        yield base


def run_js(node: str, client: str, scenario: str, infertap: str, **spec: Any) -> dict[str, Any]:
    """Runs one scenario of tests/js/<client>.mjs against infertap; the JSON it printed."""
    env = {
        k: v
        for k, v in os.environ.items()
        # the scripts talk to infertap only: no OpenAI settings, no LangSmith tracing from the shell
        if not k.startswith(("OPENAI_", "LANGCHAIN_", "LANGSMITH_", "INFERTAP_", "NODE_OPTIONS"))
    }
    env |= {"INFERTAP_BASE_URL": f"{infertap}/v1", "INFERTAP_JS_SPEC": json.dumps(spec)}
    script = JS / CLIENTS[client]
    cmd = [node, str(script), scenario]
    r = subprocess.run(cmd, env=env, cwd=JS, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, f"{script.name} {scenario} exited with {r.returncode}:\n{r.stderr}{r.stdout}"
    # Node's own runtime warnings ("(node:PID) ...", "(Use `node --trace-warnings ...") aside, anything
    # a client printed is a finding.
    printed = [
        line for line in r.stderr.splitlines() if line.strip() and not line.startswith(("(node:", "(Use"))
    ]
    assert not printed, f"{script.name} {scenario} wrote to stderr:\n{r.stderr}"
    result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def direct(sim: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own answer, not through infertap: what each client must have seen."""
    r = httpx.post(f"{sim}{path}", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def chat_answer(sim: str, **body: Any) -> dict[str, Any]:
    message: dict[str, Any] = direct(sim, "/chat/completions", body)["choices"][0]["message"]
    return message


def responses_text(sim: str, **body: Any) -> str:
    output = direct(sim, "/responses", body)["output"]
    return "".join(c["text"] for item in output if item["type"] == "message" for c in item["content"])


def as_js(obj: Any) -> str:
    """JSON.stringify's text of `obj`: what the scripts send as a tool's result."""
    return json.dumps(obj, separators=(",", ":"))


def chat_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"])}
        for c in message.get("tool_calls") or []
    ]


@dataclass
class Moved:
    """What infertap's /metrics counted between two scrapes."""

    requests: dict[Key, int]  # infertap_requests_total by (route, stream, outcome)
    ttft: float  # TTFT observations: one per stream that delivered an output event
    completion_tokens: float
    cancelled: float  # upstream attempts given up because the client left


class Metrics:
    """infertap's counts from now on: `settle(n)` once the script has made its n requests."""

    def __init__(self, infertap: str) -> None:
        self.infertap = infertap
        self.before = self._read()

    def _read(self) -> Moved:
        requests: Counter[Key] = Counter()
        text = scrape(self.infertap)
        for name, labels, v in samples(text):
            if name == "infertap_requests_total":
                requests[(labels["route"], labels["stream"], labels["outcome"])] += int(v)
        return Moved(
            dict(requests),
            value(text, "infertap_time_to_first_token_seconds_count"),
            value(text, "infertap_completion_tokens_total"),
            value(text, "infertap_upstream_attempts_total", result="cancelled"),
        )

    def settle(self, n: int) -> Moved:
        """Once infertap has counted `n` more requests (each is counted as it ends, which can be just
        after the client has seen the end of the answer): what moved since."""

        def counted() -> int:
            return sum(self._read().requests.values()) - sum(self.before.requests.values())

        wait_until(lambda: counted() >= n, 10, f"{n} requests counted")
        now, was = self._read(), self.before
        return Moved(
            dict(Counter(now.requests) - Counter(was.requests)),
            now.ttft - was.ttft,
            now.completion_tokens - was.completion_tokens,
            now.cancelled - was.cancelled,
        )


clients = pytest.mark.parametrize("client", list(CLIENTS))


# -- streamed text ------------------------------------------------------------------------------


@clients
def test_chat_stream_assembles_the_engines_answer(node: str, sim: str, infertap: str, client: str) -> None:
    expected = chat_answer(sim, messages=[USER], seed=7, temperature=0)["content"]
    count = Metrics(infertap)
    r = run_js(node, client, "chat_stream", infertap, prompt=PROMPT, seed=7)
    assert r["streamed"] == expected and r["whole"] == expected and expected
    assert r["deltas"] == OUTPUT_TOKENS and r["wholeOutputTokens"] == OUTPUT_TOKENS
    if client == "openai":
        # It did not ask for usage: the usage chunk infertap asked the engine for is not passed on.
        assert r["usageChunks"] == 0 and r["finishReason"] == "stop"
    else:
        assert r["streamOutputTokens"] == OUTPUT_TOKENS  # these ask for usage themselves
    moved = count.settle(r["requests"])
    assert moved.requests == {("chat.completions", "true", "ok"): 1, ("chat.completions", "false", "ok"): 1}
    assert moved.ttft == 1
    assert moved.completion_tokens == 2 * OUTPUT_TOKENS  # infertap's usage for both, asked for or not


@clients
def test_responses_stream_assembles_the_answer(node: str, sim: str, infertap: str, client: str) -> None:
    expected = responses_text(sim, input=PROMPT, temperature=0)
    count = Metrics(infertap)
    r = run_js(node, client, "responses_stream", infertap, prompt=PROMPT)
    assert r["streamed"] == expected and r["whole"] == expected and expected
    assert r["deltas"] == OUTPUT_TOKENS
    assert r["streamOutputTokens"] == OUTPUT_TOKENS and r["wholeOutputTokens"] == OUTPUT_TOKENS
    moved = count.settle(r["requests"])
    assert moved.requests == {("responses", "true", "ok"): 1, ("responses", "false", "ok"): 1}
    assert moved.ttft == 1 and moved.completion_tokens == 2 * OUTPUT_TOKENS


# -- tools --------------------------------------------------------------------------------------


def auto_seeds(sim: str) -> tuple[int, int]:
    """A request seed whose `tool_choice: "auto"` draw calls a tool, and one whose draw answers in text."""
    call = text = None
    for seed in range(1, 200):
        message = chat_answer(sim, messages=[TOOL_USER], tools=TOOLS, seed=seed)
        if message.get("tool_calls"):
            call = call or seed
        else:
            text = text or seed
        if call and text:
            return call, text
    raise AssertionError("no seed in 1..199 gave both kinds of answer")


@clients
def test_chat_tool_choice_required_and_auto(node: str, sim: str, infertap: str, client: str) -> None:
    call_seed, text_seed = auto_seeds(sim)
    cases = [
        {"seed": 3, "tool_choice": "required"},
        {"seed": call_seed, "tool_choice": "auto"},
        {"seed": text_seed, "tool_choice": "auto"},
    ]
    expected = [chat_answer(sim, messages=[TOOL_USER], tools=TOOLS, **case) for case in cases]
    count = Metrics(infertap)
    r = run_js(node, client, "chat_tools", infertap, prompt=TOOL_PROMPT, tools=TOOLS, cases=cases)
    for case, want, got in zip(cases, expected, r["cases"], strict=True):
        # The call's name and arguments, assembled from the streamed fragments, are the engine's;
        # or the text is.
        assert got["calls"] == chat_calls(want), case
        assert got["text"] == (want["content"] or ""), case
    assert [len(c["calls"]) for c in r["cases"]] == [1, 1, 0]
    if client != "langchain":
        finish = {"openai": "tool_calls", "ai-sdk": "tool-calls"}[client]
        assert [c["finishReason"] for c in r["cases"]] == [finish, finish, "stop"]
    moved = count.settle(r["requests"])
    # A streamed tool call is output like text: TTFT at its first delta.
    assert moved.requests == {("chat.completions", "true", "ok"): 3} and moved.ttft == 3


@clients
def test_chat_tool_loop_sends_the_result_back(node: str, sim: str, infertap: str, client: str) -> None:
    """The agent loop: a forced tool call, the tool's result sent back, the model's text answer.
    The engine's text depends on the whole conversation, the tool's result included."""
    first = chat_answer(sim, messages=[TOOL_USER], tools=TOOLS, tool_choice="required", temperature=0)
    (call,) = chat_calls(first)
    result = {"tool": call["name"], "args": call["args"], "result": TOOL_RESULT}
    messages = [
        TOOL_USER,
        {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": as_js(result)},
    ]
    answer = chat_answer(sim, messages=messages, tools=TOOLS, tool_choice="auto", temperature=0)["content"]
    count = Metrics(infertap)
    r = run_js(node, client, "chat_tool_loop", infertap, prompt=TOOL_PROMPT, tools=TOOLS)
    assert r["calls"] == [call] and r["results"] == [result]
    assert r["text"] == answer and answer and r["secondCalls"] == 0
    moved = count.settle(r["requests"])
    assert r["requests"] == 2 and moved.requests == {("chat.completions", "true", "ok"): 2}
    assert moved.ttft == 2


@clients
def test_responses_tool_loop(node: str, sim: str, infertap: str, client: str) -> None:
    """The same loop on the Responses API: a function_call, its function_call_output sent back."""
    # @langchain/openai 1.5.8 leaves the string tool_choices ("required", "auto") out of a Responses
    # API request; a named function does reach the engine.
    choice: Any = "required"
    spec: dict[str, Any] = {}
    if client == "langchain":
        choice = {"type": "function", "name": "get_weather"}
        spec["first_choice"] = "get_weather"
    tools = {"tools": RESPONSES_TOOLS, "temperature": 0}
    first = direct(sim, "/responses", {"input": [TOOL_USER], "tool_choice": choice, **tools})
    (item,) = [o for o in first["output"] if o["type"] == "function_call"]
    call = {"name": item["name"], "args": json.loads(item["arguments"])}
    result = {"tool": call["name"], "args": call["args"], "result": TOOL_RESULT}
    items = [
        TOOL_USER,
        {k: item[k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": item["call_id"], "output": as_js(result)},
    ]
    answer = responses_text(sim, input=items, **tools)
    # Without the output as the last item, "auto" gets a call here: the text answer says it came back.
    assert not responses_text(sim, input=items[:2], **tools)
    count = Metrics(infertap)
    r = run_js(node, client, "responses_tool_loop", infertap, prompt=TOOL_PROMPT, tools=TOOLS, **spec)
    assert r["calls"] == [call] and r["results"] == [result]
    assert r["text"] == answer and answer and r["secondCalls"] == 0
    if client == "openai":
        assert r["argumentDeltas"] > 1  # the arguments came in fragments, as streamed
    moved = count.settle(r["requests"])
    assert r["requests"] == 2 and moved.requests == {("responses", "true", "ok"): 2}
    assert moved.ttft == 2


# -- embeddings ---------------------------------------------------------------------------------


@clients
def test_embeddings(node: str, sim: str, infertap: str, client: str) -> None:
    (expected,) = [d["embedding"] for d in direct(sim, "/embeddings", {"input": PROMPT})["data"]]
    count = Metrics(infertap)
    r = run_js(node, client, "embeddings", infertap, input=PROMPT)
    (vector,) = r["vectors"]
    # The openai package asks for base64 (float32) and decodes it; equal to float32 precision.
    assert vector == pytest.approx(expected, rel=1e-6, abs=1e-7)
    moved = count.settle(r["requests"])
    assert moved.requests == {("embeddings", "false", "ok"): 1} and moved.ttft == 0


# -- a client that goes away --------------------------------------------------------------------


@clients
@pytest.mark.parametrize("route", ["chat.completions", "responses"])
def test_abort_mid_stream_is_a_client_disconnect(node: str, infertap: str, client: str, route: str) -> None:
    # A long answer (8,000 tokens, 20 ms apart): the client aborts after its first delta, long
    # before the engine would finish.
    headers = {"x-sim-output-tokens": "8000", "x-sim-tpot-ms": "20"}
    count = Metrics(infertap)
    api = route.removesuffix(".completions")
    r = run_js(node, client, "abort", infertap, prompt=PROMPT, headers=headers, route=api)
    assert r["deltas"] >= 1 and r["aborted"]
    moved = count.settle(r["requests"])
    assert moved.requests == {(route, "true", "client_disconnect"): 1}
    assert moved.ttft == 1  # the first token did reach the client
    assert moved.cancelled == 1  # and infertap gave up the engine's request at once
    wait_until(lambda: value(scrape(infertap), "infertap_in_flight_requests") == 0, 10, "nothing in flight")


# -- errors from the upstream -------------------------------------------------------------------


@clients
@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (
            {"model": "no-such-model"},
            404,
            "The model `no-such-model` does not exist or you do not have access",
        ),
        ({"model": MODEL, "temperature": 3}, 400, "temperature: Input should be less than or equal to 2"),
    ],
    ids=["404-unknown-model", "400-bad-parameter"],
)
def test_upstream_error_message_reaches_the_client(
    node: str, infertap: str, client: str, body: dict[str, Any], status: int, message: str
) -> None:
    """The engine refuses before any output, with an OpenAI-shaped error body: infertap relays
    status and body, and each client's thrown error carries the engine's message."""
    count = Metrics(infertap)
    r = run_js(node, client, "upstream_error", infertap, prompt=PROMPT, **body)
    assert r["errors"] and len(r["errors"]) == r["requests"]
    for key, error in r["errors"].items():
        assert error is not None, f"{key}: no error thrown"
        assert message in error["message"], (key, error)
        assert error["status"] == status, (key, error)
    moved = count.settle(r["requests"])
    expected = Counter((*key.split("/"), "client_error") for key in r["errors"])
    assert moved.requests == dict(expected) and moved.ttft == 0
