"""The OpenAI request bodies the gateway accepts (Chat Completions, Completions, Responses), decoded
strictly, and what each becomes: one streambatch Request.

Every field OpenAI defines for these endpoints is either used, accepted and ignored (it changes
nothing a client can observe here: `user`, `metadata`, `store`...), or refused with a 400 naming it
(tools, response formats, more than one choice...): never silently dropped. A field OpenAI does not
define is refused too, as OpenAI does. README ("Use it from any OpenAI client") lists them.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

from producer.protocol import Message, Request, SamplingParams
from producer.submission import choose_lane

# What a request without max_tokens may generate: OpenAI's "as much as fits" has no fixed value,
# and the workers refuse a max_tokens that leaves no room in their model length.
DEFAULT_MAX_TOKENS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's own default for /v1/completions


class Refused(ValueError):
    """A request the gateway will not serve: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted, ignored: the chat template has no place for it


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # accepted, ignored: no padding is added


# Fields every endpoint accepts and ignores, and those it refuses (with why).
IGNORED = ("user", "metadata", "store", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
           "include_obfuscation")

# `service_tier` is the lane hint: "priority" asks for the fast lane, which the lane rule grants a
# short prompt with a small max_tokens only (protocol.pick_lane), "flex" for the normal lane; "auto"
# and "default" leave the lane to the rule. Answers name the tier of the lane the request went to.
ServiceTier = Literal["auto", "default", "flex", "priority"]
LANE_ASKED = {"priority": "fast", "flex": "normal"}
REFUSED = {
    "tools": "tools are not supported", "tool_choice": "tools are not supported",
    "functions": "functions are not supported", "function_call": "functions are not supported",
    "logit_bias": "logit_bias is not supported", "audio": "audio is not supported",
    "modalities": "only text is supported", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason", "reasoning": "this model does not reason",
    "web_search_options": "web search is not supported", "suffix": "suffix is not supported",
    "echo": "echo is not supported", "previous_response_id": "previous_response_id is not supported",
    "conversation": "conversations are not supported", "include": "include is not supported",
    "truncation": "truncation is not supported", "max_tool_calls": "tools are not supported",
}


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extensions, by the same names (`extra_body` in the SDKs)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: ServiceTier | None = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    parallel_tool_calls: Any = None
    tools: Any = None
    tool_choice: Any = None


class ChatCompletionBody(_Common):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream_options: StreamOptions | None = None
    n: int = 1
    response_format: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None


class CompletionBody(_Common):
    prompt: str | list[str | int] = ""  # a text, one text in a list, or token ids
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    echo: Any = None
    suffix: Any = None
    logit_bias: Any = None


class ResponseText(msgspec.Struct, forbid_unknown_fields=True):
    format: dict | None = None
    verbosity: Any = None


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    type: Literal["message"] = "message"
    id: Any = None
    status: Any = None


class ResponsesBody(_Common):
    input: str | list[InputMessage] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    background: bool = False
    text: ResponseText | None = None
    top_logprobs: int | None = None
    include: Any = None
    reasoning: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    truncation: Any = None
    prompt: Any = None  # a stored prompt template (refused below)
    max_tool_calls: Any = None
    stream_options: StreamOptions | None = None


def decode(body: bytes, shape: type[msgspec.Struct]):
    """The body as `shape`, or Refused naming the field that is wrong (or one we refuse)."""
    try:
        decoded = msgspec.json.decode(body, type=shape)
    except msgspec.ValidationError as error:
        message, _, path = str(error).partition(" - at `$.")
        raise Refused(f"invalid request: {message}" + (f" (at {path.rstrip('`')})" if path else ""),
                      path.rstrip("`").split("[")[0].split(".")[0] or _unknown_field(message)) from None
    except msgspec.DecodeError as error:
        raise Refused(f"the body is not valid JSON: {error}") from None
    refused = REFUSED | ({"prompt": "prompt templates are not supported"} if shape is ResponsesBody else {})
    for name, why in refused.items():
        value = getattr(decoded, name, None)
        if value not in (None, [], {}) and not (name == "tool_choice" and value == "none"):
            raise Refused(why, name)
    return decoded


