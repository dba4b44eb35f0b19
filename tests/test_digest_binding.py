"""Checksums bind bytes to what they are (segment format v5): a header fuzz.

Each mutation below is a hand edit (or a writer's bug) of a real stored segment that
keeps every tensor valid: data_offsets swapped between fields, layers and blocks
(snapshots too), a tensor relabelled to another dtype or shape, a block's record or
tokens moved, a block or a whole segment's bytes copied from another segment or from
another model's store. The header digest and the whole-segment digest are recomputed,
as an editor would (only the blocks' checksums are left as they were: recomputing
those is writing new blocks). Every mutation is reported by `ppc check`, dropped by
`ppc check --fix` (also when the index is rebuilt from the segments), refused by
`ppc import` of a pack holding it, and restores 0 wrong KV: each fetch's restored
tensors are compared bitwise with a prefill of the prompt, its logits with a cold
prefill. Format v4 (bytes alone, data order) let the first kind through everywhere.

``ppc`` runs in this process (`cli.main`, the real command line), except where the
test says it runs as a subprocess: the matrix would take minutes of interpreter starts.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tarfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from families import build
from helpers import BLOCK, cold_logits, ppc_check, prefill, random_tokens, warm_logits

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.blocks import Node
from persistent_prefix_cache.cli import main as ppc_main
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.admin.pack_members import RECORD_HEAD, unpack_records
from persistent_prefix_cache.disk.segment import SegmentFiles
from persistent_prefix_cache.disk.segment_header import DIGEST_MARK, header_digest, parse_header
from persistent_prefix_cache.disk.segment_reader import OpenSegment
from persistent_prefix_cache.keys import block_key
from persistent_prefix_cache.tiers import remote_wire as wire

# -- ppc in this process ---------------------------------------------------------------


def ppc(*args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``ppc ARGS`` run in this process; never a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = ppc_main([str(a) for a in args])
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return rc, out.getvalue(), err.getvalue()


# -- reading and writing a segment as an editor would -------------------------------------


def _split(data: bytes) -> tuple[dict, bytearray]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), bytearray(data[8 + n :])


def _join(header: dict, body: bytes) -> bytes:
    """A segment with this header, its header digest made to fit."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    at = head.index(DIGEST_MARK) + len(DIGEST_MARK)
    head = head[:at] + b"0" * 16 + head[at + 16 :]
    return head[:at] + f"{header_digest(head):016x}".encode() + head[at + 16 :] + bytes(body)


def _whole_digest(path: str) -> int:
    """The whole-segment digest of a segment file as it now is (by the current rule)."""
    fd = os.open(path, os.O_RDONLY)
    seg = OpenSegment(fd, bytes.fromhex(os.path.basename(path)[:32]))
    try:
        digests = {}
        for f in seg.fields.values():
            buf = bytearray(f.nbytes)
            step = f.tokens * f.row_bytes
            assert seg.read_rows(f, f.first, len(seg.blocks), [memoryview(buf)], [0], step)
            digests[f.name] = seg.field_digest(f, lambda f, r: memoryview(buf)[r * step : (r + 1) * step])
        return seg.whole_digest(digests)
    finally:
        seg.close()


def _parse(data: bytes):
    return parse_header(data[: 8 + int.from_bytes(data[:8], "little")], len(data))


