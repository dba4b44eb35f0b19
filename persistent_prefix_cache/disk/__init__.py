"""Everything on disk: the LMDB index, node records, block files, the read path into
joined buffers, crash-safe writes and sweeps, maintenance and the migrations runner.

Nothing here knows mlx-lm's cache classes (`..layers` does) or the store facade.
"""
