from __future__ import annotations

from typing import Any

import pytest

from reference_server.serving.gateway_openai import (
    CHAT,
    TEXT_COMPLETION,
    OpenAIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    usage,
    usage_chunk,
)


def test_completion_request_defaults_and_extensions() -> None:
    req = parse_completion_request({"model": "tiny", "prompt": "hi", "top_k": 5, "ignore_eos": True,
                                    "stop": "\n", "seed": 3, "unknown_field": {"x": 1}})
    assert req.operation == TEXT_COMPLETION
    assert req.prompt == "hi" and req.messages is None
    assert req.max_tokens is None and req.temperature is None
    assert (req.top_k, req.ignore_eos, req.stop, req.seed) == (5, True, ("\n",), 3)
    assert req.top_p == 1.0 and not req.stream and not req.include_usage


@pytest.mark.parametrize(("prompt", "expected"), [
    ("abc", "abc"), (["abc"], "abc"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)),
])
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert parse_completion_request({"model": "m", "prompt": prompt}).prompt == expected


def test_chat_request_normalises_roles_and_text_parts() -> None:
    req = parse_chat_request({
        "model": "m", "max_completion_tokens": 7, "max_tokens": 99, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    })
    assert req.operation == CHAT
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"})
    assert req.max_tokens == 7  # max_completion_tokens wins over the legacy max_tokens
    assert req.stream and req.include_usage


def test_top_k_minus_one_means_off() -> None:
    assert parse_completion_request({"model": "m", "prompt": "x", "top_k": -1}).top_k == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": "m", "prompt": 3}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": []}, "stream_options"),
    ({"model": "m", "prompt": "x", "slo_class": 1}, "slo_class"),
    ({"model": "m", "prompt": "x", "logit_bias": {"x": "y"}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": True}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1e3": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": [["5", 1]]}, "logit_bias"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "suffix": 5}, "suffix"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_invalid_completion_fields_name_the_param(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(body)
    assert info.value.status == 400
    assert info.value.param == param
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], ["x"],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
])
def test_invalid_messages(messages: Any) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_request({"model": "m", "messages": messages})
    assert info.value.status == 400
    assert info.value.param is not None and info.value.param.startswith("messages")


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": 1}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"), ({"logit_bias": {"12": -101}}, "logit_bias"),
])
def test_invalid_chat_fields_name_the_param(extra: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert (info.value.status, info.value.param) == (400, param)


def test_valid_openai_fields_this_server_does_not_act_on_are_accepted() -> None:
    parse_completion_request({"model": "m", "prompt": "x", "logit_bias": {"50256": -100, "7": 99.5},
                              "presence_penalty": -2, "frequency_penalty": 1.5, "logprobs": 5, "best_of": 1,
                              "suffix": None, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 0})
    parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                        "top_logprobs": 20, "response_format": {"type": "json_object"}, "logit_bias": {}})


def test_body_must_be_an_object() -> None:
    with pytest.raises(OpenAIError, match="JSON object"):
        parse_chat_request([1, 2])


def test_response_shapes_match_openai() -> None:
    u = usage(5, 3, 2)
    assert u == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                 "prompt_tokens_details": {"cached_tokens": 2}}
    chunk = completion_chunk("id1", 10, "m", "a", None, include_usage=True)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    first = chat_chunk("id1", 10, "m", "a", None, first=True, include_usage=False)
    later = chat_chunk("id1", 10, "m", "b", "stop", first=False, include_usage=False)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert later["choices"][0]["delta"] == {"content": "b"} and later["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in first
    final = usage_chunk("id1", 10, "m", CHAT, u)
    assert final["choices"] == [] and final["usage"] == u and final["object"] == "chat.completion.chunk"
    assert completion_response("id1", 10, "m", "ab", "length", u)["choices"][0]["text"] == "ab"
    message = chat_response("id1", 10, "m", "ab", "stop", u)["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "ab"
