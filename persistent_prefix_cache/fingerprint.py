"""The model fingerprint: a digest of everything that changes a model's KV.

It covers the model class, its config and the *content* of every parameter (a
fine-tune has the same names and shapes as its base), which also covers dtype and
weight quantization. The cache layout (and so KV quantization) and the namespace
are added by the root key (`keys.root_key`).

Hashing the weights (`weights_hash`) costs a pass over them, in one of two schemes the
value's form names: ``xxh3`` on the host (the CPU's, ~4-11 GB/s on one core; every
fingerprint before issue 18) or ``lanes1:`` lane sums reduced by MLX ops where the
weights live (a GPU's: nothing but 16 bytes per 64 MiB reaches the host).

Upgrades (`current_fingerprint`): a store that holds blocks under ``xxh3`` fingerprints,
opened where the scheme is ``lanes1``, has the weights hashed the older way once; if
that value is one of its models, it stays the fingerprint (the blocks are found as
before) and is remembered under the lanes value, so later opens pay only the lanes
hash. A fingerprint remembered by model folder keeps its value (verified by its
sample as always). ``docs/fingerprint.md`` has the whole story.

Remembered by model folder, verified (`cached_fingerprint`): when the caller names the
folder the model was loaded from, the fingerprint is remembered in the store under the
folder's files' (path, size, mtime, inode), together with a *sample digest* of the
model it was computed from (`sample_digest`: class, config, every parameter's name,
dtype and shape, and 4 evenly spaced 4 KiB pages of each). Every reuse computes the
sample of the model actually loaded and uses the entry only if it is the same, so a
fingerprint remembered under the wrong files is never attached to another model: it
is discarded (with a warning), the loaded model hashed and remembered instead.
Before anything is remembered, the loaded model is compared with the folder's own
``*.safetensors`` files (`compare_with_folder`: the same pages of every tensor of the
same name, dtype and shape; differences the model's own ``sanitize`` makes on load are
recognized by running it on the files): a model that is mostly not the folder's is
refused with `ModelMismatchError`; one that differs in part (adapters fused after
loading) is hashed at every open and never remembered.
Measured (``tools/bench_fingerprint.py``, this 2-core VM, bf16): the sample costs
~14-17 us per tensor (4 ms for the 291 tensors of a 32-layer llama) against ~0.22 s per
GB for the full hash; comparing with the folder once ~12 ms.

Residual risk, honestly: the sample sees 4 pages of each tensor. Two models with the
same class, config, names, dtypes and shapes whose weights differ only outside the
sampled pages (an edit of a few rows of one tensor; a model changed in memory that
way after loading) have the same sample digest. Such a model, opened with a
`model_path` whose entry was computed from the other one, would use the other's
fingerprint, and with it its KV. A full fine-tune, different weights or a different
quantization always differ in the sample. Without `model_path` (or with
``fingerprint=``) nothing is remembered and this risk does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Iterable, cast

import mlx.core as mx
import xxhash

from .errors import ModelMismatchError
from .paths import expand_path
from .weights_hash import LANES_SCHEME, XXH3, bytes_of, fingerprint_model, model_config, named_parameters, scheme_of

__all__ = [
    "FolderComparison", "cached_fingerprint", "compare_with_folder", "current_fingerprint", "describe_model",
    "fingerprint_model", "forget_fingerprints", "sample_digest", "weight_files_signature",
]  # fmt: skip


# -- remembering a fingerprint by a model folder, verified ------------------------------

_PAGE = 4096
_SAMPLE_PAGES = 4  # evenly spaced pages per parameter in the sample digest
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def _dtype_name(value: mx.array) -> str:
    return str(value.dtype).rsplit(".", 1)[-1].rstrip("_")


def _pages(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges a sample takes of a buffer: `_SAMPLE_PAGES` evenly spaced pages."""
    if nbytes <= _SAMPLE_PAGES * _PAGE:
        return [(0, nbytes)] if nbytes else []
    last = (nbytes - 1) // _PAGE
    picked = sorted({round(i * last / (_SAMPLE_PAGES - 1)) for i in range(_SAMPLE_PAGES)})
    return [(p * _PAGE, min((p + 1) * _PAGE, nbytes)) for p in picked]


def _evaluated_params(model: Any) -> list[tuple[str, mx.array]]:
    params = sorted(named_parameters(model), key=lambda kv: kv[0])
    mx.eval([p for _, p in params])
    return params


