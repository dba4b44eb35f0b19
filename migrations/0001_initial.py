"""Schema v1: the first layout of the index.

Named databases:
- ``meta``: store-wide values (schema version, block size, byte and block totals).
- ``models``: root key -> JSON (fingerprint, namespace, layout) of every model stored.
- ``nodes``: block key -> packed `Node` record.
- ``children``: parent key + child key -> empty (the trie's edges, scanned by prefix).
- ``lru``: last access (8 bytes big-endian, ns) + block key -> empty (eviction order).
- ``fingerprints``: hash of weight files' (path, size, mtime, inode) -> model fingerprint,
  so that a model loaded from unchanged files is not hashed again.
"""

VERSION = 1
DESCRIPTION = "initial layout: meta, models, nodes, children, lru"

DATABASES = (b"meta", b"models", b"nodes", b"children", b"lru", b"fingerprints")


def upgrade(env, txn, params):
    """Create the v1 databases and the store-wide values.

    Args:
        env: The open LMDB environment.
        txn: The write transaction every migration of this run shares.
        params: ``block_size`` (int) for a new store.
    """
    for name in DATABASES:
        env.open_db(name, txn=txn, create=True)
    meta = env.open_db(b"meta", txn=txn)
    txn.put(b"block_size", str(int(params["block_size"])).encode(), db=meta)
    txn.put(b"bytes", (0).to_bytes(8, "little"), db=meta)
    txn.put(b"blocks", (0).to_bytes(8, "little"), db=meta)
