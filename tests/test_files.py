"""Files created and opened so that nobody can redirect them (``files.py``), the store's
folders by descriptor (``disk/store_dir.py``), and LMDB's page walk (``disk/index_pages.py``).

Real files, real symbolic links, real FIFOs, real LMDB environments. The attacks by
another user on a real group store are in ``tests/test_hostile_member.py``.
"""

from __future__ import annotations

import os
import stat
import threading

import lmdb
import pytest

from persistent_prefix_cache.disk import index_pages
from persistent_prefix_cache.disk.store_dir import TempFile, create_root, folder_fd, remove_entry
from persistent_prefix_cache.files import (
    NotRegularFileError,
    create_exclusive,
    create_temp,
    open_folder,
    open_regular,
    pid_of_temp,
    replace_beside,
    temp_name,
)


@pytest.fixture
def victim(tmp_path):
    """A file outside every store that nothing may change: (path, its bytes, its stat)."""
    path = tmp_path / "victim"
    path.write_bytes(b"root only\n")
    os.chmod(path, 0o600)
    return path


def assert_unchanged(path, content=b"root only\n", mode=0o600):
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode
    assert path.read_bytes() == content


# -- creating ---------------------------------------------------------------------------------


def test_temporary_names_are_unpredictable_and_carry_the_pid():
    names = {temp_name("ab" * 16) for _ in range(1000)}
    assert len(names) == 1000
    assert {pid_of_temp(n) for n in names} == {os.getpid()}
    assert pid_of_temp("costs.json") is None and pid_of_temp("x.12.y.tmp.gz") is None


def test_an_exclusive_create_never_goes_through_a_link(tmp_path, victim):
    link = tmp_path / "planted"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_exclusive(str(link), 0o600)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(FileExistsError):
        create_exclusive(str(dangling), 0o600)
    assert not (tmp_path / "would-be-created").exists()
    assert_unchanged(victim)


def test_an_exclusive_create_sets_the_mode_whatever_the_umask(tmp_path):
    saved = os.umask(0o077)
    try:
        fd = create_exclusive(str(tmp_path / "f"), 0o660)
        os.close(fd)
        fd, path = create_temp(str(tmp_path), "stem", 0o640)
        os.close(fd)
    finally:
        os.umask(saved)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o660
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and pid_of_temp(os.path.basename(path)) == os.getpid()


def test_replace_beside_replaces_a_link_at_the_name_and_never_writes_its_target(tmp_path, victim):
    out = tmp_path / "out.tar"
    out.symlink_to(victim)
    replace_beside(str(out), lambda f: f.write(b"new"), mode=0o600)
    assert not out.is_symlink() and out.read_bytes() == b"new"
    assert_unchanged(victim)
    assert sorted(os.listdir(tmp_path)) == ["out.tar", "victim"]  # no temporary file left


# -- opening ----------------------------------------------------------------------------------


def test_open_regular_refuses_links_fifos_and_folders_without_blocking(tmp_path, victim):
    link = tmp_path / "link"
    link.symlink_to(victim)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = []

    def attempt():
        for p in (link, fifo, tmp_path):
            with pytest.raises(NotRegularFileError):
                open_regular(str(p))
            done.append(p)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert len(done) == 3, "an open blocked (a FIFO without a writer)"
    fd = open_regular(str(victim))
    try:
        assert os.read(fd, 100) == b"root only\n"
        assert os.get_blocking(fd)  # blocking mode again
    finally:
        os.close(fd)


