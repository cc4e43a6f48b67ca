"""Kernel tests run natively on a GPU, or under Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, at collection,
before any test imports `radixkv.kernels.*` (only these tests and the Triton backend import
triton). Nothing else in the suite uses Triton, so setting it process-wide is harmless.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present (kernels compiled), else CPU (kernels interpreted)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    from radixkv.kernels import paged_decode

    if type(paged_decode._paged_decode_kernel).__name__ != "InterpretedFunction":
        pytest.fail(
            "radixkv.kernels was imported before tests/kernels/conftest.py set "
            "TRITON_INTERPRET=1; set it in the environment to run these tests on CPU"
        )
    return torch.device("cpu")


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    """For tests marked gpu: the CUDA device, or a skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")
