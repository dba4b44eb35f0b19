"""The store without Linux's extra calls (`disk.portable`'s fallbacks), as on macOS.

The fallbacks are checked against the real calls here; then the restart, crash
(SIGKILL of writers at every pause point) and damage tests run again in a pytest
process whose interpreter, and every process it starts, lacks ``os.preadv``,
``os.writev``, ``os.posix_fadvise`` … and libc's ``sync_file_range``
(tests/no_linux_calls/sitecustomize.py hides them before the package is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.disk import portable

TESTS = Path(__file__).resolve().parent
HIDDEN_RUN = ["portable_check.py", "test_restart.py", "test_crash.py", "test_reliability.py"]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("sizes, offset", [([10, 20, 30], 5), ([100], 0), ([500, 500], 300), ([8, 8], 1020)])
def test_preadv_fallback_reads_what_preadv_reads(data_file, monkeypatch, sizes, offset):
    want = [bytearray(n) for n in sizes]
    got_n = os.preadv(data_file, want, offset)
    monkeypatch.setattr(portable, "HAS_PREADV", False)
    got = [bytearray(n) for n in sizes]
    assert portable.preadv(data_file, got, offset) == got_n  # short at the end of the file
    assert got == want


def test_writev_fallback_writes_every_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(portable, "HAS_WRITEV", False)
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        chunks = [b"abc", memoryview(b"defgh"), bytearray(b"")]
        assert portable.writev(fd, chunks) == 8
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abcdefgh"


@pytest.mark.parametrize("native", [True, False])
def test_pwritev_writes_every_buffer_at_its_offset(tmp_path, monkeypatch, native):
    if native and not portable.HAS_PWRITEV:
        pytest.skip("no os.pwritev here")
    monkeypatch.setattr(portable, "HAS_PWRITEV", native)
    path = tmp_path / "out"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_WRONLY)
    try:
        assert portable.pwritev(fd, [b"ab", memoryview(b"cde"), bytearray(b"")], 3) == 5
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # positional: the file offset is left alone
    finally:
        os.close(fd)
    assert path.read_bytes() == b"012abcde89"


def test_durable_fsync_uses_full_fsync_where_there_is_one(monkeypatch, data_file):
    calls = []

    class FakeFcntl:  # macOS's fcntl: F_FULLFSYNC flushes the drive's cache too
        def __init__(self, fails):
            self.fails = fails

        def fcntl(self, fd, op):
            calls.append(("F_FULLFSYNC", fd, op))
            if self.fails:
                raise OSError(45, "Operation not supported")  # some file systems

    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)))
    monkeypatch.setattr(portable, "_FULLFSYNC", 51)
    monkeypatch.setattr(portable, "fcntl", FakeFcntl(fails=False))
    portable.durable_fsync(data_file)
    assert calls == [("F_FULLFSYNC", data_file, 51)]
    calls.clear()
    monkeypatch.setattr(portable, "fcntl", FakeFcntl(fails=True))
    portable.durable_fsync(data_file)
    assert calls == [("F_FULLFSYNC", data_file, 51), ("fsync", data_file)]
    calls.clear()
    monkeypatch.setattr(portable, "_FULLFSYNC", None)  # Linux: fsync is durable
    portable.durable_fsync(data_file)
    assert calls == [("fsync", data_file)]


def test_start_writeback_is_optional(monkeypatch, data_file):
    monkeypatch.setattr(portable, "_SYNC_FILE_RANGE", None)
    portable.start_writeback(data_file)  # nothing to do, and no error


@pytest.mark.slow
def test_restart_crash_and_damage_tests_pass_without_the_linux_calls(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS / "no_linux_calls"), str(TESTS.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("PPC_TEST_HOOKS", None)  # its linux_calls_hidden= must come from sitecustomize
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "run"),
         *[str(TESTS / name) for name in HIDDEN_RUN]],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
