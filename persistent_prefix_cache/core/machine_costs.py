"""The prefill a model was measured at on this machine, kept per user for every store.

A calibration (`calibration.calibrate_store`) times a model's forwards; what it learns
is a property of the model and the machine, not of one store, so it is kept once per
user, in ``$XDG_CACHE_HOME/persistent-prefix-cache/prefill.json`` (``~/.cache/...``
without it): a new store of a model this machine has measured takes the rate from there
instead of running forwards again. Only rates a calibration measured are kept (never
ones set by hand, as a benchmark does), each under a key (`record_key`) bound to the
model (its fingerprint and cache layout), this machine (``/etc/machine-id`` where there
is one, and the host name), the device MLX computes on, and the versions of MLX and
mlx-lm: a home folder shared by several machines never lends one machine's rate to
another, and an upgrade measures again.

The file is a hint, read defensively: it is taken only where its folder and the file
belong to this user and nobody else can write them, it is a regular file (never
through a link, never blocking on a FIFO) of at most `MAX_FILE_BYTES`, and each record
is well formed, finite and younger than `MAX_AGE` (the caller bounds the rates too).
Anything else is ignored, as if nothing had been measured: the cost of a bad file is one
calibration. It is written whole under a temporary name and renamed
(`files.replace_beside`), 0600 in a 0700 folder.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import time
from typing import Any

import xxhash

from ..files import NotRegularFileError, open_folder, open_regular, replace_beside
from ..untrusted import load_json

# The folder's location: None is $XDG_CACHE_HOME/persistent-prefix-cache (~/.cache/... where
# that is not set), looked up at each use; tests set a folder of their own.
FOLDER: str | None = None
FOLDER_NAME = "persistent-prefix-cache"
FILE_NAME = "prefill.json"
FORMAT = "ppc-prefill/1"
MAX_FILE_BYTES = 256 << 10  # 64 records of a few hundred bytes: more is not this file
MAX_RECORDS = 64  # the most recently measured are kept
MAX_AGE = 30 * 24 * 3600.0  # as the store's costs.json: a driver or an OS update changes rates
FUTURE_SLACK = 300.0  # a record dated later than this is not one this machine wrote
PREFILL_SUMS = 12  # the prefill fit's normal equations: 3 features (`costs.Costs`)


def folder() -> str:
    """Where the records live (see `FOLDER`)."""
    if FOLDER is not None:
        return FOLDER
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, FOLDER_NAME)


def record_key(model: str, device: str) -> str:
    """The key of a model's record on this machine.

    Args:
        model: The model's identity in the store (its root key without a namespace:
            fingerprint and cache layout).
        device: What MLX computes on (`device.target.device_kind`).

    Returns:
        32 hex digits.
    """
    return xxhash.xxh3_128_hexdigest("\0".join((FORMAT, model, device) + _this_machine()).encode())


@functools.lru_cache(maxsize=1)
def _this_machine() -> tuple[str, ...]:
    """This installation's id where the system has one (systemd, dbus), the host name,
    and the versions of MLX and mlx-lm (read once a process)."""
    import mlx.core as mx

    machine_id = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with os.fdopen(open_regular(path), "rb") as f:
                machine_id = f.read(64).decode("ascii", "replace").strip()
            break
        except OSError:
            continue
    try:
        import mlx_lm

        mlx_lm_version = str(getattr(mlx_lm, "__version__", ""))
    except ImportError:
        mlx_lm_version = ""
    mlx_version = str(mx.__version__)  # type: ignore[attr-defined]  # mlx's stubs omit __version__
    return machine_id, socket.gethostname(), mlx_version, mlx_lm_version


def _trusted(mode: int, uid: int) -> bool:
    """Whether an entry is this user's own and nobody else can write it."""
    return uid == os.geteuid() and not mode & 0o022


def _open_own_folder() -> int | None:
    """The records' folder by descriptor if it is this user's and nobody else can write
    it (a link there is not followed); None otherwise or if it is missing."""
    try:
        fd = open_folder(folder())
    except OSError:
        return None
    st = os.fstat(fd)
    if not _trusted(st.st_mode, st.st_uid):
        os.close(fd)
        return None
    return fd


def _read_all() -> dict[str, dict]:
    """Every well-formed, recent record of a trusted file (see the module's docstring)."""
    dir_fd = _open_own_folder()
    if dir_fd is None:
        return {}
    try:
        fd = open_regular(FILE_NAME, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not _trusted(st.st_mode, st.st_uid) or st.st_size > MAX_FILE_BYTES:
                return {}
            data = load_json(f.read(MAX_FILE_BYTES + 1), what=FILE_NAME, max_bytes=MAX_FILE_BYTES, max_depth=4)
    except (OSError, NotRegularFileError, ValueError):
        return {}
    finally:
        os.close(dir_fd)
    records = data.get("records") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(records, dict):
        return {}
    return {k: r for k, r in records.items() if isinstance(k, str) and len(k) == 32 and _well_formed(r)}


def _well_formed(record: Any) -> bool:
    """A record as `remember` writes it: its time, the prefill fit's sums, the fastest
    forward, all finite numbers, measured within `MAX_AGE`."""
    if not isinstance(record, dict):
        return False
    saved, sums, fastest = record.get("saved"), record.get("prefill"), record.get("fastest_forward")
    numbers = [saved] + (sums if isinstance(sums, list) else []) + ([] if fastest is None else [fastest])
    if not isinstance(sums, list) or len(sums) != PREFILL_SUMS or not isinstance(saved, (int, float)):
        return False
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers):
        return False
    return -FUTURE_SLACK <= time.time() - saved <= MAX_AGE and (fastest is None or fastest >= 0)


def recall(key: str) -> dict | None:
    """The record kept under `key`, if a trusted file holds a well-formed, recent one.

    Returns:
        ``{"saved", "prefill", "fastest_forward", ...}``, or None. Never raises.
    """
    return _read_all().get(key)


def remember(key: str, record: dict) -> bool:
    """Keep `record` (``prefill``: the fit's sums, ``fastest_forward``, and anything
    else worth reading) under `key`, with the time; the oldest records beyond
    `MAX_RECORDS` go. Other keys' records are kept (a record another process wrote
    meanwhile may be lost: the cost is one calibration).

    Returns:
        Whether it was written (not where the folder is another user's, or writable by
        others, or on any error). Never raises.
    """
    path = folder()
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    except OSError:
        return False
    dir_fd = _open_own_folder()
    if dir_fd is None:
        return False  # somebody else's folder (or a link): never written into
    os.close(dir_fd)
    records = _read_all()
    records[key] = dict(record, saved=time.time())
    newest = sorted(records.items(), key=lambda item: item[1]["saved"], reverse=True)[:MAX_RECORDS]
    text = json.dumps({"format": FORMAT, "records": dict(newest)}, indent=1, sort_keys=True)
    try:
        replace_beside(os.path.join(path, FILE_NAME), lambda f: f.write(text.encode()), mode=0o600)
    except OSError:
        return False
    return True
