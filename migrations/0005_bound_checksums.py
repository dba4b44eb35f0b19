"""Schema v5: segment format v5, every checksum bound to what its bytes are.

A v4 block checksum hashed the block's bytes alone, in data order: a header that swapped
the offsets of two tensors of one shape, or a record relabelled to another block, still
matched it. A v5 checksum starts with the block's record and each field's name, dtype
and shape, and every other digest with what it covers (`persistent_prefix_cache.disk.digest_tags`).

Every referenced v4 segment is read with the frozen v4 reader
(`migrations/formats/segment_v4.py`), each live block verified by the v4 rule against
its record, and rewritten, run by run of one chain, into new v5 segments (new ids)
through the live writer, which computes the v5 checksums; the records move there with
their new checksums in the shared write transaction. A block that is missing or
damaged (a read would have found it so) is dropped with everything stored after it.

Crash-safe like any write: the new files are written under ``tmp/``, fsynced and
renamed into ``segments/`` before the transaction commits; a crash before the commit
leaves the v4 store as it was (and unreferenced v5 files, swept later). The v4 files are
unlinked only after the commit (`after_commit`; if the process dies first, they are
unreferenced and swept later).
"""

import os

VERSION = 5
DESCRIPTION = "segment format v5: checksums bound to the field, layer, block and segment of their bytes"

# The live formats this migration reads and writes through, at the versions it was written for.
LIVE = {"record": 2, "tables": 3, "segment": 5}
_FREED = "_0005_freed"  # params key: segments to unlink once the transaction committed


def upgrade(env, txn, params):
    """Rewrite every referenced v4 segment as v5 and move the records there.

    Args:
        env: The open LMDB environment.
        txn: The write transaction every migration of this run shares.
        params: ``store``: the store directory.
    """
    from persistent_prefix_cache.blocks import Node
    from persistent_prefix_cache.disk.index_tables import Writer
    from persistent_prefix_cache.disk.segment import SegmentFiles
    from persistent_prefix_cache.migrations.formats import segment_v4  # frozen: v4 as it was written

    store = params["store"]
    w = Writer(txn)
    nodes = {n.key: n for n in w.iter_nodes()}
    by_segment = {}
    for n in nodes.values():
        by_segment.setdefault(n.segment, []).append(n)
    old_segments = set(w.segments()) | set(by_segment)
    files = SegmentFiles(store)
    doomed = []
    for seg_id in sorted(old_segments):
        live = sorted(by_segment.get(seg_id, []), key=lambda n: n.position)
        if not live:
            continue
        seg = segment_v4.open_segment(store, seg_id)
        if seg is None:
            doomed.extend(live)
            continue
        runs = [[]]
        try:
            root, model, block_size = seg.root, seg.model, seg.block_size
            for n in live:
                tensors = seg.block_tensors(n)  # verified by the v4 rule
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
            try:
                new, size, digest = files.write(run, root=root, model=model, block_size=block_size)
            except ValueError:  # tensors that do not make a segment: damaged
                doomed.extend(nodes[copy.key] for copy, _ in run)
                continue
            w.add_segment(new, size, digest)
            for copy, _ in run:
                # The writer set the copy's checksum by the v5 rule, over bytes the v4
                # rule has just verified.
                if not w.move(nodes[copy.key], new, checksum=copy.checksum):
                    doomed.append(nodes[copy.key])
            held = w.segment(new)
            if held is not None and held[0] == 0:
                w.free_segment(new)
    for n in doomed:
        w.remove_subtree(n.key)
    # Whatever still names a v4 segment could not be rewritten: a miss before, gone now.
    for n in [n for n in w.iter_nodes() if n.segment in old_segments]:
        w.remove_subtree(n.key)
    for seg_id in old_segments:
        if w.segment(seg_id) is not None:
            w.free_segment(seg_id)
    params[_FREED] = list(w.freed)


def after_commit(params):
    """Unlink the v4 segments (and any new one left without blocks) the commit freed."""
    for seg_id in params.pop(_FREED, []):
        h = seg_id.hex()
        try:
            os.unlink(os.path.join(params["store"], "segments", h[:2], f"{h}.seg"))
        except FileNotFoundError:
            pass
