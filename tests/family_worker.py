"""Subprocess side of test_families: store every family's prompt, or fetch it back.

Usage: ``python family_worker.py store|fetch WORKDIR``. ``store`` prefills each
family's prompt block-aligned into WORKDIR/<family>; ``fetch`` (a fresh process)
restores every query and writes the next-token logits and restore points to
WORKDIR/<family>.npz.
"""

import json
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from families import RUNNABLE, build  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache, fingerprint_model  # noqa: E402
from persistent_prefix_cache.prefill import prefill  # noqa: E402

BLOCK = 16


def prompt() -> list[int]:
    """The stored prompt: 150 tokens, so it spans 9 full blocks and a partial one."""
    return np.random.default_rng(7).integers(0, 256, 150).tolist()


def queries() -> dict[str, list[int]]:
    """Queries: the prompt itself, longer, a strict prefix, diverging mid-block, and one
    ending one token past every block boundary."""
    p = prompt()
    out = {
        "same": p,
        "longer": p + [3, 1, 4, 1, 5],
        "prefix": p[:57],
        "diverge_mid_block": p[:70] + [(p[70] + 1) % 256] + p[71:90],
    }
    for boundary in range(BLOCK, len(p), BLOCK):
        out[f"boundary_{boundary}"] = p[:boundary] + [(p[boundary] + 1) % 256]
    return out


def main() -> None:
    mode, workdir = sys.argv[1], sys.argv[2]
    for i, name in enumerate(RUNNABLE):  # what the installed mlx-lm can prefill block-aligned
        model = build(name)
        path = os.path.join(workdir, name)
        if mode == "store":
            # Every other family stores synchronously: written from the caller's buffers.
            with PersistentPrefixCache(path, model, block_size=BLOCK, sync_writes=i % 2 == 1) as store:
                # One block per forward: every block boundary a restore point, snapshots
                # included (the default step follows the measured cost per call).
                prefill(model, prompt(), store, prefill_step_size=BLOCK)
            continue
        results = {}
        with PersistentPrefixCache(path, model, memory_bytes=0) as store:
            for qname, q in queries().items():
                cache, remaining = store.fetch(q)
                if cache is None:
                    results[f"{qname}.restored"] = np.array(0)
                    continue
                logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
                results[f"{qname}.logits"] = np.array(logits)
                results[f"{qname}.restored"] = np.array(len(q) - len(remaining))
            results["fingerprint"] = np.array(fingerprint_model(model))
            results["stats"] = np.array(json.dumps(store.stats()))
        np.savez(os.path.join(workdir, f"{name}.npz"), **results)


if __name__ == "__main__":
    main()
