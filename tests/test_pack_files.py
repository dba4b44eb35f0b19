"""What ``ppc import`` / ``ppc export`` say about the files they are given, what a refused
pack leaves behind, and ``-`` for stdin / stdout (issue 31, item 7).

Real files, real permissions (another user: a forked child that drops to ``nobody``, and
root without capabilities through ``setpriv``), real truncation; ``ppc`` runs as a real
subprocess, on a real pseudo-terminal where a terminal matters.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pwd
import pty
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from helpers import BLOCK, random_tokens, read_terminal

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli import main as ppc_main
from persistent_prefix_cache.cli import import_  # noqa: F401 (imported before a child drops its rights)
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.admin.pack_members import PackReader
from persistent_prefix_cache.errors import InvalidArgumentError
from persistent_prefix_cache.prefill import prefill

PPC = [sys.executable, "-m", "persistent_prefix_cache"]


def ppc(*args, expect: int, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PPC, *map(str, args)], capture_output=True, timeout=120, **kwargs)
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    assert proc.returncode == expect, (proc.returncode, proc.stdout[:200], err)
    return proc


def one_error(*args, **kwargs) -> str:
    """The one line a refused ``ppc`` command prints (exit status 2)."""
    err = ppc(*args, expect=2, **kwargs).stderr.decode()
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def on_a_terminal(args) -> tuple[str, int]:
    """Run ``ppc`` with a pseudo-terminal as stdin, stdout and stderr."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [*PPC, *map(str, args)])
    out = read_terminal(fd)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return out.decode().replace("\r\n", "\n"), os.waitstatus_to_exitcode(status)


def tree(top) -> dict:
    """Every entry under `top` with its bytes (folders: None)."""
    out = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), top)] = None
        for name in files:
            out[os.path.relpath(os.path.join(folder, name), top)] = Path(folder, name).read_bytes()
    return out


@pytest.fixture
def pack(tmp_path, model, tiny_model_dir) -> Path:
    """A store of two chains and its pack (``p.tar``), both real."""
    store = tmp_path / "src"
    with PersistentPrefixCache(store, model, block_size=BLOCK, model_path=tiny_model_dir) as handle:
        for seed in (51, 52):
            prefill(model, random_tokens(3 * BLOCK, seed=seed, first=seed - 48), handle)
    with StoreAdmin(str(store)) as admin:
        admin.export_pack(str(tmp_path / "p.tar"))
    return tmp_path / "p.tar"


def member_ends(path) -> list[tuple[str, int, int]]:
    """(name, offset of its data, end of its data) of each member of a tar file."""
    with tarfile.open(path) as tar:
        return [(m.name, m.offset_data, m.offset_data + m.size) for m in tar.getmembers()]


def cut_points(path) -> dict[str, int]:
    """Where to cut a pack, by what the cut leaves."""
    ends = member_ends(path)
    names = [name for name, _, _ in ends]
    seg = names.index(next(n for n in names if n.startswith("segments/")))
    return {
        "inside the first header": 100,
        "inside manifest.json": ends[0][1] + 20,
        "after manifest.json": ends[0][1] + 512,  # its data (one block) whole, no header after it
        "inside nodes.bin's header": ends[1][1] - 200,
        "inside a segment": (ends[seg][1] + ends[seg][2]) // 2,
        "after signature.json, before the end-of-archive marker": ends[-1][1] + 512,
    }


