"""The members of an export pack (``ppc export``): a tar file of ``manifest.json``,
``nodes.bin`` (length-prefixed index records) and the segment files; read strictly, so
a damaged pack is one typed error."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import time
from typing import Iterator

from ..errors import InvalidArgumentError
from ..blocks import Node

RECORD_HEAD = struct.Struct("<16sI")  # a record's key and length, before the record


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add `data` to `tar` as the member `name`."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def read_member(tar: tarfile.TarFile, name: str, path: str) -> bytes:
    """The bytes of member `name` of the pack at `path` (a missing one is an error)."""
    try:
        f = tar.extractfile(name)
    except KeyError:
        f = None
    if f is None:
        raise InvalidArgumentError(f"{path} is not a complete ppc export: {name} is missing")
    return f.read()


def read_json(tar: tarfile.TarFile, name: str, path: str) -> dict:
    """Member `name` parsed as JSON."""
    try:
        return json.loads(read_member(tar, name, path))
    except ValueError:
        raise InvalidArgumentError(f"{path}: {name} is not valid JSON") from None


def unpack_records(data: bytes, path: str) -> Iterator[Node]:
    """The index records of ``nodes.bin``."""
    pos = 0
    while pos < len(data):
        try:
            key, n = RECORD_HEAD.unpack_from(data, pos)
            pos += RECORD_HEAD.size
            yield Node.unpack(key, data[pos : pos + n])
        except (struct.error, ValueError):
            raise InvalidArgumentError(f"{path}: damaged node records") from None
        pos += n
