"""Frozen codecs of the formats older migrations read and write: never edited.

A module here is a copy of a format's code as it was when that format was current, so
that a later format never changes what an old migration (or ``ppc import`` of an old
export) reads or writes. It imports only the standard library, numpy/mlx/xxhash, other
modules here and `persistent_prefix_cache.disk.portable` (OS calls, no format);
``tests/test_layout.py`` checks that and pins each module's bytes.
"""
