"""Make tests/data/xxh3_store.tar.gz: a store written by this project's code before the
lanes fingerprint (issue 18 item 4; main at d2fca27), for `tests/test_fingerprint_lanes.py`.

It holds a tiny model folder (``model``, seed 5), a store (``store``) with two prompts'
KV under that model's (xxh3) fingerprint and a second model's (seed 7, folder
``other``: only its fingerprint matters) one prompt, and ``spec.json`` (the prompts,
block size and both fingerprints as that code computed them).

Run with that code on the path and not the editable install of this checkout (``-S``
skips its finder), from outside the checkout::

    mkdir /tmp/mainpkg && git -C $CHECKOUT archive d2fca27 persistent_prefix_cache | tar -x -C /tmp/mainpkg
    git -C $CHECKOUT archive --prefix=persistent_prefix_cache/ d2fca27 migrations | tar -x -C /tmp/mainpkg
    cd /tmp && PYTHONPATH=/tmp/mainpkg:$VENV/lib/python3.11/site-packages \\
        $VENV/bin/python -S $CHECKOUT/tests/data/make_xxh3_store.py $CHECKOUT/tests/data/xxh3_store.tar.gz
"""

import json
import os
import sys
import tarfile
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

BLOCK = 16


def _store(path, model, prompts, **options):
    with PersistentPrefixCache(path, model, block_size=BLOCK, **options) as store:
        for tokens in prompts:
            cache = make_prompt_cache(model)
            model(mx.array(tokens)[None], cache=cache)
            store.store(tokens, cache)
        store.flush()
        return store.fingerprint


def main(out: str) -> None:
    work = tempfile.mkdtemp()
    model = load_tiny_model(write_tiny_model(os.path.join(work, "model"), seed=5, **TEST_MODEL))
    other = load_tiny_model(write_tiny_model(os.path.join(work, "other"), seed=7, **TEST_MODEL))
    prompts = [
        [(13 * i + 5) % 500 + 1 for i in range(3 * BLOCK + 4)],
        [(7 * i + 2) % 500 + 1 for i in range(2 * BLOCK)],
    ]
    other_prompts = [[(11 * i + 3) % 500 + 1 for i in range(2 * BLOCK)]]
    store = os.path.join(work, "store")
    spec = {
        "block_size": BLOCK,
        "prompts": prompts,
        "other_prompts": other_prompts,
        "fingerprint": _store(store, model, prompts),
        "other_fingerprint": _store(store, other, other_prompts),
    }
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)
    with tarfile.open(out, "w:gz") as tar:
        for name in ("model", "store", "spec.json"):
            tar.add(os.path.join(work, name), arcname=name)


if __name__ == "__main__":
    main(sys.argv[1])
