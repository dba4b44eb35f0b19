"""The install choices: MLX's build is picked with an extra on Linux (CPU or CUDA), and
nothing in the package depends on the CPU build's distribution being there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_python

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_mlx_builds_are_extras_and_the_base_needs_no_backend():
    base = [d for d in PROJECT["dependencies"] if d.startswith("mlx") and not d.startswith("mlx-lm")]
    assert base == ["mlx>=0.31.2"]  # the Metal build on macOS, no backend forced on Linux
    extras = PROJECT["optional-dependencies"]
    assert extras["cpu"] == ["mlx[cpu]>=0.31.2; sys_platform == 'linux'"]
    assert extras["cuda"] == ["mlx[cuda13]>=0.31.2; sys_platform == 'linux'"]
    assert extras["cuda12"] == ["mlx[cuda12]>=0.31.2; sys_platform == 'linux'"]
    makefile = (ROOT / "Makefile").read_text()
    assert "MLX ?= cpu" in makefile and "'.[test,$(MLX)]'" in makefile  # make's default


def test_no_code_names_the_cpu_build():
    pattern = re.compile(r"mlx[-_]cpu|mlx\[cpu\]|mlx\.core\.cpu|mlx_metal|mlx[-_]cuda")
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in (ROOT / "persistent_prefix_cache").rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_mlx_without_a_backend_gets_a_clear_message():
    # What `import mlx.core` raises when no build's libmlx is installed.
    proc = run_python(
        """
        import sys
        class NoBackend:
            def find_spec(self, name, path=None, target=None):
                if name == "mlx.core":
                    raise ImportError("libmlx.so: cannot open shared object file: No such file or directory")
        sys.meta_path.insert(0, NoBackend())
        from persistent_prefix_cache import PersistentPrefixCache
        """,
        check=False,
    )
    assert proc.returncode == 1
    assert "MLX is installed without a backend" in proc.stderr
    assert "with its [cpu] extra (pip install '.[cpu]' in its checkout), or [cuda]" in proc.stderr
