"""Segment format v5: every segment is a safetensors file the ecosystem opens, and it
describes itself well enough to rebuild the index (`read_manifest`); a damaged header
is a counted miss, never an exception and never wrong KV.

Real stores of tiny models, the real ``safetensors`` and ``mx.load``, real files.
"""

from __future__ import annotations

import base64
import json
import os

import mlx.core as mx
import numpy as np
import pytest
from families import build
from helpers import BLOCK, prefill, random_tokens
from mlx_lm.models.cache import make_prompt_cache
from safetensors import safe_open

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.disk.manifest import read_manifest
from persistent_prefix_cache.blocks import Node
from persistent_prefix_cache.disk.segment import SegmentFiles
from persistent_prefix_cache.disk.segment_header import parse_header


def _segments(path) -> list[str]:
    return sorted(str(p) for p in path.glob("segments/*/*.seg"))


def _index(path) -> tuple[dict[bytes, Node], dict[bytes, bytes], dict[bytes, int]]:
    index = Index(os.path.join(path, "index"), readonly=True)
    try:
        with index.reader() as r:
            nodes = {n.key: n for n in r.iter_nodes()}
            return nodes, r.models(), {s: r.segment_digest(s) for s in r.segments()}
    finally:
        index.close()


def _fill(path, model, prompts, **kwargs) -> list:
    """Store each prompt; the prefilled caches, by prompt."""
    caches = []
    with PersistentPrefixCache(path, model, block_size=BLOCK, **kwargs) as store:
        for tokens in prompts:
            _, cache = prefill(model, tokens)
            store.store(tokens, cache)
            caches.append(cache)
        store.flush()
    return caches


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"<u{x.itemsize}"))


def _check_opens_everywhere(path) -> int:
    """Every tensor of every segment, read by safetensors (numpy) and by mx.load, equals
    what our own reader verified for each block; returns the tensors checked."""
    files = SegmentFiles(str(path), readonly=True)
    nodes, _, _ = _index(path)
    checked = 0
    for seg_path in _segments(path):
        segment = bytes.fromhex(os.path.basename(seg_path)[:32])
        seg = files.open(segment)
        assert seg is not None
        try:
            ours = {}
            for key, _, _ in seg.blocks:
                node = nodes.get(key)
                if node is not None and node.segment == segment:
                    ours[seg.block_index(node)] = seg.block_tensors(node)
            assert ours and all(t is not None for t in ours.values())
            loaded = mx.load(seg_path, format="safetensors")
            with safe_open(seg_path, "numpy") as f:
                meta = f.metadata()
                assert meta["format"] == "ppc-segment/5" and meta["segment"] == segment.hex()
                assert set(f.keys()) == set(loaded)
                firsts, snaps = json.loads(meta["fields"]), json.loads(meta["snaps"])
                for name in f.keys():
                    x = f.get_tensor(name)
                    y = np.array(loaded[name].view({4: mx.uint32, 2: mx.uint16, 1: mx.uint8}[x.itemsize]))
                    assert np.array_equal(_bits(x), y)
                    if name in firsts:  # the field: its blocks' pieces, joined along tokens
                        lid, _, fld = name.rpartition(".")
                        pieces = [ours[i][lid][fld][0] for i in sorted(ours) if i >= firsts[name]]
                        live = [i for i in sorted(ours) if i >= firsts[name]]
                        for i, piece in zip(live, pieces):
                            start = seg.blocks[i][1] - seg.blocks[firsts[name]][1]
                            assert np.array_equal(_bits(x)[:, :, start : start + seg.blocks[i][2]], piece)
                    else:
                        assert name in snaps
                        tag, _, rest = name.partition(".")
                        lid, _, fld = rest.rpartition(".")
                        i = int(tag[1:])
                        if i in ours:
                            assert np.array_equal(_bits(x), ours[i][lid][fld][0])
                    checked += 1
        finally:
            seg.close()
    return checked


