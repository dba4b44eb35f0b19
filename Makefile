# Quick start: `make demo` runs the warm-start demo, `make test` runs the tests
# (`make test-fast` leaves out the slow ones).
# Both create .venv and install the package (with its test extra) on first use.
PYTHON ?= python3
# MLX's build on Linux: cpu (default) or cuda / cuda12 (`make install MLX=cuda`).
# Ignored on macOS, where mlx brings its Metal build.
MLX ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The other mlx-lm line we support (docs/versions.md): its own venv, beside vllm-mlx.
VENV_031 := .venv-031
PY_031 := $(VENV_031)/bin/python
STAMP_031 := $(VENV_031)/.installed
MLX_LM_031 ?= 0.31.3
VLLM_MLX ?= 0.6.0
# On mlx-lm 0.31 CI runs the cache families, restarts and crashes, and the compat layers
# (vllm-mlx's API, the real vllm-mlx, mlx_lm.server with its tenants and one memory
# budget, mlx_lm.generate's flags).
TESTS_031 := tests/test_families.py tests/test_store.py tests/test_restart.py tests/test_crash.py \
	tests/test_prefix_cache.py tests/test_paged_cache.py tests/test_compat_gaps.py tests/test_vllm_mlx_real.py \
	tests/test_serve.py tests/test_serve_metrics.py tests/test_serve_tenants.py tests/test_serve_memory.py \
	tests/test_generate_flags.py tests/test_install.py tests/test_mlx_lm_versions.py

.PHONY: demo test test-fast lint install clean servers test-mlx-lm-0.31 check-vllm-mlx-resolves

# setuptools boxes a note into every editable install of a package that is not under
# src/ ("folders ... with the same name as your package may take precedence"): true of
# any checkout, and noise in the first `make demo`'s output. Only that warning is quieted.
QUIET_EDITABLE := PYTHONWARNINGS='ignore:Editable installation'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(QUIET_EDITABLE) $(PY) -m pip install --quiet -e '.[test,$(MLX)]'
	touch $(STAMP)

install: $(STAMP)

# vllm-mlx's prefix_cache and paged_cache import only mlx: it goes in without its
# dependencies (torch and more), for tests/test_vllm_mlx_real.py.
$(STAMP_031): pyproject.toml
	$(PYTHON) -m venv $(VENV_031)
	$(PY_031) -m pip install --quiet --upgrade pip
	$(QUIET_EDITABLE) $(PY_031) -m pip install --quiet -e '.[test,$(MLX)]' 'mlx-lm==$(MLX_LM_031)'
	$(PY_031) -m pip install --quiet --no-deps 'vllm-mlx==$(VLLM_MLX)'
	touch $(STAMP_031)

demo: $(STAMP)
	$(PY) -m persistent_prefix_cache demo

# The remote-tier tests start their own servers (Redis, and Valkey where the system's
# packages have it): install them when missing and we can (root, or sudo without a
# password, on a system with apt-get); otherwise say how and go on (those tests then
# skip, unless PPC_TEST_HOOKS=require=redis:valkey makes them fail, as in CI).
servers:
	@if command -v apt-get >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  for pkg in redis-server valkey-server; do \
	    command -v $$pkg >/dev/null 2>&1 && continue; \
	    if [ "$$SUDO" = none ]; then echo "$$pkg not found: its remote-tier tests will be skipped (apt-get install -y $$pkg)"; continue; fi; \
	    if [ "$$pkg" = valkey-server ] && ! apt-cache policy valkey-server 2>/dev/null | grep -q "Candidate: [0-9]"; then \
	      echo "valkey-server is not in this system's packages: the Valkey tests will be skipped"; continue; fi; \
	    echo "installing $$pkg (for the remote-tier tests)"; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y $$pkg >/dev/null 2>&1 || \
	      { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y $$pkg >/dev/null 2>&1; } || \
	      echo "could not install $$pkg: its remote-tier tests will be skipped"; \
	  done; \
	elif ! command -v redis-server >/dev/null 2>&1; then \
	  echo "redis-server not found: the remote-tier tests will be skipped (brew install redis valkey, or your system's packages)"; \
	fi

# The suite runs on every core (pytest-xdist; 2 on CI, where that halves its time:
# docs/development.md#the-full-suite). JOBS=0 runs it in one process.
JOBS ?= auto

test: $(STAMP) servers
	$(PY) -m pytest -q -n $(JOBS)

# The edit-and-check loop: every test but those marked slow (see pyproject.toml). Not what CI runs.
test-fast: $(STAMP) servers
	$(PY) -m pytest -q -n $(JOBS) -m "not slow"

# The linter and the formatter (ruff), then the type check (mypy): pinned in the test
# extra, their settings in pyproject.toml. ruff reads the package, tests, tools and
# migrations; mypy the package. CI runs them before the tests; a finding fails the build.
# `$(PY) -m ruff format .` formats the tree as the check wants it.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test-mlx-lm-0.31: $(STAMP_031) servers
	$(PY_031) -m pytest -q -n $(JOBS) $(TESTS_031)

# pip resolves vllm-mlx beside this checkout (asks the package registry; installs nothing).
check-vllm-mlx-resolves: $(STAMP_031)
	$(PY_031) -m pip install --quiet --dry-run --ignore-installed 'vllm-mlx==$(VLLM_MLX)' '.[$(MLX)]'
	@echo "pip resolves vllm-mlx==$(VLLM_MLX) together with persistent-prefix-cache"

clean:
	rm -rf $(VENV) $(VENV_031) .demo .pytest_cache .ruff_cache build *.egg-info
