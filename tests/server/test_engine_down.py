"""503 while the engine starts and once it has died; a server whose engine cannot start exits."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess, child_pids
from tests.server.test_errors import assert_error


def test_503_while_starting_and_after_the_engine_dies(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = ServerProcess(tiny_llama_dir, ["--kv-cache-tokens", "4096"], tmp_path / "log")
    try:
        # The HTTP server listens at once; the engine needs seconds (the worker imports torch).
        assert_error(server.first_health_status(), 503, None, "engine_unavailable")
        early = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi"})
        assert_error(early, 503, None, "engine_unavailable")

        server.wait_ready()
        client = server.client()
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices

        body = {"prompt": "Hello", "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            [scheduler] = [
                pid for pid in child_pids(server.proc.pid)
                if b"radixkv.scheduler.loop" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]
            os.kill(scheduler, signal.SIGKILL)
            rest = [line for line in lines if line]
        # The stream in flight ends with the error, then [DONE].
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == "engine_unavailable"

        assert_error(httpx.get(f"{server.base_url}/health"), 503, None, "engine_unavailable")
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert caught.value.status_code == 503
        chat = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}]})
        assert_error(chat, 503, None, "engine_unavailable")
        assert "radixkv_engine_serving 0.0" in httpx.get(f"{server.base_url}/metrics").text
    finally:
        server.stop()


def test_server_exits_when_the_engine_cannot_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(tiny_llama_dir, ["--device", "cuda:7"], tmp_path / "log")
    try:
        code = server.proc.wait(timeout=120)
    finally:
        server.stop()
    assert code == 1
    assert "the engine failed to start" in server.log()


def test_bad_model_path_exits_with_a_message(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "no-such-model", [], tmp_path / "log")
    try:
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert code == 2
    assert "does not exist" in server.log()
