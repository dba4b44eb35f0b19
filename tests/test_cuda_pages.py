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
