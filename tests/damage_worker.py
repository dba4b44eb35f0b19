"""One process of the index damage sweep (`test_index_damage.py`): for each page it is
given, on a fresh copy of the store, overwrite that 4 KiB page of ``index/data.mdb``
with random bytes, run ``ppc check`` and ``ppc check --fix`` as real subprocesses, then
open the store here and restore every prompt, comparing its KV with the original bits.

With ``"serve": true`` in the spec it plays a serving process instead, before any
check: it opens the damaged copy with the library and fetches every prompt, recording
hits (exact or not), misses and exceptions.

Usage: ``python damage_worker.py SPEC_JSON FIRST_PAGE`` (the spec names the store, the
work folder, the model, the prompts, the originals' ``.npz`` and the page count; optional
``seed`` for the random bytes, or ``"fill": "zeros"``).
Prints one JSON line per page; a page on which this process dies is the last line's
successor (the test restarts the worker after it and counts the death as an abort).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np

PAGE = 4096


def ppc_check(store: str, *flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--json", "--store", store, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = None
    return {
        "rc": proc.returncode,
        "traceback": "Traceback" in proc.stderr,
        "signal": -proc.returncode if proc.returncode < 0 else None,
        "error": proc.stderr.strip()[-300:] if proc.returncode else "",
        "clean": report["clean"] if report else None,
        "rebuilt": bool(report and report.get("rebuild")),
        "problems": [p["detail"] for p in report["problems"]] if report else [],
    }


def restore_all(store: str, model, prompts: list[list[int]], originals) -> tuple[int, list[str]]:
    """How many prompts restore fully and bitwise equal, and what went wrong for the rest."""
    import mlx.core as mx

    from persistent_prefix_cache import PersistentPrefixCache

    ok, failures = 0, []
    with PersistentPrefixCache(store, model, memory_bytes=0) as cache_store:
        for i, tokens in enumerate(prompts):
            cache, remaining = cache_store.fetch(tokens + [1])
            if cache is None or len(remaining) != 1:
                failures.append(f"prompt {i}: restored {len(tokens) + 1 - len(remaining)} of {len(tokens)}")
                continue
            same = True
            for j, layer in enumerate(cache):
                keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
                mx.eval(keys, values)
                same &= np.array_equal(np.array(keys), originals[f"{i}.{j}.k"])
                same &= np.array_equal(np.array(values), originals[f"{i}.{j}.v"])
            if same:
                ok += 1
            else:
                failures.append(f"prompt {i}: KV differs")
        # A write goes through (check never says clean when writes would fail).
        extra = [3, 1, 4, 1, 5, 9, 2, 6] * 5
        cache_store.store(extra, _prefill(model, extra))
        cache_store.flush()
    return ok, failures


def serve_all(store: str, model, prompts: list[list[int]], originals) -> dict:
    """A serving process on a damaged index: every fetch is an exact hit or a miss."""
    import mlx.core as mx

    from persistent_prefix_cache import PersistentPrefixCache, StoreCorruptError

    out = {"refused_at_open": False, "exact": 0, "misses": 0, "wrong": 0, "errors": []}
    try:
        cache_store = PersistentPrefixCache(store, model, memory_bytes=0)
    except StoreCorruptError:  # one typed error at open, naming `ppc check --fix`
        out["refused_at_open"] = True
        return out
    with cache_store:
        for i, tokens in enumerate(prompts):
            try:
                cache, remaining = cache_store.fetch(tokens + [1])
            except Exception as exc:  # recorded: the test asserts there are none
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                continue
            if cache is None:
                out["misses"] += 1
                continue
            n = len(tokens) + 1 - len(remaining)
            same = True
            for j, layer in enumerate(cache):
                keys = layer.keys[..., : layer.offset, :]
                mx.eval(keys)
                same &= np.array_equal(np.array(keys), originals[f"{i}.{j}.k"][..., :n, :])
            out["exact" if same else "wrong"] += 1
        out["corrupt"] = cache_store.stats()["corrupt"]
    return out


def _prefill(model, tokens):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    first = int(sys.argv[2])
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(spec["model"])
    originals = np.load(spec["originals"])
    for page in range(first, spec["pages"]):
        work = os.path.join(spec["work"], f"page{page}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(spec["store"], work)
        with open(os.path.join(work, "index", "data.mdb"), "r+b") as f:
            f.seek(page * PAGE)
            seed = spec.get("seed", 0) * 1_000_003 + page
            f.write(bytes(PAGE) if spec.get("fill") == "zeros" else random.Random(seed).randbytes(PAGE))
        if spec.get("serve"):
            line = {"page": page, "served": serve_all(work, model, spec["prompts"], originals)}
            shutil.rmtree(work, ignore_errors=True)
            print(json.dumps(line), flush=True)
            continue
        line = {"page": page, "check": ppc_check(work), "fix": ppc_check(work, "--fix")}
        try:
            line["restored"], line["failures"] = restore_all(work, model, spec["prompts"], originals)
            line["opens"] = True
        except Exception as exc:  # recorded, not raised: the sweep counts every page
            line["restored"], line["failures"], line["opens"] = 0, [f"{type(exc).__name__}: {exc}"], False
        shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
