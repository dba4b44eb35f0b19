"""Hashing a model's weights, where they live: the two schemes of a fingerprint.

A fingerprint covers the model class, its config and the content of every parameter
(name, dtype, shape and bytes: a fine-tune has its base's names and shapes, so only the
bytes tell them apart). Two ways to hash the bytes, told apart by the value's form:

- ``xxh3`` (32 hex digits, no prefix; every fingerprint before issue 18): one xxh3-128
  stream over all of it, on the host. On the CPU the fastest measured here (~11 GB/s on
  one core of the 2-core VM; threads over per-tensor digests gained nothing there, the
  same lane sums with MLX ops on the CPU ran at ~0.2 GB/s), so it stays the CPU's scheme
  and every CPU store keeps its fingerprints. On a CUDA GPU, arrays live in managed
  memory: the host reading them moves their pages, 16 GB took 3.5-7.1 s on an H200.
- ``lanes1:`` + 32 hex digits (where the default device is a GPU: CUDA or Metal): each
  weight is reduced on the device (on CUDA by one kernel, `lane_kernel`; else with MLX
  ops) to a few 32-bit *lane sums* per chunk of `_CHUNK_WORDS` words; only those (16
  bytes a chunk) reach the host, which hashes them with the names, dtypes and shapes
  (xxh3-128). The weights' pages never move.

The lane sums (`_mix`): the bytes, zero-padded to whole 32-bit words ``w[i]`` (the
byte count is hashed too, so padding is unambiguous), give in lane ``l``
``t_l(i) = g_l(w[i] ^ (i * P_l + Q_l))`` with ``g_l`` a multiply by an odd constant,
xor-shift, multiply by another odd constant (lane ``l``'s own), xor-shift; a lane sum is
``sum_i t_l(i) mod 2**32`` over the chunk. Every step of ``g_l`` is a bijection of 32-bit
words (an odd multiplier is invertible mod 2**32; ``x ^ (x >> s)`` is invertible), so for
a fixed position ``t_l`` is a bijection of the word: **a change of any one word changes
its term and so every lane sum of its chunk, in every lane, by construction** (the
other terms are unchanged). The position enters each term, so moving words (a
transposed or permuted weight) changes it too, and integer sums wrap the same in any
order, so the value is the same on every device, however the reduction is split.
Several changed words (a fine-tune changes most words of the tensors it touches) go
unseen only if, in all `LANES` lanes at once, their terms' differences sum to zero
mod 2**32; each lane mixes with its own constants through non-linear steps, so for
changes not built against these constants the lanes fail independently, about
2**-32 each: 2**-128 per chunk. That is a checksum's argument, not a cryptographic
one: the scheme, like xxh3, is **not meant to resist an adversary** who crafts weights
to collide (nor is a fingerprint: anyone who can write the weights can write the store).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, cast

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten

from . import lane_kernel
from .errors import InvalidArgumentError

XXH3 = "xxh3"
LANES_SCHEME = "lanes1"
SCHEMES = (XXH3, LANES_SCHEME)
LANES = 4
_CHUNK_WORDS = 1 << 24  # 64 MiB of weights a chunk: 256 MiB of lane terms on the device
_EVAL_WORDS = 1 << 27  # words reduced per evaluation (bounds the device memory in flight)
# Words one kernel call reduces: a chunk's lane sums are the (wrapping) sums of its pieces'
# (the same value however split); each call's terms take 16 bytes a word on the device.
_TERM_WORDS = _CHUNK_WORDS
# Hand MLX's buffer cache back after lane sums made by MLX ops (their terms' buffers).
CLEAR_AFTER = True
# Where the default device is a CUDA GPU, each weight's lane sums come from one kernel
# (`lane_kernel.py`): no terms' buffers, so nothing to hand back after; a weight
# it does not take (bytes not whole words) goes by MLX ops.
DEVICE_KERNEL = True
# The settings measured against those above (``tools/bench_fingerprint.py``,
# ``tools/prefill_variants.py``): 1M-word pieces, 16M words an evaluation, MLX's cache
# left as it was. On a CPU a quarter of the peak memory and no slower. On an H100 (8B
# shape) an eighth of the peak memory (+3.1 GB against +23.1 GB) but a slower open (0.50
# s against 0.41 s) and a slower `prefill()` after it (1.44 x mlx-lm's at 256 tokens
# against 1.29), so the defaults stay (docs/performance.md, sixteenth day).
SMALL_PIECES = {"_TERM_WORDS": 1 << 20, "_EVAL_WORDS": 1 << 24, "CLEAR_AFTER": False}


@contextmanager
def lane_settings(settings: dict[str, Any]) -> Iterator[None]:
    """This module's lane settings (e.g. `SMALL_PIECES`) in force inside the block, and
    restored after it (for the tools that measure them; not thread-safe). A name this
    module does not define is a KeyError."""
    saved = {k: globals()[k] for k in settings}
    globals().update(settings)
    try:
        yield
    finally:
        globals().update(saved)


# Lane constants: odd multipliers (invertible mod 2**32) and offsets, one set per lane.
_P = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
_Q = (0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)
_M1 = 0x7FEB352D
_M2 = (0x846CA68B, 0x2C1B3C6D, 0x297A2D39, 0x9E485565)


def scheme_of(fingerprint: str) -> str | None:
    """The scheme a fingerprint was computed with.

    Args:
        fingerprint: A fingerprint as a store records it.

    Returns:
        `XXH3` (32 lowercase hex digits), `LANES_SCHEME` (``lanes1:`` and the digits), or
        None for a string a caller chose (``fingerprint=``, derived ones).
    """
    if fingerprint.startswith(LANES_SCHEME + ":"):
        return LANES_SCHEME
    if len(fingerprint) == 32 and all(c in "0123456789abcdef" for c in fingerprint):
        return XXH3
    return None


SCHEME_ENV = "PPC_FINGERPRINT_SCHEME"


def default_scheme() -> str:
    """The scheme `fingerprint_model` uses unless told: the environment variable
    ``PPC_FINGERPRINT_SCHEME`` (``xxh3`` or ``lanes1``: one value for hosts of both kinds
    sharing a remote tier), else `LANES_SCHEME` where the default device is a GPU (the
    weights live there), else `XXH3`.

    Raises:
        InvalidArgumentError: If the environment variable names no scheme.
    """
    chosen = os.environ.get(SCHEME_ENV, "").strip()
    if chosen:
        if chosen not in SCHEMES:
            raise InvalidArgumentError(f"{SCHEME_ENV}={chosen!r} names no fingerprint scheme ({' or '.join(SCHEMES)})")
        return chosen
    return LANES_SCHEME if mx.default_device() == mx.gpu else XXH3


def model_config(model: Any) -> Any:
    """The config a model was built from (its ``args`` dataclass or dict, or ``config``)."""
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return dataclasses.asdict(args)
    if isinstance(args, dict):
        return args
    return getattr(model, "config", None)


def named_parameters(model: Any) -> list[tuple[str, mx.array]]:
    """A model's parameters as ``(dotted name, array)`` pairs, in the model's order."""
    # tree_flatten gives this list unless passed a dict to fill: its annotation names both.
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def _head(model: Any) -> Any:
    h = xxhash.xxh3_128()
    cls = type(model)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
    h.update(json.dumps(model_config(model), sort_keys=True, default=str).encode() + b"\0")
    return h


def fingerprint_model(model: Any, *, scheme: str | None = None, prefetch: bool | None = None) -> str:
    """Digest a loaded mlx-lm model: class, config and the content of every parameter.

    Args:
        model: An mlx ``nn.Module``.
        scheme: `XXH3` (the host hashes the bytes) or `LANES_SCHEME` (the default
            device reduces them to lane sums, the host hashes those); None:
            `default_scheme()`. The two give different values for one model.
        prefetch: `XXH3` only: hash copies made on the default device, their pages
            touched by a few threads ahead of the hash (the value is the same). None:
            only where the default device is a GPU, where the host reading a weight
            moves its pages to the host and the next prefill moves them back.

    Returns:
        A string: 32 hex digits (`XXH3`) or ``lanes1:`` and 32 hex digits.

    Raises:
        InvalidArgumentError: If `scheme` (or ``PPC_FINGERPRINT_SCHEME``) names no scheme.
    """
    scheme = default_scheme() if scheme is None else scheme
    if scheme not in SCHEMES:
        raise InvalidArgumentError(f"unknown fingerprint scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    h = _head(model)
    params = sorted(named_parameters(model), key=lambda kv: kv[0])
    mx.eval([p for _, p in params])
    if scheme == LANES_SCHEME:
        for name, value, sums in _lane_sums_or_unfused(params):
            h.update(f"{name}:{value.dtype}:{tuple(value.shape)}:{value.nbytes}\0".encode())
            h.update(sums)
        # The lane terms' buffers (GBs for an 8B model) go back now, with the open, not
        # at the first `mx.clear_cache()` after it: freed there, they slowed the first
        # prefill() after an open on a GPU (docs/performance.md). The kernel made none:
        # MLX's cache stays as the caller left it, for the forwards after the open.
        source = _kernel_source()
        if CLEAR_AFTER and any(not _by_kernel(p, source) for _, p in params):
            mx.clear_cache()
        return f"{LANES_SCHEME}:{h.hexdigest()}"
    if prefetch is None:
        prefetch = mx.default_device() == mx.gpu
    for name, value, view in _ahead(params) if prefetch else _in_place(params):
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)}\0".encode())
        h.update(view)
    if prefetch:
        mx.clear_cache()  # the copies' buffers, as the lane terms' above
    return h.hexdigest()


# -- lanes: lane sums on the device ---------------------------------------------------------


def _u32(values) -> mx.array:
    return mx.array(np.array(values, dtype=np.uint32))


_CONSTANTS: dict[str, mx.array] = {}


def _constants() -> dict[str, mx.array]:
    if not _CONSTANTS:  # made on first use: importing this module makes no array
        _CONSTANTS.update(p=_u32(_P[:LANES]), q=_u32(_Q[:LANES]), m1=_u32(_M1), m2=_u32(_M2[:LANES]))
    return _CONSTANTS


def _terms(words, positions, offset, p, q, m1, m2):
    # (n, 1) words and positions against (LANES,) constants: (n, LANES) terms, each a
    # bijection of its word for a fixed position and lane (see the module docstring).
    x = mx.bitwise_xor(words[:, None], (positions + offset)[:, None] * p + q)
    x = x * m1
    x = mx.bitwise_xor(x, mx.right_shift(x, 15))
    x = x * m2
    x = mx.bitwise_xor(x, mx.right_shift(x, 13))
    return mx.sum(x, axis=0)


_compiled = mx.compile(_terms, shapeless=True)  # one trace for every chunk size


def _words(value: mx.array) -> mx.array:
    """The parameter's bytes as a flat uint32 array, zero-padded to whole words."""
    flat = value.reshape(-1)
    if flat.dtype == mx.bool_:
        flat = flat.astype(mx.uint8)  # one byte per element, 0 or 1, as its buffer holds
    if value.nbytes % 4:
        flat = flat.view(mx.uint8)
        flat = mx.concatenate([flat, mx.zeros(4 - value.nbytes % 4, dtype=mx.uint8)])
    return flat.view(mx.uint32)


