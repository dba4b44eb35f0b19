"""Schema v2: hit counters that outlive the process.

v1 kept hits, misses and tokens saved only in each open handle, so `ppc stats` could
not say how much a store had served, nor `ppc inspect` which prefixes are hot. v2
adds store-wide counters to ``meta`` and a ``hits`` database:

- ``meta``: ``hits``, ``misses``, ``tokens_saved``, ``corrupt`` (u64 little-endian).
- ``hits``: block key -> u64 little-endian count of fetches that restored the block.

Existing blocks start at zero hits; nothing else changes.
"""

VERSION = 2
DESCRIPTION = "store-wide hit counters and per-block hit counts"

COUNTERS = (b"hits", b"misses", b"tokens_saved", b"corrupt")


def upgrade(env, txn, params):
    """Create the ``hits`` database and zeroed counters.

    Args:
        env: The open LMDB environment.
        txn: The write transaction every migration of this run shares.
        params: Unused.
    """
    env.open_db(b"hits", txn=txn, create=True)
    meta = env.open_db(b"meta", txn=txn)
    for name in COUNTERS:
        txn.put(name, (0).to_bytes(8, "little"), db=meta, overwrite=False)
