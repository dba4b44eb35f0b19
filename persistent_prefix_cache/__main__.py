"""``python -m persistent_prefix_cache``: the same as the ``ppc`` command."""

import sys

from .cli import main

sys.exit(main())
