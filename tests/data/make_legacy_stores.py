"""Make tests/data/legacy_stores.tar.gz: stores written by this project's code before
schema v3, for the migration tests.

Run with that code (commit f56ca36, the last with schema v2) on the path and not the
editable install of this checkout (``-S`` skips its finder; the migrations folder goes
inside the package, where an installed wheel has it), from outside the checkout::

    git worktree add /tmp/v2 f56ca36
    mkdir /tmp/v2pkg && cp -r /tmp/v2/persistent_prefix_cache /tmp/v2pkg/
    cp -r /tmp/v2/migrations /tmp/v2pkg/persistent_prefix_cache/
    cd /tmp && PYTHONPATH=/tmp/v2pkg:$VENV/lib/python3.11/site-packages \
        $VENV/bin/python -S $CHECKOUT/tests/data/make_legacy_stores.py \
        $CHECKOUT/tests/data/legacy_stores.tar.gz

``v2_export.ppcpack`` beside it is ``StoreAdmin(<the v2 store>).export_pack(...)`` run
with the same code on the v2 store of that archive (an ``ppc-export/1`` pack).

It writes the tiny test model (weights included, so the tests need not rebuild them
bit for bit), a schema v2 store filled by that code's `PersistentPrefixCache`, a schema
v1 store made from it the way that code's tests made one (the v1 migration only, then
the same records and block files), and the prompts.
"""

import json
import os
import sys
import tarfile
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.disk.index import Index, Writer
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

BLOCK = 16


def main(out: str) -> None:
    work = tempfile.mkdtemp()
    model_dir = os.path.join(work, "model")
    write_tiny_model(model_dir, **TEST_MODEL)
    model = load_tiny_model(model_dir)
    base = [(7 * i + 3) % 500 + 1 for i in range(BLOCK)]
    prompts = [
        base + [(11 * i + 5) % 500 + 1 for i in range(BLOCK + 7)],
        base + [(13 * i + 2) % 500 + 1 for i in range(9)],
        [(17 * i + 1) % 500 + 1 for i in range(3 * BLOCK + 4)],
    ]
    v2 = os.path.join(work, "v2")
    with PersistentPrefixCache(v2, model, model_path=model_dir, block_size=BLOCK) as store:
        for tokens in prompts:
            cache = make_prompt_cache(model)
            model(mx.array(tokens)[None], cache=cache)
            store.store(tokens, cache)
        store.flush()
        store.fetch(prompts[0])  # a hit, so the counters are not all zero
        store.flush()
    v1 = os.path.join(work, "v1")
    src = Index(os.path.join(v2, "index"), readonly=True)
    old = Index(os.path.join(v1, "index"), migrate=False)
    old.apply_migrations({"block_size": src.block_size}, upto=1)
    with src.reader() as r:
        nodes = sorted(r.iter_nodes(), key=lambda n: n.position)
        models = r.models()

    def copy(w: Writer):
        for root, desc in models.items():
            w.register_model(root, desc)
        for n in nodes:
            n.child_count = 0
            assert w.insert(n)

    old.write(copy)
    old.close()
    src.close()
    for folder, _, names in os.walk(os.path.join(v2, "blocks")):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), v2)
            os.makedirs(os.path.dirname(os.path.join(v1, rel)), exist_ok=True)
            with open(os.path.join(v2, rel), "rb") as a, open(os.path.join(v1, rel), "wb") as b:
                b.write(a.read())
    with open(os.path.join(work, "prompts.json"), "w") as f:
        json.dump({"block_size": BLOCK, "prompts": prompts}, f)
    with tarfile.open(out, "w:gz") as tar:
        for name in ("model", "v1", "v2", "prompts.json"):
            tar.add(os.path.join(work, name), arcname=name)


if __name__ == "__main__":
    main(sys.argv[1])