@dataclass
class Edit:
    """A segment file being edited, and the pack records of its blocks (``nodes.bin``:
    a pack's own account of each block, which a hand edit of a pack changes with the
    header)."""

    header: dict
    body: bytearray
    records: list
    tokens: list[bytes]
    pack_nodes: dict[bytes, Node] = field(default_factory=dict)

    @classmethod
    def of(cls, data: bytes) -> "Edit":
        header, body = _split(data)
        meta = header["__metadata__"]
        records = json.loads(meta["blocks"])
        raw, tokens, at = base64.b64decode(meta["tokens"]), [], 0
        for r in records:
            tokens.append(raw[at : at + 4 * r[3]])
            at += 4 * r[3]
        return cls(header, body, records, tokens)

    @property
    def meta(self) -> dict:
        return self.header["__metadata__"]

    def save(self, path: str) -> None:
        """Write the edited file; the header digest and the whole-segment digest made to
        fit, as an editor who knows the format would."""
        self.meta["blocks"] = json.dumps(self.records, separators=(",", ":"))
        self.meta["tokens"] = base64.b64encode(b"".join(self.tokens)).decode()
        with open(path, "wb") as f:
            f.write(_join(self.header, self.body))
        self.meta["digest"] = f"{_whole_digest(path):016x}"
        with open(path, "wb") as f:
            f.write(_join(self.header, self.body))

    def block_spans(self, i: int) -> list[tuple[int, int]]:
        """(offset in the data, length) of block `i`'s piece of each row of each sliced
        field, in field then row order."""
        h = _parse(_join(self.header, self.body))
        _, pos, n = h.blocks[i]
        out = []
        for f in h.fields:
            if f.first <= i:
                for r in range(f.rows):
                    out.append((f.at + (r * f.tokens + pos - f.start) * f.row_bytes, n * f.row_bytes))
        return out

    def swap_offsets(self, a: str, b: str) -> None:
        self.header[a]["data_offsets"], self.header[b]["data_offsets"] = (
            self.header[b]["data_offsets"], self.header[a]["data_offsets"],
        )  # fmt: skip

    def checksum(self, i: int, value: str) -> None:
        """Set block `i`'s checksum in the header and in the pack's record of it."""
        self.records[i][6] = value
        key = bytes.fromhex(self.records[i][0])
        if key in self.pack_nodes:
            self.pack_nodes[key].checksum = int(value, 16)


# -- the mutations ---------------------------------------------------------------------
# Each takes the edit and the context (the other segments it may copy from).


def swap_fields(e: Edit, ctx) -> None:  # the issue's case: 0.k and 0.v trade places
    e.swap_offsets("0.k", "0.v")


def swap_layers(e: Edit, ctx) -> None:
    e.swap_offsets("0.k", "1.k")


def swap_layer_and_field(e: Edit, ctx) -> None:
    e.swap_offsets("0.v", "1.k")


def relabel_dtype(e: Edit, ctx) -> None:  # the same bytes read as another dtype of one width
    e.header["0.k"]["dtype"] = "U32" if e.header["0.k"]["dtype"] == "F32" else "F32"


