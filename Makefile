# Two commands set up a fresh machine from nothing: `make demo` and `make test`.
# The venv's interpreter: the system's /usr/bin/python3 where it is 3.10 or newer and can make a venv, else python3
# on PATH; PYTHON=... chooses another. Distributions build their Python with PGO and LTO; a plain source build, as
# pyenv's python3 on this project's machines, runs the suite's Python-bound work (dynamo, export, the tests' own code)
# 1.3x slower (`pytest tests/test_model.py`: 115 s against 83 s, Debian's 3.11.2, one run after the other).
SYSTEM_PYTHON := $(shell /usr/bin/python3 -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 10))' \
  2>/dev/null && echo /usr/bin/python3)
PYTHON ?= $(or $(SYSTEM_PYTHON),python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: 2.13.0 is the CPU wheel on this project's machines; a looser pin pulls CUDA builds.
TORCH ?= torch==2.13.0

.PHONY: demo test browser cuda-check clean

# torch with pip, which finds the local wheel (uv does not look there); the rest with uv, which resolves and installs
# the dev extra in 10 s where pip took over a minute (a fresh venv: 156 s before, compileall's 53 s included; 42 s
# now), keeping that torch (asked for again, so that nothing can swap it for another build). Where uv cannot be
# installed or cannot resolve, pip does it all.
define install
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) "$(TORCH)" -e ".[$(1)]" \
	  || $(PY) -m pip install -q --no-compile "$(TORCH)" -e ".[$(1)]"
	touch $@
endef

$(VENV)/.dev: pyproject.toml
	$(call install,dev)

$(VENV)/.demo: pyproject.toml
	$(call install,demo)

# Bytecode is compiled as modules are first imported, and kept in the venv (not beside the sources), whatever
# PYTHONDONTWRITEBYTECODE says: the suite imports ~7,200 of the venv's ~48,000 modules (compileall over all of them
# took 53 s), and a Python that may not write them compiles them again in every process it starts (each test worker,
# each subprocess: ~20 s of an import of hf_wide, peft, Ray Serve and gradio).
RUN := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache

demo: $(VENV)/.demo
	$(RUN) $(VENV)/bin/hf-wide demo

# The Space's browser test drives Debian's chromium through playwright (no browser download): install it when
# missing, as root or with sudo; where that is impossible the test says so and is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser test ..."; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; \
	} || echo "WARNING: chromium could not be installed: the browser test will be skipped."

# Two pytest-xdist workers, each module on one (tests/conftest.py runs the modules that start Ray one after another):
# on a 2-core machine much of the time is subprocesses starting and servers waiting. Each worker's torch (and what
# it starts) takes its share of the cores, OMP_NUM_THREADS (tests/conftest.py): 2 x 2 threads on 2 cores ran 25% slower.
TEST_WORKERS ?= 2

# The venv and the browser install at once (a fresh CI machine fetches Debian's chromium while the venv is made).
test:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.dev browser
	$(RUN) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# On a machine with a CUDA GPU and a CUDA build of torch (this project's machines and CI have none), with the
# dependencies installed: the CUDA tests (tests/test_cuda.py), the quick benchmark on the GPU, and member
# parallelism over one rank (nccl). Each step runs whatever the one before gave; logs and JSON go to $(CUDA_OUT).
CUDA_OUT ?= cuda-results
CUDA_WORKERS ?= 8

cuda-check:
	mkdir -p $(CUDA_OUT)
	$(PYTHON) -c "import torch, transformers, peft; print(torch.__version__, torch.cuda.get_device_name(), \
	  'transformers', transformers.__version__, 'peft', peft.__version__)" | tee $(CUDA_OUT)/versions.txt
	-timeout 240 $(PYTHON) -m pytest tests/test_cuda.py -n $(CUDA_WORKERS) -q -p no:cacheprovider \
	  > $(CUDA_OUT)/test_cuda.log 2>&1; tail -n 30 $(CUDA_OUT)/test_cuda.log
	-timeout 200 $(PYTHON) -m hf_wide.cli benchmark --preset quick --compile none --device cuda \
	  --json $(CUDA_OUT)/benchmark-quick.json > $(CUDA_OUT)/benchmark-quick.log 2>&1; \
	  tail -n 45 $(CUDA_OUT)/benchmark-quick.log
	-timeout 90 $(PYTHON) -m hf_wide.benchmark.member_parallel --ranks 1 --json $(CUDA_OUT)/member-parallel.json \
	  > $(CUDA_OUT)/member-parallel.log 2>&1; tail -n 5 $(CUDA_OUT)/member-parallel.log

clean:
	rm -rf $(VENV) build *.egg-info
