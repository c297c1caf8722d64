# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
AZURITE_VERSION := 3.37.0
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob

.PHONY: demo test test-slow test-all lint bench clean

$(STAMP): pyproject.toml constraints.txt shardkit/images/_native.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,dev]'
	$(MAKE) $(AZURITE)
	touch $(STAMP)

# Azurite, the Azure Blob emulator the remote tests run against (tests/remote_servers.py), from npm
# into the venv (gitignored, removed by `make clean`); Node 18+ must be on PATH.
$(AZURITE):
	npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION)

demo: $(STAMP)
	$(PY) tools/demo.py

# The suite without the tests marked slow: every unit, hostile-input and doc test, in under 5
# minutes on 2 cores. The tests marked slow (DDP ranks over gloo, signals and kills, CLI and other
# Python child processes, the loopback servers, several epochs of worker processes) run in
# `make test-slow`; CI (`.ci/run`) runs both, `make test-all` too.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q

# Lint and the format check, as CI runs them (`ruff format` without --check rewrites files), and
# no tracker numbers in the code (`#12`, `issue 13`, `H9s`: that history belongs in git log).
lint: $(STAMP)
	$(VENV)/bin/ruff check shardkit tests tools benchmarks
	$(VENV)/bin/ruff format --check shardkit tests tools benchmarks
	$(PY) tools/check_history.py

# The default bench: LFW-shaped data made and packed on first use; a few minutes on 2 cores.
bench: $(STAMP)
	$(PY) -m shardkit.cli bench --json bench-out/bench.json --plot bench-out/bench.png

clean:
	rm -rf $(VENV) data out out-* wds bench-out
