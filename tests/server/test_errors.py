"""Every refusal: its status and the OpenAI error body, and that none disturbs other requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import KEY_A, MAX_BODY_BYTES, ServerProcess

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello world", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **fields}


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


INVALID = [
    # (path, body, param)
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (COMPLETIONS, completion(max_tokens=-5), "max_tokens"),
    (COMPLETIONS, completion(temperature=-0.5), "temperature"),
    (COMPLETIONS, completion(top_p=0), "top_p"),
    (COMPLETIONS, completion(top_p=1.5), "top_p"),
    (COMPLETIONS, completion(n=5), "n"),
    (COMPLETIONS, completion(n=2, best_of=5), "best_of"),
    (COMPLETIONS, completion(n=3, best_of=2), "best_of"),
    (COMPLETIONS, completion(max_tokens=300), "max_tokens"),  # the context is 256
    (COMPLETIONS, completion(prompt="word " * 300), "prompt"),
    (COMPLETIONS, completion(max_tokens="5"), "max_tokens"),
    (COMPLETIONS, completion(temperature="hot"), "temperature"),
    (COMPLETIONS, completion(n=True), "n"),
    (COMPLETIONS, completion(prompt=5), "prompt"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt"),
    (COMPLETIONS, completion(prompt=[100000]), "prompt"),
    (COMPLETIONS, {"max_tokens": 4}, "prompt"),
    (COMPLETIONS, completion(stop=[""]), "stop"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (COMPLETIONS, completion(logit_bias={"5": 1.0}), "logit_bias"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options"),
    (COMPLETIONS, completion(use_beam_search=True, logprobs=1), "logprobs"),
    (COMPLETIONS, completion(use_beam_search=True, stop=["x"]), "stop"),
    (COMPLETIONS, completion(cache_salt=""), "cache_salt"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, chat(max_tokens=400), "max_tokens"),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(top_p=2.0), "top_p"),
    (CHAT, chat(n=9), "n"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(frequency_penalty=3.0), "frequency_penalty"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools"),
]


@pytest.mark.parametrize(("path", "body", "param"), INVALID)
def test_invalid_values_are_400(http: httpx.Client, path: str, body: dict[str, Any],
                                param: str) -> None:
    error = assert_error(http.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize"])
def test_unknown_model_is_400(http: httpx.Client, path: str) -> None:
    body = chat(model="gpt-4") if path == CHAT else completion(model="gpt-4")
    assert_error(http.post(path, json=body), 400, "model", "model_not_found")


@pytest.mark.parametrize("raw", [b'{"prompt": "Hello', b"[1, 2]", b"\xff\xfe", b""])
def test_bad_json_is_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post(COMPLETIONS, content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400)


def test_the_openai_client_raises_bad_request(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=0)
    assert caught.value.status_code == 400
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"},
                                     {"Authorization": KEY_A}, {"Authorization": "Basic abc"}])
@pytest.mark.parametrize(("method", "path"), [("POST", COMPLETIONS), ("POST", CHAT),
                                              ("GET", "/v1/models"), ("POST", "/tokenize")])
def test_missing_or_wrong_key_is_401(tiny_server: ServerProcess, headers: dict[str, str],
                                     method: str, path: str) -> None:
    body = chat() if path == CHAT else completion()
    response = httpx.request(method, tiny_server.base_url + path, json=body, headers=headers)
    assert_error(response, 401, None, "invalid_api_key")


def test_the_openai_client_raises_authentication_error(tiny_server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client("not-a-key").models.list()


def test_health_and_metrics_need_no_key(tiny_server: ServerProcess) -> None:
    assert httpx.get(tiny_server.base_url + "/health").status_code == 200
    assert httpx.get(tiny_server.base_url + "/metrics").status_code == 200


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = completion(prompt="x" * (MAX_BODY_BYTES + 10))
    assert_error(http.post(COMPLETIONS, json=big), 413, None, "request_too_large")
    # Streamed without a Content-Length: refused while counting.
    payload = json.dumps(big).encode()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(payload), 4096):
            yield payload[start : start + 4096]

    response = http.post(COMPLETIONS, content=chunks(),
                         headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, None, "request_too_large")


def test_unknown_route_has_the_openai_body(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)


def test_errors_do_not_disturb_a_running_stream(http: httpx.Client, model_name: str) -> None:
    body = completion(model=model_name, max_tokens=60, temperature=0, ignore_eos=True,
                      stream=True, stream_options={"include_usage": True})
    with httpx.Client(base_url=http.base_url, headers=dict(http.headers), timeout=60) as other:
        whole = other.post(COMPLETIONS, json={**body, "stream": False,
                                              "stream_options": None}).json()
        with other.stream("POST", COMPLETIONS, json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            for path, bad, param in INVALID:
                assert_error(http.post(path, json=bad), 400, param)
            assert_error(httpx.post(http.base_url.join(COMPLETIONS), json=body), 401)
            events = [first, *(line for line in lines if line)]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 60
