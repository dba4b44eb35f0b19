"""Moving restored buffers onto a CUDA GPU (`device/cuda.py`): a hint that never
changes a bit and never fails a restore. The move itself runs on the H200 only
(``tools/gpu_bench.py``, docs/h200-measurements.md §9); here, off CUDA and without a
CUDA driver, the fallbacks are what runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from persistent_prefix_cache.device import addresses, cuda, cuda_driver


@pytest.fixture(autouse=True)
def address_state(monkeypatch):
    """What a test learns of the address kernel (`addresses.device_addresses`) and of staging
    stays in that test (on this machine the kernel cannot run: the first call clears it)."""
    monkeypatch.setattr(addresses, "_addresses_work", True)
    monkeypatch.setattr(addresses, "_addresses_checked", False)
    monkeypatch.setattr(cuda, "_staging", True)


def _host_addresses(arrays):
    """`addresses.device_addresses` where MLX's memory is the host's: the arrays' host addresses."""
    mx.eval(arrays)
    return [np.frombuffer(memoryview(a).cast("B"), np.uint8).ctypes.data if a.nbytes else 0 for a in arrays]


def _arrays():
    a = mx.arange(3 * 4096, dtype=mx.float32).reshape(3, 4096)
    b = (mx.arange(2 * 5000) % 251).astype(mx.uint8).reshape(2, 5000)
    mx.eval(a, b)
    return [a, b, mx.ones((5, 4), dtype=mx.bfloat16), mx.zeros((0, 4), dtype=mx.bfloat16)]


def test_moves_never_change_the_bits(monkeypatch):
    arrays = _arrays()
    bits = lambda x: np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)  # noqa: E731
    before = [bits(x) for x in arrays]
    for mode in ("prefetch", "touch", "none"):
        monkeypatch.setattr(cuda, "MODE", mode)
        cuda.to_gpu(arrays)
        cuda.to_gpu([])
    cuda.touch(arrays)
    assert all(np.array_equal(bits(x), y) for x, y in zip(arrays, before))


def test_off_cuda_nothing_is_started():
    assert not cuda.on_cuda()  # this machine computes on its CPU
    assert not cuda.moves()
    assert not cuda.prefetch([memoryview(x) for x in _arrays()])
    cuda.wait()  # nothing to wait for: returns


def test_without_a_driver_a_cuda_restore_touches_its_pages(monkeypatch):
    # A CUDA build whose driver library cannot be loaded here (none on this machine):
    # the move falls back to touching every page with MLX, on the caller's thread.
    monkeypatch.setattr(cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda, "MODE", "prefetch")
    touched = []
    real = cuda.touch
    monkeypatch.setattr(cuda, "touch", lambda arrays: touched.append(len(arrays)) or real(arrays))
    arrays = _arrays()
    assert not cuda.prefetch([memoryview(x) for x in arrays])  # the driver is not there
    cuda.to_gpu(arrays)
    assert touched == [4]
    monkeypatch.setattr(cuda, "MODE", "none")
    cuda.to_gpu(arrays)
    assert touched == [4]  # "none" leaves the pages where they are


class _HostDriver:
    """The CUDA driver calls a `Stager` makes, done by the host (none can be had here:
    on a CPU, MLX's "managed" memory is plain host memory, so a copy is a memmove).
    `fail_after`: that many copies succeed, then every copy fails as a driver would."""

    def __init__(self, fail_after: int | None = None):
        import threading

        self._threads = threading.local()
        self.copies, self.fail_after = 0, fail_after

    def ring(self):
        ring = getattr(self._threads, "ring", None)
        if ring is None:
            ring = self._threads.ring = [[np.zeros(cuda_driver.STAGE_PIECE, np.uint8), None, False] for _ in range(2)]
            self._threads.next = 0
        return ring

    def copy(self, dst, src, nbytes):
        import ctypes

        if self.fail_after is not None and self.copies >= self.fail_after:
            raise OSError("cuMemcpyHtoDAsync failed: CUDA driver error 700")
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def copy_rows(self, dst, dst_pitch, src, src_pitch, width, rows):
        self.row_copies = getattr(self, "row_copies", 0) + 1  # one driver call for all the rows
        for r in range(rows):
            self.copy(dst + r * dst_pitch, src + r * src_pitch, width)

    def to_host(self, dst, src, nbytes, stream):
        import ctypes

        ctypes.memmove(dst, src, nbytes)

    def read(self, dst, src, nbytes):
        import ctypes

        ctypes.memmove(dst, src, nbytes)

    def lane(self):
        import contextlib

        self.lanes = getattr(self, "lanes", 0) + 1
        return contextlib.nullcontext((self.ring(), "stream"))

    def record(self, event):
        pass

    def record_on(self, event, stream):
        pass

    def wait_event(self, event):
        pass

    def prefetch(self, address, nbytes):
        pass

    def wait(self):
        pass


class _Counting(_HostDriver):
    """A `_HostDriver` that counts the bytes copied to the "device"."""

    bytes = 0

    def copy(self, dst, src, nbytes):
        self.bytes += nbytes
        super().copy(dst, src, nbytes)


def _stage(monkeypatch, driver, piece: int) -> None:
    """From now on restores go through the stages, `driver` standing for CUDA's."""
    monkeypatch.setattr(cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda, "_get_driver", lambda: driver)
    monkeypatch.setattr(cuda_driver, "STAGE_PIECE", piece)
    monkeypatch.setattr(cuda, "_staging", True)


