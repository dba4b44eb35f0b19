# Quick start: `make demo` runs the warm-start demo, `make test` runs the tests.
# Both create .venv and install the package (with its test extra) on first use.
PYTHON ?= python3
# MLX's build on Linux: cpu (default) or cuda / cuda12 (`make install MLX=cuda`).
# Ignored on macOS, where mlx brings its Metal build.
MLX ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean redis-server

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,$(MLX)]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m persistent_prefix_cache demo

# The remote-tier tests start their own redis-server: install it when missing and we can
# (root, or sudo without a password, on a system with apt-get); otherwise say how and
# go on (those tests then skip, unless PPC_REQUIRE_REDIS=1 makes them fail, as in CI).
redis-server:
	@if command -v redis-server >/dev/null 2>&1; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" != none ]; then \
	    echo "installing redis-server (for the remote-tier tests)"; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server >/dev/null 2>&1 || \
	      { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server >/dev/null 2>&1; } || \
	      echo "could not install redis-server: the remote-tier tests will be skipped"; \
	    exit 0; \
	  fi; \
	fi; \
	echo "redis-server not found: the remote-tier tests will be skipped (install it: apt-get install -y redis-server, or brew install redis)"

test: $(STAMP) redis-server
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .demo .pytest_cache build *.egg-info
