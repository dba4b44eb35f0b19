"""The package layout's rules (docs/architecture.md), checked on the source itself.

Each rule is a boundary a reader relies on: only the index touches LMDB, only
``layers/`` knows mlx-lm's cache classes, nothing imports a wing above its own, the
compat layers use the store's public names only, no module imports another's private
name, no module grows past ~600 lines, and the architecture page names every module
there is and only what the code defines (its tree, and its drawings of one store() and
one fetch()). A migration imports only frozen format code (``migrations/formats/``,
itself pinned) or live formats it declares at their current versions, so a later format
never silently changes what an old migration writes.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "persistent_prefix_cache"
NAME = "persistent_prefix_cache"

# Wings from the bottom up: a module imports only from its own wing or those below.
WINGS = [
    (
        "base",
        [
            "errors",
            "keys",
            "fingerprint",
            "weights_hash",
            "lane_kernel",
            "paths",
            "files",
            "tiny_model",
            "blocks",
            "untrusted",
            "key_filter",
        ],
    ),
    ("device", ["device"]),  # where restored bytes live: imports nothing of the package but `blocks`
    ("disk", ["disk", "migrations"]),  # the frozen formats use disk/portable's OS calls
    ("layers", ["layers"]),
    ("tiers", ["tiers"]),
    # the core wing (core/: fetch, store, writer, fills, cost model) and the modules users import by name
    ("core", ["core", "store", "prefill", "options", "metrics"]),
    ("admin", ["admin"]),  # check, repair, gc, export/import, push/pull: on the wings below, nothing below on it
    ("compat", ["compat", "prefix_cache", "paged_cache", "lru_prompt_cache"]),
    ("cli", ["cli", "__main__"]),
]
INTERNAL = (
    "disk",
    "tiers",
    "core.lookup",
    "core.restore",
    "core.writeback",
    "core.merging",
    "core.remote_fill",
    "admin",
    "core.warm",
    "core.fetching",
    "core.storing",
)  # not for compat: wings, or modules of the core wing
CACHE_CLASSES = {
    "KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache", "ArraysCache",
    "CacheList", "make_prompt_cache", "can_trim_prompt_cache", "trim_prompt_cache",
}  # fmt: skip
MAX_LINES = 600


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    """Dotted name (below the package) -> (path, tree) of every library module."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) for every import in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_absolute_module(name, node), [a.name for a in node.names], node.lineno))
    return out