def _fetches(monkeypatch, store_dir, family, driver, piece, fill=None, ask=None, seed=4242, staged_too=None):
    """One prompt stored (by `fill(store, model, tokens)` if given), then fetched (``ask(tokens)``,
    else the prompt and one token more) plainly and through the stages (`staged_too()` run
    first, if given): the logits of both restored caches fed their last token."""
    from families import build
    from helpers import BLOCK, prefill, random_tokens, warm_logits

    from persistent_prefix_cache import PersistentPrefixCache

    model = build(family)
    tokens = [t % 256 for t in random_tokens(150, seed=seed)]
    prompt = ask(tokens) if ask is not None else tokens + [3]
    options = dict(block_size=BLOCK, fingerprint="staged", memory_bytes=0)
    with PersistentPrefixCache(store_dir, model, sync_writes=True, **options) as store:
        if fill is None:
            store.store(tokens, prefill(model, tokens)[1])
        else:
            fill(store, model, tokens)
    logits = []
    for staged in (False, True):
        if staged:
            _stage(monkeypatch, driver, piece)
            if staged_too is not None:
                staged_too()
        with PersistentPrefixCache(store_dir, model, **options) as store:
            restored, rest = store.fetch(prompt)
        assert list(rest) == prompt[-1:]
        logits.append(np.array(warm_logits(model, restored, rest)))
    return logits


# Pieces of 4 KiB split each row of a field (150 tokens x 64 bytes); of 1 MiB they hold
# every row of it (2 KV heads: 2 rows, strided in the destination).
STAGED = pytest.mark.parametrize("family, piece", [("llama", 4096), ("llama", 1 << 20), ("gemma3_text", 1 << 20)])


def test_a_pieces_rows_go_to_the_device_by_one_driver_call(monkeypatch, store_dir):
    # Pieces that hold several rows of a field (1 MiB: both of a llama field's rows) put
    # them on the device by one 2D copy (`Driver.copy_rows`), not one copy per row: a
    # prompt stored in pieces had thousands of small copies, each with the copy engine's
    # fixed cost. The restore stays bitwise the plain one.
    driver = _HostDriver()
    plain, staged = _fetches(monkeypatch, store_dir, "llama", driver, 1 << 20)
    assert np.array_equal(plain, staged)
    rows = getattr(driver, "row_copies", 0)
    assert rows > 0 and driver.copies == 2 * rows  # every piece: its 2 rows by one call


@pytest.mark.parametrize(
    "offsets, length, alike",
    [([0, 100, 200], 100, True), ([0, 100, 200], 101, False), ([0, 100, 210], 10, False), ([5], 1, False)],
)
def test_only_rows_a_step_apart_that_do_not_overlap_are_one_copy(offsets, length, alike):
    assert cuda._evenly_spaced(offsets, length) is alike


@STAGED
def test_a_staged_restore_is_bitwise_the_plain_one(monkeypatch, store_dir, family, piece):
    driver = _HostDriver()
    plain, staged = _fetches(monkeypatch, store_dir, family, driver, piece)
    assert driver.copies > 0  # the pieces went through the stages
    assert np.array_equal(plain, staged)


@STAGED
def test_a_staged_restore_into_managed_buffers_is_bitwise_the_plain_one(monkeypatch, store_dir, family, piece):
    # `buffers.GPU_ALLOCATION` "managed": the restore's buffers are made on MLX's CPU
    # stream (on CUDA, managed memory no host view has to move) and placed on the
    # device before the pieces are copied in; the bits are the plain route's.
    from persistent_prefix_cache.device import buffers

    made, real = [], buffers.managed_empty

    def managed() -> None:
        monkeypatch.setattr(buffers, "GPU_ALLOCATION", "managed")
        monkeypatch.setattr(buffers, "on_gpu", lambda: True)
        monkeypatch.setattr(buffers, "managed_empty", lambda specs: made.append(len(specs)) or real(specs))

    driver = _HostDriver()
    plain, staged = _fetches(monkeypatch, store_dir, family, driver, piece, staged_too=managed)
    assert made and driver.copies > 0
    assert np.array_equal(plain, staged)


@STAGED
def test_a_failing_driver_costs_no_piece(monkeypatch, store_dir, family, piece):
    # Copies fail part-way through: those pieces go in from the host, staging stops for
    # the process, and the restore is still exact (never a block taken for damaged).
    driver = _HostDriver(fail_after=3)
    plain, staged = _fetches(monkeypatch, store_dir, family, driver, piece)
    assert driver.copies == 3 and not cuda._staging
    assert np.array_equal(plain, staged)


def _several_segments(store, model, tokens) -> None:
    """Store `tokens` so that a path over them spans four segments: its first two blocks
    with another prompt, the rest a turn at a time (one segment read in part)."""
    from helpers import BLOCK, prefill

    other = tokens[: 2 * BLOCK] + [(t + 1) % 256 for t in tokens[2 * BLOCK : 3 * BLOCK + 5]]
    store.store(other, prefill(model, other)[1])
    for end in (3 * BLOCK, 4 * BLOCK, len(tokens)):
        store.store(tokens[:end], prefill(model, tokens[:end])[1])
    assert store.stats()["blocks"] == len(tokens) // BLOCK + 1 + 2  # the other prompt's own two


@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_a_path_over_several_segments_is_staged_and_bitwise(monkeypatch, store_dir, piece):
    # Every field's buffer is filled from four segments (`_several_segments`). Every byte
    # still goes through the stages (read through the host into managed memory, such a
    # restore ran at a third of the speed on an H200), and the restore is exact.
    from helpers import prefill

    driver = _Counting()
    plain, staged = _fetches(monkeypatch, store_dir, "llama", driver, piece, fill=_several_segments)
    assert np.array_equal(plain, staged)
    # Every restored byte of KV came through a copy: 150 tokens x 4 layers x 2 fields x
    # 2 heads x 16 dims x 2 bytes (the tiny llama of tests/families.py).
    from families import build

    cache = prefill(build("llama"), list(range(1)))[1]
    per_token = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache)
    assert driver.bytes == 150 * per_token