def _host_terms(words: np.ndarray, start: int) -> np.ndarray:
    # `_terms` in numpy, on the host (uint64 arithmetic, reduced mod 2**32).
    mod = 1 << 32
    w = words.astype(np.uint64)[:, None]
    i = (np.arange(start, start + len(words), dtype=np.uint64) % mod)[:, None]
    x = w ^ ((i * np.array(_P[:LANES], np.uint64) + np.array(_Q[:LANES], np.uint64)) % mod)
    x = (x * _M1) % mod
    x ^= x >> 15
    x = (x * np.array(_M2[:LANES], np.uint64)) % mod
    x ^= x >> 13
    return (x.sum(axis=0) % mod).astype(np.uint32)


def _mix(words: mx.array, positions: mx.array, start: int) -> mx.array:
    """The `LANES` lane sums of one chunk (words at global positions start, start+1, ...)."""
    if words.size < 2:  # MLX 0.32's shapeless compile crashes on one element: the host's 4 bytes
        return mx.array(_host_terms(np.array(words, dtype=np.uint32), start))
    c = _constants()
    offset = mx.array(start % (1 << 32), dtype=mx.uint32)
    return (_compiled if _FUSED[0] else _terms)(
        words, positions[: words.size], offset, c["p"], c["q"], c["m1"], c["m2"]
    )


