# Two commands set up a fresh machine from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: 2.13.0 is the CPU wheel on this project's machines; a looser pin pulls CUDA builds.
TORCH ?= torch==2.13.0

.PHONY: demo test browser clean

$(VENV)/.dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/hf-wide demo

# The Space's browser test drives Debian's chromium through playwright (no browser download): install it when
# missing, as root or with sudo; where that is impossible the test says so and is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser test ..."; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; \
	} || echo "WARNING: chromium could not be installed: the browser test will be skipped."

# Two pytest-xdist workers, each module on one (tests/conftest.py runs the modules that start Ray one after another):
# on a 2-core machine much of the time is subprocesses starting and servers waiting.
TEST_WORKERS ?= 2

test: $(VENV)/.dev browser
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