def test_the_small_fields_of_a_segment_read_whole_are_one_read(monkeypatch, tmp_path):
    # A prompt stored in pieces ends in small segments; read field by field, each field
    # was a read, a wait for a pinned piece and a copy, each ~0.5 ms of the reader threads
    # on an H100. Fields that follow each other in the file and fit one piece together
    # are one read (`read_path._packed`); the restore is bitwise the plain one.
    from persistent_prefix_cache.disk import read_path, segment_reader

    reads: list[int] = []
    real = segment_reader.preadv
    monkeypatch.setattr(segment_reader, "preadv", lambda fd, views, at: reads.append(at) or real(fd, views, at))
    counts = []
    for packing in (True, False):
        if not packing:
            monkeypatch.setattr(read_path, "_packed", lambda jobs, piece: jobs)
        plain, staged = _fetches(
            monkeypatch, tmp_path / str(packing), "llama", _Counting(), 1 << 20, fill=_several_segments,
            staged_too=reads.clear,
        )  # fmt: skip
        assert np.array_equal(plain, staged)
        counts.append(len(reads))
    # The path's blocks lie in two segments once the turns are merged: the shared first
    # blocks, read in part (a read per field), and the rest, read whole: its 4 fields
    # (2 layers x 2) one read instead of four.
    assert counts == [5, 8]


@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_a_segment_the_path_mostly_needs_is_read_whole_and_checked_once(monkeypatch, store_dir, piece):
    # A prompt stored with more than is asked back (a server stores the prompt with the
    # token it generated): its one segment is read in part. Checked block by block on the
    # host, the stages' pages went back from the device (145 ms of a 238 ms restore of
    # 2k tokens in `ppc serve` on an H100). Where most of it is needed it is read whole,
    # hashed in the pinned pieces, verified by its one digest; only the blocks the path
    # needs are copied to the device, and the restore is bitwise the plain one.
    from families import build
    from helpers import BLOCK, prefill

    from persistent_prefix_cache.disk.segment_reader import OpenSegment

    checked = []  # whether each block checked on the host was checked by a staged restore
    real = OpenSegment.block_digest
    monkeypatch.setattr(OpenSegment, "block_digest", lambda self, *a: checked.append(cuda.on_cuda()) or real(self, *a))
    driver = _Counting()
    ask = lambda tokens: tokens[: 7 * BLOCK + 3]  # noqa: E731  # 8 of the segment's 10 blocks (9 whole, a tail of 6)
    plain, staged = _fetches(monkeypatch, store_dir, "llama", driver, piece, ask=ask, seed=4646)
    assert np.array_equal(plain, staged)
    assert False in checked and True not in checked  # the plain restore checks blocks; the staged one none
    per_token = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in prefill(build("llama"), [1])[1])
    assert driver.bytes == 8 * BLOCK * per_token  # only the blocks asked for went to the device


def _by_address(monkeypatch) -> list:
    """From now on a staged restore is given its buffers' addresses (`addresses.device_addresses`:
    a kernel on CUDA; here, where MLX's memory is the host's, their host addresses), and
    every host view the read path takes of an MLX array is counted (on CUDA each moves a
    device buffer into managed memory). Returns the list the views are counted in."""
    from persistent_prefix_cache.disk import read_path

    views: list = []

    def counted(x):
        if isinstance(x, mx.array):
            views.append(x.shape)
        return memoryview(x)

    monkeypatch.setattr(addresses, "device_addresses", _host_addresses)
    monkeypatch.setattr(read_path, "memoryview", counted, raising=False)
    return views


@STAGED
def test_a_restore_by_device_address_takes_no_host_view_and_is_bitwise(monkeypatch, store_dir, family, piece):
    # The copies go to the buffers' device addresses: the read path never asks for a host
    # view of a buffer it fills (on an H100 the views of a 16k-token restore's buffers
    # cost 85-122 ms), and the restore is bitwise the plain one.
    views: list = []
    driver = _Counting()
    plain, staged = _fetches(
        monkeypatch, store_dir, family, driver, piece, staged_too=lambda: views.extend([_by_address(monkeypatch)])
    )
    assert np.array_equal(plain, staged)
    assert driver.bytes > 0
    run_views = [shape for shape in views[0] if len(shape) == 4 and shape[2] >= 150]  # (batch, heads, rows, dims)
    assert run_views == []


@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_a_failing_driver_with_device_addresses_reads_again_through_the_host(monkeypatch, store_dir, piece):
    # Copies to device addresses fail part-way: those buffers have no host view to fall
    # back on, so the whole path is read again through host views (staging has stopped).
    # The restore is whole and exact: no healthy block is taken for damaged.
    driver = _HostDriver(fail_after=3)
    plain, staged = _fetches(
        monkeypatch, store_dir, "llama", driver, piece, staged_too=lambda: _by_address(monkeypatch)
    )
    assert driver.copies == 3 and not cuda._staging
    assert np.array_equal(plain, staged)


