"""Run by tests/test_portable.py inside the run whose Linux-only calls are hidden: proof
that they are hidden there, and in the processes it starts, before the store runs."""

from __future__ import annotations

import os

from helpers import run_python_json

from persistent_prefix_cache.disk import portable
from persistent_prefix_cache.disk.faults import hook

CHECK = """
    import json, os
    from persistent_prefix_cache.disk import portable
    print(json.dumps([hasattr(os, "preadv"), hasattr(os, "writev"), portable.HAS_PREADV,
                      portable.HAS_WRITEV, portable.HAS_SYNC_FILE_RANGE]))
"""


def test_the_linux_calls_are_hidden_here_and_in_children():
    assert hook("linux_calls_hidden")
    assert not hasattr(os, "preadv") and not hasattr(os, "writev")
    assert (portable.HAS_PREADV, portable.HAS_WRITEV, portable.HAS_SYNC_FILE_RANGE) == (False,) * 3
    assert run_python_json(CHECK) == [False] * 5
