"""A handle's cost model (`PersistentPrefixCache.costs`): what restoring and computing
cost here, taught by the caller's forwards and by `calibrate`, asked by every fetch.

`CostModel` holds the learned costs of the handle's model on this device kind
(`costs.Costs`, its `learned`), keeps them in the store's ``costs.json``
(`SavedCosts`), and answers a fetch: which prefix of a lookup's path to restore (`cut`:
blocks it leaves on disk go to the warmer, `warm.Warmer`) and how long a restore took
(`timed`). Its collaborators are passed to it: the RAM tier, the warmer, the handle's
counters, the writer thread (where saves run), and what `calibrate` needs.

Rates persist per model root and device kind (`device.target.device_kind`): a restarted
process starts informed, and a rate measured on another device is never used. A small
file, not the index: these are hints, not data (a lost or damaged file costs one
calibration, never a block), writing them never takes the index's write lock, and they
are saved at most every `SAVE_EVERY` seconds (and at flush and close), never once per
fetch; a due save runs on the writer thread (`save_soon`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

from . import machine_costs
from ..blocks import Node
from .calibration import calibrate, first_measured, plausible
from .costs import FIRST_FORWARD_TOKENS, Costs, first_forward_here, first_restore_here
from ..device.target import device_kind
from .counters import Counters
from ..files import open_regular
from .model_record import ModelRecord
from ..tiers.memory import MemoryTier
from .warm import Warmer
from .writeback import WriteBack

log = logging.getLogger("persistent_prefix_cache")

FILE_NAME = "costs.json"
MAX_FILE_BYTES = 1 << 20  # a costs file holds a few records per model and device: more is not one
SAVE_EVERY = 30.0


class SavedCosts:
    """The costs of one model root on this device kind, kept in the store's
    ``costs.json`` (see the module's docstring).

    Args:
        root: The store directory.
        key: The model's root key (hex).
        costs: The handle's `Costs`, loaded from the file here.
        readonly: Never write the file.
    """

    def __init__(self, root: str, key: str, costs: Costs, *, readonly: bool):
        self.path = os.path.join(root, FILE_NAME)
        self.root, self.key, self.costs, self.readonly = root, key, costs, readonly
        self.device = costs.device = device_kind()
        self._saved_at = 0.0
        self._lock = threading.Lock()  # the caller's thread and the writer's may both save
        record = self._read().get(self.key, {}).get(self.device)
        self.loaded = isinstance(record, dict) and costs.load(record)

    def _read(self) -> dict:
        try:
            # Never through a link, never blocked by a FIFO, never more than a costs file holds.
            with os.fdopen(open_regular(self.path), "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                return {}
            data = json.loads(raw)
        except (OSError, ValueError):
            return {}  # none yet, damaged, or not a file: rates are hints, measured again
        models = data.get("models") if isinstance(data, dict) else None
        return models if isinstance(models, dict) else {}

    def maybe_save(self, *, force: bool = False) -> None:
        """Save what was learned, if anything was and (unless `force`) the last save is
        `SAVE_EVERY` seconds old. Never raises: a rate not saved is measured again."""
        with self._lock:
            if force or self.due():
                self._save()

    def due(self) -> bool:
        """Whether `maybe_save` would write now (cheap: a fetch hands the write to the
        writer thread, ~1 ms of file work the caller does not wait for)."""
        return not self.readonly and self.costs.changed and time.monotonic() - self._saved_at >= SAVE_EVERY

    def _save(self) -> None:
        if self.readonly or not self.costs.changed:
            return
        self._saved_at = time.monotonic()
        self.costs.changed = False
        from ..disk.store_dir import TempFile, folder

        tmp = None
        try:
            models = self._read()  # another process's models and devices are kept
            entry = models.get(self.key)
            models[self.key] = entry = entry if isinstance(entry, dict) else {}
            entry[self.device] = self.costs.record()
            # Exclusively, under a random name, in the store folder; renamed by descriptor.
            tmp = TempFile(self.root, "", FILE_NAME.replace(".", "_"))
            with os.fdopen(tmp.fileno(), "w", encoding="utf-8", closefd=False) as f:
                json.dump({"version": 1, "models": models}, f)
            with folder(self.root) as root:
                tmp.move_to(root, FILE_NAME)
        except OSError:
            pass
        finally:
            if tmp is not None:
                tmp.discard()


class CostModel:
    """The cost model of one `PersistentPrefixCache`: its `costs` (see the module's
    docstring). What callers tell it and ask it (`observe_prefill`, `resumable_step`,
    `calibrate`) raises `StoreClosedError` once the handle is closed.

    Args:
        learned: The handle's learned costs (the remote fill asks them too).
        folder: The store directory (its ``costs.json``); `readonly`: never write it.
        model: The handle's model (the root its costs are kept under, and what
            `calibrate` remembers a measurement by).
        block_size: The store's.
        memory: The RAM tier (which blocks of a path a restore takes from it).
        warmer: Fills the RAM tier with what a `cut` leaves on disk.
        counters: The handle's (each cut's decision is counted).
        writeback: The writer thread, where due saves run (None: a read-only handle).
        check_open: Raises `StoreClosedError` once the handle is closed.
        peek, make_cache: The handle's (`calibrate` measures for a prompt's stored
            prefix, on fresh caches of the store's layout).
        remote: Whether the handle has a remote tier (a fetch may then restore more
            than the local store holds).
    """

    def __init__(
        self,
        learned: Costs,
        *,
        folder: str,
        readonly: bool,
        model: ModelRecord,
        block_size: int,
        memory: MemoryTier,
        warmer: Warmer,
        counters: Counters,
        writeback: WriteBack | None,
        check_open: Callable[[], None],
        peek: Callable[[Any], int],
        make_cache: Callable[[], list],
        remote: bool,
    ):
        self.learned = learned
        self.saved = SavedCosts(folder, model.root.hex(), learned, readonly=readonly)
        self._model, self._block_size, self._memory, self._warmer = model, block_size, memory, warmer
        self._counters, self._writeback, self._check_open = counters, writeback, check_open
        self._peek, self._make_cache, self._remote = peek, make_cache, remote
        self._calibrated = False  # this handle measured the prefill (`calibrate`)

    # -- what callers tell it ------------------------------------------------------------

    def observe_prefill(
        self,
        tokens: int,
        seconds: float,
        *,
        start: int = 0,
        restored: bool = False,
        forwards: int = 1,
        exact: bool = True,
    ) -> None:
        """Tell the cost model that the model computed positions ``[start, start +
        tokens)`` in `seconds` (`prefill()`, ``ppc generate`` and ``ppc serve`` do; so can
        a caller that prefills on its own).

        Args:
            tokens: Tokens fed in one forward (or a run of them).
            seconds: The time, the evaluation of the cache included.
            start: Positions the cache held before.
            restored: This was the first forward on a cache `fetch` had just restored
                (up to `costs.FIRST_FORWARD_TOKENS` tokens, it teaches the first forward's
                extra cost, not the prefill rate).
            forwards: How many forward calls it took.
            exact: False where `seconds` are a request's, not its forwards' alone (a
                server's: queueing, sampling, its answer; `costs.Costs.prefill_requests`).

        Raises:
            StoreClosedError: If the store is closed.
        """
        self._check_open()
        if first_forward_here():
            return  # it compiled the kernels: it says nothing of the model or the restore
        if restored and start > 0 and tokens <= FIRST_FORWARD_TOKENS:
            self.learned.observe_first_forward(tokens, seconds, start=start)
        else:
            # A longer forward after a restore is a prefill like any other (the restore's
            # share of it is small, and its cache has room to grow in place): left out, a
            # chat grown turn by turn through `prefill()` taught the fit one-token forwards
            # alone (docs/performance.md).
            self.learned.observe_prefill(tokens, seconds, start=start, forwards=forwards, exact=exact)
        self.save_soon()

    def resumable_step(self) -> int | None:
        """Tokens per forward for a prefill that stores after every forward (a model with
        recurrent or sliding-window layers resumes only where one ended): the shortest run
        of whole blocks whose per-call cost stays within `costs.SNAPSHOT_OVERHEAD` of its
        tokens' by the costs measured for this model (`Costs.resumable_step`); None until
        they are known. `prefill.prefill` asks it before every forward.

        Raises:
            StoreClosedError: If the store is closed.
        """
        self._check_open()
        return self.learned.resumable_step(self._block_size)

    def calibrate(
        self, model: Any, *, tokens: int = 512, only_if_unknown: bool = False, prompt: Any = None
    ) -> float | None:
        """Measure how fast `model` prefills on this machine (`calibration.calibrate`):
        remembered in the store for this model and device kind, and for every store of
        it on this machine (`machine_costs`); the first measurement of a process is
        logged (INFO, with its duration). Call it on the thread that runs the model
        (MLX's streams belong to a thread).

        Args:
            model: The model the store was opened with.
            tokens: Tokens of the first timed forward (more, up to 4,096, where a forward
                of that many is bound by its call: a fast GPU).
            only_if_unknown: Measure nothing if the prefill of this model on this
                device kind is known (priced by forwards or a server's requests, here or
                remembered by the store), was measured on this machine before (then
                taken from there: no forward runs), or this handle measured it already
                (priced or not: forwards bound by their calls up to 4,096 tokens would
                price no token again).
            prompt: Measure for a fetch of this prompt: nothing unless the store holds
                a prefix of it (a miss decides nothing: the caller's prefill then teaches
                the rate), and at most about `calibration.SHARE` of that prefix's
                predicted prefill (nothing for a prefix under ``MIN_TOKENS * FIRST_SET /
                SHARE``: 288 tokens).

        Returns:
            Tokens/s of a 1,024-token prefill as now known (None: skipped, unknown).

        Raises:
            StoreClosedError: If the store is closed.
            InvalidArgumentError: If `tokens` < 2.
        """
        self._check_open()
        costs, device = self.learned, self.saved.device
        if only_if_unknown and (self._calibrated or costs.prefill_tokens_per_s is not None):
            return costs.prefill_tokens_per_s
        key, name = machine_costs.record_key(self._model.model_root, device), self._model.label
        if only_if_unknown:
            record = machine_costs.recall(key)
            if record is not None and plausible(record):
                costs.take_prefill(record)
                log.debug("cost model: the prefill of %s on %s as this machine measured it before", name, device)
                return costs.prefill_tokens_per_s
        # What a fetch of `prompt` would restore (a remote tier may hold more than the disk).
        stake = None if prompt is None else len(prompt) if self._remote else self._peek(prompt)
        began = time.perf_counter()
        if not calibrate(costs, model, self._make_cache, tokens, stake=stake):
            return costs.prefill_tokens_per_s
        self._calibrated = True
        seconds = time.perf_counter() - began
        self.saved.maybe_save(force=True)
        record = dict(costs.prefill_record(), device=device, model=name[:200])
        kept = plausible(record) and machine_costs.remember(key, record)
        if first_measured(key):  # said once a process, where it happened
            rate = costs.prefill_tokens_per_s
            log.info(
                "cost model: measured the prefill of %s on %s in %.2f s: %s (%s)",
                name, device, seconds,
                f"{rate:.0f} tokens/s" if rate else "no rate (the forwards took as long whatever their tokens: "
                "every prefix is restored until a longer forward prices a token)",
                f"kept for every store of this model on this machine, in {machine_costs.folder()}" if kept
                else "kept for this store only",
            )  # fmt: skip
        return costs.prefill_tokens_per_s

    # -- what a fetch asks it ------------------------------------------------------------

    def cut(self, path: list[Node], matched: int, total: int) -> tuple[list[Node], int]:
        """The prefix of a lookup's `path` a fetch restores (all of it until the costs
        are known), its decision counted; what it leaves on disk goes to the warmer.

        Args:
            path: The lookup's blocks; `matched` the tokens they cover.
            total: The prompt's length.

        Returns:
            ``(blocks, tokens)`` to restore.
        """
        ends = [n.end for n in path[:-1]] + [matched]
        cuts = [i for i, n in enumerate(path[:-1]) if n.resumable] + [len(path) - 1]
        in_ram = [self._memory.node(n.key) is not None for n in path]
        choice = self.learned.choose(ends, [n.size for n in path], in_ram, cuts, total)
        self._counters.add(**{choice.decision: 1}, tokens_skipped=matched - choice.tokens)
        if choice.blocks < len(path) and not all(in_ram[choice.blocks :]):
            # Left on disk: the tier may still learn it, once the caller has computed it.
            after = self.learned.prefill_seconds(choice.tokens, matched)
            self._warmer.skipped(path, choice.blocks, matched, after=after)
        return path[: choice.blocks], choice.tokens

    def timed(self, nodes: list[Node], seconds: float, *, in_ram: bool) -> None:
        """Teach the restore's rate: `nodes` took `seconds`, all from the RAM tier or not
        (`in_ram` as it was before the restore: a disk restore admits what it read)."""
        tier = "ram" if in_ram else "disk"
        self.learned.observe_restore(tier, sum(n.size for n in nodes), seconds, first=first_restore_here(tier))

    # -- saving --------------------------------------------------------------------------

    def save_soon(self) -> None:
        """Hand a due save to the writer thread: its file work (a read, a write and a
        rename: milliseconds) is never on a caller's path."""
        if self.saved.due() and self._writeback is not None:
            self._writeback.submit(self.saved.maybe_save, data=False)

    def save(self) -> None:
        """Save what was learned now (flush, close)."""
        self.saved.maybe_save(force=True)
