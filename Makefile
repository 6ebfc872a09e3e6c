# fleetcache: the two set-up commands are `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install system-packages serve test test-fast check format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build (FACTS.md, next to the repo).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev,onnx,tensorrt-rtx]'
	touch $(STAMP)

install: $(STAMP)

# redis-server, chromium + chromedriver, promtool: installed with apt-get when missing (or a
# clear message naming the command), so that a fresh machine's `make test` runs every test.
system-packages:
	bash tests/system-packages.sh

serve: $(STAMP)
	FLEETCACHE_ENGINE=$${FLEETCACHE_ENGINE:-torch} \
	FLEETCACHE_STORE=$${FLEETCACHE_STORE:-lmdb} \
	FLEETCACHE_DEMO_DRIVERS=$${FLEETCACHE_DEMO_DRIVERS:-2000} \
	HF_HUB_OFFLINE=1 $(BIN)/fleetcache serve --host $(HOST) --port $(PORT)

# Only a test that needs a GPU may skip here: any other skip fails the run (tests/conftest.py).
test: $(STAMP) system-packages
	HF_HUB_OFFLINE=1 PYTEST_ONLY_GPU_SKIPS=1 $(BIN)/pytest -q

test-fast: $(STAMP) system-packages
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m "not model"

check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
