"""Write-back: the writer thread, what fetches and stores leave for it, and the commit policy.

`store()` cuts new blocks on the caller's thread (MLX evaluates there) and hands them
to `WriteBack.write`; the writer thread writes them into one new
segment (see `disk.segment`), then commit their records in one index transaction
together with the queued bookkeeping (LRU touches, hit counts, counters), superseded
partial leaves and, under a disk budget, evictions; only after the commit are the
segments whose last block went unlinked.

Group commit: the block writes queued while the writer was busy (a precompute whose
prefill outruns the disk) are taken together, in order: each into its own segment
(written, fsynced and renamed as one alone), then each folder they went to fsynced
once, then one index transaction for all. What a commit guarantees is unchanged:
every block it names is in a segment already fsynced, renamed and its folder fsynced
(durable); a crash before it leaves at most unreferenced files, swept later. Every
block write joins it (`WriteBack.write`: a store's, a remote fill's, a pull's); what
must follow the commit (a remote's publish) is its ``then``. A
``store()`` with ``sync_writes=True`` returns after the commit that holds its blocks;
its blocks are written from the caller's cache while the caller waits and makes the
RAM tier's copy (`WriteBack.write_from_caller`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterable, Mapping

from ..disk.segment import SegmentFiles
from ..disk.compaction import compact_sparse
from ..disk.commit import commit
from ..disk.index import WRITE_ERRORS, Index, Writer
from ..blocks import Node
from .counters import Counters
from ..errors import StoreCorruptError
from ..keys import shared_apart, starts_shared
from .merging import Merges
from ..tiers.memory import MemoryTier

log = logging.getLogger("persistent_prefix_cache")

ORPHAN_GRACE_SECONDS = 600.0
# How long `close()` waits for recency and hit counts alone behind another process's
# write lock (a writer stopped inside its commit holds it for ever).
BOOKKEEPING_WAIT_SECONDS = 2.0


class Worker:
    """Runs jobs one at a time, in submission order, on a daemon thread.

    Not a ``ThreadPoolExecutor``: its pools are shut down by ``concurrent.futures``'
    exit hook before ``atexit`` handlers run, while our exit hook still has to finish
    pending writes. A daemon thread lives until interpreter finalization, after them.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its result or exception lands in the returned future."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class Bookkeeping:
    """What fetches and stores leave for the index: recency, hit counts, counters.

    Batched so that a fetch costs no write transaction; the writer thread applies it
    with its next commit.
    """

    def __init__(self):
        self.touched: set[bytes] = set()
        self.hits: dict[bytes, int] = {}
        self.deltas: dict[str, int] = {}

    def empty(self) -> bool:
        """Whether nothing is queued."""
        return not (self.touched or self.hits or self.deltas)

    def add(self, touch: Iterable[bytes], hit: Iterable[bytes], deltas: dict[str, int]) -> None:
        """Queue LRU touches, block hits and store-wide counter deltas."""
        self.touched.update(touch)
        for key in hit:
            self.hits[key] = self.hits.get(key, 0) + 1
        for name, n in deltas.items():
            self.deltas[name] = self.deltas.get(name, 0) + n

    def take(self, lock: threading.Lock) -> "Bookkeeping":
        """Hand over what was queued and start afresh."""
        taken = Bookkeeping()
        with lock:
            taken.touched, self.touched = self.touched, set()
            taken.hits, self.hits = self.hits, {}
            taken.deltas, self.deltas = self.deltas, {}
        return taken

    def apply(self, w: Writer) -> None:
        """Write what was queued (inside the caller's transaction)."""
        now = time.time_ns()
        for key in self.touched:
            w.touch(key, now)
        w.count_hits(self.hits)
        w.add_counters(self.deltas)


