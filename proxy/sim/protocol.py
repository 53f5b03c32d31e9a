"""Request bodies of the OpenAI API as the sim accepts them, and how one becomes a RequestSpec.

Unknown OpenAI fields (user, logprobs, frequency_penalty, ...) are accepted and ignored, so any
client works; the fields that change the simulation are validated. `tools` and `tool_choice` are
read by proxy/sim/tools.py.

Test hooks, per request (headers win over the body field):
  x-sim-output-tokens: N   or  "sim": {"output_tokens": N}   the length the answer ends at by itself
  x-sim-ttft-ms: X         or  "sim": {"ttft_ms": X}          a fixed time to first token
  x-sim-tpot-ms: Y         or  "sim": {"tpot_ms": Y}          a fixed time per later token
A request with a fixed TTFT or TPOT skips the scheduler (no queueing, no KV blocks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proxy.sim.config import SimConfig
from proxy.sim.sampling import chat_prompt_tokens, is_looping, tokenize
from proxy.sim.sequence import RequestSpec

HINT_HEADERS = {
    "output_tokens": "x-sim-output-tokens",
    "ttft_ms": "x-sim-ttft-ms",
    "tpot_ms": "x-sim-tpot-ms",
}


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def invalid(message: str, param: str | None = None) -> ApiError:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return ApiError(400, {"error": body})


def vllm_bad_request(message: str) -> ApiError:
    # vLLM's own error body for context-length errors, byte for byte what its clients parse.
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    return ApiError(400, body)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class SimHints(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_tokens: int | None = Field(default=None, ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    tpot_ms: float | None = Field(default=None, ge=0)


class StreamOptions(_Open):
    include_usage: bool | None = False


class _Generate(_Open):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    sim: SimHints | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("the simulated engine supports n=1 only")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatRequest(_Generate):
    messages: list[ChatMessage] = Field(min_length=1)


class ResponsesInputItem(_Open):
    """A message among the Responses API's input items; other item types count no tokens."""

    role: str | None = None
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                p.text or "" for p in self.content if p.type in ("input_text", "output_text", "text")
            )
        return self.content or ""


class ResponsesRequest(_Generate):
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)

    @property
    def output_limit(self) -> int | None:
        return self.max_output_tokens or super().output_limit


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Generate):
    prompt: PromptInput


class EmbeddingRequest(_Open):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = "float"


_Body = TypeVar("_Body", bound=BaseModel)


def parse(model: type[_Body], body: bytes) -> _Body:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "json_invalid":
            raise invalid(f"the body is not valid JSON: {err['msg']}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise invalid(f"{where}: {msg}" if where else msg, param=where or None) from None


def input_tokens(value: PromptInput) -> list[list[str]]:
    """Token lists of a prompt/input: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [tokenize(value)]
    if value and all(isinstance(v, int) for v in value):
        return [[f"#{v}" for v in value]]
    out: list[list[str]] = []
    for v in value:
        if isinstance(v, str):
            out.append(tokenize(v))
        elif isinstance(v, list):
            out.append([f"#{t}" for t in v])
    return out


def completion_prompt(req: CompletionRequest) -> list[str]:
    prompts = input_tokens(req.prompt)
    if len(prompts) != 1:
        raise invalid("the simulated engine takes one prompt per request", param="prompt")
    return ["<s>", *prompts[0]]  # the BOS token, so that even an empty prompt has one


def chat_prompt(req: ChatRequest) -> list[str]:
    return chat_prompt_tokens((m.role, m.text()) for m in req.messages)


def responses_prompt(req: ResponsesRequest) -> list[str]:
    messages = [("system", req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        messages.append(("user", req.input))
    else:
        messages += [(item.role, item.text()) for item in req.input if item.role]
    if not messages:
        raise invalid("input: holds no message", param="input")
    return chat_prompt_tokens(messages)


def _hints(req: _Generate, headers: Mapping[str, str]) -> SimHints:
    values: dict[str, Any] = req.sim.model_dump(exclude_none=True) if req.sim else {}
    for field, header in HINT_HEADERS.items():
        if header in headers:
            values[field] = headers[header]
    try:
        return SimHints.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0])
        raise invalid(f"{HINT_HEADERS.get(name, name)}: {err['msg']}", param=name) from None


def check_context(config: SimConfig, prompt_len: int, max_tokens: int | None) -> None:
    """vLLM's validation and messages (vllm/entrypoints/openai/serving_engine.py)."""
    limit = config.model.max_model_len
    if max_tokens is None and prompt_len >= limit:
        raise vllm_bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len} tokens in the messages, Please reduce the length of the messages."
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise vllm_bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )


def build_spec(
    config: SimConfig,
    req: _Generate,
    prompt: list[str],
    headers: Mapping[str, str],
    tool_tokens: int | None = None,
) -> RequestSpec:
    """`tool_tokens`: the answer is a tool call of that many tokens (proxy/sim/tools.py), not text."""
    hints = _hints(req, headers)
    max_tokens = req.output_limit
    check_context(config, len(prompt), max_tokens)
    decode = config.decode
    cap = min(max_tokens or decode.max_tokens, config.model.max_model_len - len(prompt))
    natural = hints.output_tokens if hints.output_tokens is not None else config.sim.default_output_tokens
    if tool_tokens is not None:
        natural = tool_tokens
    temperature = req.temperature if req.temperature is not None else decode.temperature
    penalty = req.repetition_penalty if req.repetition_penalty is not None else decode.repetition_penalty
    # Same input, same text: with a seed, or greedy decoding; otherwise each request differs.
    seed_key: object = None
    if req.seed is not None:
        seed_key = ("seed", req.seed, tuple(prompt))
    elif temperature == 0:
        seed_key = ("greedy", tuple(prompt))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return RequestSpec(
        prompt=prompt,
        max_new=min(natural, cap),
        final_reason="length" if natural >= cap else "stop",
        looping=tool_tokens is None and is_looping(temperature, penalty),
        seed_key=seed_key,
        stop=() if tool_tokens is not None else tuple(s for s in stop if s),
        ttft_ms=hints.ttft_ms,
        tpot_ms=hints.tpot_ms,
    )