def test_open_folder_refuses_a_link_unless_asked_to_follow(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(NotRegularFileError):
        open_folder(str(tmp_path / "link"))
    os.close(open_folder(str(tmp_path / "link"), follow=True))


# -- the store's folders -----------------------------------------------------------------------


def test_store_folders_are_opened_without_following_links(tmp_path, victim):
    store = tmp_path / "store"
    create_root(str(store))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ab").mkdir()
    (store / "segments").mkdir()
    (store / "segments" / "ab").symlink_to(outside / "ab")
    (outside / "ab" / "file.seg").write_bytes(b"x")
    with pytest.raises(NotRegularFileError):
        folder_fd(str(store), "segments/ab")
    assert remove_entry(str(store), "segments/ab/file.seg") is False
    assert (outside / "ab" / "file.seg").exists()
    assert remove_entry(str(store), "segments/ab") is True  # the link itself
    assert (outside / "ab").is_dir() and not (store / "segments" / "ab").exists()
    (store / "tmp").symlink_to(outside)
    with pytest.raises(NotRegularFileError):
        TempFile(str(store), "tmp", "ab" * 16)
    assert sorted(os.listdir(outside)) == ["ab"]
    assert_unchanged(victim)


def test_a_temporary_file_is_private_and_moves_into_place_by_descriptor(tmp_path):
    store = tmp_path / "store"
    create_root(str(store))
    tmp = TempFile(str(store), "tmp", "cafe")
    os.write(tmp.fd, b"data")
    assert stat.S_IMODE(os.fstat(tmp.fd).st_mode) == 0o600
    target = folder_fd(str(store), "segments/ca", create=True)
    try:
        tmp.move_to(target, "cafe.seg")
    finally:
        os.close(target)
    assert (store / "segments" / "ca" / "cafe.seg").read_bytes() == b"data"
    assert os.listdir(store / "tmp") == []
    assert stat.S_IMODE(os.stat(store / "segments" / "ca").st_mode) == 0o700


# -- LMDB's pages -------------------------------------------------------------------------------


def _walked(path) -> tuple[index_pages.Meta, int, int]:
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        meta = index_pages.read_meta(fd)
        return meta, size, index_pages.pages_in_use(fd, meta, size)
    finally:
        os.close(fd)


def test_the_page_walk_finds_every_page_lmdb_uses(tmp_path):
    env = lmdb.open(str(tmp_path), map_size=1 << 28, max_dbs=4)
    sub = env.open_db(b"named")  # a named database (schemas v1-v2 had them)
    keys = [os.urandom(17) for _ in range(6000)]
    with env.begin(write=True) as txn:
        for i, k in enumerate(keys):
            txn.put(k, os.urandom(40 + i % 300))
            txn.put(k, b"v" * 10, db=sub)
        txn.put(b"big", os.urandom(50_000))  # overflow pages
    for step in range(6):
        with env.begin(write=True) as txn:
            for k in keys[step * 900 : (step + 1) * 900]:
                txn.delete(k)
        meta, size, need = _walked(tmp_path)
        info = env.info()
        assert meta.last_pgno == info["last_pgno"] and meta.psize == env.stat()["psize"]
        assert need <= info["last_pgno"] + 1 and need * meta.psize <= size
    # Truncating away a page in use is found: the walk never reads past the end.
    with open(tmp_path / "data.mdb", "r+b") as f:
        f.truncate((need - 1) * meta.psize)
    meta, size, need_after = _walked(tmp_path)
    assert need_after * meta.psize > size
    env.close()


def test_a_damaged_tree_is_damage_not_a_hang(tmp_path):
    env = lmdb.open(str(tmp_path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"%08d" % i, b"x" * 100)
    env.close()
    meta, size, _ = _walked(tmp_path)
    root = meta.roots[1]
    with open(tmp_path / "data.mdb", "r+b") as f:  # the root branch points at itself
        f.seek(root * meta.psize + 10)
        f.write(b"\x01\x00")  # flags: a branch
        f.seek(root * meta.psize + 12)
        f.write((16 + 2).to_bytes(2, "little"))  # one node
        f.seek(root * meta.psize + 16)
        f.write((100).to_bytes(2, "little"))
        f.seek(root * meta.psize + 100)
        f.write(int(root & 0xFFFF).to_bytes(2, "little") + int(root >> 16 & 0xFFFF).to_bytes(2, "little"))
        f.write(b"\x00\x00\x01\x00x")
    with pytest.raises(index_pages.DamagedPages):
        fd = os.open(tmp_path / "data.mdb", os.O_RDONLY)
        try:
            index_pages.pages_in_use(fd, meta, os.fstat(fd).st_size)
        finally:
            os.close(fd)