def test_every_segment_is_a_safetensors_file_holding_the_kv(tmp_path, model):
    base = random_tokens(2 * BLOCK, seed=501, first=3)
    prompts = [base + random_tokens(BLOCK + 5, seed=502, first=4), base + random_tokens(9, seed=503, first=5)]
    caches = _fill(tmp_path / "s", model, prompts)
    assert _check_opens_everywhere(tmp_path / "s") >= 8
    # The fields are the model's KV itself, positions [first block's start, end).
    for seg_path in _segments(tmp_path / "s"):
        m = read_manifest(seg_path)
        start, end = m.nodes[0].position, m.nodes[-1].end
        tokens = b"".join(n.tokens for n in m.nodes)
        prompt = next(i for i, p in enumerate(prompts) if np.array(p[start:end], "<i4").tobytes() == tokens)
        with safe_open(seg_path, "numpy") as f:
            for layer, c in enumerate(caches[prompt]):
                assert np.array_equal(f.get_tensor(f"{layer}.k"), np.array(c.keys[..., start:end, :]))
                assert np.array_equal(f.get_tensor(f"{layer}.v"), np.array(c.values[..., start:end, :]))


@pytest.mark.parametrize("family", ["mamba2", "gemma3_text"])
def test_snapshot_segments_open_with_safetensors(tmp_path, family):
    # mamba2: recurrent state snapshots; gemma3: a rotating window past its size.
    model = build(family)
    prompts = [[t % 256 for t in random_tokens(3 * BLOCK + 2, seed=510, first=1)]]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK) as store:
        cache = make_prompt_cache(model)
        model(mx.array(prompts[0])[None], cache=cache)
        mx.eval([c.state for c in cache])
        assert store.store(prompts[0], cache) > 0
        store.flush()
    assert _check_opens_everywhere(tmp_path / "s") > 0
    if family == "mamba2":
        assert any(json.loads(safe_open(p, "numpy").metadata()["snaps"]) for p in _segments(tmp_path / "s"))


def test_quantized_kv_segments_open_with_safetensors(tmp_path, model):
    from mlx_lm.generate import maybe_quantize_kv_cache

    tokens = random_tokens(2 * BLOCK + 3, seed=520, first=6)
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    maybe_quantize_kv_cache(cache, 0, 32, 4)
    with PersistentPrefixCache(tmp_path / "q", model, block_size=BLOCK, kv_bits=4, kv_group_size=32) as store:
        assert store.store(tokens, cache) == 3
        store.flush()
    assert _check_opens_everywhere(tmp_path / "q") >= 6
    with safe_open(_segments(tmp_path / "q")[0], "numpy") as f:
        assert "U32" in {f.get_slice(k).get_dtype() for k in f.keys()}


def test_read_manifest_holds_the_index_records(tmp_path, model):
    base = random_tokens(2 * BLOCK, seed=530, first=7)
    prompts = [base + random_tokens(BLOCK, seed=531, first=8), base + random_tokens(BLOCK + 3, seed=532, first=9)]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, namespace="tenant-a") as store:
        for tokens in prompts:
            _, cache = prefill(model, tokens)
            store.store(tokens, cache)
        # The second step of a prompt: a segment whose first block is not at position 0.
        longer = prompts[0] + random_tokens(2 * BLOCK, seed=533, first=10)
        _, cache = prefill(model, longer)
        store.store(longer, cache)
        store.flush()
    nodes, models, digests = _index(tmp_path / "s")
    listed: dict[bytes, Node] = {}
    for seg_path in _segments(tmp_path / "s"):
        m = read_manifest(seg_path)
        assert m.segment.hex() == os.path.basename(seg_path)[:32]
        assert m.model == models[m.root] and json.loads(m.model)["namespace"] == "tenant-a"
        assert m.digest == digests[m.segment] and m.file_bytes == os.path.getsize(seg_path)
        assert m.block_size == BLOCK
        assert SegmentFiles(str(tmp_path / "s"), readonly=True).digest_of(m.segment) == m.digest
        for a, b in zip(m.nodes, m.nodes[1:]):
            assert b.parent == a.key and b.position == a.end
        listed.update({n.key: n for n in m.nodes})
    assert set(listed) == set(nodes)
    assert any(read_manifest(p).nodes[0].position > 0 for p in _segments(tmp_path / "s"))
    for key, node in nodes.items():
        node.child_count = node.last_access = 0
        assert listed[key] == node


