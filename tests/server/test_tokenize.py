"""POST /tokenize and /detokenize."""

from __future__ import annotations

import httpx

from tests.server.test_errors import assert_error


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Ünïcödé, 日本語 and emoji 🙂"
    reply = http.post("/tokenize", json={"prompt": text}).json()
    assert reply["count"] == len(reply["tokens"]) > 0
    assert reply["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": reply["tokens"]}).json() == {"prompt": text}


def test_tokenize_messages_renders_the_chat_template(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_tokenize_refusals(http: httpx.Client) -> None:
    assert_error(http.post("/tokenize", json={}), 400, "prompt")
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": []}), 400, "prompt")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")
