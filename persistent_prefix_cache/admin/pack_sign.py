"""Signing packs: who wrote a pack, proven by a MAC over the digest of every member.

A pack's ``signature.json`` lists the BLAKE2b-256 digest of every member before it and one
MAC (keyed BLAKE2b-256) over them per key that signed it:

- ``store``: the store's own key, ``<store>/pack.key`` (32 random bytes), made on its first
  export (written under a temporary name, then linked into place exclusively: never through
  a link, never over another key), 0600 whatever the store's mode (a group store's members
  can read its files, never its key). A pack imported back into the store
  that wrote it is verified by it (a backup, a copy moved between two folders of one host).
- ``secret``: a key derived from a secret the user gives (``$PPC_PACK_SECRET``, or a file
  named by ``--secret-file``): the way to move packs between stores and hosts.

Each MAC names its key by an id (a hash of the key, which reveals nothing of it), so an
import tells "signed by another store" and "signed with another secret" from "altered".
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from ..disk.portable import durable_fsync
from ..disk.store_dir import folder_fd
from ..errors import InvalidArgumentError
from ..files import create_temp, open_regular

KEY_FILE = "pack.key"
SIGNATURE_FORMAT = "ppc-pack-signature/1"
SECRET_ENV = "PPC_PACK_SECRET"
MAX_SECRET_FILE = 1 << 16


@dataclass(frozen=True)
class Key:
    """A key that signs or verifies packs.

    Attributes:
        by: ``"store"`` or ``"secret"``.
        key: The 32-byte MAC key.
    """

    by: str
    key: bytes

    @property
    def id(self) -> str:
        """A name for the key that reveals nothing of it (16 hex digits)."""
        return hashlib.blake2b(self.key, digest_size=8, person=b"ppc-pack-keyid").hexdigest()

    def mac(self, digests: dict[str, bytes]) -> str:
        """The MAC (hex) over the members' names and digests, in name order."""
        h = hashlib.blake2b(digest_size=32, key=self.key, person=b"ppc-pack-mac")
        h.update(SIGNATURE_FORMAT.encode() + b"\0")
        for name in sorted(digests):
            raw = name.encode()
            h.update(len(raw).to_bytes(2, "little") + raw + digests[name])
        return h.hexdigest()


def secret_key(secret: str | bytes) -> Key:
    """The `Key` of a user's secret (any length)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return Key("secret", hashlib.blake2b(raw, digest_size=32, person=b"ppc-pack-secret").digest())


def read_secret_file(path: str) -> bytes:
    """A secret from a file (its bytes, without a trailing newline).

    Raises:
        InvalidArgumentError: If it cannot be read, is not a regular file, or is empty.
    """
    try:
        fd = open_regular(path)  # a FIFO would block a plain open; a link is refused
    except OSError as exc:
        raise InvalidArgumentError(f"--secret-file {path}: {exc.strerror}") from None
    try:
        data = os.read(fd, MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    data = data.rstrip(b"\r\n")
    if not data or len(data) > MAX_SECRET_FILE:
        raise InvalidArgumentError(f"--secret-file {path}: {'empty' if not data else 'larger than 64 KiB'}")
    return data


def store_key(root: str, *, create: bool) -> Key | None:
    """The store's own key, made now if missing and `create`.

    A key file that is not this user's regular file of mode 0600 (another user planted
    it, or opened it up) is not used: a key others could read signs nothing.

    Returns:
        The `Key`, or None (no key and not `create`, or one that cannot be trusted, or
        a store this process cannot write a key into).
    """
    try:
        fd = open_regular(os.path.join(root, KEY_FILE))
    except FileNotFoundError:
        return _create(root) if create else None
    except OSError:
        return None  # a link, a FIFO, or not ours to read
    try:
        info = os.fstat(fd)
        trusted = info.st_uid == os.geteuid() and not info.st_mode & 0o077
        data = os.read(fd, 64) if trusted else b""
    finally:
        os.close(fd)
    return Key("store", data) if len(data) == 32 else None


def _create(root: str) -> Key | None:
    """A new key, written whole under a temporary name in ``tmp/`` and then linked into
    place exclusively: it appears complete or not at all, and never over another."""
    key = os.urandom(32)
    try:
        tmp_fd, root_fd = folder_fd(root, "tmp", create=True), folder_fd(root)
    except OSError:
        return None  # a store this user cannot write: packs go unsigned by it
    try:
        fd, name = create_temp("", "pack_key", 0o600, dir_fd=tmp_fd)
        try:
            os.write(fd, key)
            durable_fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(name, KEY_FILE, src_dir_fd=tmp_fd, dst_dir_fd=root_fd, follow_symlinks=False)
            durable_fsync(root_fd)
        except FileExistsError:
            return store_key(root, create=False)  # another export made it first
        finally:
            os.unlink(name, dir_fd=tmp_fd)
    except OSError:
        return None
    finally:
        os.close(tmp_fd)
        os.close(root_fd)
    return Key("store", key)


def sign(digests: dict[str, bytes], keys: list[Key]) -> dict:
    """The ``signature.json`` of a pack whose members have these digests."""
    return {
        "format": SIGNATURE_FORMAT,
        "digests": {name: d.hex() for name, d in sorted(digests.items())},
        "macs": [{"by": k.by, "key": k.id, "mac": k.mac(digests)} for k in keys],
    }


def verify(path: str, signature: dict | None, digests: dict[str, bytes], keys: list[Key]) -> str | None:
    """Which of `keys` signed the pack (``"store"`` or ``"secret"``), or None if none did.

    Args:
        path: The pack (for messages).
        signature: Its ``signature.json`` (None: unsigned).
        digests: Every member's digest as read.
        keys: The keys this import holds.

    Raises:
        InvalidArgumentError: If a MAC made with one of `keys`, or a member's listed
            digest, does not match what was read: the pack was altered after signing.
    """
    if signature is None:
        return None
    try:
        listed = {str(k): bytes.fromhex(v) for k, v in dict(signature["digests"]).items()}
        macs = [(str(m["by"]), str(m["key"]), str(m["mac"])) for m in signature["macs"]]
        ok = signature.get("format") == SIGNATURE_FORMAT
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{path}: its signature.json is not one this version reads")
    if listed != digests:
        changed = sorted(set(listed) ^ set(digests)) or sorted(n for n in listed if listed[n] != digests[n])
        raise InvalidArgumentError(
            f"{path} was altered after it was signed: {changed[0]} is not what its signature lists",
            hint="nothing was written; export it again",
        )
    for key in keys:
        for by, key_id, mac in macs:
            if key_id == key.id:
                if not hmac.compare_digest(mac, key.mac(digests)):
                    raise InvalidArgumentError(f"{path}: its {by} signature does not match its contents",
                                               hint="nothing was written; export it again")  # fmt: skip
                return key.by
    return None


def signers(signature: dict | None) -> list[str]:
    """Who signed a pack, in words (``"another store (key 1a2b...)"``), for messages."""
    if not isinstance(signature, dict):
        return []
    out = []
    for m in signature.get("macs") or []:
        if isinstance(m, dict):
            what = "another store" if m.get("by") == "store" else "a secret"
            out.append(f"{what} (key {str(m.get('key'))[:16]})")
    return out
