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


# vllm-mlx 0.6.0's own pin (its metadata, restated for where it is not installed).
VLLM_MLX_060_MLX_LM = ">=0.31.3,<0.32.0"


def test_the_mlx_lm_pin_admits_both_lines_and_vllm_mlx_0_6():
    """pyproject's mlx-lm pin takes 0.31.3+ and 0.32.x (what `layers/mlx_lm_versions.py`
    handles), meets vllm-mlx 0.6.0's range, and holds the installed mlx-lm. Whether pip
    resolves the two together is `make check-vllm-mlx-resolves` (it asks the registry)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from persistent_prefix_cache.layers.mlx_lm_versions import MLX_LM_VERSION, SUPPORTED_RANGE

    pins = [Requirement(d) for d in PROJECT["dependencies"] if Requirement(d).name == "mlx-lm"]
    assert len(pins) == 1
    ours = pins[0].specifier
    low, high = (".".join(map(str, v)) for v in SUPPORTED_RANGE)
    assert ours == SpecifierSet(f">={low},<{high}")  # the module and the pin agree
    assert all(v in ours for v in ("0.31.3", "0.31.9", "0.32.0", "0.32.2"))
    assert not any(v in ours for v in ("0.31.2", "0.31.1", "0.33.0"))
    theirs = Requirement(f"mlx-lm{VLLM_MLX_060_MLX_LM}").specifier
    try:  # the installed vllm-mlx's own pin, where there is one (make test-mlx-lm-0.31)
        for req in map(Requirement, metadata.requires("vllm-mlx") or ()):
            if req.name == "mlx-lm" and req.marker is None:
                theirs = req.specifier
    except metadata.PackageNotFoundError:
        pass
    assert "0.31.3" in theirs and "0.31.3" in ours
    assert Version(MLX_LM_VERSION) in ours


def test_the_wheel_lists_every_subpackage():
    """pyproject names its packages one by one (migrations ship from another folder), so a
    new wing must be added there: `admin/` and `device/` were left out, and an installed
    (non-editable) package failed at import with "No module named ...device"."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    package = ROOT / "persistent_prefix_cache"
    folders = {
        ".".join(("persistent_prefix_cache", *p.parent.relative_to(package).parts))
        for p in package.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
