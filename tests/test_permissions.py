"""Private by default, and typed errors for stores that cannot be written or are no stores.

Real files, real umasks, real LMDB; the unwritable stores are made two ways, as a user
meets them: a read-only bind mount in a private mount namespace (``unshare -m``, as
root), and another user's files. "Another user" is run two ways: the real ``nobody``
(``setpriv --reuid``), which needs this checkout and its venv readable by ``nobody``
(skipped with the reason where they are not, e.g. under ``make test``'s private
folder), and root without any capability (``setpriv --bounding-set=-all``) on files
owned by ``nobody``: the kernel then checks uid 0 as it checks any user that is not the
owner, and the process still reads the checkout wherever it lives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import prefill, random_tokens
from persistent_prefix_cache import (
    InvalidArgumentError,
    PersistentLRUPromptCache,
    PersistentPrefixCache,
    PrefixCacheError,
    PrefixCacheManager,
    StorePathError,
)
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.admin.store_audit import exposed

BLOCK = 16
NOBODY = 65534
CHECKOUT = Path(__file__).resolve().parent.parent


# -- helpers -----------------------------------------------------------------------------------------


def tree(root) -> dict[str, tuple[int, str]]:
    """Every entry under `root` (itself included): (mode, sha1 of a file's bytes); each
    user's private folder ``index/lmdb-open-<uid>`` left out (see `modes`)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        if os.path.basename(folder).startswith("lmdb-open-"):
            continue
        out[os.path.relpath(folder, root)] = (os.lstat(folder).st_mode, "")
        for name in files:
            p = os.path.join(folder, name)
            out[os.path.relpath(p, root)] = (os.lstat(p).st_mode, hashlib.sha1(Path(p).read_bytes()).hexdigest())
    return out


def modes(root) -> set[tuple[str, str]]:
    """The distinct (kind, octal mode) of a store's entries (less each user's private,
    empty folder ``index/lmdb-open-<uid>``, where LMDB's files are pinned while it opens
    them: made 0700 by every open, see disk/index_files.py; and the pack key: always 0600)."""
    out = set()
    for folder, dirs, files in os.walk(root):
        if os.path.basename(folder).startswith("lmdb-open-"):
            assert not files  # empty: the links go as soon as LMDB has the files open
            continue
        out.add(("dir", f"{stat.S_IMODE(os.stat(folder).st_mode):04o}"))
        files = [f for f in files if not (f == "pack.key" and os.path.samefile(folder, root))]
        out |= {("file", f"{stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode):04o}") for f in files}
    return out


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    saved = os.umask(0o022)
    os.umask(saved)  # read without changing it
    yield lambda value: os.umask(value)
    os.umask(saved)


@pytest.fixture
def open_root():
    """A folder every user can enter (pytest's tmp folders are private to root)."""
    root = tempfile.mkdtemp(prefix="ppc-perms-")
    os.chmod(root, 0o755)
    try:
        yield Path(root)
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", root], check=False)
        shutil.rmtree(root, ignore_errors=True)


def fill(path, model, *, seed: int = 900, **options) -> list[int]:
    """Store one prompt of three blocks and a bit; return its tokens."""
    tokens = random_tokens(3 * BLOCK + 5, seed=seed, first=1)
    with PersistentPrefixCache(path, model, block_size=BLOCK, sync_writes=True, **options) as store:
        store.store(tokens, prefill(model, tokens)[1])
    return tokens


def ppc_argv(*args) -> list[str]:
    return [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)]


# How a command runs against an unwritable store (see the module docstring).
_READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'


def _probe(argv: list[str], cwd) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]


class Runner:
    """Runs argv so that `target` (a folder) cannot be written: ``how`` is
    ``read-only mount``, ``nobody`` or ``no capabilities``."""

    def __init__(self, how: str, root: Path):
        self.how, self.root = how, root

    def prepare(self, target: Path) -> None:
        """Make `target` another user's (for the two ways of "another user")."""
        if self.how == "no capabilities":
            subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(target)], check=True)
        elif self.how == "nobody":
            os.chown(target, 0, 0)

    def argv(self, argv: list[str], target: Path) -> list[str]:
        if self.how == "read-only mount":
            return ["unshare", "-m", "--propagation", "private", "sh", "-c", _READ_ONLY_MOUNT, str(target), *argv]
        if self.how == "nobody":
            return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *argv]

    def run(self, argv: list[str], target: Path, timeout: float = 180) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
        return subprocess.run(
            self.argv(argv, target), capture_output=True, text=True, timeout=timeout, cwd=self.root, env=env
        )


