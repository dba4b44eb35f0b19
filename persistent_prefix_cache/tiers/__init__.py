"""Tiers around the disk store: the RAM tier of recently used blocks (`memory`) and the
remote tier shared by every host through a Redis / Valkey server (`remote*`).

The remote tier's counter names and defaults live here, so that a handle without a
remote never imports its client (`store` imports `remote` only when one is configured).
"""

REMOTE_TIMEOUT = 0.1  # seconds one round trip to the server may take (`remote_timeout`)
REMOTE_QUEUE_BYTES = 256 * 1024 * 1024  # the publisher's queue, at most
REMOTE_COUNTERS = (
    "remote_hits", "remote_misses", "remote_blocks", "remote_errors", "remote_corrupt",
    "remote_unauthenticated", "remote_skipped", "remote_bytes_read", "remote_published",
    "remote_bytes_published", "remote_already", "remote_dropped", "remote_publish_failed", "remote_slower",
)  # fmt: skip