def sample_digest(model: Any) -> str:
    """A cheap digest of a loaded model: what tells it from another one at a glance.

    Class, config, and every parameter's name, dtype and shape with a few evenly
    spaced 4 KiB pages of its bytes (the whole of a small one). Two models that
    differ in a weight's content only outside the sampled pages have the same sample
    digest (a fine-tune changes nearly every element of the tensors it touches; an
    edit of one row may not): it verifies a remembered fingerprint, it is no
    fingerprint itself.

    Args:
        model: An mlx ``nn.Module``.

    Returns:
        A hex string (xxh3-128).
    """
    h = xxhash.xxh3_128()
    cls = type(model)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
    h.update(json.dumps(model_config(model), sort_keys=True, default=str).encode() + b"\0")
    for name, value in _evaluated_params(model):
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)}:{value.nbytes}\0".encode())
        view = bytes_of(value)
        for start, end in _pages(value.nbytes):
            h.update(view[start:end])
    return h.hexdigest()


def describe_model(model: Any) -> str:
    """A short description of a loaded model for messages: class, type, size."""
    cls = type(model)
    config = model_config(model)
    config = config if isinstance(config, dict) else {}
    parts = [f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}"]
    for key in ("model_type", "num_hidden_layers", "hidden_size"):
        if key in config:
            parts.append(f"{key}={config[key]}")
    return " ".join(parts)