def relabel_shape(e: Edit, ctx) -> None:  # the same bytes read as twice the heads, half the width
    b, h, t, w = e.header["0.k"]["shape"]
    e.header["0.k"]["shape"] = [b, 2 * h, t, w // 2]


def swap_blocks(e: Edit, ctx) -> None:
    # Blocks 0 and 1 trade their pieces in every row, each checksum following its bytes
    # (the v4 checksum of a block's bytes holds wherever they are labelled).
    a, b = e.block_spans(0), e.block_spans(1)
    for (x, n), (y, _) in zip(a, b):
        e.body[x : x + n], e.body[y : y + n] = bytes(e.body[y : y + n]), bytes(e.body[x : x + n])
    ca, cb = e.records[0][6], e.records[1][6]
    e.checksum(0, cb)
    e.checksum(1, ca)


def relabel_record(e: Edit, ctx) -> None:
    # The last block's record moved to another prompt: other tokens, the key that follows
    # from them, its bytes and checksum kept (a prompt that continues with those tokens
    # would be served this KV).
    i = len(e.records) - 1
    tokens = ctx["relabel_tokens"]
    parent = bytes.fromhex(e.records[i][1])
    old, new = bytes.fromhex(e.records[i][0]), block_key(parent, tokens)
    e.records[i][0] = new.hex()
    e.tokens[i] = tokens
    if old in e.pack_nodes:
        n = e.pack_nodes.pop(old)
        n.key, n.tokens = new, tokens
        e.pack_nodes[new] = n


def _transplant(e: Edit, source: Edit, i: int) -> None:
    for (x, n), (y, m) in zip(e.block_spans(i), source.block_spans(i)):
        assert n == m
        e.body[x : x + n] = source.body[y : y + m]
    e.checksum(i, source.records[i][6])


def block_from_another_segment(e: Edit, ctx) -> None:
    # Block 1 of another prompt's segment (same model, same shapes), with its checksum.
    _transplant(e, ctx["other_segment"], 1)


def block_from_another_model(e: Edit, ctx) -> None:
    # Block 1 of the same prompt stored by another model of the same shapes.
    _transplant(e, ctx["other_model_segment"], 1)


def segment_from_another_model(e: Edit, ctx) -> None:
    # Every block's bytes and checksum from the other model's segment of the same prompt.
    source = ctx["other_model_segment"]
    assert len(source.body) == len(e.body)
    e.body[:] = source.body
    for i in range(len(e.records)):
        e.checksum(i, source.records[i][6])


def _swap_snaps(e: Edit, a: str, b: str) -> None:
    e.swap_offsets(a, b)
    snaps = json.loads(e.meta["snaps"])
    snaps[a], snaps[b] = snaps[b], snaps[a]
    e.meta["snaps"] = json.dumps(snaps, separators=(",", ":"))


def snapshot_swap_layers(e: Edit, ctx) -> None:  # v4 saw nothing: the digests just moved
    _swap_snaps(e, "b3.0.s0", "b3.1.s0")


def snapshot_swap_blocks(e: Edit, ctx) -> None:
    _swap_snaps(e, "b1.0.s1", "b3.0.s1")


def snapshot_to_another_block(e: Edit, ctx) -> None:
    # Block 1's snapshots relabelled as block 2's.
    snaps = json.loads(e.meta["snaps"])
    for name in [n for n in snaps if n.startswith("b1.")]:
        new = "b2." + name[3:]
        e.header[new] = e.header.pop(name)
        snaps[new] = snaps.pop(name)
    e.meta["snaps"] = json.dumps(snaps, separators=(",", ":"))


KV_MUTATIONS = [
    swap_fields, swap_layers, swap_layer_and_field, relabel_dtype, relabel_shape, swap_blocks, relabel_record,
    block_from_another_segment, block_from_another_model, segment_from_another_model,
]  # fmt: skip
SNAPSHOT_MUTATIONS = [snapshot_swap_layers, snapshot_swap_blocks, snapshot_to_another_block]


# -- the stores ------------------------------------------------------------------------


def _nodes(path) -> list[Node]:
    index = Index(os.path.join(path, "index"), readonly=True)
    try:
        with index.reader() as r:
            return sorted(r.iter_nodes(), key=lambda n: n.position)
    finally:
        index.close()


def _segment_of(path, first_token: int) -> str:
    """The segment file holding the chain that starts with `first_token`, from position 0."""
    node = next(n for n in _nodes(path) if n.position == 0 and n.tokens[:4] == first_token.to_bytes(4, "little"))
    h = node.segment.hex()
    return os.path.join(path, "segments", h[:2], f"{h}.seg")


@dataclass
class Case:
    """A pristine store, the segment the mutations edit, and what restoring must give."""

    path: str
    model: object
    target: str  # the segment file the mutations edit
    prompts: list[list[int]]  # what is fetched (the relabelling's target among them)
    check_restore: Callable
    ctx: dict


def _kv_check(model):
    def check(cache, query, matched):
        # Every restored position holds the prompt's own KV, bit for bit.
        if cache is None:
            return
        _, reference = prefill(model, query[:matched])
        for got, want in zip(cache, reference):
            assert got.offset == matched
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                assert np.array_equal(np.array(a[..., :matched, :]), np.array(b[..., :matched, :]))

    return check


@pytest.fixture(scope="module")
def kv_case(tmp_path_factory, model, other_model) -> Case:
    """A store of the tiny llama: a prompt of 3 full blocks and a partial one (the
    target segment) and another prompt; the other model's store of the first prompt."""
    root = tmp_path_factory.mktemp("kv")
    p1 = random_tokens(3 * BLOCK + 5, seed=901, first=3)
    p2 = random_tokens(2 * BLOCK + 3, seed=902, first=4)
    for path, m in ((root / "a", model), (root / "b", other_model)):
        with PersistentPrefixCache(path, m, block_size=BLOCK) as store:
            for p in (p1, p2) if m is model else (p1,):
                store.store(p, prefill(m, p)[1])
            store.flush()
    relabelled = random_tokens(5, seed=903)
    with open(_segment_of(root / "a", p2[0]), "rb") as f:
        other_segment = Edit.of(f.read())
    with open(_segment_of(root / "b", p1[0]), "rb") as f:
        other_model_segment = Edit.of(f.read())
    return Case(
        str(root / "a"), model, _segment_of(root / "a", p1[0]),
        [p1 + [7, 8], p2 + [9], p1[: 3 * BLOCK] + relabelled + [10]],
        _kv_check(model),
        {
            "relabel_tokens": np.asarray(relabelled, "<i4").tobytes(),
            "other_segment": other_segment,
            "other_model_segment": other_model_segment,
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def snapshot_case(tmp_path_factory) -> Case:
    """A store of the tiny mamba2 (recurrent state: a snapshot per resumable block) with a
    segment holding snapshots of two blocks: a prompt stored in two steps (blocks 0-1,
    then 2-3), its two segments joined into one as compaction and a remote pull write
    them; and another prompt's segment. The states are kept for the comparison."""
    model = build("mamba2")
    path = str(tmp_path_factory.mktemp("snap") / "s")
    tokens = [t % 256 for t in random_tokens(3 * BLOCK + 5, seed=911, first=1)]
    other = [t % 256 for t in random_tokens(BLOCK + 3, seed=912, first=2)]
    states = {}
    cache = prefill(model, tokens[: 2 * BLOCK])[1]
    states[2 * BLOCK] = [[np.array(x) for x in c.cache] for c in cache]
    with PersistentPrefixCache(path, model, block_size=BLOCK) as store:
        store.store(tokens[: 2 * BLOCK], cache)
        model(mx.array(tokens[2 * BLOCK :])[None], cache=cache)
        mx.eval([c.state for c in cache])
        states[len(tokens)] = [[np.array(x) for x in c.cache] for c in cache]
        store.store(tokens, cache)
        cache = prefill(model, other)[1]
        states[len(other)] = [[np.array(x) for x in c.cache] for c in cache]
        store.store(other, cache)
        store.flush()
    apart = bytes.fromhex(os.path.basename(_segment_of(path, other[0]))[:32])
    nodes = [n for n in _nodes(path) if n.segment != apart]
    files = SegmentFiles(path)
    run = []
    for n in nodes:
        seg = files.open(n.segment)
        try:
            root, model_record = seg.root, seg.model
            run.append((Node(**{k: getattr(n, k) for k in Node.__slots__}), seg.block_tensors(n)))
        finally:
            seg.close()
    new, size, digest = files.write(run, root=root, model=model_record, block_size=BLOCK)
    # A block copied into another segment keeps its checksum (no tag names the segment).
    assert [c.checksum for c, _ in run] == [n.checksum for n in nodes]
    index = Index(os.path.join(path, "index"))
    try:

        def commit(w):
            w.add_segment(new, size, digest)
            assert all(w.move(n, new) for n in nodes)
            return w.freed

        files.unlink(index.write(commit))
    finally:
        index.close()
    target = files.path_of(new)
    snaps = json.loads(Edit.of(open(target, "rb").read()).meta["snaps"])
    assert {name.split(".")[0] for name in snaps} == {"b1", "b3"}

    def check(cache, query, matched):
        if cache is None:
            return
        assert matched in states, matched  # a recurrent layer resumes only at a snapshot
        assert len(cache) == len(states[matched])
        for c, want in zip(cache, states[matched]):
            assert len(c.cache) == len(want) and all(np.array_equal(np.array(a), b) for a, b in zip(c.cache, want))

    return Case(path, model, target, [tokens + [3], tokens[: 2 * BLOCK] + [5, 6], other + [4]], check, {})


# -- the scenarios -----------------------------------------------------------------------


def _copy(case: Case, dest) -> str:
    shutil.copytree(case.path, dest, symlinks=True)
    return str(dest)


def _mutate_in_store(case: Case, path: str, mutation) -> str:
    """Apply `mutation` to the target segment inside the store at `path`; its file."""
    target = os.path.join(path, os.path.relpath(case.target, case.path))
    with open(target, "rb") as f:
        e = Edit.of(f.read())
    mutation(e, case.ctx)
    e.save(target)
    return target


def _assert_zero_wrong(case: Case, path: str) -> int:
    """Fetch every prompt: whatever is restored is the prompt's own KV (bitwise) and
    continues like a cold prefill. Returns the tokens restored in all."""
    restored = 0
    with PersistentPrefixCache(path, case.model, memory_bytes=0) as store:
        for query in case.prompts:
            cache, remaining = store.fetch(query)
            matched = len(query) - len(remaining)
            case.check_restore(cache, query, matched)
            got = warm_logits(case.model, cache, remaining)
            want = cold_logits(case.model, query)
            assert np.allclose(np.array(got), np.array(want), atol=1e-4), (matched, query[:4])
            restored += matched
        store.flush()
    return restored


def _scenario_in_store(case: Case, tmp_path, mutation) -> None:
    # ppc check reports it; --fix drops it; then the store is clean and serves 0 wrong KV.
    path = _copy(case, tmp_path / "fixed")
    seg = os.path.basename(_mutate_in_store(case, path, mutation))[:32]
    rc, out, _ = ppc("check", "--json", "--store", path)
    report = json.loads(out)
    assert rc == 1 and not report["clean"], report
    assert any(seg in p["detail"] for p in report["problems"]), report["problems"]
    rc, out, _ = ppc("check", "--fix", "--json", "--store", path)
    report = json.loads(out)
    assert rc == 0 and report["fixed"] and report["removed_nodes"] >= 1, report
    with StoreAdmin(path, readonly=True) as admin:
        assert admin.check().clean
    _assert_zero_wrong(case, path)
    # Unrepaired, a fetch meets it first: a counted miss, never its KV.
    path = _copy(case, tmp_path / "unfixed")
    _mutate_in_store(case, path, mutation)
    _assert_zero_wrong(case, path)


def _scenario_rebuild(case: Case, tmp_path, mutation) -> None:
    # The index lost: check --fix rebuilds it from the segments and leaves the edited one out.
    path = _copy(case, tmp_path / "rebuilt")
    target = _mutate_in_store(case, path, mutation)
    shutil.rmtree(os.path.join(path, "index"))
    rc, out, _ = ppc("check", "--fix", "--json", "--store", path)
    report = json.loads(out)
    assert rc == 0 and report["rebuild"] is not None, report
    unusable = [u["file"] for u in report["rebuild"]["unusable"]]
    assert os.path.relpath(target, path) in unusable, report["rebuild"]
    _assert_zero_wrong(case, path)


def _scenario_import(case: Case, tmp_path, mutation) -> None:
    # A pack of the store whose segment (and records of its blocks) were edited: refused.
    pack = tmp_path / "pack.ppcpack"
    rc, _, err = ppc("export", str(pack), "--store", case.path)
    assert rc == 0, err
    work = tmp_path / "unpacked"
    with tarfile.open(pack) as tar:
        tar.extractall(work, filter="data")
    member = os.path.join(work, "segments", os.path.basename(case.target))
    with open(member, "rb") as f:
        e = Edit.of(f.read())
    nodes = list(unpack_records((work / "nodes.bin").read_bytes(), "pack"))
    keys = {bytes.fromhex(r[0]) for r in e.records}
    e.pack_nodes = {n.key: n for n in nodes if n.key in keys}
    mutation(e, case.ctx)
    e.save(member)
    others = [n for n in nodes if n.key not in keys]
    (work / "nodes.bin").write_bytes(
        b"".join(RECORD_HEAD.pack(n.key, len(n.pack())) + n.pack() for n in sorted(others + list(e.pack_nodes.values()), key=lambda n: n.position))
    )  # fmt: skip
    edited = tmp_path / "edited.ppcpack"
    with tarfile.open(edited, "w") as tar:
        for name in ("manifest.json", "nodes.bin", "segments"):
            tar.add(work / name, arcname=name)
    target = tmp_path / "imported"
    rc, out, err = ppc("import", str(edited), "--store", str(target), "--trust", "--json")
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "damaged" in err, (rc, out, err)
    assert not target.exists()  # nothing of the pack was stored: a refused import leaves no store behind


@pytest.mark.slow
@pytest.mark.parametrize("mutation", KV_MUTATIONS, ids=lambda m: m.__name__)
def test_a_relabelled_kv_segment_is_caught_everywhere(kv_case, tmp_path, mutation):
    _scenario_in_store(kv_case, tmp_path, mutation)
    _scenario_rebuild(kv_case, tmp_path, mutation)
    _scenario_import(kv_case, tmp_path, mutation)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", SNAPSHOT_MUTATIONS, ids=lambda m: m.__name__)
def test_a_relabelled_snapshot_segment_is_caught_everywhere(snapshot_case, tmp_path, mutation):
    _scenario_in_store(snapshot_case, tmp_path, mutation)
    _scenario_rebuild(snapshot_case, tmp_path, mutation)
    _scenario_import(snapshot_case, tmp_path, mutation)


def test_the_pristine_stores_restore_and_check_clean(kv_case, snapshot_case, tmp_path):
    # The fuzz's baseline: untouched, both stores are clean, restore every stored prompt
    # in full, and the relabelling's target prompt only up to the shared prefix.
    for case in (kv_case, snapshot_case):
        with StoreAdmin(case.path, readonly=True) as admin:
            assert admin.check().clean
    restored = _assert_zero_wrong(kv_case, _copy(kv_case, tmp_path / "kv"))
    p1, p2, target = kv_case.prompts
    assert restored == (len(p1) - 2) + (len(p2) - 1) + 3 * BLOCK
    assert _assert_zero_wrong(snapshot_case, _copy(snapshot_case, tmp_path / "snap")) == (3 * BLOCK + 5) + 2 * BLOCK + (
        BLOCK + 3
    )


def test_the_issues_swap_as_a_user_meets_it(kv_case, tmp_path):
    # The report's own case through real ppc subprocesses: 0.k and 0.v swapped, the
    # header digest recomputed. check reports it, check --fix drops it.
    path = _copy(kv_case, tmp_path / "s")
    _mutate_in_store(kv_case, path, swap_fields)
    rc, report = ppc_check(path)
    assert rc == 1 and len([p for p in report["problems"] if p["kind"] == "file size or checksum mismatch"]) == 4
    rc, report = ppc_check(path, "--fix")
    assert rc == 0 and report["fixed"] and report["removed_nodes"] == 4
    assert ppc_check(path)[1]["clean"]
    _assert_zero_wrong(kv_case, path)


# -- the remote tier's values ------------------------------------------------------------


def test_a_remote_value_binds_its_tensors_to_their_names_and_its_key(kv_case):
    # The wire form's xxh3-128 covers its header (key, parent, position, tokens, and each
    # tensor's leaf, field, dtype, shape and offset) and the MAC covers the server key
    # (model root and block key) too: a value relabelled without the secret is refused.
    nodes = [n for n in _nodes(kv_case.path) if n.position == 0]
    node = nodes[0]
    files = SegmentFiles(kv_case.path, readonly=True)
    seg = files.open(node.segment)
    tensors = seg.block_tensors(node)
    seg.close()
    secret = wire.mac_key("fleet")
    skey = wire.server_key(node.parent, node.key)
    value = wire.encode(skey, node, tensors, mac=secret)
    args = dict(key=node.key, parent=node.parent, position=0, tokens=node.tokens)
    good = wire.decode(value, skey, **args, mac=secret)
    assert np.array_equal(good.bits["0"]["k"][0], tensors["0"]["k"][0])

    def relabelled(v: bytes, digest: bool) -> bytes:
        # 0.k's and 0.v's offsets swapped in the header (same length), xxh3 recomputed.
        head = wire._HEAD.unpack_from(v)
        text = v[wire._HEAD.size : wire._HEAD.size + head[4]]
        spec = json.loads(text)
        by = {(t[0], t[1]): t for t in spec["tensors"]}
        by["0", "k"][4], by["0", "v"][4] = by["0", "v"][4], by["0", "k"][4]
        new = json.dumps(spec, separators=(",", ":")).encode()
        new += b" " * (len(text) - len(new))
        body = v[: wire._HEAD.size] + new + v[wire._HEAD.size + head[4] : len(v) - 16 - 32]
        return body + (xxhash.xxh3_128_digest(body) if digest else v[len(v) - 48 : len(v) - 32]) + v[len(v) - 32 :]

    for v in (relabelled(value, False), relabelled(value, True)):
        with pytest.raises(wire.BadValue):
            wire.decode(v, skey, **args, mac=secret)
    # The same value under another model's server key: the MAC binds the root.
    with pytest.raises(wire.BadValue, match="MAC"):
        wire.decode(value, wire.server_key(os.urandom(16), node.key), **args, mac=secret)