@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_a_path_over_several_segments_by_device_address_is_bitwise(monkeypatch, store_dir, piece):
    # A prompt stored turn by turn and a prefix shared with another prompt, one segment
    # read in part (`_several_segments`), and the earlier blocks served from the RAM tier:
    # the blocks the host checks or copies in are seen through host views taken after the
    # copies landed.
    from families import build
    from helpers import BLOCK, random_tokens, warm_logits

    from persistent_prefix_cache import PersistentPrefixCache

    plain, staged = _fetches(
        monkeypatch, store_dir, "llama", _HostDriver(), piece, fill=_several_segments,
        staged_too=lambda: _by_address(monkeypatch),
    )  # fmt: skip
    assert np.array_equal(plain, staged)
    # The same restore with the RAM tier holding the first blocks: copied in through host views.
    model = build("llama")
    tokens = [t % 256 for t in random_tokens(150, seed=4242)]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, fingerprint="staged") as store:
        store.fetch(tokens[: 2 * BLOCK + 1])  # its two blocks read twice: admitted
        store.fetch(tokens[: 2 * BLOCK + 1])
        served = store.stats()["memory_hits_disk"]
        restored, rest = store.fetch(tokens + [3])
        assert store.stats()["memory_hits_disk"] - served == 2  # the two blocks came from the RAM tier
    assert list(rest) == [3]
    assert np.array_equal(np.array(warm_logits(model, restored, rest)), plain)


class _LateDriver(_HostDriver):
    """As `_HostDriver`, but copies land only when waited for (an event, or the stream),
    as a copy engine's do: a read that looks at its buffers before waiting sees them
    unwritten."""

    def __init__(self):
        super().__init__()
        self.pending: list = []  # (dst, src, nbytes) or ("event", slot's event)

    def ring(self):
        ring = super().ring()
        for k, slot in enumerate(ring):
            slot[1] = slot[1] or object()  # an event per piece
        return ring

    def copy(self, dst, src, nbytes):
        self.copies += 1
        self.pending.append((dst, src, nbytes))

    def record(self, event):
        self.pending.append(("event", event))

    def _land(self, until=None):
        import ctypes

        while self.pending:
            job = self.pending.pop(0)
            if job[0] == "event":
                if job[1] is until:
                    return
                continue
            ctypes.memmove(*job)

    def wait_event(self, event):
        self._land(event)

    def wait(self):
        self._land()


@pytest.mark.parametrize("by_address", [False, True])
@pytest.mark.parametrize("asked", ["all", "most"])  # "most": read whole, only the blocks asked for copied
def test_a_damaged_segment_is_checked_after_the_copies_land(monkeypatch, store_dir, asked, by_address):
    # One flipped byte in the 3rd block: the segment's digest fails, each block is then
    # checked from the buffers. They must hold what was read (the copies waited for),
    # or intact blocks would read as damaged: the staged restore keeps what the plain
    # one keeps.
    from families import build
    from helpers import BLOCK, flip_block_byte, nodes_by_position, prefill, random_tokens

    from persistent_prefix_cache import PersistentPrefixCache

    model = build("llama")
    tokens = [t % 256 for t in random_tokens(150, seed=4545)]
    options = dict(block_size=BLOCK, fingerprint="staged", memory_bytes=0)
    with PersistentPrefixCache(store_dir, model, sync_writes=True, **options) as store:
        store.store(tokens, prefill(model, tokens)[1])
    flip_block_byte(store_dir, nodes_by_position(store_dir)[2], at=7)
    driver = _LateDriver()
    _stage(monkeypatch, driver, 1 << 20)
    if by_address:
        _by_address(monkeypatch)
    prompt = tokens + [3] if asked == "all" else tokens[: 7 * BLOCK]
    with PersistentPrefixCache(store_dir, model, **options) as store:
        restored, rest = store.fetch(prompt)
        assert store.stats()["corrupt"] == 1
    assert driver.copies > 0
    assert len(rest) == len(prompt) - 2 * BLOCK  # the two blocks before the damaged one


def _assert_stored_bitwise(store_dir, model, tokens, cache, fingerprint):
    """A fresh handle (off CUDA, no RAM tier) restores `tokens` as `cache` holds them, bit for bit."""
    from helpers import BLOCK

    from persistent_prefix_cache import PersistentPrefixCache

    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, fingerprint=fingerprint, memory_bytes=0) as store:
        restored, rest = store.fetch(tokens + [7])
    assert list(rest) == [7]
    n = len(tokens)
    for mine, theirs in zip(restored, cache):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert np.array_equal(np.array(a[..., :n, :].view(mx.uint16)), np.array(b[..., :n, :].view(mx.uint16)))


def _store_on_cuda(monkeypatch, store_dir, driver, *, by_address: bool, seed: int, n_tokens: int, **options):
    """One llama prompt stored under the CUDA emulation (`driver` for CUDA's; with
    `by_address`, copies by the arrays' addresses, as the address kernel gives them),
    flushed: ``(model, tokens, cache, the store's block bytes)``."""
    from families import build
    from helpers import BLOCK, prefill, random_tokens

    from persistent_prefix_cache import PersistentPrefixCache

    model = build("llama")
    tokens = [t % 256 for t in random_tokens(n_tokens, seed=seed)]
    cache = prefill(model, tokens)[1]
    with monkeypatch.context() as m:
        m.setattr(cuda, "on_cuda", lambda: True)
        m.setattr(cuda, "_get_driver", lambda: driver)
        if by_address:
            m.setattr(addresses, "device_addresses", _host_addresses)
        with PersistentPrefixCache(store_dir, model, block_size=BLOCK, **options) as store:
            store.store(tokens, cache)
            store.flush()
            kv = store.stats()["block_bytes"]
    return model, tokens, cache, kv