def test_pack_reader_tells_truncation_damage_and_other_files_apart(pack, tmp_path):
    data = pack.read_bytes()
    for where, at in cut_points(pack).items():
        (tmp_path / "cut.tar").write_bytes(data[:at])
        with pytest.raises(InvalidArgumentError, match=r"cut\.tar is truncated: ") as info:
            with PackReader(str(tmp_path / "cut.tar")) as reader:
                reader.manifest()
                reader.nodes(reader.manifest())
                while reader.next() is not None:  # every member's bytes (a stream skips unread ones)
                    pass
        assert "not a ppc export" not in str(info.value), where
    # Cut in its compressed form: truncated too.
    (tmp_path / "cut.tar.gz").write_bytes(gzip.compress(data)[: len(data) // 4])
    with pytest.raises(InvalidArgumentError, match=r"is truncated: it ends inside member segments/"):
        with PackReader(str(tmp_path / "cut.tar.gz")) as reader:
            reader.nodes(reader.manifest())
            member = reader.next()
            reader.stream(member, 1 << 30, io.BytesIO())
    # A header whose bytes were changed: damaged, not the end of the pack.
    damaged = bytearray(data)
    damaged[member_ends(pack)[1][1] - 512 + 148] ^= 0xFF  # nodes.bin's header checksum
    (tmp_path / "bad.tar").write_bytes(bytes(damaged))
    with pytest.raises(InvalidArgumentError, match=r"bad\.tar is a damaged ppc export: the header after member "):
        with PackReader(str(tmp_path / "bad.tar")) as reader:
            reader.nodes(reader.manifest())
    for content, said in ((b"", "is empty: not a ppc export"), (b"just some text\n" * 50, "is not a ppc export")):
        (tmp_path / "other").write_bytes(content)
        with pytest.raises(InvalidArgumentError, match=said):
            PackReader(str(tmp_path / "other"))


@pytest.mark.slow
def test_a_truncated_pack_says_truncated_and_leaves_nothing_behind(pack, tmp_path):
    data = pack.read_bytes()
    for where, at in cut_points(pack).items():
        (tmp_path / "cut.tar").write_bytes(data[:at])
        err = one_error("import", "--store", tmp_path / "a" / "b" / "store", tmp_path / "cut.tar", "--trust")
        assert err.startswith(f"error: {tmp_path / 'cut.tar'} is truncated: "), (where, err)
        assert err.endswith("(nothing was written; export it again, or copy the whole file)\n"), err
        assert not (tmp_path / "a").exists(), where  # nor the folders above the store it would have made
    # The tar's last bytes, past tar's end-of-archive marker, are padding: the pack is whole.
    (tmp_path / "cut.tar").write_bytes(data[: member_ends(pack)[-1][2] + 1024 + 512])
    ppc("import", "--store", tmp_path / "whole", tmp_path / "cut.tar", "--trust", expect=0)


@pytest.mark.slow
def test_a_damaged_pack_leaves_no_folder_and_an_existing_store_as_it_was(pack, tmp_path, model):
    data = bytearray(pack.read_bytes())
    name, start, end = next(m for m in member_ends(pack) if m[0].startswith("segments/"))
    data[(start + end) // 2] ^= 0x01  # one bit of KV inside a segment
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    segment = name.split("/")[1][:-4]
    line = f"error: {bad}: segment {segment} is damaged (fix the argument; nothing was written)\n"
    assert one_error("import", "--store", tmp_path / "x" / "y" / "new", bad, "--trust") == line
    assert not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()
    assert one_error("import", "--store", tmp_path / "empty", bad, "--trust") == line
    assert os.listdir(tmp_path / "empty") == []  # the folder was there: it stays, empty
    other = tmp_path / "other"  # an existing store of other blocks: as it was, no new empty folder
    with PersistentPrefixCache(other, model, block_size=BLOCK) as handle:
        prefill(model, random_tokens(2 * BLOCK, seed=53, first=9), handle)
    before = tree(other / "segments")
    assert one_error("import", "--store", other, bad, "--trust") == line
    assert tree(other / "segments") == before


@pytest.mark.slow
def test_a_directory_is_named_a_directory(pack, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    assert one_error("import", "--store", tmp_path / "t", folder) == (
        f"error: {folder} is a directory, not a pack: name a file written by `ppc export` "
        "(fix the argument; nothing was written)\n"
    )
    assert not (tmp_path / "t").exists()
    assert one_error("export", "--store", tmp_path / "src", folder) == (
        f"error: {folder} is a directory: name the file to write (e.g. {folder / 'prompts.ppc.tar'})\n"
    )
    assert one_error("export", "--store", tmp_path / "src", tmp_path / "no" / "p.tar") == (
        f"error: cannot write {tmp_path / 'no' / 'p.tar'}: no such folder {tmp_path / 'no'}\n"
    )
    assert one_error("import", "--store", tmp_path / "t", tmp_path / "missing.tar") == (
        f"error: {tmp_path / 'missing.tar'}: no such file (fix the argument; nothing was written)\n"
    )
    assert os.listdir(folder) == [] and not (tmp_path / "t").exists()


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody on this machine")


@pytest.mark.slow
def test_a_pack_this_user_cannot_read_says_permission_denied(pack):
    """As ``nobody`` (a forked child that drops to it and runs ppc's own code), and as root
    without capabilities (a real ``ppc`` under ``setpriv``), on a pack nobody may read."""
    user = _nobody()
    place = Path(tempfile.mkdtemp(prefix="ppc-unreadable-"))
    try:
        os.chmod(place, 0o777)
        unreadable = place / "p.tar"
        shutil.copy(pack, unreadable)
        os.chmod(unreadable, 0o000)
        want = (
            f"error: {unreadable}: permission denied: this user cannot read it (nothing was written; run as a user "
            "who may read it, or change its permissions)\n"
        )
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nobody from here on, ppc's code already imported
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                os.dup2(write_end, 2)
                sys.stderr = os.fdopen(2, "w")
                code = ppc_main(["import", "--store", str(place / "store"), str(unreadable)])
                sys.stderr.flush()
                os._exit(code)
            except BaseException:
                os._exit(99)
        os.close(write_end)
        with os.fdopen(read_end) as f:
            said = f.read()
        _, status = os.waitpid(pid, 0)
        assert (os.waitstatus_to_exitcode(status), said) == (2, want)
        assert sorted(os.listdir(place)) == ["p.tar"]  # no store made

        os.chown(unreadable, user.pw_uid, user.pw_gid)  # root without capabilities is not its owner
        argv = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *PPC, "import", "--store", place / "store",
                unreadable]  # fmt: skip
        proc = subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=120)
        if "setpriv" in proc.stderr:
            pytest.skip(f"setpriv does not work here: {proc.stderr.strip()}")
        assert (proc.returncode, proc.stderr) == (2, want)
        assert sorted(os.listdir(place)) == ["p.tar"]
    finally:
        shutil.rmtree(place)


@pytest.mark.slow
def test_dash_is_stdout_for_export_and_stdin_for_import(pack, tmp_path):
    src = tmp_path / "src"
    exported = ppc("export", "--store", src, "-", "--json", expect=0)
    summary = json.loads(exported.stderr)  # the summary on stderr, the pack alone on stdout
    with tarfile.open(fileobj=io.BytesIO(exported.stdout)) as tar:
        names = tar.getnames()
    with StoreAdmin(str(src), readonly=True) as admin:
        blocks = admin.summary()["blocks"]
    assert names == [name for name, _, _ in member_ends(pack)] and summary["blocks"] == blocks > 0
    text = ppc("export", "--store", src, "-", expect=0)
    assert text.stderr.decode() == (
        f"exported {blocks} block(s) of 1 model(s), {summary['bytes']:,} bytes, to stdout; signed by this store\n"
    )
    assert text.stdout[:13] == b"manifest.json"

    # A pipe from one to the other, as a shell runs it.
    exporter = subprocess.Popen([*PPC, "export", "--store", str(src), "-"], stdout=subprocess.PIPE)
    imported = ppc("import", "--store", src, "-", "--json", expect=0, stdin=exporter.stdout)
    exporter.stdout.close()
    assert exporter.wait(60) == 0
    assert json.loads(imported.stdout) == {"added": 0, "skipped": blocks, "bytes": 0, "verified": "store"}
    with open(pack, "rb") as f:
        fresh = json.loads(ppc("import", "--store", tmp_path / "t", "-", "--trust", "--json", expect=0, stdin=f).stdout)
    assert fresh["added"] == blocks
    (tmp_path / "cut.tar").write_bytes(pack.read_bytes()[:5000])
    with open(tmp_path / "cut.tar", "rb") as f:
        err = one_error("import", "--store", tmp_path / "u", "-", "--trust", stdin=f)
    assert err.startswith("error: stdin is truncated: ") and not (tmp_path / "u").exists()

    # A file named "-" is ./-
    ppc("export", "--store", src, "./-", expect=0, cwd=tmp_path)
    assert (tmp_path / "-").read_bytes()[:13] == b"manifest.json"

    # A terminal is neither where a pack goes nor where one comes from.
    said, status = on_a_terminal(["export", "--store", src, "-"])
    assert (status, said) == (
        2, "error: - writes the pack to stdout, which is a terminal: redirect it (ppc export ... - > pack.tar)\n"
    )  # fmt: skip
    said, status = on_a_terminal(["import", "--store", tmp_path / "v", "-"])
    assert (status, said) == (
        2, "error: - reads a pack from stdin, which is a terminal: pipe one in (ppc import ... - < pack.tar)\n"
    )  # fmt: skip
    assert not (tmp_path / "v").exists()
