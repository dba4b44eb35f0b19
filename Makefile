# Quick start: `make demo` runs the warm-start demo, `make test` runs the tests.
# Both create .venv and install the package (with its test extra) on first use.
PYTHON ?= python3
# MLX's build on Linux: cpu (default) or cuda / cuda12 (`make install MLX=cuda`).
# Ignored on macOS, where mlx brings its Metal build.
MLX ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,$(MLX)]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m persistent_prefix_cache demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .demo .pytest_cache build *.egg-info
