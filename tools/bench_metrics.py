#!/usr/bin/env python3
"""What the miss reasons and the Prometheus metrics cost: a fetch (hit, short hit, miss)
and a scrape, timed in one process on a tiny random-weight model.

1. **Fetches.** A store holds `--prompts` prompts of `--tokens` tokens (64-token blocks)
   of one model, and one prompt of a second model (so a miss looks its first block up
   under another root). Each round fetches a stored prompt (a hit from the RAM tier: all
   but its last token), a stored prompt with a new block after it (a short hit, reason
   ``never_stored``) and an unseen prompt (a miss, ``never_stored``: the costliest
   reason to tell, an index read of the models table and one record per other root).
   The median per kind is printed. The miss reasons' own part is timed on its own too
   (`MissReasons.why` for the miss and the short hit), and within fetches: the same
   fetches with the checks replaced by a constant, interleaved with real ones (the
   difference of the medians: ``fetch_*_checks_us``).
2. **A scrape.** ``ppc serve``'s ``/metrics`` body, built as the server builds it
   (`metrics.server_metrics` of `PersistentLRUPromptCache.persistent_stats()`, then
   `metrics.exposition`), and ``ppc stats --prometheus``'s (`StoreAdmin.summary` and
   `metrics.summary_metrics`), median of `--scrapes`.

Run it on the code before the change for the same fetch figures
(``PYTHONPATH=<checkout of main> python tools/bench_metrics.py``): parts that do not
exist there print as ``-``.

Examples::

    python tools/bench_metrics.py
    python tools/bench_metrics.py --rounds 500 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: a checkout given there is the one measured


def median_ms(fn, rounds: int) -> float:
    """The median of `rounds` calls of `fn`, in milliseconds."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Time fetches and scrapes (see the module's docstring); print a table or JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20, help="prompts stored (default 20)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per prompt (default 1024)")
    parser.add_argument("--rounds", type=int, default=300, help="fetches of each kind (default 300)")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes timed (default 200)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import persistent_prefix_cache as ppc
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model, write_tiny_model

    rng = random.Random(0)
    folder = tempfile.mkdtemp(prefix="ppc-bench-metrics-")
    model = load_tiny_model(write_tiny_model(os.path.join(folder, "model"), seed=0))
    other = load_tiny_model(write_tiny_model(os.path.join(folder, "other"), seed=1))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    def stored(store, m, toks) -> None:
        cache = make_prompt_cache(m)
        m(mx.array([toks]), cache=cache)
        mx.eval([c.state for c in cache])
        store.store(toks, cache)

    path = os.path.join(folder, "store")
    prompts = [tokens(args.tokens) for _ in range(args.prompts)]
    with PersistentPrefixCache(path, other, block_size=64, model_name="other") as store:
        stored(store, other, tokens(args.tokens))
    out: dict[str, float | None] = {}
    with PersistentPrefixCache(path, model, block_size=64, model_name="tiny", cost_model=False) as store:
        for p in prompts:
            stored(store, model, p)
        store.flush()
        unseen = [tokens(args.tokens) for _ in range(args.rounds)]
        longer = [p + tokens(64) for p in prompts]
        which = iter(range(10**9))
        out["fetch_hit_ms"] = median_ms(lambda: store.fetch(prompts[next(which) % len(prompts)]), args.rounds)
        out["fetch_short_hit_ms"] = median_ms(lambda: store.fetch(longer[next(which) % len(longer)]), args.rounds)
        out["fetch_miss_ms"] = median_ms(lambda: store.fetch(unseen[next(which) % len(unseen)]), args.rounds)
        try:  # this branch: the reasons' own part, on a lookup of the store's index
            from persistent_prefix_cache.core.miss_reasons import MissReasons
        except ImportError:
            out["why_miss_us"] = out["why_short_us"] = None
            out["fetch_miss_checks_us"] = out["fetch_short_hit_checks_us"] = None
        else:
            import numpy as np

            from persistent_prefix_cache.disk.index import Index
            from persistent_prefix_cache.core.lookup import Trie
            from persistent_prefix_cache.tiers.memory import MemoryTier

            root, index = bytes.fromhex(store.this_model()["root"]), Index(os.path.join(path, "index"))
            reasons, trie = MissReasons(index, root, 64, None), Trie(index, MemoryTier(0), root, 64)
            miss, short = np.array(unseen[0], dtype=np.int32), np.array(longer[0], dtype=np.int32)
            walks = trie.walk(miss), trie.walk(short)
            assert (reasons.why(miss, walks[0], None), reasons.why(short, walks[1], None)) == ("never_stored",) * 2
            out["why_miss_us"] = 1000 * median_ms(lambda: reasons.why(miss, walks[0], None), args.rounds)
            out["why_short_us"] = 1000 * median_ms(lambda: reasons.why(short, walks[1], None), args.rounds)
            index.close()
            # The same fetches with the checks replaced by a constant, interleaved with real
            # ones: what the reasons add to a fetch, less the noise of two runs.
            real = MissReasons.why
            for kind, queries in (("miss", unseen), ("short_hit", longer)):
                times: dict[bool, list[float]] = {True: [], False: []}
                for i in range(2 * args.rounds):
                    checked = bool(i % 2)
                    MissReasons.why = real if checked else (lambda self, toks, walk, remote: "never_stored")
                    started = time.perf_counter()
                    store.fetch(queries[i // 2 % len(queries)])
                    times[checked].append(time.perf_counter() - started)
                MissReasons.why = real
                out[f"fetch_{kind}_checks_us"] = 1e6 * (
                    statistics.median(times[True]) - statistics.median(times[False])
                )
        out["misses_counted"] = store.stats()["misses"]

        try:
            from persistent_prefix_cache.metrics import exposition, server_metrics, summary_metrics
        except ImportError:  # before the change
            out.update(scrape_ms=None, scrape_bytes=None, stats_prometheus_ms=None)
        else:
            from persistent_prefix_cache.admin import StoreAdmin

            lru = ppc.PersistentLRUPromptCache(store, max_size=10)
            body = exposition(server_metrics(lru.persistent_stats()))
            out["scrape_ms"] = median_ms(lambda: exposition(server_metrics(lru.persistent_stats())), args.scrapes)
            out["scrape_bytes"] = len(body.encode())

            def stats_prometheus():
                with StoreAdmin(path, readonly=True) as admin:
                    return exposition(summary_metrics(admin.summary()))

            out["stats_prometheus_ms"] = median_ms(stats_prometheus, max(1, args.scrapes // 10))
        out["blocks"] = store.stats()["blocks"]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, value in out.items():
            print(f"{name:24} {'-' if value is None else f'{value:,.3f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