def _unknown_field(message: str) -> str | None:
    """The field named in msgspec's "Object contains unknown field `x`"."""
    return message.split("`")[1] if "unknown field `" in message else None


def service_tier(request: Request) -> str:
    """The tier an answer names: that of the lane stream the request goes to."""
    lane = choose_lane(request)
    return "priority" if lane == "fast" else "flex" if request.lane == "normal" else "default"


def new_id(kind: Literal["chatcmpl", "cmpl", "resp"]) -> str:
    """An OpenAI-style id, which is also the streambatch request id (both fit REQUEST_ID)."""
    return f"{kind}-{secrets.token_hex(12)}" if kind != "resp" else f"resp_{secrets.token_hex(16)}"


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _message(role: str, content: str | list[TextPart]) -> Message:
    return Message(role="system" if role == "developer" else role, content=_text(content))


def _stop(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _one_choice(n: int, best_of: int | None = None) -> None:
    if n != 1:
        raise Refused("n must be 1: one request is one choice here (send n requests for n choices)", "n")
    if best_of not in (None, 1):
        raise Refused("best_of must be 1", "best_of")


def _params(body, max_tokens: int | None, default_max_tokens: int, logprobs: int | None = None,
            stop: str | list[str] | None = None) -> dict:
    params: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else default_max_tokens}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "ignore_eos"):
        if getattr(body, name, None) is not None:
            params[name] = getattr(body, name)
    if stop is not None:
        params["stop"] = _stop(stop)
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def _sampling(params: dict) -> SamplingParams:
    try:
        return msgspec.convert(params, SamplingParams)
    except (msgspec.ValidationError, ValueError) as error:
        problem = str(error).removeprefix("invalid sampling params: ")
        named = problem.split()[0] if problem else ""  # "temperature must be in [0, 100], got -1"
        raise Refused(problem, named if named in params else None) from None


def chat_request(body: ChatCompletionBody, request_id: str, default_max_tokens: int) -> Request:
    _one_choice(body.n)
    if not body.messages:
        raise Refused("messages must hold at least one message", "messages")
    if body.response_format not in (None, {"type": "text"}):
        raise Refused("only the text response format is supported", "response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise Refused("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, max_tokens, default_max_tokens, logprobs, body.stop)
    return Request(id=request_id, messages=[_message(m.role, m.content) for m in body.messages],
                   params=_sampling(params), lane=LANE_ASKED.get(body.service_tier))


def completion_request(body: CompletionBody, request_id: str) -> Request:
    _one_choice(body.n, body.best_of)
    prompt = body.prompt
    if isinstance(prompt, list) and any(isinstance(item, str) for item in prompt):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise Refused("prompt: one text per request (send a request for each), or a list of token ids", "prompt")
        prompt = prompt[0]
    if prompt in ("", []):
        raise Refused("prompt is empty", "prompt")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise Refused("logprobs must be in [0, 5]", "logprobs")
    params = _sampling(_params(body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs, body.stop))
    lane = LANE_ASKED.get(body.service_tier)
    if isinstance(prompt, str):
        return Request(id=request_id, prompt=prompt, params=params, lane=lane)
    return Request(id=request_id, prompt_ids=prompt, params=params, lane=lane)


def responses_request(body: ResponsesBody, request_id: str, default_max_tokens: int) -> Request:
    if body.text is not None and body.text.format not in (None, {"type": "text"}):
        raise Refused("only the text format is supported", "text")
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(Message(role="user", content=body.input))
    else:
        messages += [_message(item.role, item.content) for item in body.input]
    if not any(message.role != "system" for message in messages) or not any(m.content for m in messages):
        raise Refused("input is empty", "input")
    logprobs = body.top_logprobs if body.top_logprobs is not None else None
    params = _sampling(_params(body, body.max_output_tokens, default_max_tokens, logprobs))
    return Request(id=request_id, messages=messages, params=params, lane=LANE_ASKED.get(body.service_tier))