@pytest.mark.parametrize("by_address", [True, False])
def test_the_writer_copies_a_stores_kv_to_the_host_by_the_copy_engine(monkeypatch, store_dir, by_address):
    # On a CUDA GPU the writer must not read a store's copy of the new KV in place: managed
    # memory moves to whoever touches it, page by page, while the caller's next forward
    # runs, and the RAM tier's next restore faults it back. The copy engine copies the
    # fields (one stack: one shape) into host memory, from the copy's device address where
    # MLX gives one (else from a host view); nothing is moved to the device afterwards.
    import ctypes

    copied, moved = [], []

    class Driver(_HostDriver):
        def to_host(self, dst, src, nbytes, stream):
            copied.append(nbytes)
            ctypes.memmove(dst, src, nbytes)

        def prefetch(self, address, nbytes):
            moved.append(nbytes)

    monkeypatch.setattr(cuda_driver, "STAGE_PIECE", 1000)  # several pinned pieces per field, the last one short
    model, tokens, cache, kv = _store_on_cuda(
        monkeypatch, store_dir, Driver(), by_address=by_address, seed=4244, n_tokens=5 * 16 + 3, fingerprint="host"
    )
    assert sum(copied) == kv and len(copied) == -(-kv // 1000)  # once, piece by piece
    assert moved == []
    _assert_stored_bitwise(store_dir, model, tokens, cache, "host")  # what was written: the caller's KV


@pytest.mark.parametrize("by_address", [True, False])
def test_a_host_copy_that_disagrees_is_never_written(monkeypatch, store_dir, by_address):
    # A driver whose copies land wrong (here: zeros): the writer sees the copy's ends differ
    # from the source's (read again by a plain driver copy, or in place), writes the
    # source's bits read through a host view, and staging stops.
    class Wrong(_HostDriver):
        def to_host(self, dst, src, nbytes, stream):
            import ctypes

            ctypes.memset(dst, 0, nbytes)

    model, tokens, cache, _ = _store_on_cuda(
        monkeypatch, store_dir, Wrong(), by_address=by_address, seed=4245, n_tokens=3 * 16, fingerprint="wrong"
    )
    assert not cuda._staging
    _assert_stored_bitwise(store_dir, model, tokens, cache, "wrong")


@pytest.mark.parametrize("by_address", [True, False])
def test_no_host_view_of_the_callers_cache_or_the_ram_tiers_copy(monkeypatch, store_dir, by_address):
    # On a CUDA GPU a host view of an MLX buffer moves it into managed memory (MLX's
    # allocator): taken of the caller's cache (the range of a full buffer is that buffer)
    # or of the RAM tier's copy, that move cost the caller ~100 ms at 16k tokens (H100)
    # and left the memory off the device. By address the writer takes no view at all, and
    # the RAM tier keeps views of the writer's one copy; without, the writer views that
    # copy on its own thread and the RAM tier's copies are their own.
    import builtins
    import threading

    from persistent_prefix_cache.device import buffers
    from persistent_prefix_cache.tiers.memory import MemoryTier

    viewed, kept = [], []
    caller = threading.get_ident()

    def view(x):
        viewed.append((threading.get_ident(), x))
        return builtins.memoryview(x)

    real_put = MemoryTier.put
    monkeypatch.setattr(buffers, "memoryview", view, raising=False)
    monkeypatch.setattr(
        MemoryTier,
        "put",
        lambda self, node, tensors, *a, **k: kept.append(tensors) or real_put(self, node, tensors, *a, **k),
    )
    copied = []

    class Driver(_HostDriver):
        def to_host(self, dst, src, nbytes, stream):
            copied.append(src)
            super().to_host(dst, src, nbytes, stream)

    # 256 tokens: mlx-lm's buffer step, so the cache is full (a range of it would be the buffer itself)
    model, tokens, cache, _ = _store_on_cuda(
        monkeypatch, store_dir, Driver(), by_address=by_address, seed=4243, n_tokens=256, fingerprint="own"
    )
    assert len(kept) == 256 // 16  # the RAM tier kept every block

    def host(x) -> np.ndarray:
        return np.asarray(builtins.memoryview(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x))

    theirs = [host(x) for layer in cache for x in (layer.keys, layer.values)]
    tiers = [host(x) for tensors in kept for part in tensors.values() for x in part.values()]
    if by_address:
        assert viewed == [] and copied  # copied from the address the kernel gave
        start = min(copied)  # every layer's keys and values (one shape): one copy, the RAM tier's views of it
        assert all(start <= t.ctypes.data < start + 2 * len(theirs) * theirs[0].nbytes for t in tiers)
        assert not any(np.shares_memory(t, other) for t in tiers for other in theirs)
    else:
        assert len(viewed) == 1 and caller not in {thread for thread, _ in viewed}
        mine = np.asarray(builtins.memoryview(viewed[0][1]))
        assert not any(np.shares_memory(mine, other) for other in theirs + tiers)
    _assert_stored_bitwise(store_dir, model, tokens, cache, "own")


def test_the_first_address_is_checked_by_reading_it_back(monkeypatch):
    # Every copy by address trusts the kernel's parameter layout and the driver: the
    # process's first call reads an array computed on the device back from the address
    # given. A wrong address (here: 4 bytes on) turns addresses off for the process.
    from persistent_prefix_cache.device.buffers import WriterRoute

    def kernels(shift):
        return lambda arrays: [mx.array([a + shift], dtype=mx.uint64) for a in _host_addresses(arrays)]

    monkeypatch.setattr(cuda, "_get_driver", lambda: _HostDriver())
    a = mx.arange(4096, dtype=mx.uint16)
    monkeypatch.setattr(addresses, "_address_kernels", kernels(0))
    assert addresses.device_addresses([a]) == _host_addresses([a]) and addresses._addresses_checked
    monkeypatch.setattr(addresses, "_addresses_checked", False)
    monkeypatch.setattr(addresses, "_address_kernels", kernels(4))
    assert addresses.device_addresses([a]) is None and not addresses._addresses_work
    monkeypatch.setattr(cuda, "on_cuda", lambda: True)
    route = WriterRoute()
    b = mx.arange(10, dtype=mx.uint32) * 3
    assert route.evaluate([b]) == [None]  # evaluated all the same: the writer takes a host view
    assert np.array_equal(route.bits(b, None), np.arange(10) * 3)


def test_a_cuda_handle_makes_the_readers_rings_at_open(monkeypatch, store_dir):
    # The first restore of a process made the reader threads and their pinned pieces
    # inside its own time (on an H200 the first fetch of 2k tokens took as long as the
    # second of 8k), and the cost model learned that as the disk's rate. A handle opened
    # on a CUDA GPU has them made in the background, once per process.
    import threading
    import time

    from families import build

    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.device import readers

    made = []

    class Driver(_HostDriver):
        def ring(self):
            if getattr(self._threads, "ring", None) is None:
                made.append(threading.current_thread().name)
            return super().ring()

    driver = Driver()
    monkeypatch.setattr(cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda, "_get_driver", lambda: driver)
    monkeypatch.setattr(cuda, "_prepared", False)
    monkeypatch.setattr(readers, "_pool", None)  # a fresh pool: its threads are made here
    model = build("llama")
    with PersistentPrefixCache(store_dir, model, fingerprint="rings"):
        deadline = time.monotonic() + 60
        while len(made) < readers.READERS and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(made) == readers.READERS == len(set(made))
    assert all(name.startswith("ppc-reader") for name in made)
    with PersistentPrefixCache(store_dir, model, fingerprint="rings"):
        pass
    readers.reader_pool().submit(lambda: None).result()
    assert len(made) == readers.READERS  # once per process


@pytest.mark.parametrize("keep", [False, True])
def test_only_the_calls_that_queue_work_may_keep_the_gil(monkeypatch, keep):
    # `ENQUEUE_KEEPS_GIL` sends the copies to the device and the events' records through a
    # handle that keeps the GIL (`ctypes.PyDLL`); every call that waits (an event, a stream,
    # a copy to the host) stays on the handle that lets it go, whatever the setting.
    import ctypes

    class Fn:
        def __init__(self, log, name):
            self.log, self.name, self.argtypes = log, name, None

        def __call__(self, *args):
            self.log.append(self.name)
            return 0

    class Lib:
        def __init__(self):
            self.log: list = []

        def __getattr__(self, name):
            fn = Fn(self.log, name)
            setattr(self, name, fn)
            return fn

    released, held = Lib(), Lib()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: released)
    monkeypatch.setattr(ctypes, "PyDLL", lambda name: held)
    monkeypatch.setattr(cuda_driver, "ENQUEUE_KEEPS_GIL", keep)
    driver = cuda_driver.Driver()
    del released.log[:]
    driver.copy(1, 2, 3)
    driver.copy_rows(1 << 20, 4096, 2, 1024, 1024, 4)
    driver.record(1)
    driver.wait_event(1)
    driver.wait()
    queued = ["cuMemcpyHtoDAsync_v2", "cuMemcpy2DAsync_v2", "cuEventRecord"]
    assert held.log == (queued if keep else [])
    assert released.log == ([] if keep else queued) + ["cuEventSynchronize", "cuStreamSynchronize"]


