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

.PHONY: demo test test-fast install clean servers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,$(MLX)]'
	touch $(STAMP)

install: $(STAMP)

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

test: $(STAMP) servers
	$(PY) -m pytest -q

# The edit-and-check loop: every test but those marked slow (see pyproject.toml). Not what CI runs.
test-fast: $(STAMP) servers
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .demo .pytest_cache build *.egg-info
