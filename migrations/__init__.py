"""Numbered schema migrations of the store's LMDB index.

Each module ``NNNN_name.py`` defines ``VERSION`` (the schema version it produces),
``DESCRIPTION`` and ``upgrade(env, txn, params)``. The runner (`persistent_prefix_cache.index`)
applies pending ones in order inside one write transaction and stamps the version last.
This folder sits at the top of the repository and ships inside the wheel as
``persistent_prefix_cache.migrations``.
"""