def test_a_copy_to_the_host_goes_piece_by_piece_through_a_lane_reused_by_the_next_thread(monkeypatch):
    # One driver call per field held a restore up for all of it; pieces through pinned
    # memory let the writer give way (`pause`) between them. The pinned pieces and the
    # stream are a lane the process keeps: a new handle's writer thread takes the lane an
    # earlier one gave back (rings made per thread were pinned again by every handle and
    # never freed). The real `Driver` runs here against a stand-in of the driver's C API.
    import ctypes
    import threading

    class Lib:
        def __init__(self):
            self.pinned, self.streams, self.copies = [], 0, []

        def cuCtxSetCurrent(self, context):
            return 0

        def cuMemHostAlloc(self, address, size, flags):
            buffer = ctypes.create_string_buffer(size)
            self.pinned.append(buffer)
            address._obj.value = ctypes.addressof(buffer)
            return 0

        def cuEventCreate(self, event, flags):
            event._obj.value = 1
            return 0

        def cuStreamCreate(self, stream, flags):
            self.streams += 1
            stream._obj.value = self.streams
            return 0

        def cuMemcpyDtoHAsync_v2(self, dst, src, nbytes, stream):
            self.copies.append(nbytes)
            ctypes.memmove(dst, src, nbytes)
            return 0

        def cuEventRecord(self, event, stream):
            return 0

        def cuEventSynchronize(self, event):
            return 0

    driver = object.__new__(cuda_driver.Driver)
    driver.lib, driver.context, driver._threads, driver._lanes = Lib(), None, threading.local(), []
    driver._lanes_lock = threading.Lock()
    driver.queue = driver.lib  # the calls that only queue work (`ENQUEUE_KEEPS_GIL` off)
    monkeypatch.setattr(cuda_driver, "STAGE_PIECE", 1000)
    rng = np.random.default_rng(3)
    paused = []
    for seed in range(2):  # two writer threads, one after the other
        src = rng.integers(0, 256, size=(5 + seed) * 1000 + 17, dtype=np.uint8)
        out = np.zeros_like(src)
        thread = threading.Thread(
            target=cuda._copy_to_host, args=(driver, out, src.ctypes.data, lambda: paused.append(1))
        )
        thread.start()
        thread.join()
        assert np.array_equal(out, src)
    assert driver.lib.copies == [1000] * 5 + [17] + [1000] * 6 + [17]
    assert len(paused) == 13  # before each piece
    assert driver.lib.streams == 1 and len(driver.lib.pinned) == cuda_driver.STAGE_RING  # one lane, made once


