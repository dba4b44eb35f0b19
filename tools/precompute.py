#!/usr/bin/env python3
"""Run ``ppc precompute`` from a checkout, without installing the package.

Usage: ``python tools/precompute.py --model MODEL --store STORE [INPUT ...]``
(the same options as ``ppc precompute --help``).
"""

import os
import sys

# The repository root, so that `persistent_prefix_cache` imports from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from persistent_prefix_cache.cli.precompute import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
