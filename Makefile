# One-stop commands. `make setup` builds .venv; `make test` runs the suite; `make run` runs the main job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Without a GPU, take the CPU wheel of torch (a few hundred MB instead of several GB of CUDA).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_INSTALL := $(PIP) install torch==$(TORCH_VERSION)
else
TORCH_INSTALL := $(PIP) install --retries 0 --timeout 10 torch==$(TORCH_VERSION) --extra-index-url https://download.pytorch.org/whl/cpu
endif

.PHONY: setup run test test-all lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(TORCH_INSTALL)
	$(PIP) install -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m jobs.generate $(ARGS)

test: setup
	$(PY) -m pytest -m "not slow" -q $(ARGS)

test-all: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check spectr pipeline jobs tests scripts

clean:
	rm -rf $(VENV) .pytest_cache