@pytest.fixture(params=["read-only mount", "nobody", "no capabilities"])
def runner(request, open_root) -> Runner:
    """Each way of meeting an unwritable store that works here (skipped with why)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a bind mount, another user)")
    how = request.param
    probe_dir = open_root / "probe"
    probe_dir.mkdir()
    r = Runner(how, open_root)
    probe = [sys.executable, "-c", "import persistent_prefix_cache.admin.store_admin"]
    why = _probe(r.argv(probe, probe_dir), open_root)
    if why is not None and how == "nobody":
        pytest.skip(f"user nobody cannot run this checkout's venv ({why}): the no-capabilities run covers it")
    if why is not None:
        pytest.skip(f"{how} does not work on this machine: {why}")
    probe_dir.rmdir()
    return r


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


# -- 1. private by default ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["umask022", "umask002"])
def test_a_new_store_is_private_whatever_the_umask(tmp_path, model, umask, mask):
    umask(mask)
    store = tmp_path / "store"
    tokens = fill(store, model)
    with StoreAdmin(store, readonly=True) as admin:
        admin.export_pack(str(store / "pack.tar"))  # a pack holds the prompts too
    imported = tmp_path / "imported"
    with StoreAdmin(imported, create=True, block_size=BLOCK) as admin:
        assert admin.import_pack(str(store / "pack.tar"), trust=True)["added"] == 4
    for root in (store, imported):
        assert modes(root) == {("dir", "0700"), ("file", "0600")}, root
        assert exposed(root) == []
    # A later writer under another umask keeps the store's modes.
    umask(0o000)
    with PersistentPrefixCache(store, model, sync_writes=True) as handle:
        more = tokens[:BLOCK] + random_tokens(2 * BLOCK, seed=901, first=2)
        handle.store(more, prefill(model, more)[1])
    assert modes(store) == {("dir", "0700"), ("file", "0600")}


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_a_shared_store_gives_its_group_read_write_never_others(tmp_path, model, umask, mask):
    umask(mask)
    store = tmp_path / "shared"
    fill(store, model, shared=True)
    assert modes(store) == {("dir", "2770"), ("file", "0660")}
    # shared=True does not change an existing private store (and vice versa).
    private = tmp_path / "private"
    fill(private, model)
    fill(private, model, seed=902, shared=True)
    assert modes(private) == {("dir", "0700"), ("file", "0600")}
    fill(store, model, seed=903)
    assert modes(store) == {("dir", "2770"), ("file", "0660")}
    # ppc's --store-shared does the same for a store it creates.
    with StoreAdmin(store, readonly=True) as admin:
        admin.export_pack(str(tmp_path / "pack.tar"))
    assert stat.S_IMODE(os.stat(store / "pack.key").st_mode) == 0o600  # the group may not sign packs
    proc = subprocess.run(
        ppc_argv("import", tmp_path / "pack.tar", "--store-shared", "--store", tmp_path / "imported", "--trust"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert modes(tmp_path / "imported") == {("dir", "2770"), ("file", "0660")}
    with pytest.raises(InvalidArgumentError):
        PersistentPrefixCache(tmp_path / "never", model, shared="yes")
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_ppc_check_warns_about_a_store_others_can_read_and_fix_makes_it_private(tmp_path, model, umask):
    umask(0o022)
    store = tmp_path / "old"
    tokens = fill(store, model)
    # A store made before stores were private: the umask decided (0755 / 0644).
    subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(store)], check=True)
    with PersistentPrefixCache(store, model, sync_writes=True) as handle:
        more = random_tokens(2 * BLOCK, seed=904, first=3)
        handle.store(more, prefill(model, more)[1])
    # Existing stores keep their modes: old and new files alike, until the user asks.
    assert modes(store) == {("dir", "0755"), ("file", "0644")}
    proc = subprocess.run(ppc_argv("check", "--store", store), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "open to other users" in proc.stdout and "--fix" in proc.stdout and "index/data.mdb 0644" in proc.stdout
    proc = subprocess.run(ppc_argv("check", "--json", "--store", store), capture_output=True, text=True)
    found = json.loads(proc.stdout)["permissions"]
    assert found["exposed"] == len(tree(store)) and found["made_private"] == 0
    proc = subprocess.run(ppc_argv("check", "--fix", "--store", store), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"made {len(tree(store))} file(s)/folder(s) private" in proc.stdout
    assert modes(store) == {("dir", "0700"), ("file", "0600")}
    proc = subprocess.run(ppc_argv("check", "--store", store), capture_output=True, text=True)
    assert "open to other users" not in proc.stdout and "clean" in proc.stdout
    # --store-shared turns it into a group store instead; the store still serves.
    proc = subprocess.run(
        ppc_argv("check", "--fix", "--store-shared", "--store", store), capture_output=True, text=True
    )
    assert proc.returncode == 0 and modes(store) == {("dir", "2770"), ("file", "0660")}
    with PersistentPrefixCache(store, model) as handle:
        assert handle.fetch(tokens)[0] is not None


# -- 3. library entry points: no store here ------------------------------------------------------------


def _entry_points(model):
    """Each library entry point that takes a store path, as a function of the path."""

    def lru(path):
        # mlx-lm's interface has no model: the store comes from an opener, whose typed
        # error the cache reports once (memory only) rather than raising in a server.
        opened = []
        cache = PersistentLRUPromptCache(lambda key: opened.append(key) or PersistentPrefixCache(path, model))
        try:
            assert cache.store_for("m") is None and opened == ["m"]
        finally:
            cache.close()
        PersistentPrefixCache(path, model)  # what the opener raised, for the assertion

    return {
        "PersistentPrefixCache": lambda p: PersistentPrefixCache(p, model),
        "readonly": lambda p: PersistentPrefixCache(p, model, readonly=True),
        "PrefixCacheManager": lambda p: PrefixCacheManager(model, store=p),
        "StoreAdmin(create)": lambda p: StoreAdmin(p, create=True),
        "PersistentLRUPromptCache": lru,
    }


@pytest.mark.parametrize("case", ["a file", "under a file", "a folder of other files", "a tmp/ of other files"])
def test_no_library_entry_point_makes_a_store_among_other_files(tmp_path, model, case):
    target = tmp_path / "target"
    if case == "a file":
        target.write_text("my notes")
    elif case == "under a file":
        (tmp_path / "file").write_text("my notes")
        target = tmp_path / "file" / "store"
    elif case == "a folder of other files":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
        (target / "segments").mkdir()  # a store's name among them does not make it one
    else:
        (target / "tmp").mkdir(parents=True)
        (target / "tmp" / "draft.txt").write_text("mine")
    before = tree(tmp_path)
    for name, open_at in _entry_points(model).items():
        with pytest.raises(StorePathError) as caught:
            open_at(target)
        assert isinstance(caught.value, PrefixCacheError) and caught.value.hint, name
        assert "nothing was created" in str(caught.value) or "no store" in str(caught.value), (name, caught.value)
        assert tree(tmp_path) == before, name


def test_a_creation_killed_midway_is_finished_by_the_next_open(tmp_path, model):
    store = tmp_path / "store"
    (store / "segments" / "ab").mkdir(parents=True)
    (store / "tmp").mkdir()
    (store / "tmp" / "0123.77.1.tmp").write_bytes(b"half a segment")
    tokens = fill(store, model)
    with PersistentPrefixCache(store, model) as handle:
        assert handle.fetch(tokens)[0] is not None


def test_lru_prompt_cache_reports_a_store_that_cannot_open_once(tmp_path, model, caplog):
    (tmp_path / "file").write_text("x")
    before = tree(tmp_path)
    with pytest.raises(InvalidArgumentError, match="PersistentPrefixCache or a callable"):
        PersistentLRUPromptCache(tmp_path / "file")  # it takes a store or an opener, never a path
    cache = PersistentLRUPromptCache(lambda key: PersistentPrefixCache(tmp_path / "file", model))
    with caplog.at_level(logging.WARNING):
        assert cache.store_for("m") is None and cache.store_for("m") is None
    assert [r.getMessage() for r in caplog.records if "is a file" in r.getMessage()] and len(caplog.records) == 1
    cache.close()
    assert tree(tmp_path) == before


_LIBRARY_SCRIPT = """
import json, sys
from persistent_prefix_cache import PersistentPrefixCache, PrefixCacheManager, PrefixCacheError
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.tiny_model import load_tiny_model
model = load_tiny_model(sys.argv[1])
out = {}
for path in sys.argv[2:]:
    for name, open_at in (
        ("PersistentPrefixCache", lambda p: PersistentPrefixCache(p, model)),
        ("PrefixCacheManager", lambda p: PrefixCacheManager(model, store=p)),
        ("StoreAdmin(create)", lambda p: StoreAdmin(p, create=True)),
    ):
        try:
            open_at(path)
            out[f"{name} {path}"] = "opened"
        except PrefixCacheError as exc:
            out[f"{name} {path}"] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_library_entry_points_refuse_an_unwritable_place_and_create_nothing(runner, open_root, tiny_model_dir):
    model_dir = open_root / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    subprocess.run(["chmod", "-R", "a+rX", str(model_dir)], check=True)
    target = open_root / "target"
    target.mkdir(mode=0o755)
    (target / "empty").mkdir(mode=0o755)
    runner.prepare(target)
    before = tree(open_root)
    proc = runner.run(
        [sys.executable, "-c", _LIBRARY_SCRIPT, str(model_dir), str(target / "new" / "store"), str(target / "empty")],
        target,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    for where, result in results.items():
        assert result != "opened" and result[0] == "StoreNotWritableError", (where, result)
        assert "cannot create store" in result[1] and "give a directory you can write" in result[1], result
        if runner.how == "read-only mount":
            assert "read-only file system" in result[1]
    assert tree(open_root) == before


# -- 2. commands on a store this user cannot write ------------------------------------------------------


@pytest.mark.slow
def test_commands_on_an_unwritable_store_end_in_one_error_line(runner, open_root, model, legacy, tiny_model_dir):
    store = open_root / "target" / "store"
    fill(store, model)
    shutil.copytree(tiny_model_dir, open_root / "model")
    (open_root / "prompt.txt").write_text("a prompt for a store that cannot take it")
    old = open_root / "target" / "old"  # schema v1: ppc migrate has work to do
    shutil.copytree(legacy["v1"], old)
    with StoreAdmin(store, readonly=True) as admin:
        admin.export_pack(str(open_root / "pack.tar"))
    subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(open_root)], check=True)  # readable, not writable
    (open_root / "out").mkdir(mode=0o777)
    os.chmod(open_root / "out", 0o777)
    runner.prepare(open_root / "target")
    before = tree(open_root / "target")
    writes = {
        "check --fix": ["check", "--fix", "--store", store],
        "gc": ["gc", "--max-bytes", "0", "--store", store],
        "migrate": ["migrate", "--store", old],
        "import": ["import", open_root / "pack.tar", "--store", store],
        "import (new store)": ["import", open_root / "pack.tar", "--store", open_root / "target" / "new"],
        "precompute": ["precompute", "--model", open_root / "model", "--store", store, open_root / "prompt.txt"],
    }
    why = "read-only file system" if runner.how == "read-only mount" else "not writable by this user"
    for name, args in writes.items():
        proc = runner.run(ppc_argv(*args), open_root / "target")
        assert_one_error_line(proc, why)
        remedy = {
            "import (new store)": "give a directory you can write",
            "precompute": "give a store directory you can write to",
        }.get(name, "copy it to a directory you can write")
        assert remedy in proc.stderr, (name, proc.stderr)
    # What only reads works as it is.
    reads = {
        "stats": ["stats", "--store", store],
        "inspect": ["inspect", "--store", store],
        "check": ["check", "--store", store],
        "export": ["export", "--store", store, open_root / "out" / "pack.tar"],
        "migrate (nothing to do)": ["migrate", "--store", store],
        "migrate --dry-run": ["migrate", "--dry-run", "--store", old],
    }
    for name, args in reads.items():
        proc = runner.run(ppc_argv(*args), open_root / "target")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr)
    assert tree(open_root / "target") == before


@pytest.mark.slow
def test_another_users_private_store_is_named_so(runner, open_root, model):
    if runner.how == "read-only mount":
        pytest.skip("a read-only mount of one's own store is readable")
    store = open_root / "target"
    fill(store, model)
    runner.prepare(store)  # nobody's private store, or root's private store for nobody
    for args in (["stats", "--store", store], ["gc", "--max-bytes", "0", "--store", store]):
        proc = runner.run(ppc_argv(*args), store)
        assert_one_error_line(proc, "this user cannot open it (mode 0700", "run as the store's owner")
