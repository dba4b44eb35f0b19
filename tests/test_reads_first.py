"""A store's restores go before its writer (`disk.reads_first`): while a fetch reads,
the writer waits at its safe points (before a segment, between batches, before an
fsync), never for long, and never for itself.

Real stores of the tiny model and real segment files; the only thing put in between is
the moment a fetch reads, where a test starts a write and sees it wait.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from helpers import BLOCK, assert_restores_kv, prefill, random_tokens

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.core import restore as restore_module
from persistent_prefix_cache.disk.reads_first import ReadsFirst

EVENT_TIMEOUT = 60.0  # how long a test waits for something that must happen (never a speed)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


@contextmanager
def _a_reader(gate: ReadsFirst):
    """Another thread reading (`gate.reading()`) until the block ends."""
    inside, leave = threading.Event(), threading.Event()

    def reader():
        with gate.reading():
            inside.set()
            leave.wait(EVENT_TIMEOUT)

    r = threading.Thread(target=reader)
    r.start()
    assert inside.wait(EVENT_TIMEOUT)
    try:
        yield
    finally:
        leave.set()
        r.join()


def test_the_writer_waits_while_a_fetch_reads_and_writes_after(store_dir, model, monkeypatch):
    first = random_tokens(3 * BLOCK + 5, seed=901, first=3)
    second = random_tokens(4 * BLOCK + 3, seed=902, first=4)
    _, first_cache = prefill(model, first)
    _, second_cache = prefill(model, second)
    seen = {}
    real_read_path = restore_module.read_path

    def read_path_with_a_write_beside(nodes, cached, files, *args, **kwargs):
        # A store() of another prompt starts on another thread while this fetch reads.
        gate = files.reads_first
        writing = threading.Thread(target=store.store, args=(second, second_cache))
        writing.start()
        _until(lambda: gate.waiting == 1, "the writer waits for the fetch")
        seen["held"] = store.peek(second)  # tokens of it the index holds
        seen["thread"] = writing
        return real_read_path(nodes, cached, files, *args, **kwargs)

    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0, cost_model=False) as store:
        store.store(first, first_cache)
        store.flush()
        monkeypatch.setattr(restore_module, "read_path", read_path_with_a_write_beside)
        restored, _ = store.fetch(first)
        monkeypatch.setattr(restore_module, "read_path", real_read_path)
        assert restored is not None
        seen["thread"].join(EVENT_TIMEOUT)
        assert not seen["thread"].is_alive()
        assert seen["held"] == 0, "the write went ahead while the fetch read"
        store.flush()
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0, cost_model=False) as store:
        assert_restores_kv(store, first, first_cache)
        assert_restores_kv(store, second, second_cache)


def test_a_write_with_no_fetch_under_way_never_waits(store_dir, model, monkeypatch):
    tokens = random_tokens(2 * BLOCK + 1, seed=903, first=5)
    _, cache = prefill(model, tokens)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0, cost_model=False) as store:
        gate = {}
        real = restore_module.read_path

        def spy(nodes, cached, files, *args, **kwargs):
            gate["it"] = files.reads_first
            return real(nodes, cached, files, *args, **kwargs)

        monkeypatch.setattr(restore_module, "read_path", spy)
        store.store(tokens, cache)
        store.flush()
        assert_restores_kv(store, tokens, cache)
        store.store(random_tokens(2 * BLOCK, seed=904, first=6), cache)
        store.flush()
        assert gate["it"].waits == 0


def test_a_wait_is_bounded_and_a_reader_never_waits_for_itself():
    gate = ReadsFirst()
    done = threading.Event()
    with gate.reading():
        with gate.reading():  # nested: still one reader
            pass
        gate.wait(limit=10.0)  # the reading thread itself: returns at once
        assert gate.waits == 0

        def writer():
            gate.wait(limit=0.05)  # another thread: gives up after its limit
            done.set()

        t = threading.Thread(target=writer)
        t.start()
        assert done.wait(EVENT_TIMEOUT)
        t.join()
    assert gate.waits == 1 and gate.waiting == 0


def test_a_writer_goes_on_as_soon_as_the_last_reader_leaves():
    gate = ReadsFirst()
    w = threading.Thread(target=gate.wait, kwargs={"limit": 3 * EVENT_TIMEOUT})
    with _a_reader(gate):
        w.start()
        _until(lambda: gate.waiting == 1, "the writer waits")
        assert w.is_alive()
    w.join(EVENT_TIMEOUT)  # long before its own limit: the reader left
    assert not w.is_alive()


@pytest.mark.parametrize("threaded", [False, True])
def test_the_writers_batches_wait_too(tmp_path, model, monkeypatch, threaded):
    """A segment's batches (their hashing and their writes) wait while a reader reads."""
    from persistent_prefix_cache.disk import segment_writer

    monkeypatch.setattr(segment_writer, "BATCH_BYTES", 3000)
    monkeypatch.setattr(segment_writer, "THREADED_BYTES", 0 if threaded else 1 << 60)
    gate = ReadsFirst()
    calls = []

    def pause():
        calls.append(threading.current_thread().name)
        gate.wait(limit=3 * EVENT_TIMEOUT)

    path = tmp_path / "data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    chunks = [np.full(1000, i, dtype=np.uint8) for i in range(40)]
    try:
        sink = segment_writer.Sink(fd, 0, nbytes=40_000, pause=pause)
        feeding = threading.Thread(target=lambda: ([sink.put(c) for c in chunks], sink.close()))
        with _a_reader(gate):
            feeding.start()
            _until(lambda: gate.waiting == 1, "a batch waits for the reader")
            assert path.stat().st_size == 0  # nothing written while the reader reads
        feeding.join(EVENT_TIMEOUT)
        assert not feeding.is_alive()
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(c.tobytes() for c in chunks)
    # Each batch paused before its hand-over, and in the second thread before its write.
    assert len(calls) >= (2 if threaded else 1) * (40_000 // 3000)
