"""Make tests/data/v3_stores.tar.gz: a schema v3 store (segment format ``ppc-segment/3``)
and an export of it (``ppc-export/2``) written by this project's code before segment
format v4, for the migration tests.

Run with that code (commit 1fd2b40, the last with schema v3) on the path and not the
editable install of this checkout (``-S`` skips its finder; the migrations folder goes
inside the package, where an installed wheel has it), from outside the checkout::

    git worktree add /tmp/v3 1fd2b40
    mkdir /tmp/v3pkg && cp -r /tmp/v3/persistent_prefix_cache /tmp/v3pkg/
    cp -r /tmp/v3/migrations /tmp/v3pkg/persistent_prefix_cache/
    cd /tmp && PYTHONPATH=/tmp/v3pkg:$VENV/lib/python3.11/site-packages \
        $VENV/bin/python -S $CHECKOUT/tests/data/make_v3_stores.py \
        $CHECKOUT/tests/data/legacy_stores.tar.gz $CHECKOUT/tests/data/v3_stores.tar.gz

The model is the one kept in ``legacy_stores.tar.gz`` (the tests load it from there).
The store holds the legacy prompts (two share their first block) and a prompt stored
in two steps (two segments on one chain), with a hit recorded.
"""

import json
import os
import sys
import tarfile
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.tiny_model import load_tiny_model


def main(legacy: str, out: str) -> None:
    work = tempfile.mkdtemp()
    with tarfile.open(legacy) as tar:
        tar.extractall(work, filter="data")
    spec = json.load(open(os.path.join(work, "prompts.json")))
    block = spec["block_size"]
    model = load_tiny_model(os.path.join(work, "model"))
    prompts = list(spec["prompts"])
    long = [(19 * i + 7) % 500 + 1 for i in range(4 * block + 3)]
    prompts.append(long)
    v3 = os.path.join(work, "v3")
    with PersistentPrefixCache(v3, model, block_size=block) as store:
        for tokens in spec["prompts"]:
            cache = make_prompt_cache(model)
            model(mx.array(tokens)[None], cache=cache)
            store.store(tokens, cache)
        # The long prompt in two steps: its first two blocks, then the rest.
        cache = make_prompt_cache(model)
        model(mx.array(long[: 2 * block])[None], cache=cache)
        store.store(long[: 2 * block], cache)
        model(mx.array(long[2 * block :])[None], cache=cache)
        store.store(long, cache)
        store.flush()
        store.fetch(prompts[0])  # a hit, so the counters are not all zero
        store.flush()
    pack = os.path.join(work, "v3.ppcpack")
    with StoreAdmin(v3) as admin:
        admin.export_pack(pack)
    with open(os.path.join(work, "v3_prompts.json"), "w") as f:
        json.dump({"block_size": block, "prompts": prompts}, f)
    with tarfile.open(out, "w:gz") as tar:
        for name in ("v3", "v3.ppcpack", "v3_prompts.json"):
            tar.add(os.path.join(work, name), arcname=name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
