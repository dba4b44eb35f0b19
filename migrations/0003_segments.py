"""Schema v3: segment files, and every table in LMDB's main database.

v2 kept one file per block (64 opens and ~16k I/O vectors to restore 128 MiB) and
its tables in named databases (opening one takes LMDB's write lock, so a writable
open waited behind any other process's commit). v3:

- blocks live in *segment* files (``segments/ab/<id>.seg``, see
  `persistent_prefix_cache.disk.segment`): each v2 block file is verified and its
  blocks are rewritten, chain by chain (up to 64 consecutive blocks per segment);
- node records gain their segment id (record version 2); a block file that is
  missing or damaged is dropped with everything stored after it (a miss, as a read
  would have found);
- the tables move into the main database under one-byte prefixes (see
  `persistent_prefix_cache.disk.index_tables`), with a new ``segments`` table of live
  counts, and the named databases are dropped.

Segment files (format v3, written by the frozen `migrations/formats/segment_v3.py`: migration 0004
rewrites them as v4) are written and fsynced before the transaction commits; a crash before
the commit leaves the v2 store as it was (and unreferenced segments, swept later).
After the commit the old ``blocks/`` folder is removed.
"""

import os
import shutil

VERSION = 3
DESCRIPTION = "segment files; all tables in the main database"

OLD_DATABASES = (b"meta", b"models", b"nodes", b"children", b"lru", b"fingerprints", b"hits")
GROUP = 64  # blocks per segment written by the migration
# The live formats this migration reads and writes through (`persistent_prefix_cache.blocks`'
# records, `disk.index_tables`' tables), at the versions it was written for: before either
# moves on, the code this migration needs is frozen into migrations/formats/ (tests/test_layout.py).
LIVE = {"record": 2, "tables": 3}


def upgrade(env, txn, params):
    """Rewrite the v2 blocks into segments and the tables into the main database.

    Args:
        env: The open LMDB environment.
        txn: The write transaction every migration of this run shares.
        params: ``store``: the store directory.
    """
    import lmdb

    from persistent_prefix_cache.blocks import Node
    from persistent_prefix_cache.disk.index_tables import Writer, u64
    from persistent_prefix_cache.migrations.formats import block_files_v2  # frozen: the v1-v2 block files
    from persistent_prefix_cache.migrations.formats import segment_v3  # frozen: v3 as this migration wrote it

    old = {}
    for name in OLD_DATABASES:
        try:
            old[name] = env.open_db(name, txn=txn, create=False)
        except lmdb.NotFoundError:
            pass

    def items(name):
        if name not in old:
            return []
        with txn.cursor(db=old[name]) as cur:
            return [(bytes(k), bytes(v)) for k, v in cur]

    meta = dict(items(b"meta"))
    w = Writer(txn)
    w.put_meta(b"block_size", meta.get(b"block_size", str(int(params.get("block_size", 64))).encode()))
    for name in (b"hits", b"misses", b"tokens_saved", b"corrupt"):
        w.put_meta(name, meta.get(name, u64(0)))
    w.put_meta(b"bytes", u64(0))
    w.put_meta(b"blocks", u64(0))
    w.put_meta(b"file_bytes", u64(0))
    for root, description in items(b"models"):
        w.register_model(root, description)
    for signature, fingerprint in items(b"fingerprints"):
        w.remember_fingerprint(signature, fingerprint.decode())
    hits = dict(items(b"hits"))

    nodes = {}
    for key, raw in items(b"nodes"):
        try:
            nodes[key] = Node.unpack(key, raw)
        except ValueError:
            continue  # a malformed record: a miss before, dropped now
    segments = os.path.join(params["store"], "segments")
    # A v2 store references no segment: any there were left by a migration that died
    # before its commit. (The folder is made by the first write: a new, empty store
    # passes through here too, and its folders take the store's modes.)
    for entry in os.scandir(segments) if os.path.isdir(segments) else ():
        if entry.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
    dropped = set()
    for group in _chains(nodes):
        blocks = []
        for node in group:
            tensors = None if node.parent in dropped else block_files_v2.read_block(params["store"], node)
            if tensors is None:
                dropped.add(node.key)
                continue
            node.child_count = 0  # counted again as the children are inserted
            blocks.append((node, tensors))
        if not blocks:
            continue
        segment, size, digest = segment_v3.write(params["store"], blocks)
        w.add_segment(segment, size, digest)
        for node, _ in blocks:
            if w.insert(node) and node.key in hits:
                w.count_hits({node.key: int.from_bytes(hits[node.key], "little")})
        if w.segment(segment) is not None and w.segment(segment)[0] == 0:
            w.free_segment(segment)
    for db in old.values():
        txn.drop(db, delete=True)


def after_commit(params):
    """Remove the v2 block files (nothing references them any more)."""
    shutil.rmtree(f"{params['store']}/blocks", ignore_errors=True)


def _chains(nodes):
    """The nodes in trie preorder, cut into runs of consecutive blocks (parent, child)."""
    children = {}
    for node in nodes.values():
        children.setdefault(node.parent, []).append(node)
    for kids in children.values():
        kids.sort(key=lambda n: n.key)
    roots = sorted((n for n in nodes.values() if n.parent not in nodes), key=lambda n: (n.parent, n.key))
    group = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if group and (group[-1].key != node.parent or len(group) >= GROUP):
            yield group
            group = []
        group.append(node)
        stack.extend(reversed(children.get(node.key, [])))
    if group:
        yield group