def test_the_writers_copy_to_the_host_gives_way_to_a_restore_between_pieces(monkeypatch, store_dir):
    # A restore that starts while the writer copies a store's new KV off the GPU goes
    # first: the copy waits before its next piece until the restore is done.
    import ctypes
    import threading
    import time

    from families import build
    from helpers import BLOCK, prefill, random_tokens

    from persistent_prefix_cache import PersistentPrefixCache

    from persistent_prefix_cache.disk.reads_first import ReadsFirst

    entered, release = threading.Event(), threading.Event()
    copies = []
    gates = []  # every ReadsFirst of the store's segment files (the handle's, its admin's)
    real_init = ReadsFirst.__init__

    def init(self):
        real_init(self)
        gates.append(self)

    def restore() -> None:  # a restore on another thread, marked as the read path marks it
        import contextlib

        with contextlib.ExitStack() as marks:
            for gate in gates:
                marks.enter_context(gate.reading())
            entered.set()
            release.wait(30)

    class Driver(_HostDriver):
        def to_host(self, dst, src, nbytes, stream):
            copies.append(release.is_set())
            if len(copies) == 1:
                threading.Thread(target=restore, daemon=True).start()
                assert entered.wait(30)
            ctypes.memmove(dst, src, nbytes)

    model = build("llama")
    tokens = [t % 256 for t in random_tokens(4 * BLOCK, seed=4246)]
    cache = prefill(model, tokens)[1]
    with monkeypatch.context() as m:
        m.setattr(cuda, "on_cuda", lambda: True)
        m.setattr(cuda, "_get_driver", lambda: Driver())
        m.setattr(cuda_driver, "STAGE_PIECE", 1000)
        m.setattr(ReadsFirst, "__init__", init)
        with PersistentPrefixCache(store_dir, model, block_size=BLOCK, fingerprint="host") as store:
            store.store(tokens, cache)
            deadline = time.monotonic() + 30
            while not any(g.waiting for g in gates) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert sum(g.waiting for g in gates) == 1 and copies == [False]  # paused after its first piece
            release.set()
            store.flush()
    assert len(copies) > 2 and all(copies[1:])  # every later piece after the restore
    _assert_stored_bitwise(store_dir, model, tokens, cache, "host")


@pytest.mark.parametrize(
    "x",
    [
        mx.arange(2 * 3 * 5 * 4, dtype=mx.float32).reshape(2, 3, 5, 4)[:, :, 1:, :],  # a slice: a view
        (mx.arange(64) % 17).astype(mx.bfloat16).reshape(1, 2, 8, 4),  # a whole buffer
        mx.array([7.5], dtype=mx.bfloat16).reshape(1, 1, 1, 1),  # one element
        mx.array(3, dtype=mx.uint8),
        mx.zeros((1, 2, 0, 4), dtype=mx.bfloat16),
    ],
)
def test_a_device_copy_is_bitwise_and_owns_its_buffer(x):
    # What the writer takes to the host on a CUDA GPU, and what the RAM tier keeps of a
    # restore there: never a buffer the source shares (a host view would move it).
    from persistent_prefix_cache.blocks import mx_uint
    from persistent_prefix_cache.device.buffers import device_copy

    mx.eval(x)
    y = device_copy(x)
    mx.eval(y)
    assert y.shape == x.shape and y.dtype == x.dtype
    bits = lambda a: np.array(a.view(mx_uint(a.itemsize)))  # noqa: E731
    assert np.array_equal(bits(y), bits(x))
    if x.size:
        assert not np.shares_memory(
            np.asarray(memoryview(y.view(mx_uint(y.itemsize)))), np.asarray(memoryview(x.view(mx_uint(x.itemsize))))
        )


@pytest.mark.parametrize(
    "family, kv_bits", [("gemma3_text", None), ("qwen3_next", None), ("deepseek_v32", None), ("llama", 4)]
)
def test_a_store_on_a_gpu_writes_what_a_store_on_the_cpu_does(monkeypatch, tmp_path, family, kv_bits):
    # The writer's copy on a CUDA GPU stacks fields of one shape and dtype (one copy to the
    # host, by address or through a host view; by address the RAM tier keeps views of it):
    # sliding windows, recurrent states, keys and values of other widths (MLA) and
    # quantized caches restore what the plain route wrote, bit for bit, from the disk and
    # from the RAM tier.
    from families import build
    from helpers import BLOCK, prefill, random_tokens, warm_logits

    from persistent_prefix_cache import PersistentPrefixCache

    model = build(family)
    tokens = [t % 256 for t in random_tokens(5 * BLOCK + 3, seed=4246)]
    if kv_bits is not None:  # head dim 32: a quantization group
        from families import FAMILIES
        from mlx_lm.models import llama

        model = llama.Model(
            llama.ModelArgs.from_dict(dict(FAMILIES["llama"][1], num_attention_heads=2, num_key_value_heads=1))
        )
        mx.eval(model.parameters())
    options = dict(block_size=BLOCK, fingerprint="both", kv_bits=kv_bits, kv_group_size=32)
    logits = []
    for route in ("cpu", "gpu", "gpu by address"):
        path = tmp_path / route
        with monkeypatch.context() as m:
            if route != "cpu":
                m.setattr(cuda, "on_cuda", lambda: True)
                m.setattr(cuda, "_get_driver", lambda: _HostDriver())
            if route == "gpu by address":
                m.setattr(addresses, "device_addresses", _host_addresses)
            with PersistentPrefixCache(path, model, **options) as store:
                cache = prefill(model, tokens)[1] if kv_bits is None else store.make_cache()
                if kv_bits is not None:
                    model(mx.array(tokens)[None], cache=cache)
                store.store(tokens, cache)
                restored, rest = store.fetch(tokens + [3])  # from the RAM tier
                assert list(rest) == [3] and store.stats()["memory_hits_store"] > 0
                logits.append(np.array(warm_logits(model, restored, rest)))
        with PersistentPrefixCache(path, model, memory_bytes=0, **options) as store:
            restored, rest = store.fetch(tokens + [3])
        assert list(rest) == [3]
        logits.append(np.array(warm_logits(model, restored, rest)))
    assert len(logits) == 6 and all(np.array_equal(logits[0], other) for other in logits[1:])


