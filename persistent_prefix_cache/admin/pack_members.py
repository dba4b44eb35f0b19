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
from typing import IO, Any, Iterator, Protocol

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


# What a pack's first bytes are when it is one: its first member's name (``ppc export``
# writes manifest.json first), tar's magic, or a compressor's.
HEAD = 512
PACK_STARTS = (MANIFEST.encode() + b"\0", b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")
DAMAGED_HINT = "nothing was written; export it again, or copy the whole file"


class _PackTar(tarfile.TarFile):
    """A tar file that says how its archive ended: `cut` is None at tar's end-of-archive
    marker, else why a member's header could not be read (`_BoundedTarInfo` sets it)."""

    cut: str | None = None


class _BoundedTarInfo(tarfile.TarInfo):
    # tarfile reads a pax header or a GNU long name whole into memory, whatever size its
    # header declares: a bound first (the members of a pack have short names).
    def _proc_member(self, tarfile_):
        if self.type in tarfile.GNU_TYPES + (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
            if self.size > MAX_EXTENDED_HEADER:
                raise tarfile.ReadError(f"an extended header of {self.size:,} bytes")
        return super()._proc_member(tarfile_)

    # tarfile takes a header it cannot read whole, past the first, for the end of the
    # archive: say which it was, so that a cut pack is not taken for a complete one.
    @classmethod
    def fromtarfile(cls, tarfile_):
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.EOFHeaderError:
            raise  # a block of zeros: tar's end-of-archive marker
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):
            tarfile_.cut = "truncated"
            raise
        except tarfile.InvalidHeaderError:
            tarfile_.cut = "damaged"
            raise


class _Head:
    """A binary stream read through, keeping its first `HEAD` bytes (to tell a pack that
    does not read from a file that is no pack at all)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.head = f, b""

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if len(self.head) < HEAD:
            self.head += data[: HEAD - len(self.head)]
        return data


def _ends_early(exc: BaseException) -> bool:
    """Whether a tar or decompression error means the data stopped short."""
    text = str(exc)
    return isinstance(exc, EOFError) or any(w in text for w in ("unexpected end", "truncated", "ended before"))


class Sink(Protocol):
    """Where `PackReader.stream` writes a member's bytes (a binary file, or a sink that keeps nothing)."""

    def write(self, data: bytes, /) -> object: ...


class PackReader:
    """A pack opened for reading, member by member (compressed or not: ``r|*``), in one
    pass: a pipe (``ppc import -``) reads as well as a file.

    Args:
        path: The pack (with `stream`: the name messages give it, e.g. ``stdin``).
        stream: A binary stream to read the pack from instead of opening `path`.

    Raises:
        InvalidArgumentError: If `path` cannot be read (missing, a folder, permissions:
            said as such), is empty, is not a tar file, or is cut short or damaged
            before its first member.
    """

    def __init__(self, path: str, *, stream: IO[bytes] | None = None):
        self.path = path
        self.digests: dict[str, bytes] = {}  # member -> BLAKE2b-256 of its bytes, as read
        self._file = stream if stream is not None else _open(path)
        self._own = stream is None
        self._head = _Head(self._file)
        try:
            # Ignored: typeshed's fileobj also seeks, tells and writes; a stream ("r|*") only reads.
            self._tar = _PackTar.open(  # type: ignore[call-overload]
                fileobj=self._head, mode="r|*", tarinfo=_BoundedTarInfo
            )
        except (tarfile.TarError, OSError, EOFError) as exc:
            self._close_file()
            raise self._not_opened(exc) from None
        self._pending: tarfile.TarInfo | None = None
        self._ended = False
        self._last: str | None = None  # the last member read (for messages)
        self._manifest: dict | None = None

    def _not_opened(self, exc: BaseException) -> InvalidArgumentError:
        if str(exc) == "empty file":
            return InvalidArgumentError(f"{self.path} is empty: not a ppc export")
        if not self._head.head.startswith(PACK_STARTS) and self._head.head[257:262] != b"ustar":
            return InvalidArgumentError(f"{self.path} is not a ppc export (not a tar file written by `ppc export`)")
        if _ends_early(exc):
            return self._truncated("it ends inside its first member's header")
        return self._bad(f"its first member does not read ({exc})")

    def _close_file(self) -> None:
        if self._own:
            self._file.close()

    def close(self) -> None:
        """Release the file (a stream given is left open)."""
        self._tar.close()
        self._close_file()

    def __enter__(self) -> "PackReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _bad(self, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.path} is a damaged ppc export: {why}", hint=DAMAGED_HINT)

    def _truncated(self, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.path} is truncated: {why}", hint=DAMAGED_HINT)

    def next(self) -> tarfile.TarInfo | None:
        """The next member (None at the end); folders are passed over, anything else but
        a plain file is refused."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
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
            if _ends_early(exc):
                raise self._truncated(f"it ends {self._where()}") from None
            raise self._bad(f"its tar structure is damaged ({exc})") from None
        if member is None and self._tar.cut == "truncated":
            raise self._truncated(f"it ends {self._where()}, without tar's end-of-archive marker")
        if member is None and self._tar.cut is not None:
            raise self._bad(f"the header {self._where()} is not a tar header")
        if member is not None:
            self._last = member.name
        return member

    def _where(self) -> str:
        return f"after member {self._last}" if self._last else "before its first member"

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

    def stream(self, member: tarfile.TarInfo, limit: int, sink: Sink | None = None) -> bytes:
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
        short = f"it ends inside member {member.name} ({member.size:,} bytes)"
        try:
            f = self._tar.extractfile(member)
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise self._truncated(short)
                h.update(chunk)
                left -= len(chunk)
                if sink is None:
                    parts.append(chunk)
                else:
                    sink.write(chunk)
        except (tarfile.TarError, EOFError, ValueError) as exc:  # a zlib.error comes as tarfile's ReadError
            if isinstance(exc, InvalidArgumentError):
                raise
            if _ends_early(exc):
                raise self._truncated(short) from None
            raise self._bad(f"member {member.name} does not read ({exc})") from None
        self.digests[member.name] = h.digest()
        return b"".join(parts)

    def manifest(self) -> dict:
        """The first member, ``manifest.json``, parsed and checked for its fields (read
        once: a second call gives the same)."""
        if self._manifest is None:
            self._manifest = self._read_manifest()
        return self._manifest

    def _read_manifest(self) -> dict:
        data = self.stream(self.expect(MANIFEST), MAX_MANIFEST)
        try:
            manifest = load_json(data, what=MANIFEST, max_bytes=MAX_MANIFEST, max_depth=8)
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.path}: {exc}") from None
        fields = {"format": str, "block_size": int, "models": dict, "blocks": int}
        for key, kind in fields.items():
            value = manifest.get(key) if isinstance(manifest, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
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


def _open(path: str) -> IO[bytes]:
    """`path` opened for reading; what stops it said as such (a folder, permissions)."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InvalidArgumentError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{path} is a directory, not a pack: name a file written by `ppc export`") from None
    except PermissionError:
        raise InvalidArgumentError(
            f"{path}: permission denied: this user cannot read it",
            hint="nothing was written; run as a user who may read it, or change its permissions",
        ) from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc.strerror or exc}") from None


def dumps(value: Any) -> bytes:
    """A member's JSON as the packs write it."""
    return json.dumps(value, indent=1).encode()