def _absolute_module(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of module `name` reads."""
    if not node.level:
        return node.module or ""
    here = [NAME] + (name.split(".") if name else [])
    if MODULES[name][0].name != "__init__.py":
        here = here[:-1]
    return ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))


def _own(module: str, names: list[str]) -> list[str]:
    """The package modules an import statement reaches (``from . import codec`` too)."""
    if module != NAME and not module.startswith(NAME + "."):
        return []
    inner = module[len(NAME) + 1 :]
    reached = [inner]
    for n in names:
        sub = f"{inner}.{n}" if inner else n
        if sub in MODULES:
            reached.append(sub)
    return reached


def _wing(name: str) -> int:
    top = name.split(".")[0]
    for rank, (_, tops) in enumerate(WINGS):
        if top in tops:
            return rank
    raise AssertionError(f"module {name!r} belongs to no wing: add it to WINGS and docs/architecture.md")


def test_only_the_index_imports_lmdb():
    users = {
        name
        for name, (_, tree) in MODULES.items()
        for module, _, _ in _imports(name, tree)
        if module == "lmdb" or module.startswith("lmdb.")
    }
    assert users == {"disk.index", "disk.index_env"}  # index_tables uses transactions it is given


def test_only_layers_names_mlx_lm_cache_classes():
    found = []
    for name, (_, tree) in MODULES.items():
        if name.split(".")[0] == "layers":
            continue
        for module, names, line in _imports(name, tree):
            if module == "mlx_lm.models" and "cache" in names:
                found.append(f"{name}:{line} imports mlx_lm.models.cache")
            if module == "mlx_lm.models.cache" and set(names) - {"LRUPromptCache"}:
                found.append(f"{name}:{line} imports {sorted(set(names) - {'LRUPromptCache'})}")
        for node in ast.walk(tree):
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if ident in CACHE_CLASSES:
                found.append(f"{name}:{node.lineno} names {ident}")
    assert not found


def test_no_module_imports_a_wing_above_its_own():
    found = []
    for name, (_, tree) in MODULES.items():
        if name == "":
            continue  # the package root re-exports lazily from every wing
        for module, names, line in _imports(name, tree):
            for target in _own(module, names):
                if target and _wing(target) > _wing(name):
                    found.append(f"{name}:{line} imports {target} ({WINGS[_wing(target)][0]})")
    assert not found


def test_layers_import_nothing_from_disk():
    # The block vocabulary (`blocks`) is below both: layers/ cuts and rebuilds caches in its
    # terms and never reaches into the disk's formats.
    found = [
        f"{name}:{line} imports {target}"
        for name, (_, tree) in MODULES.items()
        if name.split(".")[0] == "layers"
        for module, names, line in _imports(name, tree)
        for target in _own(module, names)
        if target.split(".")[0] == "disk"
    ]
    assert not found


# What names a device in code: its kind (CUDA, a GPU, Metal), MLX's choice of one, or a
# driver reached through ctypes. Comments, docstrings and messages to users are not code.
DEVICE_WORDS = re.compile(r"cuda|gpu|metal|default_device|ctypes", re.IGNORECASE)
# Modules outside device/ allowed to name one, each with its reason.
NAMES_A_DEVICE = {
    # Fingerprinting, not placement: which hash is cheap depends on where the weights live
    # (lane sums on a GPU); the base sits below every wing, the device wing included.
    "weights_hash": {"gpu", "default_device"},
    # The lane sums in one PTX kernel, where the weights live on a CUDA GPU (as above).
    "lane_kernel": {"cuda", "gpu", "metal", "default_device"},
    # The OS's sync_file_range (a libc call), not a driver's.
    "disk.portable": {"ctypes"},
}


def _device_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) for each name in the code of `tree` that names a device (`DEVICE_WORDS`):
    imports, names, attributes, definitions, arguments and keywords."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            idents = [a.name for a in node.names] + [a.asname for a in node.names if a.asname]
        elif isinstance(node, ast.ImportFrom):
            idents = [node.module or ""] + [a.name for a in node.names] + [a.asname for a in node.names if a.asname]
        elif isinstance(node, ast.Name):
            idents = [node.id]
        elif isinstance(node, ast.Attribute):
            idents = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            idents = [node.name]
        elif isinstance(node, (ast.arg, ast.keyword)):
            idents = [node.arg or ""]
        else:
            continue
        found += [(node.lineno, i) for i in idents if DEVICE_WORDS.search(i)]
    return found


def test_only_the_device_wing_names_a_device():
    # Every other module asks the handle's `device.target.Target` (writer_route,
    # join_on_device, device, how read bytes reach the device) instead.
    found, used = [], {}
    for name, (_, tree) in MODULES.items():
        if name.split(".")[0] == "device":
            continue
        for line, ident in _device_names(tree):
            words = {w.lower() for w in DEVICE_WORDS.findall(ident)}
            allowed = NAMES_A_DEVICE.get(name, set())
            used.setdefault(name, set()).update(words & allowed)
            if words - allowed:
                found.append(f"{name}:{line} names {ident}")
    assert found == []
    assert {n: w for n, w in NAMES_A_DEVICE.items() if used.get(n) != w} == {}, "an exception that no longer applies"


def test_the_device_rule_finds_a_cuda_call():
    code = "import ctypes\nfrom .disk import cuda_pages\n\n\ndef f(x):\n    cuda_pages.to_gpu(x)\n    return mx.default_device() == mx.gpu\n"
    got = [ident for _, ident in _device_names(ast.parse(code))]
    assert sorted(got) == sorted(["ctypes", "cuda_pages", "cuda_pages", "to_gpu", "default_device", "gpu"])


def test_no_import_cycles():
    graph = {
        name: {t for m, ns, _ in _imports(name, tree) for t in _own(m, ns) if t and t != name}
        for name, (_, tree) in MODULES.items()
        if name
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1 and not _is_package(nxt):
                pytest.fail("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def _is_package(name: str) -> bool:
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    return MODULES[name][0].name == "__init__.py"


def test_compat_uses_only_public_names_of_the_store():
    found = []
    for name, (_, tree) in MODULES.items():
        if name.split(".")[0] != "compat":
            continue
        for module, names, line in _imports(name, tree):
            for target in _own(module, names):
                if target.split(".")[0] in INTERNAL or ".".join(target.split(".")[:2]) in INTERNAL:
                    found.append(f"{name}:{line} imports internal {target}")
            if module.startswith(NAME):
                found += [f"{name}:{line} imports private {n}" for n in names if n.startswith("_")]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{name}:{node.lineno} uses private attribute {node.attr}")
    assert not found


def _store_private_attributes() -> set[str]:
    """The private attributes a `PersistentPrefixCache` sets on itself (its collaborators)."""
    names = set()
    for module in ("store",):
        for node in ast.walk(MODULES[module][1]):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
            ):
                names.add(node.attr)
    return names


def test_compat_and_cli_reach_no_collaborator_of_the_store():
    # The facade's collaborators (its `_parts`: index, RAM tier, writer, ...) are private: the
    # compat layers and ppc go through its public methods (the rule above checks compat
    # for every private name; ppc legitimately touches argparse's).
    private = _store_private_attributes()
    assert "_parts" in private
    found = []
    for name, (_, tree) in MODULES.items():
        if name.split(".")[0] not in ("compat", "cli", "prefix_cache", "paged_cache", "lru_prompt_cache", "__main__"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{name}:{node.lineno} reaches the store's {node.attr}")
    assert not found


# Tests and tools reach the facade through its public API and public parts (`costs`,
# `remote_fill`, `ram_tier`; a fault at a chosen step through `disk.faults.acting_at`, a
# busy writer through `hold_writer`): none reaches a collaborator. Never raise this.
TEST_REACH_INS = 0
STORE_PARTS = ("costs", "remote_fill", "ram_tier")  # the facade's public parts


def _reach_ins(trees: dict[str, ast.Module]) -> list[str]:
    """Where code outside the package reaches a collaborator of the facade: a private
    attribute it sets on itself (``store._parts``), or a private attribute of one of its
    public parts (``store.remote_fill.remote._value_bytes``)."""
    private = _store_private_attributes()
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            chain, inner = [], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if any(attr in private for attr in chain):
                continue  # counted once, at the collaborator it goes through
            if node.attr in private or any(attr in STORE_PARTS for attr in chain):
                base = [inner.id] if isinstance(inner, ast.Name) else []
                found.append((name, node.lineno, ".".join([*base, *reversed(chain), node.attr])))
    return [f"{name}:{line} reaches {reached}" for name, line, reached in sorted(found)]


def test_tests_reach_no_more_collaborators_of_the_store_than_they_do():
    from persistent_prefix_cache import PersistentPrefixCache

    assert all(isinstance(getattr(PersistentPrefixCache, part), property) for part in STORE_PARTS)
    trees = {
        str(path.relative_to(ROOT)): ast.parse(path.read_text())
        for folder in ("tests", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    found = _reach_ins(trees)
    assert len(found) <= TEST_REACH_INS, "reach the store through its public API:\n" + "\n".join(found)


def test_the_reach_in_rule_finds_a_collaborator():
    code = (
        "def test(store, b):\n"
        "    store._parts.memory._entries.clear()\n"
        "    b.remote_fill.remote._value_bytes = 1\n"
        "    store.costs._learned\n"
        "    self._index, store.ram_tier.items(), store.__class__\n"
    )
    assert _reach_ins({"fake.py": ast.parse(code)}) == [
        "fake.py:2 reaches store._parts",
        "fake.py:3 reaches b.remote_fill.remote._value_bytes",
        "fake.py:4 reaches store.costs._learned",
    ]


def _admin_findings() -> list[str]:
    """What breaks the admin wing's rules: a module of a wing below it importing it, ppc
    or compat importing one of its rooms instead of its face (``from ..admin import X``),
    and admin code touching a private attribute of another object (the store's
    collaborators among them: it uses the facade's public API)."""
    below = {tops_name for rank, (_, tops) in enumerate(WINGS) if rank < _wing("admin") for tops_name in tops}
    found = []
    for name, (_, tree) in MODULES.items():
        top = name.split(".")[0]
        for module, names, line in _imports(name, tree):
            reached = [t for t in _own(module, names) if t.split(".")[0] == "admin"]
            if reached and top in below:
                found.append(f"{name}:{line} imports {reached[-1]} from below the admin wing")
            if top in ("cli", "compat") and any(t != "admin" for t in reached):
                found.append(f"{name}:{line} imports {max(reached)}, not the admin wing's face")
        if top == "admin":
            found += [
                f"{name}:{node.lineno} uses private attribute {node.attr}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not _on_self(node) and not _on_super(node)
            ]  # fmt: skip
    return found


def _on_super(node: ast.Attribute) -> bool:
    # ``super()._hook``: a base's hook the class overrides (tarfile's, in a pack's reader)
    return isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"


def test_the_admin_wing_stands_on_public_names_and_is_entered_by_its_face():
    assert _admin_findings() == []
    from persistent_prefix_cache import admin

    assert all(getattr(admin, n) is not None for n in admin.__all__)  # each name of the face is there


def test_the_admin_rule_finds_what_breaks_it(monkeypatch):
    fakes = {
        "disk.fake": "from ..admin import StoreAdmin\n",
        "remote_fake": "from .admin.store_admin import StoreAdmin\n",
        "cli.fake": "from ..admin.packs import import_pack\nfrom ..admin import StoreAdmin\n",
        "admin.fake": "def pull(store):\n    return store._writeback\n",
    }
    for name, code in fakes.items():
        monkeypatch.setitem(MODULES, name, (PKG / (name.replace(".", "/") + ".py"), ast.parse(code)))
    wings = [(wing, [*tops, "remote_fake"] if wing == "core" else tops) for wing, tops in WINGS]
    monkeypatch.setattr(sys.modules[__name__], "WINGS", wings)
    assert sorted(_admin_findings()) == [
        "admin.fake:2 uses private attribute _writeback",
        "cli.fake:1 imports admin.packs, not the admin wing's face",
        "disk.fake:1 imports admin from below the admin wing",
        "remote_fake:1 imports admin.store_admin from below the admin wing",
    ]


def test_the_package_shows_only_its_api():
    # `__all__` is the API: the only public top-level names, even once a program has
    # imported submodules (which Python binds as attributes of the package).
    code = (
        "import persistent_prefix_cache as p, persistent_prefix_cache.store, persistent_prefix_cache.cli.serve,"
        " persistent_prefix_cache.compat.lru_prompt_cache, persistent_prefix_cache.admin.store_admin\n"
        "public = [n for n in dir(p) if not n.startswith('_')]\n"
        "assert public == sorted(p.__all__), sorted(set(public) ^ set(p.__all__))\n"
        "assert all(getattr(p, n) is not None for n in p.__all__)\n"
        "ns = {}; exec('from persistent_prefix_cache import *', ns)\n"
        "assert sorted(n for n in ns if not n.startswith('_')) == sorted(p.__all__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_environment_variables_are_the_documented_few():
    # Six for users and one for the tests (docs/environment.md's table, in that order);
    # tuning knobs are module settings, test hooks live in PPC_TEST_HOOKS.
    sources = [*PKG.rglob("*.py"), *(ROOT / "migrations").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
               *(ROOT / "tests").rglob("*.py"), ROOT / ".ci" / "run", ROOT / "Makefile"]  # fmt: skip
    read = set()
    for path in sources:
        read |= set(re.findall(r"PPC_[A-Z_0-9]+", path.read_text()))
    page = (ROOT / "docs" / "environment.md").read_text()
    table = re.findall(r"^\| `(PPC_[A-Z_0-9]+)` \|", page, flags=re.M)
    assert table == ["PPC_STORE", "PPC_REMOTE", "PPC_REMOTE_SECRET", "PPC_REMOTE_TIMEOUT", "PPC_FINGERPRINT_SCHEME",
                     "PPC_PACK_SECRET", "PPC_TEST_HOOKS"]  # fmt: skip
    assert read == set(table), sorted(read ^ set(table))


def test_test_hooks_are_read_from_one_variable(monkeypatch):
    from persistent_prefix_cache.disk import faults

    monkeypatch.setenv(faults.VARIABLE, faults.hooks_value(pause_at="in_write_txn", pause_file="/tmp/a=b"))
    assert faults.hook("pause_at") == "in_write_txn" and faults.hook("pause_file") == "/tmp/a=b"
    assert faults.hook("require") is None
    faults.pause_point("before_commit")  # another point: returns at once
    monkeypatch.delenv(faults.VARIABLE)
    assert faults.hook("pause_at") is None


def test_no_module_imports_another_modules_private_name():
    # A leading underscore says "used here only": a name another module needs is public.
    found = [
        f"{name}:{line} imports {module}.{n}"
        for name, (_, tree) in MODULES.items()
        for module, names, line in _imports(name, tree)
        if module.startswith(NAME)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert found == []


# Classes that read a private attribute they define nowhere (nor a base class of the
# package does): a mixin reading its host's state. Each exception with its reason.
READS_UNDEFINED = {
    "cli.common.Parser": "argparse.ArgumentParser's own _actions: ppc's parser names a misspelt option",
}


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its methods, class attributes and annotations, and every
    ``self.x`` its methods assign (``=``, ``+=``, annotated, in a tuple, ``del``)."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and _on_self(node):
            out.add(node.attr)
    return out


def _package_classes() -> dict[str, tuple[ast.ClassDef, list[str], bool]]:
    """``module.Class`` -> (the class, its bases of the package as ``module.Class``,
    whether it has a base from outside: ``object`` apart)."""
    found, imported = {}, {}
    for name, (_, tree) in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute_module(name, node)[len(NAME) + 1 :]
                imported.update({(name, a.asname or a.name): f"{module}.{a.name}" for a in node.names})
        found.update({f"{name}.{c.name}": (name, c) for c in tree.body if isinstance(c, ast.ClassDef)})
    out = {}
    for dotted, (name, cls) in found.items():
        named = [b.id if isinstance(b, ast.Name) else None for b in cls.bases]  # mod.Base: not ours
        refs = [f"{name}.{b}" if f"{name}.{b}" in found else imported.get((name, b)) for b in named if b != "object"]
        ours = [r for r in refs if r in found]
        out[dotted] = (cls, ours, len(ours) < len(refs))
    return out


def _reads_undefined() -> dict[str, list[str]]:
    """``module.Class`` -> the private attributes it reads on itself (``self._x``, with
    the line) that neither it nor a base class of the package defines."""
    classes = _package_classes()

    def defined(dotted: str) -> tuple[set[str], bool]:
        cls, bases, outside = classes[dotted]
        names = _defined_in(cls)
        for base in bases:
            more, further = defined(base)
            names, outside = names | more, outside or further
        return names, outside

    found = {}
    for dotted, (cls, _, _) in classes.items():
        have, outside = defined(dotted)
        reads = {
            f"{node.attr}:{node.lineno}"
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and _on_self(node)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in have
        }
        if reads:
            found[dotted] = [r + (" (a base outside the package?)" if outside else "") for r in sorted(reads)]
    return found


def test_no_class_reads_attributes_it_does_not_define():
    # A class reads on itself only what it (or a base class of the package) defines: its
    # collaborators are passed to it, never found on a host it is mixed into.
    found = _reads_undefined()
    assert {k: v for k, v in found.items() if k not in READS_UNDEFINED} == {}
    assert set(READS_UNDEFINED) <= set(found), "an exception that no longer applies"


def test_the_rule_finds_a_mixin(monkeypatch):
    code = "class Host(Part):\n    def __init__(self):\n        self._x = 1\n\n\nclass Part:\n    def f(self):\n        return self._x\n"
    monkeypatch.setitem(MODULES, "fake", (PKG / "fake.py", ast.parse(code)))
    assert _reads_undefined()["fake.Part"] == ["_x:8"] and "fake.Host" not in _reads_undefined()


def test_no_library_module_is_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, (path, _) in MODULES.items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_every_module_says_what_it_holds():
    assert [n for n, (_, tree) in MODULES.items() if not ast.get_docstring(tree)] == []


def test_architecture_page_names_every_module_and_nothing_else():
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z0-9_]+(?:/[a-z0-9_]+)*\.py)`", page))
    in_package = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")}
    in_repo = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("*/*.py"), *ROOT.glob("migrations/formats/*.py")]}
    modules = {m for m in in_package if not m.endswith("/__init__.py")}
    modules |= {
        m for m in in_repo if m.startswith(("migrations/0", "migrations/formats/")) and not m.endswith("__init__.py")
    }
    assert modules - named == set(), "modules the architecture page does not name"
    assert named - in_package - in_repo == set(), "files it names that do not exist"


# -- the architecture page is right --------------------------------------------------------
# Naming every module is not enough: the page's tree, its drawings of one store() and one
# fetch() and its dotted names must name what the code defines, or a rename leaves it wrong.

ARCHITECTURE = ROOT / "docs" / "architecture.md"
STORE_FOLDERS = {"tmp", "segments", "index"}  # folders of a store the drawings name, not of the package


def _code_blocks(page: str, heading: str) -> list[str]:
    """The fenced code blocks of the section under `heading` (up to the next ``## ``)."""
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, re.S)


def _definitions() -> tuple[dict[str, set[str]], dict[str, list[str]], dict[str, set[str]]]:
    """(names defined at each module's top level, each class's bases, each class's own
    names: methods, class attributes, ``self.x`` assigned in its methods)."""
    top: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    members: dict[str, set[str]] = {}
    for name, (_, tree) in MODULES.items():
        names = top.setdefault(name, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                own = members.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(item.name)
                    elif (
                        isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self"
                    ):
                        own.add(item.attr)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        own |= {t.id for t in targets if isinstance(t, ast.Name)}
    return top, bases, members


def _has_member(cls: str, attr: str, bases: dict[str, list[str]], members: dict[str, set[str]]) -> bool:
    if attr in members.get(cls, ()):
        return True
    return any(_has_member(b, attr, bases, members) for b in bases.get(cls, ()))


def _wrong_names(text: str, *, drawing: bool) -> list[str]:
    """What `text` (a drawing, or the page's backticked names) names that the code lacks."""
    top, bases, members = _definitions()
    source = "\n".join(path.read_text() for path, _ in MODULES.values())
    found = []
    for cls, attr in re.findall(r"(?<![\w.])([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\.([a-z_][a-z0-9_]*)\b", text):
        if cls not in members:
            found.append(f"class {cls} (in {cls}.{attr})")
        elif not _has_member(cls, attr, bases, members):
            found.append(f"{cls}.{attr}")
    for dotted in re.findall(r"`([a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", text):
        parts = dotted.split(".")
        if parts[-1] in ("py", "md", "json", "toml"):
            continue  # a file's name: the tests above check those
        if parts[0] == NAME:
            parts = parts[1:]
        if not parts or (
            parts[0] not in top and parts[0] not in {"core", "device", "disk", "layers", "tiers", "compat", "cli"}
        ):
            continue  # another project's name (mlx_lm.server, vllm_mlx.prefix_cache)
        k = max(k for k in range(len(parts) + 1) if ".".join(parts[:k]) in MODULES or k == 0)
        rest = parts[k:]
        if k == 0 or (rest and rest[0] not in top[".".join(parts[:k])]):
            found.append(f"`{dotted}`")
    if drawing:
        for path in re.findall(r"(?<![\w/.])([a-z_]+(?:/[a-z_]+)*(?:\.py|/))(?![\w])", text):
            if path.rstrip("/") in STORE_FOLDERS:
                continue
            if not (PKG / path).exists():
                found.append(f"file {path}")
        for fn in re.findall(r"(?<![\w.])([a-z_][a-z0-9_]*)\(", text):
            if not any(fn in names for names in top.values()):
                found.append(f"function {fn}")
        for word in set(re.findall(r"(?<![\w.])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w(])", text)):
            if not re.search(rf"\b{word}\b", source):
                found.append(f"name {word}")
    return found


def test_architecture_drawings_name_what_the_code_defines():
    page = ARCHITECTURE.read_text()
    drawings = _code_blocks(page, "## One `store()` call") + _code_blocks(page, "## One `fetch()` call")
    assert len(drawings) == 2
    assert _wrong_names("\n".join(drawings), drawing=True) == []


def test_architecture_page_names_only_what_exists():
    # Its tree: every file and folder it lists is there.
    page = ARCHITECTURE.read_text()
    tree = re.search(r"```\n(persistent_prefix_cache/\n.*?)```", page, re.S).group(1)
    missing, base = [], ROOT
    for line in tree.splitlines():
        if not line.startswith(" "):
            base = ROOT / line.split()[0]
            missing += [] if base.exists() else [line.split()[0]]
        elif not line.startswith("   "):  # an entry; deeper lines continue a description
            for entry in re.split(r"\s{2,}", line.strip())[0].split(", "):
                missing += [] if (base / entry).exists() else [entry]
    assert missing == []
    # The prose's backticked Class.method and dotted module names, in every page that
    # describes the code.
    for doc in ("architecture.md", "how-it-works.md"):
        text = (ROOT / "docs" / doc).read_text()
        assert _wrong_names(" ".join(re.findall(r"`[^`\n]+`", text)), drawing=False) == [], doc


def test_the_drawing_check_finds_a_stale_name():
    stale = "Fleet.fill  fleet.py\n  Trie.longest(toks)  core/lookup.py\n  Trie.shortest  read_blocks(x)  fleet_sync\n"
    assert _wrong_names(stale, drawing=True) == [
        "class Fleet (in Fleet.fill)", "Trie.shortest", "file fleet.py", "function read_blocks", "name fleet_sync",
    ]  # fmt: skip


def test_nothing_cites_a_document_that_is_not_in_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    present = set(tracked)
    citing = []
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".toml", ".cfg", ".txt")) or rel == "tests/test_layout.py":
            continue
        text = (ROOT / rel).read_text(errors="replace")
        for doc in set(re.findall(r"\b((?:[\w.-]+/)*[A-Za-z][\w-]*\.md)\b", text)):
            candidates = {doc, str((Path(rel).parent / doc)), f"docs/{doc}"}
            if not candidates & present:
                citing.append(f"{rel} cites {doc}")
    assert citing == []


# -- migrations/ -------------------------------------------------------------------------

MIGRATIONS = ROOT / "migrations"
FORMATS = MIGRATIONS / "formats"
# The live modules a migration may import, each the current code of one format, and that
# format's version now. A migration that imports one declares ``LIVE = {format: version}``
# at the version it was written for; when the format moves on, this test fails until the
# code that migration needs is frozen into migrations/formats/ (as v3 was for 0003).
LIVE_FORMATS = {
    "blocks": "record",
    "disk.index_tables": "tables",
    "disk.segment": "segment",
}
NO_FORMAT = {"errors", "disk.portable"}  # helpers that hold no format: free to import


def _current_versions() -> dict[str, int]:
    from persistent_prefix_cache import blocks
    from persistent_prefix_cache.disk import index_tables, segment_header

    return {
        "record": blocks.RECORD_VERSION,
        "tables": index_tables.TABLES_VERSION,
        "segment": int(segment_header.SEGMENT_FORMAT.rpartition("/")[2]),
    }


def _package_imports(path: Path) -> list[tuple[str, int]]:
    """The package modules a file under migrations/ imports (absolute or relative)."""
    tree = ast.parse(path.read_text(), str(path))
    here = ["migrations"] + list(path.parent.relative_to(MIGRATIONS).parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([NAME] + here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            mods = [(base, [a.name for a in node.names])]
        else:
            continue
        for module, names in mods:
            if module == NAME or module.startswith(NAME + "."):
                inner = module[len(NAME) + 1 :]
                subs = [f"{inner}.{n}" if inner else n for n in names if _is_module(f"{inner}.{n}" if inner else n)]
                out += [(m, node.lineno) for m in (subs or [inner])]
    return out


def _is_module(dotted: str) -> bool:
    """Whether a dotted name below the package is a module (migrations/ included)."""
    parts = dotted.split(".")
    base = ROOT.joinpath(*parts) if parts[0] == "migrations" else PKG.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _migrations() -> list[Path]:
    return sorted(p for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))


def _migration_findings(paths: list[Path], current: dict[str, int]) -> list[str]:
    """What breaks the migrations rule in these migration files, given the live formats' versions."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        live = next(
            (ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and
             any(isinstance(t, ast.Name) and t.id == "LIVE" for t in n.targets)),
            {},
        )  # fmt: skip
        for module, line in _package_imports(path):
            if module.startswith("migrations.formats.") or module in NO_FORMAT:
                continue
            fmt = LIVE_FORMATS.get(module)
            if fmt is None:
                found.append(f"{path.name}:{line} imports {module}: neither frozen nor a declared live format")
            elif fmt not in live:
                found.append(f"{path.name}:{line} imports {module} without declaring LIVE[{fmt!r}]")
            elif live[fmt] != current[fmt]:
                found.append(
                    f"{path.name}:{line} was written for {fmt} v{live[fmt]}, now v{current[fmt]}: "
                    f"freeze the code it needs into migrations/formats/ and import that instead"
                )
    return found


def test_migrations_import_only_frozen_formats_or_live_ones_they_declare():
    assert _migration_findings(_migrations(), _current_versions()) == []


def test_the_migrations_rule_finds_an_unfrozen_migration(tmp_path, monkeypatch):
    # The rule as the next format change meets it: 0005 as shipped, once segments are v6
    # (as 0004 met it when segments moved to v5, and froze segment_v4).
    later = {**_current_versions(), "segment": _current_versions()["segment"] + 1}
    shipped = MIGRATIONS / "0005_bound_checksums.py"
    assert any("freeze the code" in f for f in _migration_findings([shipped], later))
    # A migration importing live code it does not declare, or code that is no format.
    monkeypatch.setattr(sys.modules[__name__], "MIGRATIONS", tmp_path)
    (tmp_path / "0009_x.py").write_text(
        "def upgrade(env, txn, params):\n"
        "    from persistent_prefix_cache.disk.segment import SegmentFiles\n"
        "    from persistent_prefix_cache.disk import read_path\n"
        "    from persistent_prefix_cache.migrations.formats import segment_v3\n"
    )
    found = _migration_findings([tmp_path / "0009_x.py"], _current_versions())
    assert [f.split(" ", 2)[1:] for f in found] == [
        ["imports", "disk.segment without declaring LIVE['segment']"],
        ["imports", "disk.read_path: neither frozen nor a declared live format"],
    ]


def test_frozen_formats_import_nothing_live():
    found = [
        f"formats/{path.name}:{line} imports {module}"
        for path in sorted(FORMATS.glob("*.py"))
        for module, line in _package_imports(path)
        if not module.startswith("migrations.formats") and module not in NO_FORMAT
    ]
    assert found == []


# The bytes of every frozen module: frozen code is never edited (a fix to an old format is
# a new module beside it). A new frozen module adds its line here.
FROZEN = {
    "block_files_v2.py": "5561b8797e160bef",
    "dtypes.py": "fe6097e320b0c772",
    "segment_v3.py": "f0a7f3493bbb491e",
    "segment_v4.py": "7d009b3bf9d53e40",
}


def test_frozen_formats_never_change():
    got = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(FORMATS.glob("*.py"))
        if p.stem != "__init__"
    }
    assert got == FROZEN


def test_the_facade_fits_on_a_screen():
    # `store.py` opens, delegates and answers what it was opened with; what grows goes to
    # the wing that owns it (`core/`), never back into the facade.
    path, _ = MODULES["store"]
    assert len(path.read_text().splitlines()) <= 350
