#!/usr/bin/env python3
"""Where `prefill()` on an empty store spends its time beyond mlx-lm's prefill (a
diagnostic for row 2 of `tools/user_paths.py`).

Row 2 opens a handle per call, as the README's example does once per process. Per length
and round, on a handle opened with a given fingerprint (the open then hashes nothing),
this times each piece of `prefill()`, synchronized: the fetch (a miss), mlx-lm's forwards
as `prefill()` runs them, the `store()` at the end, and the close; mlx-lm's own prefill
(``generate_step``) runs in the same round. Then, per handle, three `store()` calls of new
prompts in a row, beside a bare device copy of the same KV (a handle's first store may
pay what its next ones do not). Medians leave the first round out (kernels).

``--phases`` also times what the caller's thread does inside each `store()` (`PHASES`:
the functions it calls, each summed over the call, nested ones inside their callers'),
for the round's store on its new handle (row 2's case) and the three in a row.

    python3 tools/prefill_pieces.py [--tokens 256,1024] [--rounds 6] [--small] [--phases]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import Phases, clock, mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402

GIVEN = "given-" + "0" * 26  # a fingerprint the caller gives: the open hashes no weight

# What `--phases` times inside a store(): (module, attribute path), each wrapped for the run.
PHASES = [
    ("persistent_prefix_cache.core.storing", "Storer.store"),
    ("persistent_prefix_cache.core.storing", "chain_keys"),
    ("persistent_prefix_cache.core.lookup", "Trie.stored_prefix"),
    ("persistent_prefix_cache.core.admission", "Admission.admitted"),
    ("persistent_prefix_cache.core.writeback", "WriteBack.note"),
    ("persistent_prefix_cache.layers.layout", "Layout.new_blocks"),
    ("persistent_prefix_cache.layers.layout", "stacked_copy"),
    ("persistent_prefix_cache.device.buffers", "WriterRoute.evaluate"),
    ("persistent_prefix_cache.device.addresses", "device_addresses"),
    ("persistent_prefix_cache.layers.layout", "Layout.learn_fields"),
    ("persistent_prefix_cache.layers.layout", "Layout.evaluate"),
    ("persistent_prefix_cache.tiers.memory", "MemoryTier.put"),
    ("persistent_prefix_cache.core.writeback", "WriteBack.write"),
    ("mlx.core", "eval"),
]


PHASER: Phases | None = None


def timed_store(store, ids, cache) -> float:
    """Seconds of one `store()`, its phases summed into `PHASER` where on."""
    if PHASER is not None:
        PHASER.on = True
    try:
        return clock(lambda: store.store(ids, cache))[0]
    finally:
        if PHASER is not None:
            PHASER.on = False


def show_phases(label: str, rows: list[dict[str, float]]) -> None:
    """Each phase's median over `rows` (ms), in `PHASES` order."""
    if not rows:
        return
    names = [path for _, path in PHASES if any(path in r for r in rows)]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names}
    print(f"  {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))


def pieces(model, ids: list[int], folder: str) -> dict[str, float]:
    """One round: mlx-lm's prefill, then `prefill()`'s pieces on a new handle (seconds)."""
    out = {"mlx-lm": clock(lambda: mlx_prefill(model, ids))[0]}
    store = PersistentPrefixCache(folder, model, fingerprint=GIVEN)
    out["fetch"] = clock(lambda: store.fetch(ids))[0]
    cache = store.make_cache()

    def forwards() -> None:  # as prefill() runs them below 2,048 tokens
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
        mx.eval(model(mx.array(ids[-1:])[None], cache=cache)[:, -1, :])

    out["forwards"] = clock(forwards)[0]
    out["store"] = timed_store(store, ids, cache)
    if PHASER is not None:
        PHASES_FIRST.append(PHASER.take())
    out["close"] = clock(store.close)[0]
    return out


PHASES_FIRST: list[dict[str, float]] = []  # per round: the phases of its handle's store()
PHASES_ROW: list[list[dict[str, float]]] = [[], [], []]  # the 1st, 2nd, 3rd store in a row


def stores_in_a_row(model, vocab: int, n: int, folder: str, seed: int) -> list[tuple[float, float]]:
    """A handle's 1st, 2nd and 3rd `store()` of new prompts, each beside a bare device
    copy of the same KV (seconds)."""
    store = PersistentPrefixCache(folder, model, fingerprint=GIVEN)
    out = []
    try:
        for k in range(3):
            ids = prompt_ids(vocab, n, seed=seed + k)
            cache = mlx_prefill(model, ids)
            stored = timed_store(store, ids, cache)
            if PHASER is not None:
                PHASES_ROW[k].append(PHASER.take())
            fields = [c.keys[..., : c.offset, :] for c in cache] + [c.values[..., : c.offset, :] for c in cache]
            copied = clock(lambda: mx.eval([mx.contiguous(x) for x in fields]))[0]
            out.append((stored, copied))
    finally:
        store.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="256,1024", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="rounds per length (the first is left out)")
    p.add_argument("--small", action="store_true", help="a small model (gpu_bench.SMALL) in place of the 8B shape")
    p.add_argument("--phases", action="store_true", help="time what each store() calls on the caller's thread")
    args = p.parse_args()
    try:
        lengths = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens takes comma-separated ints, got {args.tokens!r}")
    if args.rounds < 2 or any(n < 2 for n in lengths):
        p.error("--rounds must be >= 2 and every length >= 2")
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    vocab = model.args.vocab_size
    global PHASER
    if args.phases:
        PHASER = Phases(PHASES)
    work = tempfile.mkdtemp(prefix="ppc-prefill-pieces-")
    try:
        print(f"device {mx.default_device()}, mlx {mx.__version__}")
        for n in lengths:
            ids = prompt_ids(vocab, n, seed=n)
            PHASES_FIRST.clear()
            rounds = [pieces(model, ids, f"{work}/p{n}-{r}") for r in range(args.rounds)]
            med = {k: statistics.median(r[k] for r in rounds[1:]) * 1000 for k in rounds[0]}
            print(f"{n} tokens, medians (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
            show_phases("store() on a new handle, phases (ms)", PHASES_FIRST[1:])
            for row_phases in PHASES_ROW:
                row_phases.clear()
            for h in range(3):
                row = stores_in_a_row(model, vocab, n, f"{work}/s{n}-{h}", seed=1000 * (h + 1) + n)
                print(f"  handle {h + 1}: store() / bare copy (ms), 1st to 3rd: "
                      + ", ".join(f"{s * 1000:.1f} / {c * 1000:.1f}" for s, c in row))  # fmt: skip
            for k, row_phases in enumerate(PHASES_ROW):
                show_phases(f"store() {k + 1} of 3 in a row, phases (ms)", row_phases)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
