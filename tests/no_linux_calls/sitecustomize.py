"""Makes this interpreter look like one without Linux's extra calls (macOS's Python).

`tests/test_portable.py` puts this folder first on PYTHONPATH, so Python imports it at
start-up in the test run and in every process that run starts (workers killed with
SIGKILL, restarted stores, ``ppc`` commands), before anything of the package is
imported. The package picks its fallbacks (`disk.portable`) when it is imported.
"""

import ctypes
import os

HIDDEN = ("preadv", "pwritev", "writev", "posix_fadvise", "posix_fallocate", "sched_getaffinity")
for _name in HIDDEN:
    if hasattr(os, _name):
        delattr(os, _name)


class _WithoutSyncFileRange(ctypes.CDLL):
    """libc as macOS has it: no ``sync_file_range``."""

    def __getattr__(self, name):
        if name == "sync_file_range":
            raise AttributeError(name)
        return super().__getattr__(name)

    def __getitem__(self, name):
        if name == "sync_file_range":
            raise AttributeError(name)
        return super().__getitem__(name)


ctypes.CDLL = _WithoutSyncFileRange
# Said in the one test-hook variable (`disk/faults.py`), for `tests/portable_check.py`.
_hooks = [h for h in os.environ.get("PPC_TEST_HOOKS", "").split(",") if h and not h.startswith("linux_calls_hidden=")]
os.environ["PPC_TEST_HOOKS"] = ",".join(_hooks + ["linux_calls_hidden=" + ":".join(HIDDEN + ("sync_file_range",))])
