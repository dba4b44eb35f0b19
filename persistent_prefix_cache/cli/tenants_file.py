"""``ppc serve --tenants FILE``: the operator's tenants file, read and checked at start-up.

JSON, or TOML for a name ending in ``.toml``::

    default = "guest"              # optional: the tenant of a request without a known key
                                   # (absent: such a request gets 401)
    [tenants.alice]
    key_sha256 = ["<64 hex digits>"]   # SHA-256 of each API key: printf %s KEY | sha256sum
    quota = "2GB"                  # optional: its blocks' bytes (a size, or bytes)
    [tenants.guest]
    [[shared]]                     # prefixes every tenant shares, stored once
    system = "You are a helpful assistant."   # or text = "...", tokens = [...],
                                   # tokens_file = "ids.json" (next to this file)

Every mistake is one line naming the file and what is wrong (`UserError`): never a
traceback, never a key.
"""

from __future__ import annotations

import argparse
import os

try:
    import tomllib
except ImportError:  # Python 3.10: JSON files only
    tomllib = None  # type: ignore[assignment]
from typing import Any

from ..compat.tenants import SharedPrompt, Tenant, Tenants, valid_name
from ..keys import TOKEN_MAX, TOKEN_MIN
from ..untrusted import load_json
from .common import UserError, parse_size

MAX_FILE = 1 << 20  # a tenants file: keys and names, a few system prompts
MAX_TOKENS_FILE = 64 << 20
_TOP = {"default", "tenants", "shared"}
_TENANT = {"key_sha256", "quota"}
_SHARED = ("tokens", "tokens_file", "text", "system")


def load_tenants(path: str, *, header: str | None, shared_namespace: str) -> Tenants:
    """Read and check a tenants file.

    Args:
        path: The file (``--tenants``).
        header: ``--tenant-header`` (then a tenant needs no key: the proxy names it).
        shared_namespace: ``--namespace``, where the shared prefixes are stored: no tenant
            may be named so.

    Returns:
        The tenants, as `compat.tenants.Tenants` serves them.

    Raises:
        UserError: One line saying what is wrong with the file.
    """

    def bad(what: str) -> UserError:
        return UserError(f"--tenants {path}: {what}")

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise bad(exc.strerror or str(exc)) from None
    if len(raw) > MAX_FILE:
        raise bad(f"larger than {MAX_FILE} bytes")
    try:
        if path.endswith(".toml"):
            if tomllib is None:
                raise bad("TOML needs Python 3.11 or later; give the same table as JSON")
            data: Any = tomllib.loads(raw.decode("utf-8"))
        else:
            data = load_json(raw, what="the file", max_bytes=MAX_FILE)
    except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise bad(f"not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise bad("the file must hold a table (an object) with 'tenants'")
    _no_unknown(data, _TOP, "", bad)
    table = data.get("tenants")
    if not isinstance(table, dict) or not table:
        raise bad("'tenants' must be a table of at least one tenant")
    tenants: list[Tenant] = []
    digests: dict[bytes, str] = {}
    for name, entry in table.items():
        if not valid_name(name):
            raise bad(f"tenant name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
        if name == shared_namespace:
            raise bad(f"tenant {name!r} is the shared prefixes' namespace (--namespace): rename one")
        if not isinstance(entry, dict):
            raise bad(f"tenant {name!r} must be a table")
        _no_unknown(entry, _TENANT, f"tenant {name!r}: ", bad)
        keys = entry.get("key_sha256", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise bad(f"tenant {name!r}: key_sha256 must be a list of hex SHA-256 digests")
        for key in keys:
            digest = _digest(key)
            if digest is None:
                raise bad(f"tenant {name!r}: a key_sha256 entry is not 64 hex digits (give the key's SHA-256)")
            if digest in digests:
                raise bad(f"tenant {name!r}: a key digest also belongs to tenant {digests[digest]!r}")
            digests[digest] = name
        tenants.append(Tenant(name, _quota(entry.get("quota"), name, bad)))
    default = data.get("default")
    if default is not None and (not isinstance(default, str) or default not in table):
        raise bad(f"default {default!r} is not one of the tenants")
    if header is None and not digests and default is None:
        raise bad("no tenant has a key_sha256 and there is no default: every request would be refused")
    shared = data.get("shared", [])
    if not isinstance(shared, list):
        raise bad("'shared' must be a list of tables")
    prompts = [_shared(entry, i, os.path.dirname(os.path.abspath(path)), bad) for i, entry in enumerate(shared)]
    return Tenants(tenants, key_digests=digests, default=default, header=header, shared=prompts)


def _no_unknown(entry: dict, known: set[str], where: str, bad) -> None:
    unknown = sorted(set(entry) - known)
    if unknown:
        raise bad(f"{where}unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _digest(text: str) -> bytes | None:
    text = text.strip().lower()
    if len(text) != 64:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def _quota(value: Any, name: str, bad) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise bad(f'tenant {name!r}: quota must be a size such as "2GB" or a number of bytes')
    if isinstance(value, int):
        if value < 0:
            raise bad(f"tenant {name!r}: quota must be >= 0, got {value}")
        return value
    try:
        return parse_size(value)
    except argparse.ArgumentTypeError as exc:
        raise bad(f"tenant {name!r}: quota {exc}") from None


def _shared(entry: Any, i: int, folder: str, bad) -> SharedPrompt:
    where = f"shared[{i}]"
    if not isinstance(entry, dict):
        raise bad(f"{where} must be a table")
    _no_unknown(entry, set(_SHARED), f"{where}: ", bad)
    given = [k for k in _SHARED if k in entry]
    if len(given) != 1:
        raise bad(f"{where} needs exactly one of {', '.join(_SHARED)}")
    kind, value = given[0], entry[given[0]]
    if kind in ("text", "system"):
        if not isinstance(value, str) or not value:
            raise bad(f"{where}: {kind} must be a non-empty string")
        return SharedPrompt(text=value) if kind == "text" else SharedPrompt(system=value)
    if kind == "tokens_file":
        if not isinstance(value, str) or not value:
            raise bad(f"{where}: tokens_file must be a file name")
        file = os.path.join(folder, value)
        try:
            with open(file, "rb") as f:
                raw = f.read(MAX_TOKENS_FILE + 1)
            value = load_json(raw, what=file, max_bytes=MAX_TOKENS_FILE)
        except OSError as exc:
            raise bad(f"{where}: tokens_file {file}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise bad(f"{where}: tokens_file: {exc}") from None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and TOKEN_MIN <= t <= TOKEN_MAX for t in value)
    ):
        raise bad(f"{where}: tokens must be a non-empty list of int32 token ids")
    return SharedPrompt(tokens=tuple(value))
