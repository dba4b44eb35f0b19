"""Which pages of an LMDB ``data.mdb`` its trees use, read with ``pread``: the size guard.

A ``data.mdb`` shorter than a page LMDB reads kills the interpreter with SIGBUS (LMDB
reads through a memory map). The meta page's ``last_pgno`` is not that bound: LMDB
allocates pages past the end of the file and writes only those a commit still uses, so
a page freed in the transaction that allocated it (eviction frees many) is never
written, the file stays shorter than ``last_pgno``, and nothing ever reads that page.
What a reader or writer reads is the pages the trees of the newest meta page reach:
branch, leaf and overflow pages of the main database, of its named databases (schemas
v1-v2) and of the free list. `pages_in_use` walks them here, by ``pread`` (no map, so
a page past the end is a short read, never a signal), and returns the page count the
file must hold. It is only needed when the file is shorter than ``last_pgno`` says;
then it is exact: a file that holds every page in use opens, one that does not is
refused before LMDB maps it.

The layout read here is LMDB 0.9's on a 64-bit build (py-lmdb's bundled library):
page header ``[pgno u64][pad u16][flags u16][lower u16][upper u16 | pages u32]``,
node ``[lo u16][hi u16][flags u16][ksize u16][key][data]``, meta
``[magic u32][version u32][address u64][mapsize u64][free db][main db][last_pgno u64]
[txnid u64]``, each db ``[pad u32][flags u16][depth u16][branch, leaf, overflow pages,
entries, root: u64 each]``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAGIC = 0xBEEFC0DE
PAGE_HEADER = 16
META = struct.Struct("<IIQQ48s48sQQ")  # after the page header
DB = struct.Struct("<IHHQQQQQ")
NODE = struct.Struct("<HHHH")
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = (1 << 64) - 1
MAX_DEPTH = 64  # a B-tree of 2^64 pages is far shallower: deeper is a cycle


class DamagedPages(ValueError):
    """The trees do not parse (a page of the wrong kind, a cycle, a node out of its page)."""


@dataclass(frozen=True)
class Meta:
    """The newest meta page of a ``data.mdb``: page size, last page, transaction id and
    the roots of the free list and the main database (``P_INVALID``: empty)."""

    psize: int
    last_pgno: int
    txnid: int
    roots: tuple[int, int]


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return out


def read_meta(fd: int) -> Meta | None:
    """The newest valid meta page (None: not an LMDB data file, or shorter than its
    two meta pages)."""
    first = _pread(fd, PAGE_HEADER + META.size, 0)
    if len(first) < PAGE_HEADER + META.size:
        return None
    psize = DB.unpack(META.unpack_from(first, PAGE_HEADER)[4])[0]  # the free db's pad holds it
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return None
    best = None
    for n in (0, 1):
        raw = _pread(fd, PAGE_HEADER + META.size, n * psize)
        if len(raw) < PAGE_HEADER + META.size:
            return None
        magic, _, _, _, free, main, last, txnid = META.unpack_from(raw, PAGE_HEADER)
        if magic != MAGIC:
            continue
        meta = Meta(psize, last, txnid, (DB.unpack(free)[7], DB.unpack(main)[7]))
        if best is None or meta.txnid > best.txnid:
            best = meta
    return best


def pages_in_use(fd: int, meta: Meta, size: int) -> int:
    """How many pages the file must hold for every page the trees of `meta` reach (the
    two meta pages at least). A page is read only where the file holds it whole.

    Args:
        fd: The open ``data.mdb``.
        meta: Its newest meta page (`read_meta`).
        size: The file's size in bytes.

    Returns:
        1 + the highest page used (counting an overflow page's whole run).

    Raises:
        DamagedPages: If a tree does not parse (damage, or a writer in another process
            reused a page meanwhile: the caller reads the meta again and retries).
    """
    psize = meta.psize
    held = size // psize
    need = 2
    seen: set[int] = set()
    stack = [(root, 0) for root in meta.roots if root != P_INVALID]
    while stack:
        pgno, depth = stack.pop()
        if pgno in seen or depth > MAX_DEPTH or pgno < 2 or pgno > meta.last_pgno:
            raise DamagedPages(f"page {pgno} is referenced twice, too deep or out of range")
        seen.add(pgno)
        need = max(need, pgno + 1)
        if pgno >= held:
            continue  # not in the file: the caller refuses it; nothing below it can be read
        page = _pread(fd, psize, pgno * psize)
        flags = struct.unpack_from("<H", page, 10)[0]
        if flags & P_LEAF2:
            continue  # fixed-size keys, no pages below (DUPFIXED: not used by the index)
        if not flags & (P_BRANCH | P_LEAF):
            raise DamagedPages(f"page {pgno} is neither a branch nor a leaf (flags {flags:#x})")
        lower = struct.unpack_from("<H", page, 12)[0]
        if lower < PAGE_HEADER or lower > psize:
            raise DamagedPages(f"page {pgno} has a bad lower bound {lower}")
        for i in range((lower - PAGE_HEADER) // 2):
            at = struct.unpack_from("<H", page, PAGE_HEADER + 2 * i)[0]
            if at + NODE.size > psize:
                raise DamagedPages(f"page {pgno}: node {i} lies outside the page")
            lo, hi, nflags, ksize = NODE.unpack_from(page, at)
            if flags & P_BRANCH:
                stack.append((lo | hi << 16 | nflags << 32, depth + 1))
                continue
            data = at + NODE.size + ksize
            if nflags & F_BIGDATA:
                if data + 8 > psize:
                    raise DamagedPages(f"page {pgno}: node {i} lies outside the page")
                first = struct.unpack_from("<Q", page, data)[0]
                nbytes = lo | hi << 16
                run = (PAGE_HEADER + nbytes + psize - 1) // psize
                if first < 2 or first + run - 1 > meta.last_pgno:
                    raise DamagedPages(f"page {pgno}: overflow page {first} out of range")
                need = max(need, first + run)
            elif nflags & F_SUBDATA:
                if data + DB.size > psize:
                    raise DamagedPages(f"page {pgno}: node {i} lies outside the page")
                root = DB.unpack_from(page, data)[7]
                if root != P_INVALID:
                    stack.append((root, depth + 1))
    return need
