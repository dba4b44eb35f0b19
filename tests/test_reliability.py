"""Damaged block files, unwritable stores, schema versions and bad arguments.

test_store.py already covers a truncated, emptied, deleted or swapped block file and a
flipped tensor byte under an unchanged record, read-only handles, a newer schema and
the common bad arguments; this module adds what is missing:

- every structural damage the strict decoder exists for, first under the original
  record (the checksum catches it) and then with the record's size and checksum
  rewritten to match the damaged file, as if the writer itself were buggy, so that the
  decoder is what must catch it;
- a store the process cannot write (a read-only bind mount, in a real subprocess);
- an older schema migrated on open, refused untouched read-only, and a writer killed
  in the middle of its migration;
- the bad arguments test_store.py does not try.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest
from helpers import (
    BLOCK,
    assert_same_logits,
    assert_tree_consistent,
    cold_logits,
    flip_block_byte,
    nodes_by_position,
    prefill,
    random_tokens,
    read_index,
    segment_files,
    segment_path,
    warm_logits,
)
from mlx_lm.models.cache import make_prompt_cache
from store_worker import Worker

from persistent_prefix_cache import (
    InvalidArgumentError,
    PersistentPrefixCache,
)
from persistent_prefix_cache.disk.segment import SegmentFiles
from persistent_prefix_cache.disk.segment_header import DIGEST_MARK, header_digest
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.admin import StoreAdmin


def assert_fetch(store, model, query, matched: int) -> None:
    """`query` restores exactly `matched` tokens and continues like a cold prefill."""
    cache, remaining = store.fetch(query)
    assert len(query) - len(remaining) == matched
    assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, query))


def _snapshot(root) -> dict:
    """Hash of every file but LMDB's lock file (its reader table changes on open)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name != "lock.mdb":
                with open(os.path.join(folder, name), "rb") as f:
                    out[os.path.relpath(os.path.join(folder, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- 3. damaged block files ------------------------------------------------------------------


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, body: bytes) -> bytes:
    """A segment with this header, its header digest made to fit (as a buggy writer
    would have written it): only the structural checks can catch the damage."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    at = head.find(DIGEST_MARK)
    if at >= 0:
        at += len(DIGEST_MARK)
        head = head[:at] + f"{header_digest(head[:at] + b'0' * 16 + head[at + 16 :]):016x}".encode() + head[at + 16 :]
    return head + body


def _fields(header: dict) -> list[dict]:
    """The safetensors entries of a segment's sliced fields, in data order."""
    names = json.loads(header["__metadata__"]["fields"])
    return sorted((header[name] for name in names), key=lambda e: e["data_offsets"][0])


# A sliced field's shape: [batch, heads, tokens, width].
BATCH, HEADS, TOKENS, WIDTH = range(4)


def truncated_body(data: bytes) -> bytes:
    return data[:-7]


def empty(data: bytes) -> bytes:
    return b""


def truncated_header(data: bytes) -> bytes:
    return data[: 8 + int.from_bytes(data[:8], "little") // 2]


def header_length_absurd(data: bytes) -> bytes:
    return (2**62).to_bytes(8, "little") + data[8:]


def invalid_json(data: bytes) -> bytes:
    return data[:8] + b"#" + data[9:]  # the header's opening brace


def unknown_dtype(data: bytes) -> bytes:
    header, body = _split(data)
    _fields(header)[0]["dtype"] = "F33"
    return _join(header, body)


def shape_not_matching_bytes(data: bytes) -> bytes:
    header, body = _split(data)
    _fields(header)[0]["shape"][WIDTH] -= 1
    return _join(header, body)


def trailing_bytes(data: bytes) -> bytes:
    return data + bytes(8)


def overlapping_offsets(data: bytes) -> bytes:
    # Every field reads the first field's bytes (all have one shape here).
    header, body = _split(data)
    fields = _fields(header)
    first, end = fields[0]["data_offsets"]
    for f in fields:
        f["data_offsets"] = [first, end]
    return _join(header, body[first:end])


def metadata_not_an_object(data: bytes) -> bytes:
    header, body = _split(data)
    header["__metadata__"] = "ppc-segment/5"
    return _join(header, body)


def deeply_nested_header(data: bytes) -> bytes:
    text = b"[" * 100_000 + b"]" * 100_000  # valid JSON, 100k levels deep
    return len(text).to_bytes(8, "little") + text + _split(data)[1]


# Damage to the structure of the segment holding the victim (alone in its segment).
STRUCTURAL = [
    truncated_body,
    empty,
    truncated_header,
    header_length_absurd,
    invalid_json,
    unknown_dtype,
    shape_not_matching_bytes,
    trailing_bytes,
    overlapping_offsets,
    metadata_not_an_object,
    deeply_nested_header,
]


def well_formed_but_wrong_dtype(data: bytes) -> bytes:
    # Parses cleanly: the first half of every field's bytes, read as float16.
    header, body = _split(data)
    parts, offset = [], 0
    for f in _fields(header):
        a, b = f["data_offsets"]
        half = body[a : a + (b - a) // 2]
        f["dtype"], f["data_offsets"] = "F16", [offset, offset + len(half)]
        parts.append(half)
        offset += len(half)
    return _join(header, b"".join(parts))


def well_formed_but_wrong_shape(data: bytes) -> bytes:
    header, body = _split(data)
    for f in _fields(header):
        f["shape"][HEADS], f["shape"][WIDTH] = f["shape"][WIDTH], f["shape"][HEADS]
    return _join(header, body)


@pytest.fixture
def three_blocks(store_dir, model, separate_segments):
    """A store holding one prompt of three full blocks, each alone in its segment;
    returns the prompt."""
    tokens = random_tokens(3 * BLOCK, seed=300)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for n in (BLOCK, 2 * BLOCK, 3 * BLOCK):
            store.store(tokens[:n], prefill(model, tokens[:n])[1])
            store.flush()  # else stores queued behind the writer join one segment
    return tokens


def _damage(store_dir, node, damage, *, rewrite_record: bool) -> None:
    """Damage `node`'s segment; with `rewrite_record`, make its record describe the
    damage (size and checksum of what the segment now holds for it, where the header
    still tells), as a buggy writer would have."""
    path = segment_path(store_dir, node)
    with open(path, "rb") as f:
        bad = damage(f.read())
    with open(path, "wb") as f:
        f.write(bad)
    if not rewrite_record:
        return
    seg = SegmentFiles(str(store_dir), readonly=True).open(node.segment)
    if seg is None:
        return  # nothing a writer could have described
    try:
        i = seg.block_index(node)
        assert i is not None
        pieces = {f.name: bytearray(f.nbytes) for f in seg.fields_of(i)}
        for f in seg.fields_of(i):
            assert seg.read_rows(f, i, i + 1, [memoryview(pieces[f.name])], [0], f.nbytes // f.rows)
        step = {name: len(b) // seg.fields[name].rows for name, b in pieces.items()}
        node.checksum = seg.block_digest(
            i, lambda f, r: memoryview(pieces[f.name])[r * step[f.name] : (r + 1) * step[f.name]], node
        )
        size_before, node.size = node.size, sum(len(b) for b in pieces.values())
    finally:
        seg.close()
    # The header's record of the block says so too.
    with open(path, "rb") as f:
        header, body = _split(f.read())
    records = json.loads(header["__metadata__"]["blocks"])
    records[i][5], records[i][6] = node.size, f"{node.checksum:016x}"
    header["__metadata__"]["blocks"] = json.dumps(records, separators=(",", ":"))
    with open(path, "wb") as f:
        f.write(_join(header, body))
    index = Index(os.path.join(store_dir, "index"))

    def rewrite(w):
        w._add_meta(b"bytes", node.size - size_before)  # the writer recorded what it wrote
        w._put(node)

    try:
        index.write(rewrite)
    finally:
        index.close()


def _assert_damage_is_a_counted_miss(store_dir, model, tokens, problem: str) -> None:
    # Maintenance sees it first, without raising.
    with StoreAdmin(str(store_dir), readonly=True) as admin:
        report = admin.check()
    assert [p[0] for p in report.problems] == [problem]
    query = tokens + [1, 2, 3]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert_fetch(store, model, query, BLOCK)  # the block before the damage serves
        assert store.stats()["corrupt"] == 1
        store.flush()
    # The damaged block and the one after it are gone, files included.
    nodes = assert_tree_consistent(store_dir)
    assert [n.position for n in nodes.values()] == [0]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert_fetch(store, model, query, BLOCK)
        assert store.stats()["corrupt"] == 0  # removed: never read again


@pytest.mark.parametrize("rewrite_record", [False, True], ids=["record_as_written", "record_describing_damage"])
@pytest.mark.parametrize("damage", STRUCTURAL, ids=lambda f: f.__name__)
def test_structural_damage_is_caught_by_the_decoder(store_dir, model, three_blocks, damage, rewrite_record):
    victim = nodes_by_position(store_dir)[1]
    _damage(store_dir, victim, damage, rewrite_record=rewrite_record)
    _assert_damage_is_a_counted_miss(store_dir, model, three_blocks, "file does not decode")


def test_a_flipped_byte_is_caught_by_the_checksum(store_dir, model, three_blocks):
    victim = nodes_by_position(store_dir)[1]
    flip_block_byte(store_dir, victim, piece=1, at=5)
    _assert_damage_is_a_counted_miss(store_dir, model, three_blocks, "file size or checksum mismatch")


@pytest.mark.parametrize(
    "damage, victim",
    [
        (well_formed_but_wrong_dtype, 0),
        (well_formed_but_wrong_dtype, 1),
        (well_formed_but_wrong_shape, 1),
    ],
    ids=["wrong_dtype_first_block", "wrong_dtype_second_block", "wrong_shape_second_block"],
)
def test_tensors_not_fitting_the_layout_are_a_counted_miss(store_dir, model, three_blocks, damage, victim):
    node = nodes_by_position(store_dir)[victim]
    _damage(store_dir, node, damage, rewrite_record=True)
    query = three_blocks[: (victim + 1) * BLOCK] + [1, 2, 3]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert_fetch(store, model, query, victim * BLOCK)  # the intact blocks serve
        assert store.stats()["corrupt"] == 1


# -- 7. a store this process cannot write -------------------------------------------------------


def _readonly_mount(folder: str) -> list[str] | None:
    """A command prefix that runs a program in a private mount namespace where `folder`
    is a read-only bind mount: even root cannot write there (chmod does not stop root),
    and the program needs no other user's rights, so the test does not depend on who
    may read the checkout or the venv. None where that cannot be had."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", folder, "true"],
        capture_output=True,
    )
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", folder]


@pytest.mark.slow
def test_unwritable_store_serves_hits_and_warns_once(tmp_path, model, tiny_model_dir):
    store_dir = str(tmp_path / "store")
    a = random_tokens(2 * BLOCK + 5, seed=310, first=1)
    p = random_tokens(BLOCK + 3, seed=311, first=2)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(a, prefill(model, a)[1])
    wrap = _readonly_mount(store_dir)
    if wrap is None:
        pytest.skip("needs root and unshare(1) with mount namespaces for a read-only bind mount")
    before = _snapshot(store_dir)
    steps = [["fetch", a], ["store", p], ["store", p], ["flush"], ["fetch", p], ["stats"]]
    results = {}
    for readonly in (False, True):
        worker = Worker(
            {
                "model": str(tiny_model_dir),
                "store": store_dir,
                "steps": steps,
                "readonly": readonly,
                "memory_bytes": 64 << 20,
            },
            str(tmp_path),
            name=f"readonly-mount-{readonly}",
            wrap=wrap,
        )
        try:
            results[readonly] = worker.result(timeout=120)
        finally:
            worker.reap()
    for readonly, result in results.items():
        fetch_a, stored, stored_again, _, fetch_p, stats = result["steps"]
        assert fetch_a == {"matched": len(a) - 1, "exact": True}
        assert (stored, stored_again) == (0, 0)
        assert fetch_p == {"matched": 0, "exact": True}
        assert stats["write_errors"] == 0 and stats["blocks"] == 3
        # Not writable: one clear message per handle (not one per refused write), in
        # words that say what to do; read-only as asked: no message at all.
        if readonly:
            assert result["warnings"] == []
        else:
            assert len(result["warnings"]) == 1, result["warnings"]
            assert "not writable" in result["warnings"][0] and "readonly=False" not in result["warnings"][0]
    assert _snapshot(store_dir) == before


# -- 9. schema versions ------------------------------------------------------------------------


# -- 11. bad arguments ---------------------------------------------------------------------------


def _assert_nothing_written(store_dir) -> None:
    nodes = read_index(store_dir)["nodes"]
    assert nodes == {} and segment_files(store_dir) == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": -1},
        {"block_size": True},
        {"memory_bytes": 1.5},
        {"memory_bytes": True},
        {"disk_bytes": 2.5},
        {"namespace": None},
        {"fingerprint": 5},
    ],
    ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}",
)
def test_more_bad_constructor_arguments_are_refused(store_dir, model, kwargs):
    with pytest.raises(InvalidArgumentError) as excinfo:
        PersistentPrefixCache(store_dir, model, **kwargs)
    assert next(iter(kwargs)) in str(excinfo.value)  # it names the argument
    assert not store_dir.exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_bits": 0},
        {"kv_bits": 7},
        {"kv_bits": "4"},
        {"kv_bits": 4, "kv_group_size": 0},
        {"model_path": "/nonexistent/model"},
    ],
    ids=["kv_bits=0", "kv_bits=7", "kv_bits='4'", "kv_group_size=0", "model_path_missing"],
)
def test_unchecked_constructor_arguments_are_refused(store_dir, model, kwargs):
    # Regression: these were accepted (a missing model_path raised FileNotFoundError
    # after the store directory was created).
    with pytest.raises(InvalidArgumentError):
        PersistentPrefixCache(store_dir, model, **kwargs)
    assert not store_dir.exists()


@pytest.mark.parametrize(
    "tokens, cache",
    [
        (None, "prefilled"),
        ("some text", "prefilled"),
        ([1, None, 3], "prefilled"),
        ("prompt", None),
        ("prompt", "one layer"),
        ("prompt", "empty"),
        ("prompt+1", "prefilled"),
    ],
    ids=[
        "tokens_none",
        "tokens_str",
        "tokens_with_none",
        "cache_none",
        "cache_not_a_list",
        "cache_covers_nothing",
        "cache_covers_fewer",  # (a sliced cache may cover more: tests/test_store.py)
    ],
)
def test_more_bad_store_arguments_are_refused(store_dir, model, tokens, cache):
    prompt = random_tokens(BLOCK + 4, seed=330)
    _, prefilled = prefill(model, prompt)
    if isinstance(tokens, str):  # names of the prompt's slices; other text as is
        tokens = {"prompt": prompt, "prompt+1": prompt + [1]}.get(tokens, tokens)
    caches = {"prefilled": prefilled, "one layer": prefilled[0], None: None}
    cache = make_prompt_cache(model) if cache == "empty" else caches[cache]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        with pytest.raises(InvalidArgumentError):
            store.store(tokens, cache)
        store.flush()
        assert store.stats()["blocks_in_memory"] == 0
    _assert_nothing_written(store_dir)


@pytest.mark.parametrize("api", ["sweep_orphans", "StoreAdmin.check"])
def test_negative_grace_is_refused(store_dir, model, api):
    # Regression: the API accepted a negative grace (the CLI refuses it), which sweeps
    # files a live writer in another process is about to commit.
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        with pytest.raises(InvalidArgumentError):
            if api == "sweep_orphans":
                store.sweep_orphans(grace=-1)
            else:
                with StoreAdmin(str(store_dir)) as admin:
                    admin.check(fix=True, grace=-1)


@pytest.mark.parametrize("error", ["MapResizedError", "ReadersFullError"])
def test_housekeeping_after_a_commit_neither_fails_nor_repeats_it(store_dir, model, error):
    """Every 256th commit frees the reader slots of dead processes (LMDB's
    ``reader_check``). Its failure came after the commit: a resize error re-ran the
    committed change, another error failed the write (whose caller then unlinks the
    segments the index holds). Now it is only logged."""
    import lmdb

    from persistent_prefix_cache.disk.index import Index

    PersistentPrefixCache(store_dir, model, block_size=BLOCK).close()  # a store, then its index alone
    index = Index(os.path.join(store_dir, "index"))

    class FailingCheck:
        """The real environment, whose reader_check fails."""

        def __init__(self, env):
            self._env = env

        def reader_check(self):
            raise getattr(lmdb, error)("planted")

        def __getattr__(self, name):
            return getattr(self._env, name)

    real = index.env
    index.env = FailingCheck(real)
    runs = []
    try:
        for i in range(300):  # past the 256th commit

            def change(w, i=i):
                runs.append(i)
                w.put_meta(b"test-counter", str(i).encode())

            assert index.write(change) is None
    finally:
        index.env = real
    assert runs == list(range(300))  # each change ran once, none failed
    with index.reader() as r:
        assert r.meta(b"test-counter") == b"299"
    index.close()