def _folder_tensors(root: str) -> dict[str, tuple[str, str, tuple, int, int]]:
    """name -> (file, dtype, shape, first byte, end) of every tensor in a folder's
    ``*.safetensors``, from their headers (an unreadable file is left out)."""
    out = {}
    for name in sorted(os.listdir(root)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size > 100 << 20:
                    continue
                header = json.loads(f.read(size))
            for tensor, info in header.items():
                if tensor == "__metadata__" or info.get("dtype") not in _ST_DTYPES:
                    continue
                start, end = info["data_offsets"]
                out[tensor] = (path, _ST_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + start, 8 + size + end)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue  # not a safetensors file we can read: nothing to compare there
    return out


@dataclasses.dataclass
class FolderComparison:
    """What `compare_with_folder` found.

    Attributes:
        compared: Parameters compared (same name, dtype and shape in the files).
        differing: Names of those whose sampled bytes differ from the files.
        compared_bytes: Their total size.
        differing_bytes: The total size of the differing ones.
        explained: The differences are the model's ``sanitize`` at work (mlx-lm
            rewrites some weights on load: folds in multipliers, normalizes a head):
            the files, sanitized, give the loaded weights (checked on the smallest
            `_SANITIZE_CHECKS` of them). `differing` is then empty.
    """

    compared: int = 0
    differing: list = dataclasses.field(default_factory=list)
    compared_bytes: int = 0
    differing_bytes: int = 0
    explained: int = 0

    @property
    def proven_other(self) -> bool:
        """Most of what was compared (by bytes) differs, and not by the model's own
        ``sanitize``: another model."""
        return self.compared > 0 and 2 * self.differing_bytes > self.compared_bytes


def compare_with_folder(model: Any, model_path: str) -> FolderComparison:
    """Compare a loaded model with the weight files of the folder said to hold it.

    Every parameter whose name, dtype and shape a ``*.safetensors`` file of the
    folder also has is compared on the pages `sample_digest` takes. Parameters that
    mlx-lm's ``sanitize`` renamed or reshaped on load are skipped; where some differ,
    the model's ``sanitize`` is run on the files to see whether it explains them.

    Args:
        model: The loaded model.
        model_path: The folder.

    Returns:
        A `FolderComparison`.
    """
    files = _folder_tensors(os.path.realpath(model_path))
    out = FolderComparison()
    handles: dict[str, int] = {}
    try:
        for name, value in _evaluated_params(model):
            entry = files.get(name)
            if entry is None:
                continue
            path, dtype, shape, first, end = entry
            if dtype != _dtype_name(value) or shape != tuple(value.shape) or end - first != value.nbytes:
                continue
            try:
                if path not in handles:
                    handles[path] = os.open(path, os.O_RDONLY)
                view = bytes_of(value)
                same = all(
                    os.pread(handles[path], stop - start, first + start) == view[start:stop]
                    for start, stop in _pages(value.nbytes)
                )
            except OSError:
                continue
            out.compared += 1
            out.compared_bytes += value.nbytes
            if not same:
                out.differing.append(name)
                out.differing_bytes += value.nbytes
    finally:
        for fd in handles.values():
            os.close(fd)
    if out.differing and _sanitize_explains(model, model_path, out.differing):
        out.explained, out.differing, out.differing_bytes = len(out.differing), [], 0
    return out


_SANITIZE_CHECKS = 8  # differing weights recomputed through `sanitize`, smallest first


def _sanitize_explains(model: Any, model_path: str, names: list[str]) -> bool:
    """Whether the model's ``sanitize`` turns the folder's tensors into the loaded ones
    (as mlx-lm's loader does), for the smallest `_SANITIZE_CHECKS` of `names`.

    The files are opened lazily (``mx.load``): only the checked tensors, and what
    ``sanitize`` needs to make them, are read. Any failure means "not explained".
    """
    sanitize = getattr(model, "sanitize", None)
    if not callable(sanitize):
        return False
    params = dict(named_parameters(model))
    root = os.path.realpath(model_path)
    try:
        weights: dict[str, mx.array] = {}
        for name in sorted(os.listdir(root)):
            if name.endswith(".safetensors"):
                # mx.load gives a .safetensors file's tensors by name (metadata only when asked)
                weights.update(cast(dict[str, mx.array], mx.load(os.path.join(root, name))))
        weights = sanitize(weights)
        for name in sorted(names, key=lambda n: params[n].nbytes)[:_SANITIZE_CHECKS]:
            made, loaded = weights.get(name), params[name]
            if made is None or made.shape != loaded.shape or made.dtype != loaded.dtype:
                return False
            if not mx.array_equal(made, loaded, equal_nan=True).item():
                return False
    except Exception:  # a sanitize that needs what we did not give it: not explained
        return False
    return True


def weight_files_signature(model_path: str) -> bytes:
    """A digest of the (path, size, mtime, inode) of a model folder's files.

    Args:
        model_path: The folder ``mlx_lm.load`` read the model from.

    Returns:
        16 bytes; it changes whenever a weight or config file is replaced or edited
        (an edit in place that keeps size and mtime is caught by the sample digest).
    """
    h = xxhash.xxh3_128()
    root = os.path.realpath(model_path)
    for name in sorted(os.listdir(root)):
        if not (name.endswith(".safetensors") or name.endswith(".json")):
            continue
        st = os.stat(os.path.join(root, name))
        h.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\0".encode())
    return h.digest()


def cached_fingerprint(
    model: Any,
    model_path: str | None,
    lookup: Callable[[bytes], dict | None],
    remember: Callable[[bytes, dict], None],
    stored: Callable[[], Iterable[str]] = tuple,
) -> str:
    """`fingerprint_model`, remembered by the files of `model_path` and verified.

    What happens, case by case (the module docstring has the residual risk):

    - An entry remembered for the folder's files whose sample digest is the loaded
      model's: its fingerprint is used (nothing is hashed).
    - No entry, or one whose sample digest is not the loaded model's (another model
      was hashed under these files, or an earlier version remembered it without a
      sample): the loaded model is compared with the folder's files, then
      - most of what was compared differs (by bytes; a model of another seed or a
        full fine-tune differs in every large weight): `ModelMismatchError` (the
        entry, if any, is left alone: it is the folder's, the loaded model is not);
      - some differ (a partial fine-tune, adapters fused after loading): the weights
        are hashed, nothing is remembered and a warning says why;
      - none differ, or only as the model's ``sanitize`` rewrites them on load (or
        none could be compared): the weights are hashed and the result remembered
        with the sample digest; a discarded entry is warned about.

    Args:
        model: The loaded model.
        model_path: The folder it was loaded from, or None (always hash).
        lookup: Returns the entry remembered for a files signature (a dict with
            ``fingerprint`` and ``sample``), or None.
        remember: Stores an entry for a files signature (replacing a stale one).
        stored: Returns the fingerprints of the models the store holds blocks of:
            where one is of the older `XXH3` scheme, the weights are hashed that way
            too, once, to keep that model's blocks (`current_fingerprint`).

    Returns:
        The fingerprint (hex).

    Raises:
        ModelMismatchError: If the loaded model is proven not to be the one in
            `model_path`.
    """
    if model_path is None:
        return current_fingerprint(model, lookup, remember, stored)
    folder = os.path.realpath(model_path)
    signature = weight_files_signature(folder)
    sample = sample_digest(model)
    known = lookup(signature)
    if known and known.get("sample") == sample and known.get("fingerprint"):
        return known["fingerprint"]
    found = compare_with_folder(model, folder)
    if found.proven_other:
        raise ModelMismatchError(
            f"model_path {folder} does not hold the model that was loaded ({describe_model(model)}, "
            f"weights sample {sample[:12]}): {len(found.differing)} of the {found.compared} weights compared "
            f"({found.differing_bytes:,} of {found.compared_bytes:,} bytes) differ from the folder's files"
        )
    fp = current_fingerprint(model, lookup, remember, stored)
    stale = known is not None and (known.get("sample") is not None or known.get("fingerprint") != fp)
    if found.differing:
        warnings.warn(
            f"the loaded model differs from the files of model_path {folder} in {len(found.differing)} of "
            f"{found.compared} weights compared (e.g. {found.differing[0]}): its fingerprint is hashed from "
            "the weights at every open, never remembered by the folder",
            stacklevel=3,
        )
        return fp
    if stale and known is not None:
        warnings.warn(
            f"the fingerprint remembered for model_path {folder} was computed from another model "
            f"(remembered {str(known.get('fingerprint'))[:16]}, loaded {fp[:16]}): not used; the loaded model "
            "was hashed and its fingerprint replaces that one (unless the store is read-only)",
            stacklevel=3,
        )
    remember(signature, {"fingerprint": fp, "sample": sample, "folder": folder, "compared": found.compared})
    return fp


_ALIAS = b"scheme-alias\0"  # key prefix: never 16 bytes, so never a files signature


def current_fingerprint(
    model: Any,
    lookup: Callable[[bytes], dict | None],
    remember: Callable[[bytes, dict], None],
    stored: Callable[[], Iterable[str]] = tuple,
) -> str:
    """`fingerprint_model` of the default scheme, or the `XXH3` one the store knows the
    model by: a store written before the `LANES_SCHEME` keeps its blocks.

    Where the default scheme is `LANES_SCHEME` (a GPU) and the store holds blocks of
    models fingerprinted with `XXH3` (every fingerprint before it), the weights are
    hashed with `XXH3` too, once: if that value is one of the store's models, it is the
    fingerprint (the same value as before the upgrade, so its blocks are found); either
    way the outcome is remembered under the lanes fingerprint, so later opens pay only
    the lanes hash. The remembered value was computed from weights of that very lanes
    fingerprint, so it is as safe as the fingerprint itself (no sample involved). A
    read-only store remembers nothing: it pays the `XXH3` hash at every open, as before.

    Args:
        model: The loaded model.
        lookup: As in `cached_fingerprint` (here keyed by the lanes fingerprint).
        remember: As in `cached_fingerprint`.
        stored: As in `cached_fingerprint`.

    Returns:
        The fingerprint (a string).
    """
    fp = fingerprint_model(model)
    if scheme_of(fp) != LANES_SCHEME:
        return fp
    key = _ALIAS + fp.encode()
    known = lookup(key)
    if known and isinstance(known.get("fingerprint"), str) and known.get("alias_of") == fp:
        return known["fingerprint"]
    older = {f for f in stored() if isinstance(f, str) and scheme_of(f) == XXH3}
    if not older:
        return fp  # nothing to keep: nothing remembered (a later open looks again, cheaply)
    legacy = fingerprint_model(model, scheme=XXH3)
    chosen = legacy if legacy in older else fp
    remember(key, {"fingerprint": chosen, "alias_of": fp, "folder": None})
    return chosen


def forget_fingerprints(index: Any, model_path: str | os.PathLike | None = None) -> int:
    """Forget the fingerprints an index remembers by model folder.

    Args:
        index: The store's `disk.index.Index`.
        model_path: Only those of this folder (recorded with the entry, or keyed by its
            files as they are now); None: every one.

    Returns:
        How many were forgotten.

    Raises:
        ReadOnlyStoreError: If the index is read-only.
        InvalidArgumentError: If `model_path` is not a path.
    """
    if model_path is None:
        return index.forget_fingerprints()
    folder = os.path.realpath(expand_path(model_path, what="model_path"))
    signature = weight_files_signature(folder) if os.path.isdir(folder) else None
    return index.forget_fingerprints(folder=folder, signature=signature)
