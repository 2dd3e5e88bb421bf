"""OpenAI API request parsing and validation, and the response and error shapes.

Pure functions over parsed JSON: no I/O, no backend. Bad input raises
:class:`OpenAIError`, which carries the HTTP status and renders OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Unknown request fields are ignored,
as the OpenAI API does; known fields of the wrong type or out of range are rejected (also
those this server accepts without acting on them: ``logit_bias``, the penalties,
``logprobs``, ...), and so is text that is not valid Unicode (JSON's ``"\ud800"`` escape decodes to a lone surrogate, which has no
UTF-8 form to tokenize or echo).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHAT", "TEXT_COMPLETION", "CompletionRequest", "OpenAIError", "chat_chunk", "chat_response",
    "completion_chunk", "completion_response", "parse_chat_request", "parse_completion_request", "usage",
    "usage_chunk",
]

TEXT_COMPLETION = "text_completion"  # OpenTelemetry gen_ai.operation.name of /v1/completions
CHAT = "chat"  # ... and of /v1/chat/completions
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class OpenAIError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI sends with this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated completions or chat request. Exactly one of ``prompt`` (text or token
    ids) and ``messages`` (chat, roles normalised to system/user/assistant) is set."""

    operation: str  # TEXT_COMPLETION or CHAT
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None
    max_tokens: int | None  # None = the endpoint's default
    temperature: float | None  # None = the server's default
    top_p: float
    top_k: int  # 0 = off (vLLM's -1 is accepted and means off)
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    slo_class: str | None  # body field (the X-SLO-Class header wins over it)
    user: str | None


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body."""
    body = _object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("you must provide a prompt parameter", "prompt", code="missing_required_parameter")
    prompt = _prompt(body["prompt"])
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
    if body.get("echo"):
        raise _bad("echo is not supported by this server", "echo")
    return _common(body, TEXT_COMPLETION, prompt=prompt, messages=None,
                   max_tokens=_opt_int(body, "max_tokens", minimum=1))


def parse_chat_request(body: Any) -> CompletionRequest:
    """Validate a ``POST /v1/chat/completions`` body."""
    body = _object(body)
    if "messages" not in body or body["messages"] is None:
        raise _bad("you must provide a messages parameter", "messages", code="missing_required_parameter")
    messages = _messages(body["messages"])
    max_tokens = _opt_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", minimum=1)
    return _common(body, CHAT, prompt=None, messages=messages, max_tokens=max_tokens)


def _common(body: Mapping[str, Any], operation: str, *, prompt: str | tuple[int, ...] | None,
            messages: tuple[dict[str, str], ...] | None, max_tokens: int | None) -> CompletionRequest:
    model = body.get("model")
    if model is None:
        raise _bad("you must provide a model parameter", "model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {_type(model)}", "model")
    _check_text(model, "model")
    n = _opt_int(body, "n", minimum=1)
    if n not in (None, 1):
        raise _bad("only n=1 is supported by this server", "n")
    temperature = _opt_number(body, "temperature", low=0.0, high=2.0)
    top_p = _opt_number(body, "top_p", low=0.0, high=1.0)
    if top_p is not None and top_p == 0:
        raise _bad("top_p must be greater than 0", "top_p")
    top_k = _opt_int(body, "top_k", minimum=-1)
    stream = _opt_bool(body, "stream") or False
    _check_unused_fields(body, operation, max_tokens)
    return CompletionRequest(
        operation=operation, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=temperature, top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k, seed=_opt_int(body, "seed"), stop=_stop(body.get("stop")),
        ignore_eos=_opt_bool(body, "ignore_eos") or False, stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream), slo_class=_opt_str(body, "slo_class"),
        user=_opt_str(body, "user"))


_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on a logit bias, either sign
_PENALTY_LIMIT = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty, either sign
_MAX_COMPLETION_LOGPROBS = 5  # /v1/completions logprobs: at most 5 alternatives
_MAX_TOP_LOGPROBS = 20  # /v1/chat/completions top_logprobs
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_unused_fields(body: Mapping[str, Any], operation: str, max_tokens: int | None) -> None:
    """Check the OpenAI (and vLLM) sampling fields this server accepts without acting on them, as those
    servers check them: a client's mistake is a 400 here as it would be there, never silently ignored."""
    _logit_bias(body.get("logit_bias"))
    for name in ("presence_penalty", "frequency_penalty"):
        _opt_number(body, name, low=-_PENALTY_LIMIT, high=_PENALTY_LIMIT)
    _opt_number(body, "min_p", low=0.0, high=1.0)
    repetition_penalty = _opt_number(body, "repetition_penalty", low=0.0, high=math.inf)
    if repetition_penalty == 0:
        raise _bad("repetition_penalty must be greater than 0", "repetition_penalty")
    min_tokens = _opt_int(body, "min_tokens", minimum=0)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    best_of = _opt_int(body, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise _bad("only best_of=1 is supported by this server", "best_of")
    if operation == CHAT:
        logprobs = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", minimum=0)
        if top is not None and top > _MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs must be at most {_MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        if top and not logprobs:
            raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
        _response_format(body.get("response_format"))
    else:
        logprobs_n = _opt_int(body, "logprobs", minimum=0)
        if logprobs_n is not None and logprobs_n > _MAX_COMPLETION_LOGPROBS:
            raise _bad(f"logprobs must be at most {_MAX_COMPLETION_LOGPROBS}, got {logprobs_n}", "logprobs")
        _opt_str(body, "suffix")


def _logit_bias(value: Any) -> None:
    """``{"<token id>": bias}``: keys are token ids (decimal strings), biases numbers in [-100, 100]."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad(f"logit_bias must be an object mapping token ids to biases, got {_type(value)}", "logit_bias")
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise _bad(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _bad(f"logit_bias[{key}] must be a finite number, got {_type(bias)}", "logit_bias")
        if not -_LOGIT_BIAS_LIMIT <= bias <= _LOGIT_BIAS_LIMIT:
            raise _bad(f"logit_bias[{key}] must be between -100 and 100, got {bias}", "logit_bias")


def _response_format(value: Any) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise _bad(f"response_format must be an object with type one of {', '.join(_RESPONSE_FORMATS)}",
                   "response_format")


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_type(body)}", None)
    return body


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return tuple(value)
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0]) if isinstance(value[0], (str, list)) else _bad_prompt()
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise _bad("only one prompt per request is supported by this server", "prompt")
    return _bad_prompt()


def _bad_prompt() -> Any:
    raise _bad("prompt must be a string, a list of one string, or a list of token ids", "prompt")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {role!r}",
                       f"messages[{i}].role")
        content = _content(message.get("content"), i)
        _check_text(content, f"messages[{i}].content")
        out.append({"role": _CHAT_ROLES[role], "content": content})
    return tuple(out)


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or text parts ``[{"type": "text", "text": ...}]`` joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content must be a string or an array of text parts", f"messages[{i}].content")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop must be a string or an array of strings", "stop")
    if not all(items):
        raise _bad("stop strings must not be empty", "stop")
    for item in items:
        _check_text(item, "stop")
    return tuple(items)


def _include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _bad("stream_options must be an object", "stream_options")
    if not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    include = value.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise _bad("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return bool(include)


def _opt_int(body: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise _bad(f"{name} must be an integer, got {_type(value)}", name)
    if minimum is not None and value < minimum:
        raise _bad(f"{name} must be at least {minimum}, got {value}", name)
    return value


def _opt_number(body: Mapping[str, Any], name: str, *, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {_type(value)}", name)
    if not math.isfinite(value):
        raise _bad(f"{name} must be a finite number, got {value}", name)
    if not low <= value <= high:
        raise _bad(f"{name} must be between {low:g} and {high:g}, got {value}", name)
    return float(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean, got {_type(value)}", name)
    return value


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(f"{name} must be a string, got {_type(value)}", name)
    if value is not None:
        _check_text(value, name)
    return value


def _check_text(value: str, param: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (no UTF-8 form: not text)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(f"{param} is not valid Unicode text: it holds a lone surrogate "
                   f"{value[exc.start]!r} at character {exc.start}", param) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _bad(message: str, param: str | None, *, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- response shapes


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object (with ``prompt_tokens_details.cached_tokens``)."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     *, include_usage: bool) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (one token)."""
    chunk: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
               *, first: bool, include_usage: bool) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` (one token; the first carries the role)."""
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    chunk: dict[str, Any] = {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, created: int, model: str, operation: str, usage_obj: dict[str, Any]
                ) -> dict[str, Any]:
    """The final chunk of ``stream_options.include_usage``: empty ``choices``, ``usage``."""
    obj = "chat.completion.chunk" if operation == CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_obj}


def completion_response(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage_obj: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming ``text_completion`` answer."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_obj}


def chat_response(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage_obj: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` answer."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_obj}
