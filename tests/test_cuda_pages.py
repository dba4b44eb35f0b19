"""Moving restored buffers onto a CUDA GPU (`disk/cuda_pages.py`): a hint that never
changes a bit and never fails a restore. The move itself runs on the H200 only
(``tools/gpu_bench.py``, docs/h200-measurements.md §9); here, off CUDA and without a
CUDA driver, the fallbacks are what runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from persistent_prefix_cache.disk import cuda_pages


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
        monkeypatch.setattr(cuda_pages, "MODE", mode)
        cuda_pages.to_gpu(arrays)
        cuda_pages.to_gpu([], started=True)
    cuda_pages.touch(arrays)
    assert all(np.array_equal(bits(x), y) for x, y in zip(arrays, before))


def test_off_cuda_nothing_is_started():
    assert not cuda_pages.on_cuda()  # this machine computes on its CPU
    assert not cuda_pages.moves()
    assert not cuda_pages.prefetch([memoryview(x) for x in _arrays()])
    cuda_pages.wait()  # nothing to wait for: returns


def test_without_a_driver_a_cuda_restore_touches_its_pages(monkeypatch):
    # A CUDA build whose driver library cannot be loaded here (none on this machine):
    # the move falls back to touching every page with MLX, on the caller's thread.
    monkeypatch.setattr(cuda_pages, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_pages, "MODE", "prefetch")
    touched = []
    real = cuda_pages.touch
    monkeypatch.setattr(cuda_pages, "touch", lambda arrays: touched.append(len(arrays)) or real(arrays))
    arrays = _arrays()
    assert not cuda_pages.prefetch([memoryview(x) for x in arrays])  # the driver is not there
    cuda_pages.to_gpu(arrays)
    assert touched == [4]
    monkeypatch.setattr(cuda_pages, "MODE", "none")
    cuda_pages.to_gpu(arrays)
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
            ring = self._threads.ring = [[np.zeros(cuda_pages.STAGE_PIECE, np.uint8), None, False] for _ in range(2)]
            self._threads.next = 0
        return ring

    def copy(self, dst, src, nbytes, event):
        import ctypes

        if self.fail_after is not None and self.copies >= self.fail_after:
            raise OSError("cuMemcpyHtoDAsync failed: CUDA driver error 700")
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def wait_event(self, event):
        pass

    def prefetch(self, address, nbytes):
        pass

    def wait(self):
        pass


def _staged_fetch(monkeypatch, store_dir, model, driver, tokens):
    from helpers import BLOCK, prefill

    from persistent_prefix_cache import PersistentPrefixCache

    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, sync_writes=True) as store:
        store.store(tokens, prefill(model, tokens)[1])
    monkeypatch.setattr(cuda_pages, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_pages, "_get_driver", lambda: driver)
    monkeypatch.setattr(cuda_pages, "STAGE_PIECE", 4096)  # many pieces per row: the ring wraps
    monkeypatch.setattr(cuda_pages, "_staging", True)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0) as store:
        return store.fetch(tokens + [3])


def test_a_staged_restore_is_bitwise_the_plain_one(monkeypatch, store_dir, model):
    from helpers import assert_same_logits, cold_logits, random_tokens, warm_logits

    tokens = random_tokens(150, seed=4242)
    driver = _HostDriver()
    restored, rest = _staged_fetch(monkeypatch, store_dir, model, driver, tokens)
    assert driver.copies > 0  # the pieces went through the stages
    assert list(rest) == [3]
    assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, tokens + [3]))


def test_a_failing_driver_costs_no_piece(monkeypatch, store_dir, model):
    # Copies fail part-way through: those pieces go in from the host, staging stops for
    # the process, and the restore is still exact (never a block taken for damaged).
    from helpers import assert_same_logits, cold_logits, random_tokens, warm_logits

    tokens = random_tokens(150, seed=4343)
    driver = _HostDriver(fail_after=3)
    restored, rest = _staged_fetch(monkeypatch, store_dir, model, driver, tokens)
    assert driver.copies == 3 and not cuda_pages._staging
    assert list(rest) == [3]
    assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, tokens + [3]))
