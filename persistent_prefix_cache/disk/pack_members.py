"""The members of an export pack (``ppc export``): a tar file of ``manifest.json``,
``nodes.bin`` (length-prefixed index records), the segment files (or an older format's
block files) and ``signature.json``; read strictly, member by member in that order,
each one's size checked against what it may hold before a byte of it is read, and
hashed as it streams, so a damaged or hostile pack is one typed error, never a
`MemoryError` (a small gzip pack can declare a member of gigabytes)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
import time
from typing import IO, Any, Iterator

from ..blocks import Node
from ..errors import InvalidArgumentError
from ..untrusted import load_json

RECORD_HEAD = struct.Struct("<16sI")  # a record's key and length, before the record
MANIFEST, NODES, SIGNATURE = "manifest.json", "nodes.bin", "signature.json"
MAX_MANIFEST = 4 << 20  # a few KiB per model (its layout's fields)
MAX_SIGNATURE = 1 << 20  # a digest per member: some 100 bytes per segment
MAX_NODES = 256 << 20  # ~1M block records, what one process can hold as records
# A record: its fixed head (64 bytes), 4 bytes per token, a JSON tail of at most 64 KiB, its segment.
RECORD_FIXED = 64 + 0xFFFF + 16
CHUNK = 1 << 20
MAX_EXTENDED_HEADER = 64 << 10
DIGEST_SIZE = 32


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add `data` to `tar` as the member `name`."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def digest() -> Any:
    """A new hash of a member's bytes (BLAKE2b-256: what a signature covers)."""
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def unpack_records(data: bytes, path: str) -> Iterator[Node]:
    """The index records of ``nodes.bin``."""
    pos = 0
    while pos < len(data):
        try:
            key, n = RECORD_HEAD.unpack_from(data, pos)
            pos += RECORD_HEAD.size
            if pos + n > len(data):
                raise ValueError("record past the end")
            yield Node.unpack(key, data[pos : pos + n])
        except (struct.error, ValueError, RecursionError):  # a record's JSON tail nested past the parser
            raise InvalidArgumentError(f"{path}: damaged node records") from None
        pos += n