def _flip(path: str, offset: int, *, to: bytes | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(to if to is not None else bytes([byte[0] ^ 0x01]))


def test_a_flipped_metadata_byte_makes_the_segment_a_counted_miss(tmp_path, model):
    tokens = random_tokens(3 * BLOCK, seed=540, first=11)
    _fill(tmp_path / "s", model, [tokens])
    (seg_path,) = _segments(tmp_path / "s")
    data = open(seg_path, "rb").read()
    head = data[: 8 + int.from_bytes(data[:8], "little")]
    # A token id changed inside the base64 text: the JSON still parses, the lengths
    # still fit; only the header digest tells.
    meta = json.loads(head[8:])["__metadata__"]
    text = meta["tokens"]
    at = head.index(text.encode()) + 4
    swapped = b"A" if head[at : at + 1] != b"A" else b"B"
    assert base64.b64decode(text[:4] + swapped.decode() + text[5:]) != base64.b64decode(text)
    _flip(seg_path, at, to=swapped)
    with pytest.raises(ValueError, match="header digest"):
        read_manifest(seg_path)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, memory_bytes=0) as store:
        cache, remaining = store.fetch(tokens)
        assert cache is None and len(remaining) == len(tokens)
        store.flush()
        assert store.stats()["corrupt"] == 1


def test_every_header_byte_is_checked(tmp_path, model):
    tokens = random_tokens(2 * BLOCK + 1, seed=550, first=12)
    _fill(tmp_path / "s", model, [tokens])
    (seg_path,) = _segments(tmp_path / "s")
    data = open(seg_path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    segment = bytes.fromhex(os.path.basename(seg_path)[:32])
    parse_header(data[: 8 + n], len(data), segment)  # intact: parses
    for i in range(8 + n):
        for mask in (0x01, 0x20):
            damaged = bytearray(data[: 8 + n])
            damaged[i] ^= mask
            with pytest.raises(ValueError):
                parse_header(bytes(damaged), len(data), segment)
    with pytest.raises(ValueError):  # a byte more or less of data
        parse_header(data[: 8 + n], len(data) + 1, segment)
    with pytest.raises(ValueError):
        parse_header(data[: 8 + n], len(data), os.urandom(16))


def test_a_segment_holds_one_chain_of_one_model(tmp_path):
    files = SegmentFiles(str(tmp_path))
    x = np.zeros((1, 1, 4, 8), np.float32)
    root, other = os.urandom(16), os.urandom(16)

    def node(key, parent, position):
        return Node(key, parent, position, bytes(16), 1, 0, 0)

    a, b = node(b"a" * 16, root, 0), node(b"b" * 16, b"a" * 16, 4)
    seg, size, _ = files.write([(a, {"0": {"k": x}}), (b, {"0": {"k": x}})], root=root, model=b"{}", block_size=4)
    assert read_manifest(files.path_of(seg)).root == root and size == os.path.getsize(files.path_of(seg))
    with pytest.raises(ValueError, match="root"):
        files.write([(node(b"c" * 16, other, 0), {"0": {"k": x}})], root=root, model=b"{}", block_size=4)
    with pytest.raises(ValueError, match="chain"):
        files.write(
            [(a, {"0": {"k": x}}), (node(b"d" * 16, b"z" * 16, 4), {"0": {"k": x}})],
            root=root,
            model=b"{}",
            block_size=4,
        )
    assert not os.listdir(files.tmp)
