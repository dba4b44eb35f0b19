"""Schema v4: segment format v4, safetensors files that hold their own index records.

v3 segments named only ``[key, position, tokens]`` per block and were not valid
safetensors files. A v4 segment (see `persistent_prefix_cache.disk.segment`) is one,
and its header names the model (root key and record) and holds every block's record
and token ids, so a damaged index can be rebuilt from the segments.

Every referenced v3 segment is read with the frozen v3 reader
(`migrations/formats/segment_v3.py`), its live blocks verified against their
records, and rewritten, run by run of one chain, into new v4 segments (new ids) with
the parents, token ids, flags and model record the index holds; the records move to
the new segments in the shared write transaction. A block that is missing or damaged
(a read would have found it so) is dropped with everything stored after it, as is a
block that no model root can be found for.

Crash-safe like any write: the new files are written under ``tmp/``, fsynced and
renamed into ``segments/`` before the transaction commits; a crash before the commit
leaves the v3 store as it was (and unreferenced v4 files, swept later). The v3 files
are unlinked only after the commit (`after_commit`; if the process dies first, they
are unreferenced and swept later).

It writes v4 with the frozen v4 writer (`migrations/formats/segment_v4.py`, the v4
code as it was), so that it does what it did when v4 was current; migration 0005 then
rewrites those segments as v5 in the same transaction.
"""

import os

VERSION = 4
DESCRIPTION = "segment format v4: safetensors files holding their own index records"

# The live formats this migration reads and writes through, at the versions it was written for.
LIVE = {"record": 2, "tables": 3}
_FREED = "_0004_freed"  # params key: segments to unlink once the transaction committed


def upgrade(env, txn, params):
    """Rewrite every referenced v3 segment as v4 and move the records there.

    Args:
        env: The open LMDB environment.
        txn: The write transaction every migration of this run shares.
        params: ``store``: the store directory.
    """
    from persistent_prefix_cache.blocks import Node
    from persistent_prefix_cache.disk.index_tables import Writer
    from persistent_prefix_cache.migrations.formats import segment_v3  # frozen: v3 as it was written
    from persistent_prefix_cache.migrations.formats import segment_v4  # frozen: v4 as this migration wrote it

    store = params["store"]
    w = Writer(txn)
    nodes = {n.key: n for n in w.iter_nodes()}
    roots = _roots(nodes)
    old_segments = set(w.segments())
    block_size = int(w.meta(b"block_size") or b"64")  # stamped as ASCII digits since schema v1
    by_segment = {}
    for n in nodes.values():
        by_segment.setdefault(n.segment, []).append(n)
    doomed = [n for n in nodes.values() if n.key not in roots]  # no way up to a model
    for seg_id in sorted(old_segments):
        live = sorted((n for n in by_segment.get(seg_id, []) if n.key in roots), key=lambda n: n.position)
        if not live:
            continue
        seg = segment_v3.open_segment(store, seg_id)
        if seg is None:
            doomed.extend(live)
            continue
        runs = [[]]
        try:
            for n in live:
                tensors = seg.block_tensors(n)
                if tensors is None:
                    doomed.append(n)
                    runs.append([])
                    continue
                if runs[-1] and runs[-1][-1][0].key != n.parent:
                    runs.append([])
                runs[-1].append((Node(**{k: getattr(n, k) for k in Node.__slots__}), tensors))
        finally:
            seg.close()
        for run in filter(None, runs):
            root = roots[run[0][0].key]
            try:
                new, size, digest = segment_v4.write(
                    store, run, root=root, model=w.model(root) or b"{}", block_size=block_size
                )
            except ValueError:  # tensors that do not make a segment: damaged
                doomed.extend(nodes[copy.key] for copy, _ in run)
                continue
            w.add_segment(new, size, digest)
            for copy, _ in run:
                # The checksum is computed anew from the same bytes: equal, or damaged.
                if copy.checksum != nodes[copy.key].checksum or not w.move(nodes[copy.key], new):
                    doomed.append(nodes[copy.key])
            held = w.segment(new)
            if held is not None and held[0] == 0:
                w.free_segment(new)
    for n in doomed:
        w.remove_subtree(n.key)
    # Whatever still names a v3 segment could not be rewritten: a miss before, gone now.
    for n in [n for n in w.iter_nodes() if n.segment in old_segments]:
        w.remove_subtree(n.key)
    for seg_id in old_segments:
        if w.segment(seg_id) is not None:
            w.free_segment(seg_id)
    params[_FREED] = list(w.freed)


def after_commit(params):
    """Unlink the v3 segments (and any new one left without blocks) the commit freed."""
    for seg_id in params.pop(_FREED, []):
        h = seg_id.hex()
        try:
            os.unlink(os.path.join(params["store"], "segments", h[:2], f"{h}.seg"))
        except FileNotFoundError:
            pass


def _roots(nodes):
    """Block key -> the root key of its model, for every node whose parents lead up to
    a first block (position 0) within the index."""
    out = {}
    for key in nodes:
        path, k = [], key
        while k in nodes and k not in out and len(path) <= len(nodes):
            path.append(k)
            if nodes[k].position == 0:
                out[k] = nodes[k].parent
                break
            k = nodes[k].parent
        root = out.get(k)
        if root is not None:
            for p in path:
                out[p] = root
    return out
