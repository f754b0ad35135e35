# vllm_bridge: every target does its own set-up, so a fresh clone needs only
#   make test      (or make demo, make bench)
# make test: lint (ruff, mypy, mix format), codegen check, pytest (with 100,000 fuzzed frames),
# ExUnit (the same for its decoders), and every benchmark once in quick mode.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
export MIX_HOME ?= $(CURDIR)/_build/mix_home
export VLLM_BRIDGE_PYTHON ?= $(CURDIR)/.venv/bin/python

.PHONY: setup test test-python test-elixir lint codegen demo bench fuzz

# Idempotent: installs only what is missing.
setup: .setup-stamp
	@mix compile >/dev/null

.setup-stamp: pyproject.toml mix.exs
	@command -v mix >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y elixir erlang-dev; }
	@test -x $(PY) || python3 -m venv .venv
	@$(PY) -c 'import torch' 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -q -e '.[test]'
	@touch $@

test: setup lint
	$(PY) -m bridge_py.codegen --check
	$(MAKE) test-python
	$(MAKE) test-elixir
	$(MAKE) bench-quick

test-python:
	$(PY) -m pytest -q

test-elixir:
	MIX_ENV=test mix compile --warnings-as-errors --force
	MIX_ENV=test mix test

lint:
	$(PY) -m ruff check bridge_py tests $(wildcard bench)
	$(PY) -m ruff format --check bridge_py tests $(wildcard bench)
	$(PY) -m mypy
	mix format --check-formatted

# The decoders of both sides, and the Elixir API (a fiftieth as many calls), fuzzed
# for longer than make test does (100,000 inputs each there); VLLM_BRIDGE_FUZZ_SEED
# picks another seed.
FUZZ_FRAMES ?= 2000000
fuzz: setup
	VLLM_BRIDGE_FUZZ_FRAMES=$(FUZZ_FRAMES) $(PY) -m pytest -q tests/fuzz
	VLLM_BRIDGE_FUZZ_FRAMES=$(FUZZ_FRAMES) MIX_ENV=test mix test --only fuzz

# Regenerate the checked-in Elixir modules from the export table, and both codecs' field
# tables and error categories from proto/.
codegen: setup
	$(PY) -m bridge_py.codegen

demo: setup
	mix vllm_bridge.demo

# Every benchmark runs ours and its peer in the same run and prints a table; the full
# run writes bench/RESULTS.md. bench-quick: tiny iteration counts (under a minute), so
# the suite never rots. Neither fails on speed, only on wrong results.
bench: setup
	BENCH_COMMAND="make bench" bench/run

.PHONY: bench-quick
bench-quick: setup
	bench/run --quick