def host_lane_sums(value: mx.array) -> bytes:
    """`lane_sums` computed by numpy on the host, from the array's bytes: the reference
    a device's sums are checked against (``tools/gpu_bench.py``, the tests).

    Args:
        value: An evaluated mlx array of any dtype.

    Returns:
        The same bytes `lane_sums` gives.
    """
    return _host_sums(np.frombuffer(bytes_of(value), dtype=np.uint8), _CHUNK_WORDS)


def _host_sums(raw: np.ndarray, chunk_words: int) -> bytes:
    words = np.concatenate([raw, np.zeros(-len(raw) % 4, np.uint8)]).view("<u4")
    out = []
    for start in range(0, len(words), chunk_words):
        sums = np.zeros(LANES, dtype=np.uint64)
        for part in range(start, min(start + chunk_words, len(words)), 1 << 20):  # bounded host memory
            stop = min(part + (1 << 20), start + chunk_words, len(words))
            sums = (sums + _host_terms(words[part:stop], part)) % (1 << 32)
        out.append(sums.astype("<u4").tobytes())
    return b"".join(out)


_kernel_works: list[bool | None] = [None]  # None until tried in this process


def _kernel_source() -> bytes | None:
    """The lane kernel's PTX where `DEVICE_KERNEL` is on, the default device is a CUDA
    GPU and the kernel gave the host's sums for a probe in this process; else None."""
    if not DEVICE_KERNEL or LANES != 4:
        return None
    if _kernel_works[0] is None:
        _kernel_works[0] = _probe_kernel()
    return lane_kernel.ptx(_P, _Q, _M1, _M2) if _kernel_works[0] else None


