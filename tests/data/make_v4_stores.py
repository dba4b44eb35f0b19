"""Make tests/data/v4_stores.tar.gz: a schema v4 store (segment format ``ppc-segment/4``)
and an export of it (``ppc-export/3``) written by this project's code before segment
format v5, for the migration tests.

Run with that code (commit ed6cf38, the last with schema v4) on the path and not the
editable install of this checkout (``-S`` skips its finder; the migrations folder goes
inside the package, where an installed wheel has it), from outside the checkout::

    mkdir /tmp/v4 && git archive ed6cf38 | tar -x -C /tmp/v4
    mkdir /tmp/v4pkg && cp -r /tmp/v4/persistent_prefix_cache /tmp/v4pkg/
    cp -r /tmp/v4/migrations /tmp/v4pkg/persistent_prefix_cache/
    cd /tmp && PYTHONPATH=/tmp/v4pkg:$VENV/lib/python3.11/site-packages \
        $VENV/bin/python -S $CHECKOUT/tests/data/make_v4_stores.py \
        $CHECKOUT/tests/data/legacy_stores.tar.gz $CHECKOUT/tests/data/v4_stores.tar.gz

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
from persistent_prefix_cache.disk.segment_header import SEGMENT_FORMAT
from persistent_prefix_cache.tiny_model import load_tiny_model


def main(legacy: str, out: str) -> None:
    assert SEGMENT_FORMAT == "ppc-segment/4", "run with the v4 code (see the docstring)"
    work = tempfile.mkdtemp()
    with tarfile.open(legacy) as tar:
        tar.extractall(work, filter="data")
    spec = json.load(open(os.path.join(work, "prompts.json")))
    block = spec["block_size"]
    model = load_tiny_model(os.path.join(work, "model"))
    prompts = list(spec["prompts"])
    long = [(23 * i + 11) % 500 + 1 for i in range(4 * block + 3)]
    prompts.append(long)
    v4 = os.path.join(work, "v4")
    with PersistentPrefixCache(v4, model, block_size=block) as store:
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
    pack = os.path.join(work, "v4.ppcpack")
    with StoreAdmin(v4) as admin:
        admin.export_pack(pack)
    with open(os.path.join(work, "v4_prompts.json"), "w") as f:
        json.dump({"block_size": block, "prompts": prompts}, f)
    with tarfile.open(out, "w:gz") as tar:
        for name in ("v4", "v4.ppcpack", "v4_prompts.json"):
            tar.add(os.path.join(work, name), arcname=name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
