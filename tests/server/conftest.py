"""Real server processes for the server tests: `python -m radixkv.cli serve` on a free port.

`tiny_server` (one per session) serves the tiny random Llama with two API keys; most tests
drive it with the official openai client or raw httpx. Tests that need a server of their
own (the engine killed, the default model) start one with `ServerProcess`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY_A = "test-key-alpha"
KEY_B = "test-key-bravo"
MAX_N = 4
MAX_BODY_BYTES = 64 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`radixkv serve MODEL ARGS...` in a child process, logging to a file."""

    def __init__(self, model: Path | None, args: list[str], log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "radixkv.cli", "serve"]
        if model is not None:
            command.append(str(model))
        command += ["--port", str(self.port), *args]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env
        )

    def first_health_status(self, timeout_s: float = 30.0) -> httpx.Response:
        """The first answer /health gives once the HTTP server listens."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_running()
            try:
                return httpx.get(f"{self.base_url}/health", timeout=2.0)
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError(f"the server did not listen within {timeout_s} s\n{self.log()}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_running()
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready within {timeout_s} s\n{self.log()}")

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120.0,
            **kwargs,
        )

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120.0
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels written name{k="v"}) -> value."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {self.proc.returncode}\n{self.log()}"
            )


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces, so split after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            children.append(int(entry.name))
    return children


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tiny_llama_dir,
        [
            "--kv-cache-tokens", "8192", "--max-n", str(MAX_N),
            "--max-body-bytes", str(MAX_BODY_BYTES),
            "--api-key", KEY_A, "--api-key", KEY_B,
        ],
        tmp_path_factory.mktemp("tiny-server") / "server.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return tiny_server.client(KEY_A)


@pytest.fixture(scope="session")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def http(tiny_server: ServerProcess) -> Iterator[httpx.Client]:
    """Raw HTTP to the tiny server, authenticated with KEY_A."""
    with httpx.Client(
        base_url=tiny_server.base_url, headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=60.0,
    ) as http_client:
        yield http_client