class _BoundedTarInfo(tarfile.TarInfo):
    # tarfile reads a pax header or a GNU long name whole into memory, whatever size its
    # header declares: a bound first (the members of a pack have short names).
    def _proc_member(self, tarfile_):
        if self.type in tarfile.GNU_TYPES + (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
            if self.size > MAX_EXTENDED_HEADER:
                raise tarfile.ReadError(f"an extended header of {self.size:,} bytes")
        return super()._proc_member(tarfile_)


class PackReader:
    """A pack opened for reading, member by member (compressed or not: ``r|*``).

    Args:
        path: The pack.

    Raises:
        InvalidArgumentError: If it is not a tar file.
    """

    def __init__(self, path: str):
        self.path = path
        self.digests: dict[str, bytes] = {}  # member -> BLAKE2b-256 of its bytes, as read
        try:
            self._file = open(path, "rb")
        except OSError as exc:
            raise InvalidArgumentError(f"{path} is not a ppc export: {exc.strerror}") from None
        try:
            self._tar = tarfile.open(fileobj=self._file, mode="r|*", tarinfo=_BoundedTarInfo)
        except (tarfile.TarError, OSError, EOFError) as exc:
            self._file.close()
            raise InvalidArgumentError(f"{path} is not a ppc export: {exc}") from None
        self._pending: tarfile.TarInfo | None = None
        self._ended = False

    def close(self) -> None:
        """Release the file."""
        self._tar.close()
        self._file.close()

    def __enter__(self) -> "PackReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _bad(self, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.path} is not a complete ppc export: {why}")

    def next(self) -> tarfile.TarInfo | None:
        """The next member (None at the end); folders are passed over, anything else but
        a plain file is refused."""
        if self._pending is not None:
            member, self._pending = self._pending, None
            return member
        if self._ended:
            return None  # a stream cannot be asked again past its end
        member = self._next()
        while member is not None and member.isdir():  # a pack tarred by hand lists its folders: no data
            member = self._next()
        self._ended = member is None
        if member is not None and not member.isfile():
            raise self._bad(f"member {member.name} is not a plain file")
        if member is not None and member.name in self.digests:
            raise self._bad(f"member {member.name} appears twice")
        return member

    def _next(self) -> tarfile.TarInfo | None:
        try:
            member = self._tar.next()
            # Stream mode keeps every member it has read: a pack of many members would grow it.
            self._tar.members.clear()
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            raise self._bad(f"its tar structure is damaged ({exc})") from None
        return member

    def push_back(self, member: tarfile.TarInfo) -> None:
        """Hand `member` out again at the next `next` (its bytes not read yet)."""
        self._pending = member

    def expect(self, name: str) -> tarfile.TarInfo:
        """The next member, which must be `name`."""
        member = self.next()
        if member is None or member.name != name:
            found = "the end" if member is None else member.name
            raise self._bad(f"{name} is missing (found {found} in its place)")
        return member

    def stream(self, member: tarfile.TarInfo, limit: int, sink: IO[bytes] | None = None) -> bytes:
        """Read `member` in chunks, hashing it; its declared size is checked first.

        Args:
            member: The member `next` gave.
            limit: The most bytes it may hold (the error says so before anything is read).
            sink: Where its bytes go (None: returned, for the small members).

        Returns:
            Its bytes if no `sink` was given, else b"".
        """
        if member.size > limit:
            raise self._bad(f"member {member.name} declares {member.size:,} bytes, more than the {limit:,} it may hold")
        h, parts, left = digest(), [], member.size
        try:
            f = self._tar.extractfile(member)
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise self._bad(f"member {member.name} is truncated")
                h.update(chunk)
                left -= len(chunk)
                if sink is None:
                    parts.append(chunk)
                else:
                    sink.write(chunk)
        except (tarfile.TarError, EOFError, ValueError) as exc:  # zlib.error is an OSError: raised as one
            raise self._bad(f"member {member.name} does not read ({exc})") from None
        self.digests[member.name] = h.digest()
        return b"".join(parts)

    def manifest(self) -> dict:
        """The first member, ``manifest.json``, parsed and checked for its fields."""
        data = self.stream(self.expect(MANIFEST), MAX_MANIFEST)
        try:
            manifest = load_json(data, what=MANIFEST, max_bytes=MAX_MANIFEST, max_depth=8)
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.path}: {exc}") from None
        fields = {"format": str, "block_size": int, "models": dict, "blocks": int}
        for key, kind in fields.items():
            value = manifest.get(key) if isinstance(manifest, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                raise InvalidArgumentError(f"{self.path}: {MANIFEST} lacks a valid {key!r}")
        if manifest["block_size"] < 1:
            raise InvalidArgumentError(f"{self.path}: {MANIFEST} lacks a valid 'block_size'")
        return manifest

    def nodes(self, manifest: dict) -> list[Node]:
        """The second member, ``nodes.bin``: as many records as the manifest declares."""
        per_record = RECORD_HEAD.size + RECORD_FIXED + 4 * manifest["block_size"]
        data = self.stream(self.expect(NODES), min(MAX_NODES, manifest["blocks"] * per_record))
        nodes = list(unpack_records(data, self.path))
        if len(nodes) != manifest["blocks"]:
            raise InvalidArgumentError(
                f"{self.path}: damaged node records: {NODES} holds {len(nodes)}, its manifest says {manifest['blocks']}"
            )
        return nodes

    def signature(self) -> dict | None:
        """The last member, ``signature.json`` (None if the pack has none); nothing may follow."""
        member = self.next()
        if member is None:
            return None
        if member.name != SIGNATURE:
            raise self._bad(f"unexpected member {member.name}")
        data = self.stream(member, MAX_SIGNATURE)
        if self.next() is not None:
            raise self._bad(f"a member follows {SIGNATURE}")
        try:
            return load_json(data, what=SIGNATURE, max_bytes=MAX_SIGNATURE, max_depth=4)
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.path}: {exc}") from None


def block_size_of(path: str) -> int:
    """The block size a pack's manifest declares (its first member, read bounded).

    Raises:
        InvalidArgumentError: If `path` is not a pack.
    """
    with PackReader(path) as reader:
        return int(reader.manifest()["block_size"])


def dumps(value: Any) -> bytes:
    """A member's JSON as the packs write it."""
    return json.dumps(value, indent=1).encode()
