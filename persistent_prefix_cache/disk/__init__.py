"""Everything on disk: the LMDB index, segment files (writer, reader), the read path into
joined buffers, crash-safe writes and sweeps, and the migrations runner (maintenance: `..admin`).

Nothing here knows mlx-lm's cache classes (`..layers` does) or the store facade.
"""
