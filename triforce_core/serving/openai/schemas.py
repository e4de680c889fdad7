"""The request side of the chat-completions protocol: a body validated into a `CompletionRequest`.

Follows the protocol as the official `openai` client uses it: `messages` (system, developer,
user, assistant; text content, a long document travels inside them), `temperature` (default 1,
as the protocol says; 0 is greedy and equals Hugging Face's greedy output), `top_p`,
`frequency_penalty` and `presence_penalty` (the protocol's, over the answer's own tokens,
default 0), `max_tokens` / `max_completion_tokens`, `seed`, `stop`, `stream` with server-sent
events and `stream_options.include_usage` (and, as in vLLM, `ignore_eos` for fixed-length answers
and `repetition_penalty`, Hugging Face's, over the answer's tokens; when a request gives none, the
model's default: `TriForceEngine.default_sampling()`, 1 = off for the demo pair). All three
penalties keep decoding exact (`triforce_core.decoding.penalties`).

Extension `triforce` (for a client that renders the speculation itself, such as `python app.py
--engine URL`): `{"events": true}` makes each streamed chunk carry the engine's events of that
chunk (`triforce_core.serving.event_wire`); `"inspect": true` adds the numbers behind each
verification (`TokenCheck`s), `"mode"` picks the decoding mode for this request. Only with
`stream: true`; a request without it gets no events.

Parameters it does not support are a 400 naming them, never ignored silently. Errors have the
protocol's shape: `{"error": {"message", "type", "param", "code"}}` (`ApiError`). A body's size
is bounded before it reaches a route: the server's `Guard` refuses it (413) once it passes
`MAX_BODY_BYTES`, or before it is read when its `Content-Length` says it would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from ...config import MODES

MAX_BODY_BYTES = 16_000_000  # a long document is ~4 bytes a token: room for a 128K-token context
MAX_STOPS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Accepted only at the value that means "off" (anything else is a 400 naming the parameter).
OFF_VALUES: dict[str, tuple] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "parallel_tool_calls": (True, False),
}
IGNORED = {"user", "metadata", "safety_identifier", "prompt_cache_key"}  # no effect on the answer
SUPPORTED = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop",
             "stream", "stream_options", "frequency_penalty", "presence_penalty",
             "ignore_eos",  # an extension (as in vLLM): fixed-length answers for benchmarks
             "repetition_penalty",  # an extension (as in vLLM): Hugging Face's penalty
             "triforce"}  # our extension: the engine's events in the stream (module docstring)
EXTENSION_FIELDS = ("events", "inspect", "mode")


class ApiError(Exception):
    """An error response in the protocol's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class CompletionRequest:
    messages: list[dict]
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: the model's default
    events: bool = False  # stream the engine's events (`triforce.events`)
    inspect: bool = False  # ... with each verification's TokenChecks
    mode: str | None = None  # None: the server's mode


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {json.dumps(v)}", param=name)
    if not (low < v <= high if low_open else low <= v <= high):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(400, f"{name} must be in {bounds}, got {v}", param=name)
    return float(v)


def _integer(body: dict, name: str, low: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(v)}", param=name)
    if v < low:
        raise ApiError(400, f"{name} must be >= {low}, got {v}", param=name)
    return v


def _extension(body: dict, stream: bool) -> tuple[bool, bool, str | None]:
    """(events, inspect, mode) of the `triforce` request extension."""
    ext = body.get("triforce")
    if ext is None:
        return False, False, None
    if not isinstance(ext, dict) or set(ext) - set(EXTENSION_FIELDS):
        raise ApiError(400, f"triforce must be an object with at most {', '.join(EXTENSION_FIELDS)}", param="triforce")
    flags = {}
    for name in ("events", "inspect"):
        v = ext.get(name, False)
        if not isinstance(v, bool):
            raise ApiError(400, f"triforce.{name} must be true or false", param=f"triforce.{name}")
        flags[name] = v
    mode = ext.get("mode")
    if mode is not None and mode not in MODES:
        raise ApiError(400, f"triforce.mode must be one of {', '.join(MODES)}", param="triforce.mode")
    if flags["inspect"] and not flags["events"]:
        raise ApiError(400, "triforce.inspect needs triforce.events", param="triforce.inspect")
    if flags["events"] and not stream:
        raise ApiError(400, "triforce.events needs stream: true", param="triforce.events")
    return flags["events"], flags["inspect"], mode


def _content(m: Any, i: int) -> str:
    param = f"messages[{i}].content"
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"only text content parts are supported, got {kind!r}", param=param)
            parts.append(part["text"])
        return "".join(parts)
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        raise ApiError(400, "tool calls are not supported", param=f"messages[{i}].tool_calls")
    raise ApiError(400, f"{param} must be a string or a list of text parts", param=param)


def parse_request(body: Any) -> CompletionRequest:
    """Validate a chat-completions request body (a 400 `ApiError` names what is wrong)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in SUPPORTED or name in IGNORED or value is None:
            continue
        if name in OFF_VALUES:
            if value not in OFF_VALUES[name]:
                raise ApiError(400, f"{name}={json.dumps(value)} is not supported by this server", param=name,
                               code="unsupported_parameter")
            continue
        raise ApiError(400, f"unsupported parameter: {name}", param=name, code="unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "model is required (see GET /v1/models)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {role!r} is not supported (system, developer, user, assistant)",
                           param=f"messages[{i}].role")
        out.append({"role": ROLES[role], "content": _content(m, i)})
    if not any(m["role"] == "user" for m in out):
        raise ApiError(400, "messages need at least one user message", param="messages")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", param="stop")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, "stream_options supports only include_usage", param="stream_options")
        include_usage = bool(options.get("include_usage"))
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be true or false", param="ignore_eos")
    events, inspect, mode = _extension(body, bool(stream))
    max_tokens = _integer(body, "max_tokens", 1)
    max_completion = _integer(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                       param="max_completion_tokens")
    return CompletionRequest(
        messages=out,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        seed=_integer(body, "seed", -(2**63)),
        stop=tuple(stops),
        stream=bool(stream),
        include_usage=include_usage,
        ignore_eos=bool(ignore_eos),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=(None if body.get("repetition_penalty") is None
                            else _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)),
        events=events,
        inspect=inspect,
        mode=mode,
    )