class WriteBack:
    """The store's writer thread and everything it commits.

    Args:
        index: The store's index.
        files: The store's segment files.
        memory: The RAM tier (blocks that fail to be written or are removed leave it).
        counters: The handle's counters (``write_errors``, ``evictions``).
        root: The model's root key, and `describe` what gives its JSON record
            (registered with the first block, and when the record learns more);
            `describe_shared` the record of a `keys.TenantRoot`'s shared root.
        disk_bytes: Budget of the blocks' bytes (None: unbounded).
        quota: Budget of the bytes `root` owns (`disk.index_owners`; None: none): its own leaves go.
    """

    def __init__(
        self,
        index: Index,
        files: SegmentFiles,
        memory: MemoryTier,
        counters: Counters,
        *,
        root: bytes,
        describe: Callable[[], bytes],
        disk_bytes: int | None,
        describe_shared: Callable[[], bytes] | None = None,
        quota: int | None = None,
    ):
        self.index, self.files, self.memory, self.counters = index, files, memory, counters
        self.root, self.describe, self.disk_bytes, self.quota = root, describe, disk_bytes, quota
        self.describe_shared = describe_shared or describe
        self._book = Bookkeeping()
        self._futures: set[Future] = set()
        self._flying: dict[bytes, int] = {}  # block key -> queued writes holding it, not yet committed
        self._data: set[Future] = set()  # jobs that write blocks (never abandoned)
        self._lock = threading.Lock()
        # Block writes waiting for the writer: (generation, blocks, then); a generation ends at
        # every other data job, so no write is committed ahead of one queued before it.
        self._staged: list[tuple[int, list, Callable[[list], None] | None]] = []
        self._generation = 0
        self._worker = Worker("ppc-writer")
        self.merges = Merges(index, files, memory, counters, self.submit)
        self.submit(self.sweep)

    # -- the queue --------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return len(self._futures)

    def submit(self, fn: Callable[..., Any], *args: Any, data: bool = True) -> Future:
        """Run ``fn(*args)`` on the writer thread; failures are logged and counted.

        A data job ends the group commit of the block writes queued before it (no block
        write is committed ahead of a job queued before it). Block writes go through
        `write`, never here.

        Args:
            data: False for bookkeeping only (recency, hit counts), which `stop` may
                leave behind.
        """
        with self._lock:  # counted and queued under one lock: the queue keeps their order
            if data:
                self._generation += 1
            future = self._worker.submit(self._guarded, fn, *args)
        self._track(future, data)
        return future

    def hold(self, release: threading.Event) -> threading.Event:
        """Hold the writer at the start of its next job until `release` is set: what is
        queued meanwhile waits behind it (a data job: block writes queued before and after
        it never share a group commit). For tests and tools that need a busy writer;
        `stop` waits for `release` as for any data job.

        Returns:
            An event set once the writer stands at the hold (every job queued before it done).
        """
        reached = threading.Event()

        def held() -> None:
            reached.set()
            release.wait()

        self.submit(held)
        return reached

    def write(self, blocks: list[tuple[Node, Mapping]], *, then: Callable[[list], None] | None = None) -> Future:
        """Write blocks into a segment and commit their records, joining the group commit:
        the block writes queued behind a busy writer share one index transaction (see the
        module). Every block write goes through here.

        Args:
            blocks: ``(node, tensors by leaf)`` per block, consecutive, tensors
                evaluated (or bits), not changed until the future is done.
            then: Called with `blocks` on the writer thread once the commit that holds
                them is done, or the local write failed (counted): a remote's publish,
                whose copy does not depend on this disk.

        Returns:
            A future, done once that commit is (and `then` has run).
        """
        keys = [node.key for node, _ in blocks]
        with self._lock:  # staged and queued under one lock: the queue keeps their order
            self._staged.append((self._generation, blocks, then))
            for key in keys:
                self._flying[key] = self._flying.get(key, 0) + 1
            future = self._worker.submit(self._guarded, self._write_staged, self._generation)
        self._track(future, True)
        future.add_done_callback(lambda _: self._landed(keys))
        return future

    def _landed(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                left = self._flying.pop(key, 1) - 1
                if left > 0:
                    self._flying[key] = left

    def in_flight(self, key: bytes) -> bool:
        """Whether a write this handle queued holds block `key` and has not committed yet
        (a fetch that misses it then says so: `miss_reasons`)."""
        with self._lock:
            return key in self._flying

    def _track(self, future: Future, data: bool) -> None:
        with self._lock:
            self._futures.add(future)
            if data:
                self._data.add(future)
        future.add_done_callback(self._forget_future)

    def _forget_future(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
            self._data.discard(future)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except StoreCorruptError as exc:  # a damaged index: one line per handle, naming the repair
            self.index.write_damaged(exc)
            self.counters.add(write_errors=1)
        except Exception:  # never let a failed background write reach the caller
            log.exception("background work failed in store %s", self.files.root)
            self.counters.add(write_errors=1)

    def flush(self) -> None:
        """Wait until every job queued so far, and the bookkeeping, is committed."""
        self.submit(self._apply_bookkeeping, data=False)
        while True:
            with self._lock:
                pending = list(self._futures)
            if not pending:
                return
            for f in pending:
                f.result()

    def stop(self) -> bool:
        """Finish the queued jobs, then end the thread.

        Block writes are always waited for. Bookkeeping alone is waited for at most
        `BOOKKEEPING_WAIT_SECONDS` when the index's write lock is held elsewhere: a
        handle that only read must not hang behind a stopped writer.

        Returns:
            False if bookkeeping was left behind (the writer thread may still be
            waiting for the lock: the caller must then not close the index).
        """
        self.merges.stop()  # its tidy of the last writes, if any, is a data job: waited for
        self.submit(self._apply_bookkeeping, data=False)
        deadline = None  # one wait for all the bookkeeping, not one per job
        while True:
            with self._lock:
                data, pending = list(self._data), list(self._futures)
            if data:
                for f in data:
                    f.result()
                continue
            if not pending:
                break
            if deadline is None:
                deadline = time.monotonic() + BOOKKEEPING_WAIT_SECONDS
            done = [f for f in pending if f.done() or _wait(f, max(0.0, deadline - time.monotonic()))]
            if len(done) < len(pending):
                log.warning(
                    "store %s: recency and hit counts of this handle not committed: another "
                    "process holds the index's write lock", self.files.root,
                )  # fmt: skip
                return False
        self._worker.stop()
        return True

    # -- bookkeeping ------------------------------------------------------------------

    def note(self, *, touch: Iterable[bytes] = (), hit: Iterable[bytes] = (), **deltas: int) -> None:
        """Queue LRU touches, block hit counts and store-wide counter deltas."""
        with self._lock:
            was_empty = self._book.empty()
            self._book.add(touch, hit, deltas)
        if was_empty:
            self.submit(self._apply_bookkeeping, data=False)

    def _apply_bookkeeping(self) -> None:
        book = self._book.take(self._lock)
        if not book.empty():
            self.index.write(book.apply)

    # -- blocks -----------------------------------------------------------------------

    def _write_staged(self, generation: int) -> None:
        """Write the staged block writes of `generation` (a writer-thread job): those of
        a later one wait for the data jobs queued between (nothing if an earlier job of
        this generation took them all); then each write's `then`, in order."""
        with self._lock:
            n = 0
            while n < len(self._staged) and self._staged[n][0] == generation:
                n += 1
            taken, self._staged = self._staged[:n], self._staged[n:]
        if not taken:
            return
        try:
            self._write_many([blocks for _, blocks, _ in taken])
        finally:
            for _, blocks, then in taken:
                if then is not None:
                    self._guarded(then, blocks)  # one failing does not keep the others back

    def write_from_caller(self, new: list[tuple[Node, Mapping, Mapping, dict]], evaluate: Callable[[], None]) -> None:
        """A synchronous store's write: the writer thread writes the blocks from their
        bits, views of the caller's cache (no copy before the disk starts), while this
        thread runs `evaluate`, the RAM tier's copy of them (the tier never shares a
        buffer the caller's cache grows into); the blocks join the tier once the index
        holds them, so a failed write leaves nothing there.

        Args:
            new: ``(node, tensors, bits, origin)`` per block (`layers.Layout.new_blocks`
                with ``direct``).
            evaluate: Makes the tensors (skipped where the tier would keep none).
        """
        future = self.write([(node, bits) for node, _, bits, _ in new])
        keep = any(self.memory.fits(tensors) for _, tensors, _, _ in new)
        interrupted = False
        try:
            if keep:
                evaluate()
        finally:
            # The writer reads the caller's cache: never return before it is done, not
            # even on Ctrl-C (the caller could then change what is being written).
            while True:
                try:
                    wait([future])
                    break
                except KeyboardInterrupt:
                    interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        future.result()
        if keep:
            with self.index.reader() as reader:
                held = [reader.get(node.key) is not None for node, _, _, _ in new]
            for (node, tensors, _, origin), ok in zip(new, held):
                if ok:
                    self.memory.put(node, tensors, origin)

    def _write_many(self, groups: list[list[tuple[Node, dict]]]) -> None:
        """Write each group into its own segment (groups that continue one another's chain
        into one), fsync their folders once, then commit every record in one index
        transaction; then the small segments at the end of each chain written merge
        (`merging.Merges`, in jobs of their own)."""
        joined = shared_apart(self.root, _joined(groups))
        description = self.describe()  # kept in the segment too: the index can be rebuilt
        models = [(self.root, description)]
        segments, blocks = [], []  # each new segment (id, size, digest), and its blocks
        writes = 0  # the block writes (`write` calls) the commit holds
        now = time.time_ns()
        for new, n_writes in joined:
            written = [node for node, _ in new]
            for node in written:  # a block that comes without a time of use (the remote's) is used now
                node.last_access = node.last_access or now
            root, model = self.root, description
            if starts_shared(root, new[0][0]):  # a shared prefix's first blocks: the shared namespace's
                root, model = root.shared_root, self.describe_shared()  # type: ignore[attr-defined]
                models.append((root, model))
            try:
                segment = self.files.write(
                    new, root=root, model=model, block_size=self.index.block_size, sync_folder=False
                )
            except (OSError, ValueError) as exc:
                self._failed("write", written, exc)  # nothing was renamed into place
                continue
            segments.append(segment)
            blocks.append(written)
            writes += n_writes
        if not segments:
            return
        ids = [segment for segment, _, _ in segments]
        try:
            self.files.sync_folders(ids)
        except OSError as exc:
            for written in blocks:
                self._failed("write", written, exc)
            self.files.unlink(ids)
            return
        book = self._book.take(self._lock)

        quota_evicted: list[Node] = []  # reset by each try of the transaction

        def records(w: Writer):
            removed, taken, nbytes = [], 0, 0
            quota_evicted.clear()
            for (_, size, _), written in zip(segments, blocks):
                took = 0
                for node in written:
                    if w.insert(node):  # else someone stored this block first: theirs stays
                        took += 1
                        removed.extend(_superseded(w, node))
                taken += took
                nbytes += size if took else 0
            book.apply(w)
            if self.quota is not None:  # the namespace's own leaves first: never another's
                quota_evicted.extend(w.evict_owned(self.root, self.quota))
                removed.extend(quota_evicted)
            if self.disk_bytes is not None:
                removed.extend(w.evict(self.disk_bytes))
            return removed, taken, nbytes

        try:
            # The model is recorded with its first block, not at open: a run that
            # stores nothing leaves no trace in the store.
            removed, taken, nbytes = commit(
                self.index,
                self.files,
                records,
                new=segments,
                models=models,
                before="before_commit",
                after="after_commit",
            )
        except WRITE_ERRORS as exc:
            # The index could not take the records (disk full, say) and is as it was;
            # `commit` unlinked the segments.
            for written in blocks:
                self._failed("commit", written, exc)
            return
        # What this handle added to the store (another writer's blocks are theirs).
        self.counters.add(blocks_written=taken, bytes_written=nbytes, group_commits=1, group_commit_writes=writes, quota_evictions=len(quota_evicted))  # fmt: skip
        self._forget(removed)
        compact_sparse(self.index, self.files, (n.segment for n in removed))
        # Jobs behind any write queued meanwhile: a caller waiting for its own never waits for them.
        self.merges.after_write(ids, [written[-1].key for written in blocks])

    def _failed(self, what: str, nodes: list[Node], exc: Exception) -> None:
        if isinstance(exc, StoreCorruptError):
            self.index.write_damaged(exc)  # said once per handle, with the repair to run
        else:
            log.warning("could not %s blocks to %s: %s", what, self.files.root, exc)
        self.counters.add(write_errors=1)
        for node in nodes:
            self.memory.discard(node.key)

    def _forget(self, removed: list[Node]) -> None:
        for node in removed:
            self.memory.discard(node.key)
        if removed:
            self.counters.add(evictions=len(removed))

    def drop_subtree(self, key: bytes) -> None:
        """Remove a block and everything stored after it (a writer-thread job)."""
        removed = commit(self.index, self.files, lambda w: w.remove_subtree(key))
        for node in removed:
            self.memory.discard(node.key)
        compact_sparse(self.index, self.files, (n.segment for n in removed))

    # -- sweeps -----------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove temporary files of dead writers and old unreferenced segment files."""
        self.files.sweep_tmp()
        sweep_orphans(self.index, self.files, grace=ORPHAN_GRACE_SECONDS)


def _wait(future: Future, seconds: float) -> bool:
    try:
        future.result(timeout=seconds)
    except Exception:  # a timeout, or a failure already logged by _guarded
        return future.done()
    return True


def sweep_orphans(index: Index, files: SegmentFiles, *, grace: float) -> int:
    """Remove segment files the index does not reference, older than `grace` seconds
    (and files a schema v1-v2 store left in ``blocks/``).

    Returns:
        How many files were removed.
    """
    with index.reader() as reader:
        referenced = set(reader.segments())
    return files.sweep_orphans(referenced.__contains__, grace=grace)


def _joined(groups: list[list[tuple[Node, Any]]]) -> list[tuple[list[tuple[Node, Any]], int]]:
    """The groups of a group commit, each that continues the one before it (its first
    block's parent is that group's last block: one prompt stored a piece at a time, or
    a turn at a time) joined to it: one segment each, not one per `store()`; with how
    many groups each holds."""
    out: list[tuple[list[tuple[Node, Any]], int]] = []
    for group in groups:
        if out and group and out[-1][0] and _continues(group, out[-1][0]):
            out[-1] = (out[-1][0] + group, out[-1][1] + 1)
        else:
            out.append((list(group), 1))
    return out


def _continues(group: list[tuple[Node, Any]], before: list[tuple[Node, Any]]) -> bool:
    first, last = group[0][0], before[-1][0]
    return first.parent == last.key and first.position == last.end


def _superseded(w: Writer, node: Node) -> list[Node]:
    # A partial leaf whose tokens start the new block serves nothing the new block
    # cannot (by trimming): drop it so shared prefixes are stored once.
    if not node.trimmable:
        return []
    removed = []
    for sib in w.children(node.parent):
        if (
            sib.key != node.key
            and sib.child_count == 0
            and sib.n_tokens < node.n_tokens
            and node.tokens.startswith(sib.tokens)
        ):
            w.remove_leaf(sib)
            removed.append(sib)
    return removed