def _probe_kernel() -> bool:
    # Once a process: the kernel must give, for words at an aligned address and at an
    # unaligned one, over chunks of one threadgroup's words and a part, what the host
    # gives. Else (an MLX without the call, a driver that refuses the PTX, a wrong sum)
    # the lane sums go by MLX ops: the same value, slower.
    if not lane_kernel.runs_here():
        return False
    raw = np.random.default_rng(28).integers(0, 256, 4 * (2 * lane_kernel.BLOCK_WORDS + 1001) + 1, dtype=np.uint8)
    whole = mx.array(raw)
    cases = [(whole[:-1], raw[:-1]), (whole[1:], raw[1:])]  # offsets 0 and 1 byte into one buffer
    chunk = lane_kernel.BLOCK_WORDS
    try:
        source = lane_kernel.ptx(_P, _Q, _M1, _M2)
        got = [lane_kernel.lane_sums(value, chunk, source) for value, _ in cases]
        mx.eval(got)
        same = all(np.asarray(g).astype("<u4").tobytes() == _host_sums(want, chunk) for g, (_, want) in zip(got, cases))
    except (AttributeError, RuntimeError, ValueError, TypeError) as exc:
        warnings.warn(f"the lane kernel does not run here ({exc}); hashing with MLX ops (the same value)")
        return False
    if not same:
        warnings.warn("the lane kernel's sums differ from the host's here; hashing with MLX ops (the same value)")
    return same


def _by_kernel(value: mx.array, source: bytes | None) -> bool:
    return source is not None and lane_kernel.fits(value.nbytes, _CHUNK_WORDS)


def lane_sums(value: mx.array) -> bytes:
    """The lane sums of one array, chunk after chunk (16 bytes a chunk), as bytes.

    Args:
        value: An evaluated mlx array of any dtype.

    Returns:
        ``LANES`` little-endian uint32 per chunk of `_CHUNK_WORDS` words.
    """
    return b"".join(s for _, _, s in _lane_sums([("", value)]))


_FUSED = [True]  # False once the fused kernel failed here: plain MLX ops, the same value


def _lane_sums_or_unfused(params) -> list:
    """`_lane_sums`, again with plain (unfused) MLX ops if the fused kernel fails on this
    device (a compile bug must not fail an open: the value is the same, only slower)."""
    try:
        return list(_lane_sums(params))
    except (RuntimeError, ValueError) as exc:
        if _kernel_works[0]:  # a weight the probe did not foresee: MLX ops from now on
            warnings.warn(f"the lane kernel failed ({exc}); hashing with MLX ops (the same value)")
            _kernel_works[0] = False
            return _lane_sums_or_unfused(params)
        if not _FUSED[0]:
            raise
        warnings.warn(f"the fused fingerprint kernel failed ({exc}); hashing with plain MLX ops (the same value)")
        _FUSED[0] = False
        return list(_lane_sums(params))


