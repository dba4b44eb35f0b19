"""Tiers around the disk store: the RAM tier of recently used blocks (`memory`) and the
remote tier shared by every host through a Redis / Valkey server (`remote*`).

The remote tier's counter names and defaults live here, so that a handle without a
remote never imports its client (`store` imports `remote` only when one is configured).
"""

REMOTE_TIMEOUT = 0.1  # seconds one round trip to the server may take (`remote_timeout`)
REMOTE_QUEUE_BYTES = 256 * 1024 * 1024  # the publisher's queue, at most
REMOTE_COUNTERS = (
    "remote_hits", "remote_misses",  # fetches the remote served blocks to, or was asked in vain
    "remote_blocks", "remote_bytes_read",
    "remote_errors",  # failed round trips
    "remote_corrupt", "remote_unauthenticated",  # values rejected
    "remote_skipped",  # calls skipped while the server backs off
    "remote_published", "remote_bytes_published",
    "remote_already",  # published blocks the server held before
    "remote_dropped",  # publish queue full
    "remote_publish_failed",
    # Continuations left on the server: reading them was slower than a prefill, by the
    # cost model (their tokens count in tokens_skipped).
    "remote_slower",
)  # fmt: skip
