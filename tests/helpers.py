"""Shared helpers for the test suite: prefill, logits, store inspection, subprocesses.

Everything here drives the real code paths (mlx-lm model code, the LMDB index, block
files on disk, real interpreters); nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.disk.node import Node

BLOCK = 16  # block size of most test stores: small, so prompts stay tiny
VOCAB = 512


def random_tokens(n: int, seed: int, *, first: int | None = None) -> list[int]:
    """`n` reproducible random token ids; `first` pins the first one.

    Pinning the first token keeps prompts of one test from sharing a prefix by chance.
    """
    toks = np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
    if first is not None and n:
        toks[0] = first
    return toks


def different_tokens(n: int, avoid: int, seed: int = 12345) -> list[int]:
    """`n` random tokens whose first token differs from `avoid` (forces a divergence)."""
    toks = random_tokens(n, seed)
    if toks[0] == avoid:
        toks[0] = (avoid + 1) % VOCAB
    return toks


def feed(model: Any, cache: list, tokens: Sequence[int]) -> mx.array:
    """Run `tokens` through the model on top of `cache` (mutated); next-token logits."""
    out = model(mx.array(list(tokens))[None], cache=cache)
    logits = out[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits


def prefill(model: Any, tokens: Sequence[int]) -> tuple[mx.array, list]:
    """One-shot prefill of `tokens` into a fresh `make_prompt_cache`: (logits, cache)."""
    cache = make_prompt_cache(model)
    return feed(model, cache, tokens), cache


def cold_logits(model: Any, tokens: Sequence[int]) -> mx.array:
    """Next-token logits of a one-shot prefill of all `tokens` with a fresh cache."""
    return prefill(model, tokens)[0]


def warm_logits(model: Any, cache: list | None, remaining: Sequence[int]) -> mx.array:
    """Next-token logits after feeding `remaining` on top of a fetched cache.

    A miss (``cache is None``) starts from a fresh cache, as a caller would.
    """
    if cache is None:
        cache = make_prompt_cache(model)
    return feed(model, cache, remaining)


def assert_same_logits(got: mx.array, want: mx.array) -> None:
    """Exact (bitwise) equality, with a useful message when it fails."""
    assert got.shape == want.shape
    if not mx.array_equal(got, want).item():
        diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        raise AssertionError(f"logits differ (max abs diff {diff:.3g})")


# -- looking at a store from the outside ------------------------------------------


def block_files(store_path: str | os.PathLike) -> dict[str, int]:
    """Every file under ``blocks/``: path relative to ``blocks/`` -> size in bytes."""
    root = os.path.join(os.fspath(store_path), "blocks")
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder, name)
            out[os.path.relpath(full, root)] = os.path.getsize(full)
    return out


def read_index(store_path: str | os.PathLike) -> dict[str, Any]:
    """A snapshot of a store's index, read through the package's own `Index`.

    Works whether or not a store object is open on the same path in this process
    (the package shares one LMDB environment per path and process).

    Returns:
        nodes (key -> Node), roots (set of model root keys), edges (set of
        (parent, child) pairs), lru (set of (access, key) pairs), totals
        ((bytes, blocks) as recorded), block_size.
    """
    index = Index(os.path.join(os.fspath(store_path), "index"), readonly=True)
    try:
        with index.reader() as r:
            nodes = {n.key: n for n in r.iter_nodes()}
            roots = set(r.models())
            with r.txn.cursor(db=index.dbs["children"]) as cur:
                edges = {
                    (bytes(k[:16]), bytes(k[16:])) for k in cur.iternext(values=False)
                }
            with r.txn.cursor(db=index.dbs["lru"]) as cur:
                lru = {
                    (int.from_bytes(k[:8], "big"), bytes(k[8:]))
                    for k in cur.iternext(values=False)
                }
            totals = r.totals()
        return {
            "nodes": nodes,
            "roots": roots,
            "edges": edges,
            "lru": lru,
            "totals": totals,
            "block_size": index.block_size,
        }
    finally:
        index.close()


def assert_tree_consistent(store_path: str | os.PathLike) -> dict[bytes, Node]:
    """Check every invariant that ties the index to itself and to the files on disk.

    - every node's parent is a model root or a stored node (no orphans);
    - every node's child count equals its children in the index, and the edge table
      holds exactly one edge per node;
    - the LRU table holds exactly one entry per node, at its last access;
    - the recorded totals equal the nodes' sizes, and the files on disk are exactly
      the nodes' files, each of the recorded size.

    Returns:
        The nodes by key.
    """
    snap = read_index(store_path)
    nodes: dict[bytes, Node] = snap["nodes"]
    for node in nodes.values():
        assert (
            node.parent in snap["roots"] or node.parent in nodes
        ), f"node {node.key.hex()} at {node.position} has a missing parent"
        if node.parent in nodes:
            assert nodes[node.parent].end == node.position
        else:
            assert node.position == 0
        kids = [n for n in nodes.values() if n.parent == node.key]
        assert node.child_count == len(kids), f"child count of {node.key.hex()}"
    assert snap["edges"] == {(n.parent, n.key) for n in nodes.values()}
    assert snap["lru"] == {(n.last_access, n.key) for n in nodes.values()}
    assert snap["totals"] == (sum(n.size for n in nodes.values()), len(nodes))
    files = block_files(store_path)
    assert files == {n.file_name.replace("/", os.sep): n.size for n in nodes.values()}
    return nodes


def nodes_by_position(store_path: str | os.PathLike) -> list[Node]:
    """The stored nodes sorted by position (for stores holding a single chain)."""
    return sorted(read_index(store_path)["nodes"].values(), key=lambda n: n.position)


# -- real subprocesses --------------------------------------------------------------


def run_python(
    code: str, *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a Python snippet in a fresh interpreter (``sys.executable -c``).

    Args:
        code: The snippet (dedented here).
        args: Its ``sys.argv[1:]``.
        timeout: Seconds before the child is killed and the test fails.
        check: Fail the test (showing stderr) if the child exits non-zero.
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess exited with {proc.returncode}\n--- stdout\n{proc.stdout}"
            f"\n--- stderr\n{proc.stderr}"
        )
    return proc


def run_python_json(code: str, *args: str, timeout: float = 120) -> Any:
    """`run_python`, returning the JSON the snippet printed on its last stdout line."""
    proc = run_python(code, *args, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1])


def ppc_check(
    store_path: str | os.PathLike, *flags: str, timeout: float = 120
) -> tuple[int, dict]:
    """Run ``ppc check --json`` (plus `flags`) in a subprocess, as a user would.

    Returns:
        (exit code, the JSON report). A traceback on stderr fails the test.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--json"]
        + ["--store", os.fspath(store_path), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)
