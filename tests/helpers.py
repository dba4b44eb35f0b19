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
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.blocks import Node

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


def counted_forwards(model: Any, monkeypatch: Any = None, seconds: Any = None) -> list[int]:
    """Count `model`'s forward calls (the returned list gets each one's tokens), and have a
    prefill's and a calibration's timings (`costs.clock`) move by 0.1 ms a call and 10 us a
    token: the tiny model's small forwards are bound by their calls, and on a busy machine
    their own timings could price a token at nothing, which leaves the prefill unknown.

    Args:
        model: The model, or its class (every model of it is counted).
        monkeypatch: Undoes the change after the test; None: for the rest of the process
            (a subprocess, `COUNTED_PPC`).
        seconds: What a forward of ``n`` tokens moves the clock by, in place of the above.
    """
    from persistent_prefix_cache.core import costs

    put = setattr if monkeypatch is None else monkeypatch.setattr
    cls = model if isinstance(model, type) else type(model)
    calls: list[int] = []
    clock = [0.0]
    real = cls.__call__
    put(costs, "clock", lambda: clock[0])

    def counted(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(inputs.shape[1])
        clock[0] += 1e-4 + 1e-5 * inputs.shape[1] if seconds is None else seconds(inputs.shape[1])
        return real(self, inputs, *args, **kwargs)

    put(cls, "__call__", counted)
    return calls


# ``ppc`` in a process whose llama forwards are timed by `counted_forwards` (run as
# ``python -c COUNTED_PPC args...``, the tests' folder on its path).
COUNTED_PPC = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from helpers import counted_forwards
from mlx_lm.models import llama
from persistent_prefix_cache.cli import main
counted_forwards(llama.Model)
sys.exit(main())
"""


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


def assert_restores_kv(store: Any, tokens: Sequence[int], cache: list) -> None:
    """`store` restores `tokens` (all but at most a block) with exactly `cache`'s keys
    and values."""
    restored, rest = store.fetch(tokens)
    assert restored is not None
    n = len(tokens) - len(rest)
    assert n >= len(tokens) - BLOCK
    for got, want in zip(restored, cache):
        assert mx.array_equal(got.keys[..., :n, :], want.keys[..., :n, :])
        assert mx.array_equal(got.values[..., :n, :], want.values[..., :n, :])


def segment_files(store_path: str | os.PathLike) -> dict[str, int]:
    """Every file under ``segments/``: path relative to ``segments/`` -> size in bytes."""
    root = os.path.join(os.fspath(store_path), "segments")
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
        ((bytes, blocks) as recorded), segments (id -> (live blocks, live bytes,
        file bytes)), file_bytes (as recorded), block_size.
    """
    index = Index(os.path.join(os.fspath(store_path), "index"), readonly=True)
    try:
        with index.reader() as r:
            nodes = {n.key: n for n in r.iter_nodes()}
            roots = set(r.models())
            edges = r.edges()
            lru = r.lru_entries()
            totals = r.totals()
            segments = r.segments()
            file_bytes = r.file_bytes()
        return {
            "nodes": nodes,
            "roots": roots,
            "edges": edges,
            "lru": lru,
            "totals": totals,
            "segments": segments,
            "file_bytes": file_bytes,
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
    - the recorded totals equal the nodes' sizes; every node's segment is referenced,
      each segment's live counts equal its nodes', and the files on disk are exactly
      the referenced segments, each of the recorded size.

    Returns:
        The nodes by key.
    """
    snap = read_index(store_path)
    nodes: dict[bytes, Node] = snap["nodes"]
    for node in nodes.values():
        assert node.parent in snap["roots"] or node.parent in nodes, (
            f"node {node.key.hex()} at {node.position} has a missing parent"
        )
        if node.parent in nodes:
            assert nodes[node.parent].end == node.position
        else:
            assert node.position == 0
        kids = [n for n in nodes.values() if n.parent == node.key]
        assert node.child_count == len(kids), f"child count of {node.key.hex()}"
    assert snap["edges"] == {(n.parent, n.key) for n in nodes.values()}
    assert snap["lru"] == {(n.last_access, n.key) for n in nodes.values()}
    assert snap["totals"] == (sum(n.size for n in nodes.values()), len(nodes))
    live: dict[bytes, tuple[int, int]] = {}
    for n in nodes.values():
        blocks, nbytes = live.get(n.segment, (0, 0))
        live[n.segment] = (blocks + 1, nbytes + n.size)
    assert {seg: rec[:2] for seg, rec in snap["segments"].items()} == live
    files = segment_files(store_path)
    want = {os.path.join(s.hex()[:2], f"{s.hex()}.seg"): rec[2] for s, rec in snap["segments"].items()}
    assert files == want
    assert snap["file_bytes"] == sum(files.values())
    return nodes


def nodes_by_position(store_path: str | os.PathLike) -> list[Node]:
    """The stored nodes sorted by position (for stores holding a single chain)."""
    return sorted(read_index(store_path)["nodes"].values(), key=lambda n: n.position)


# -- real subprocesses --------------------------------------------------------------


def run_python(code: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
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
            f"subprocess exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def run_python_json(code: str, *args: str, timeout: float = 120) -> Any:
    """`run_python`, returning the JSON the snippet printed on its last stdout line."""
    proc = run_python(code, *args, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1])


def ppc_check(store_path: str | os.PathLike, *flags: str, timeout: float = 120) -> tuple[int, dict]:
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


def segment_path(store_path: str | os.PathLike, node: Node) -> str:
    """The segment file holding `node`."""
    h = node.segment.hex()
    return os.path.join(os.fspath(store_path), "segments", h[:2], f"{h}.seg")


def block_pieces(store_path: str | os.PathLike, node: Node) -> list[tuple[int, int]]:
    """(file offset, length) of every piece of `node`'s bytes inside its segment, in
    checksum order (the format's own header tells where they are)."""
    from persistent_prefix_cache.disk.segment import SegmentFiles

    seg = SegmentFiles(os.fspath(store_path), readonly=True).open(node.segment)
    assert seg is not None, "segment missing or damaged"
    try:
        i = seg.block_index(node)
        assert i is not None
        out = []
        for f in seg.fields_of(i):
            p0 = node.position - f.start
            for r in range(f.rows):
                out.append((seg.body + f.at + (r * f.tokens + p0) * f.row_bytes, node.n_tokens * f.row_bytes))
        out += [(seg.body + s.at, s.nbytes) for s in seg.snaps_of(i)]
        return out
    finally:
        seg.close()


def flip_block_byte(store_path: str | os.PathLike, node: Node, *, piece: int = 0, at: int = 0) -> None:
    """Flip one byte of `node`'s bytes in its segment (other blocks stay intact)."""
    offset, length = block_pieces(store_path, node)[piece]
    with open(segment_path(store_path, node), "r+b") as f:
        f.seek(offset + min(at, length - 1))
        byte = f.read(1)
        f.seek(offset + min(at, length - 1))
        f.write(bytes([byte[0] ^ 0x5A]))


def read_terminal(fd: int, until: bytes | None = None, timeout: float = 120.0) -> bytes:
    """What a child wrote to its pseudo-terminal (`fd`, from ``pty.fork``): up to where
    `until` appears, or until it closes the terminal (or `timeout` seconds pass)."""
    import time

    out, deadline = b"", time.monotonic() + timeout
    while (until is None or until not in out) and time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out