def _lane_sums(params):
    """(name, value, lane sums bytes) per parameter, reduced on the default device,
    `_EVAL_WORDS` words an evaluation (at least one chunk)."""
    piece = max(2, min(_TERM_WORDS, _CHUNK_WORDS))
    # (A chunk's last piece may take one word more: see below.)
    positions = mx.arange(min(piece + 1, max((p.nbytes + 3) // 4 for _, p in params) if params else 1),
                          dtype=mx.uint32)  # fmt: skip
    pending: deque[tuple[str, mx.array, list]] = deque()
    in_flight = 0
    source = _kernel_source()

    def drain():
        mx.eval([s for _, _, sums in pending for s in sums])
        while pending:
            name, value, sums = pending.popleft()
            yield name, value, b"".join(np.asarray(s, dtype=np.uint32).astype("<u4").tobytes() for s in sums)

    for name, value in params:
        if _by_kernel(value, source):
            assert source is not None
            pending.append((name, value, [lane_kernel.lane_sums(value, _CHUNK_WORDS, source)]))  # 16 bytes a chunk
            if len(pending) >= 64:
                yield from drain()
            continue
        words = _words(value)
        sums = []
        for start in range(0, words.size, _CHUNK_WORDS):
            stop = min(start + _CHUNK_WORDS, words.size)
            acc: mx.array | None = None
            # No piece of one word: `_mix` would take it to the host through a view of
            # the weight's buffer (on CUDA, a move of the whole buffer); the last takes it.
            bounds = [*range(start, stop, piece), stop]
            if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
                del bounds[-2]
            for at, end in zip(bounds, bounds[1:]):
                part = _mix(words[at:end], positions, at)
                acc = part if acc is None else acc + part  # uint32: wraps, as one sum would
                in_flight += end - at
                if in_flight >= _EVAL_WORDS:
                    mx.eval(sums + [acc])
                    in_flight = 0
            assert acc is not None  # start < stop: one piece at least
            sums.append(acc)
        pending.append((name, value, sums))
        if in_flight >= _EVAL_WORDS or len(pending) >= 64:
            yield from drain()
            in_flight = 0
    yield from drain()


# -- xxh3: the bytes on the host --------------------------------------------------------------

_PAGE = 4096
_PREFETCHERS = 8
_AHEAD_BYTES = 1 << 30  # device memory the copies in flight may take


def bytes_of(value: mx.array) -> memoryview:
    """An evaluated array's buffer as bytes (no MLX op: this also works in a process
    forked after MLX ran, where MLX can no longer evaluate anything)."""
    view = memoryview(value)  # type: ignore[arg-type]  # mlx's stubs omit mx.array's buffer protocol
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _in_place(params):
    for name, value in params:
        yield name, value, bytes_of(value)


def _copy(value: mx.array) -> mx.array:
    # A bitwise copy made by the device (adding zero to the bytes as unsigned ints).
    copy = value.view(mx.uint8) + 0 if value.dtype != mx.bool_ else mx.array(value)
    mx.eval(copy)
    return copy


def _touch(copy: mx.array) -> memoryview:
    view = bytes_of(copy)
    if len(view):  # one byte per page moves the page; numpy's strided sum drops the GIL
        np.frombuffer(view, dtype=np.uint8)[::_PAGE].sum()
    return view


def _ahead(params):
    """The parameters' bytes as device copies, touched on a few threads ahead of the
    hash; at most `_AHEAD_BYTES` of copies (and at least one) in flight."""
    pool = ThreadPoolExecutor(min(_PREFETCHERS, os.cpu_count() or 1), thread_name_prefix="ppc-prefetch")
    pending: deque[tuple[Future, int]] = deque()
    in_flight, nxt = 0, 0
    try:
        for name, value in params:
            while nxt < len(params) and (not pending or in_flight + params[nxt][1].nbytes <= _AHEAD_BYTES):
                copy = _copy(params[nxt][1])
                pending.append((pool.submit(_touch, copy), copy.nbytes))
                in_flight += copy.nbytes
                nxt += 1
            future, size = pending.popleft()
            yield name, value, future.result()
            in_flight -= size
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
