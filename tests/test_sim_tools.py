"""The simulated engine speaks tools and knows its models; infertap measures a tool-call stream.

Tool calls: streamed `tool_calls` deltas (id and name, then argument fragments) ending in
finish_reason "tool_calls" when tool_choice requires or names a tool, a seeded decision under
"auto", the same for whole answers and for the Responses API's function calls. Through infertap
with the OpenAI SDK (sync and async): the assembled call, and TTFT counted once per stream, at the
first tool-call delta. Models: unknown names get OpenAI's 404 model_not_found unless the sim
accepts any; infertap's /v1/models lists a model once even when two upstreams serve it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from proxy.core.sse import SSEScanner
from proxy.sim import create_sim_app
from proxy.sim.config import SimConfig, sim_config_from_dict
from tests.conftest import make_settings, run_proxy, serve_in_thread, wait_until
from tests.promtext import scrape, value

FAST = {"prefill_base_ms": 1.0, "prefill_ms_per_token": 0.01, "decode_step_ms": 1.0, "seed": 7,
        "default_output_tokens": 6}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def config(**sim: Any) -> SimConfig:
    return sim_config_from_dict({"sim": {**FAST, **sim}})


@contextmanager
def sim(cfg: SimConfig | None = None) -> Iterator[str]:
    with serve_in_thread(create_sim_app(cfg or config())) as url:
        yield url + "/v1"


def check_weather_arguments(arguments: str) -> None:
    args = json.loads(arguments)
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["days"], int)


# -- the sim alone ---------------------------------------------------------------------------------
def test_required_and_named_tool_choice_give_a_call_streamed_and_whole() -> None:
    with sim() as base, openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(
            model="sim-model", messages=ASK, tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        check_weather_arguments(call.function.arguments)

        raw = httpx.post(
            f"{base}/chat/completions",
            json={"model": "sim-model", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                  "stream": True},
        ).text  # fmt: skip
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}  # the role chunk, as before
        header = deltas[1]["tool_calls"][0]
        assert header["id"].startswith("call_") and header["function"] == {
            "name": "get_weather",
            "arguments": "",
        }
        fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:-1]]
        assert len(fragments) > 3 and all("id" not in d["tool_calls"][0] for d in deltas[2:-1])
        check_weather_arguments("".join(fragments))
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # each tool-call delta is an output event for infertap's scanner; the role chunk is not
        scanner = SSEScanner()
        _, events = scanner.feed(raw.encode())
        assert events == 1 + len(fragments)

        named = {"type": "function", "function": {"name": "nope"}}
        body = {"model": "sim-model", "messages": ASK, "tools": [WEATHER], "tool_choice": named}
        bad = httpx.post(f"{base}/chat/completions", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_auto_is_deterministic_under_the_seed_and_ends_after_a_tool_result() -> None:
    def kinds(base: str) -> list[str]:
        out = []
        for i in range(12):
            body = {"model": "sim-model", "messages": [{"role": "user", "content": f"question {i}"}],
                    "tools": [WEATHER]}  # fmt: skip
            r = httpx.post(f"{base}/chat/completions", json=body).json()
            out.append(r["choices"][0]["finish_reason"])
        return out

    with sim() as base:
        first = kinds(base)
        assert kinds(base) == first  # same requests, same answers
        assert "tool_calls" in first and set(first) - {"tool_calls"}  # "auto" picks both ways
        after = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]  # fmt: skip
        for i in range(4):
            body = {"model": "sim-model", "messages": after, "tools": [WEATHER], "seed": i, "max_tokens": 5}
            r = httpx.post(f"{base}/chat/completions", json=body).json()
            assert r["choices"][0]["message"]["content"] and "tool_calls" not in r["choices"][0]["message"]
        none = {
            "model": "sim-model",
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "none",
            "max_tokens": 3,
        }
        assert (
            httpx.post(f"{base}/chat/completions", json=none).json()["choices"][0]["finish_reason"]
            == "length"
        )
    with sim(config(seed=8)) as base:
        assert kinds(base) != first  # another engine seed, other draws


def test_responses_api_function_calls() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    with sim() as base, openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        whole = client.responses.create(
            model="sim-model", input="weather?", tools=[tool], tool_choice="required"
        )
        (item,) = whole.output
        assert (
            item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
        )
        check_weather_arguments(item.arguments)
        events = list(client.responses.create(
            model="sim-model", input="weather?", tools=[tool], tool_choice="required", stream=True
        ))  # fmt: skip
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert "".join(pieces) == done.arguments and kinds[-1] == "response.completed"
        check_weather_arguments(done.arguments)


def test_unknown_model_gets_404_model_not_found_unless_any_is_accepted() -> None:
    with sim(config(served_model_names=["alias-1"])) as base:
        assert [m["id"] for m in httpx.get(f"{base}/models").json()["data"]] == ["sim-model", "alias-1"]
        for path, body in (("chat/completions", {"messages": ASK}), ("completions", {"prompt": "x"}),
                           ("responses", {"input": "x"}), ("embeddings", {"input": "x"})):  # fmt: skip
            r = httpx.post(f"{base}/{path}", json={"model": "gpt-nope", **body})
            assert r.status_code == 404 and r.json() == {"error": {
                "message": "The model `gpt-nope` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}  # fmt: skip
        ok = httpx.post(
            f"{base}/chat/completions", json={"model": "alias-1", "messages": ASK, "max_tokens": 2}
        )
        assert ok.status_code == 200 and ok.json()["model"] == "alias-1"
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as err:
                client.chat.completions.create(model="gpt-nope", messages=ASK)  # type: ignore[arg-type]
            assert err.value.code == "model_not_found"
    with sim(config(accept_any_model=True)) as base:
        r = httpx.post(
            f"{base}/chat/completions", json={"model": "anything", "messages": ASK, "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == "anything"


# -- through infertap ------------------------------------------------------------------------------
def assemble(chunks: list[Any]) -> tuple[str, str, str, str | None]:
    """(id, name, arguments, finish_reason) from a streamed tool call, as an agent framework does."""
    call_id = name = arguments = ""
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            call_id += tc.id or ""
            if tc.function is not None:
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
    return call_id, name, arguments, finish


def test_openai_sdk_streams_a_tool_call_through_infertap_sync_and_async() -> None:
    kwargs: dict[str, Any] = {"model": "sim-model", "messages": ASK, "tools": [WEATHER], "stream": True}
    kwargs |= {"tool_choice": "required", "stream_options": {"include_usage": True}}
    with sim() as base, run_proxy(make_settings(("sim", base))) as proxy:
        with openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0) as client:
            sync_chunks = list(client.chat.completions.create(**kwargs))

        async def run_async() -> list[Any]:
            async with openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0) as aclient:
                return [c async for c in await aclient.chat.completions.create(**kwargs)]

        async_chunks = asyncio.run(run_async())
        # the terminal hooks run as the stream's last bytes go out: wait for both to be counted
        wait_until(lambda: value(scrape(proxy), "infertap_requests_total", outcome="ok") == 2, what="2 ok")
        text = scrape(proxy)
    for chunks in (sync_chunks, async_chunks):
        call_id, name, arguments, finish = assemble(chunks)
        assert call_id.startswith("call_") and name == "get_weather" and finish == "tool_calls"
        check_weather_arguments(arguments)
        assert chunks[-1].usage is not None
    labels = {"model": "sim-model", "upstream": "sim"}
    assert value(text, "infertap_time_to_first_token_seconds_count", **labels) == 2
    # the header delta and every argument fragment are output events: ITL counts the gaps between them
    events = sum(1 for c in sync_chunks + async_chunks if c.choices and c.choices[0].delta.tool_calls)
    assert value(text, "infertap_inter_token_latency_seconds_count", **labels) == events - 2
    assert value(text, "infertap_requests_total", outcome="ok", **labels) == 2


def test_responses_function_call_stream_through_infertap_counts_ttft() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    with sim() as base, run_proxy(make_settings(("sim", base))) as proxy:
        with openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0) as client:
            events = list(client.responses.create(
                model="sim-model", input="weather?", tools=[tool], tool_choice="required", stream=True
            ))  # fmt: skip
        text = scrape(proxy)
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and value(text, "infertap_time_to_first_token_seconds_count", model="sim-model") == 1
    assert value(text, "infertap_inter_token_latency_seconds_count", model="sim-model") == len(deltas) - 1


def test_infertap_lists_a_model_once_when_two_upstreams_serve_it() -> None:
    with sim() as a, sim(config(served_model_names=["only-b"])) as b:
        with run_proxy(make_settings(("a", a), ("b", b))) as proxy:
            data = httpx.get(f"{proxy}/v1/models").json()["data"]
    ids = [m["id"] for m in data]
    assert sorted(ids) == ["only-b", "sim-model"], data
    assert {m["id"]: m["upstream"] for m in data} == {"sim-model": "a", "only-b": "b"}


def test_an_empty_tool_calls_list_is_not_output() -> None:
    """Some engines send `"tool_calls": []` beside text deltas: only a call with an entry is output."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":[]}}]}\n\n'
    call = b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}\n\n'
    legacy = b'data: {"choices":[{"index":0,"delta":{"function_call":{"name":"f"}}}]}\n\n'
    assert SSEScanner().feed(role)[1] == 0
    assert SSEScanner().feed(role + call + legacy)[1] == 2
