# The two quick-start commands of the README: `make demo` (set up, then the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FASHION := /usr/share/datasets/fashion-mnist

.PHONY: setup data demo test lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(STAMP)

# Fashion-MNIST from Debian's dataset-fashion-mnist package (needs root or sudo); or set VITKIT_DATA.
data:
	@if [ -z "$$VITKIT_DATA" ] && [ ! -d $(FASHION) ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q dataset-fashion-mnist; \
	fi

demo: setup
	$(VENV)/bin/vitkit models
	$(PY) -c "import torch, vitkit; m = vitkit.create_model('ViT-B/16').eval(); print('ViT-B/16 logits', tuple(m(torch.randn(1, 3, 224, 224)).shape))"

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
