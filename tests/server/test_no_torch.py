"""The server process never imports torch: the scheduler and worker processes do the work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess

SERVER_MODULES = [
    "app", "body_limit", "chat", "completions", "engine_client", "errors", "event_stream",
    "generation_params", "logprobs", "metrics", "openai_types", "state", "submission", "tenancy",
]


def test_importing_the_server_imports_no_torch() -> None:
    imports = "; ".join(f"import radixkv.server.{name}" for name in SERVER_MODULES)
    code = f"import sys; {imports}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_the_running_server_has_no_torch_mapped(tiny_server: ServerProcess) -> None:
    maps = Path(f"/proc/{tiny_server.proc.pid}/maps")
    if not maps.exists():
        pytest.skip("needs Linux /proc")
    mapped = maps.read_text()
    assert "libtorch" not in mapped and "/torch/" not in mapped