def test_staged_reads_are_shared_by_the_staged_read_threads(monkeypatch, store_dir):
    # Reads staged to a CUDA GPU go to `readers.STAGED_READ_THREADS` threads (each piece is
    # also handed to the copy engine); every other read to `readers.READ_THREADS`. Both ways
    # restore the same bits.
    from persistent_prefix_cache.device import readers

    asked: list = []
    real = readers.share
    monkeypatch.setattr(readers, "STAGED_READ_THREADS", 3)
    monkeypatch.setattr(
        readers, "share", lambda fn, items, **kw: asked.append(kw.get("threads")) or real(fn, items, **kw)
    )
    plain, staged = _fetches(
        monkeypatch, store_dir, "llama", _HostDriver(), 4096, staged_too=lambda: asked.append("staged")
    )
    assert np.array_equal(plain, staged)
    split = asked.index("staged")
    assert asked[:split] and set(asked[:split]) == {None}  # the plain fetch: READ_THREADS
    assert asked[split + 1 :] and set(asked[split + 1 :]) == {3}


@pytest.mark.parametrize("threads", [1, 3])
def test_share_uses_at_most_the_threads_it_is_given(threads):
    import threading
    import time

    from persistent_prefix_cache.device import readers

    seen: list = []

    def fn(x: int) -> int:
        seen.append(threading.get_ident())
        time.sleep(0.002)  # long enough for every helper to take items: the bound is what is checked
        return x * x

    assert readers.share(fn, list(range(24)), threads=threads) == [x * x for x in range(24)]
    assert len(seen) == 24 and len(set(seen)) <= threads


def test_where_mlx_cannot_run_the_address_kernel_reads_take_host_views(monkeypatch):
    # This machine's MLX has no CUDA: the kernel that reads device addresses cannot run,
    # so `device_addresses` says None and stops trying for the process (without a driver
    # it does not try: an address is only ever read by one), and a target that
    # does not stage asks nothing (its reads take host views).
    from persistent_prefix_cache.device.target import device_target

    monkeypatch.setattr(addresses, "_addresses_work", True)
    tried, real = [], mx.fast.precompiled_cuda_kernel
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: tried.append(kw["name"]) or real(**kw))
    a = mx.zeros((4, 64), dtype=mx.bfloat16)
    mx.eval(a)
    assert (
        addresses.device_addresses([a]) is None and not addresses._addresses_work and tried == []
    )  # no driver: no copy
    monkeypatch.setattr(addresses, "_addresses_work", True)
    monkeypatch.setattr(addresses, "_addresses_checked", False)
    monkeypatch.setattr(cuda, "_get_driver", lambda: _HostDriver())
    assert addresses.device_addresses([a]) is None and not addresses._addresses_work
    assert addresses.device_addresses([a]) is None and tried == ["ppc_address"]  # not tried again
    assert device_target().addresses([a]) is None  # off CUDA nothing is staged


@pytest.mark.skipif(not cuda.on_cuda(), reason="the copies by device address run on a CUDA GPU only")
def test_on_a_cuda_gpu_the_writer_copies_by_address_and_both_tiers_restore_bitwise(monkeypatch, store_dir):
    # The real route: the stack's address from the kernel (checked once by reading it
    # back), the writer's copy by the copy engine, the RAM tier's views of the stack; what
    # the disk and the RAM tier give back is the caller's KV, bit for bit.
    from families import build
    from helpers import BLOCK, prefill, random_tokens

    from persistent_prefix_cache import PersistentPrefixCache

    copied, real = [], cuda.from_device
    monkeypatch.setattr(cuda, "from_device", lambda *a, **k: copied.append(a[1]) or real(*a, **k))
    model = build("llama")
    tokens = [t % 256 for t in random_tokens(6 * BLOCK + 5, seed=4247)]
    cache = prefill(model, tokens)[1]
    n = len(tokens)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, fingerprint="cuda") as store:
        store.store(tokens, cache)
        store.flush()
        restored, rest = store.fetch(tokens + [7])
        assert list(rest) == [7] and store.stats()["memory_hits_store"] > 0
        for mine, theirs in zip(restored, cache):
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                assert np.array_equal(np.array(a[..., :n, :].view(mx.uint16)), np.array(b[..., :n, :].view(mx.uint16)))
        kv = store.stats()["block_bytes"]
    assert addresses._addresses_work and cuda._staging and sum(copied) == kv
    _assert_stored_bitwise(store_dir, model, tokens, cache, "cuda")
