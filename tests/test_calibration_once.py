"""The prefill's calibration: run only where a fetch has something to decide, bounded by
what that is, measured once per model and machine (`machine_costs`: a per-user record
every store takes), said once in the log. Counted, never timed: a test counts the
model's forwards during a fetch (a fetch runs none of its own but a calibration's)."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time

import pytest
from helpers import BLOCK, counted_forwards, prefill, random_tokens

from persistent_prefix_cache import PersistentPrefixCache

from persistent_prefix_cache.core import calibration, machine_costs
from persistent_prefix_cache.compat.prefix_cache import PrefixCacheManager
from persistent_prefix_cache.core.costs import Costs

LINE = "cost model: measured the prefill"
PROMPT = 25 * BLOCK  # 400 tokens: above the 288 a calibration for a fetch needs


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """This test's own per-user folder, and a process that has said nothing yet."""
    path = tmp_path / "cache" / machine_costs.FOLDER_NAME
    monkeypatch.setattr(machine_costs, "FOLDER", str(path))
    monkeypatch.setattr(calibration, "_announced", set())
    return path


@pytest.fixture
def forwards(model, monkeypatch):
    """The model's forward calls, counted, a calibration timing them by their tokens."""
    return counted_forwards(model, monkeypatch)


def _filled(path, model, tokens) -> None:
    """A store holding `tokens`, its prefill never timed (as a store filled elsewhere)."""
    with PersistentPrefixCache(path, model, block_size=BLOCK) as store:
        store.store(tokens, prefill(model, tokens)[1])


def _first_read(path, model, tokens, forwards) -> tuple[int, float | None, bool]:
    """A compat layer's first read of `tokens`: (forwards it ran, the prefill rate after
    it, whether it restored)."""
    manager = PrefixCacheManager(model, store=str(path))
    try:
        before = len(forwards)
        cache, _ = manager.fetch_cache(tokens)
        return len(forwards) - before, manager.store.stats()["prefill_tokens_per_s"], cache is not None
    finally:
        manager.close()


def test_a_miss_calibrates_nothing_and_a_requests_time_teaches_the_rate_not_a_calls_cost(
    tmp_path, model, folder, forwards, caplog
):
    caplog.set_level(logging.INFO, logger="persistent_prefix_cache")
    tokens = random_tokens(PROMPT, seed=950)
    manager = PrefixCacheManager(model, store=str(tmp_path / "store"))
    try:
        cache, rest = manager.fetch_cache(tokens)  # a new store: nothing to decide
        assert cache is None and forwards == [] and manager.store.stats()["prefill_tokens_per_s"] is None
        manager.store_cache(tokens, prefill(model, tokens)[1])  # the caller's prefill, timed by the link
        assert manager.store.stats()["prefill_tokens_per_s"] is not None
        # The link timed a request (read to write), not forwards: it teaches the rate but
        # never what one call costs (on an H100, `ppc serve`'s request overhead read as a
        # call's cost restored 64 tokens of 2,092 to "save a call").
        assert manager.store.costs.learned.fastest_forward is None
        assert manager.store.stats()["prefill_per_forward_s"] == 0
    finally:
        manager.close()
    assert LINE not in caplog.text and not folder.exists()
    # A restarted server's first read of a stored prefix: the rate is known (from requests,
    # remembered by the store), so no calibration forward runs.
    ran, rate, restored = _first_read(tmp_path / "store", model, tokens + [7], forwards)
    assert ran == 0 and rate is not None and restored and LINE not in caplog.text


def test_a_second_store_of_the_same_model_runs_no_calibration_forward(tmp_path, model, folder, forwards, caplog):
    caplog.set_level(logging.INFO, logger="persistent_prefix_cache")
    tokens = random_tokens(PROMPT, seed=951)
    _filled(tmp_path / "one", model, tokens)
    ran, rate, restored = _first_read(tmp_path / "one", model, tokens + [7], forwards)
    assert ran > 0 and rate is not None and restored
    said = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert len(said) == 1 and " s: " in said[0] and str(folder) in said[0], said  # with its duration and where
    # The per-user record: 0600 in a 0700 folder, nothing else left there.
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert os.listdir(folder) == [machine_costs.FILE_NAME]
    assert stat.S_IMODE((folder / machine_costs.FILE_NAME).stat().st_mode) == 0o600
    # A new store of the same model on this machine: the rate, and not one forward.
    _filled(tmp_path / "two", model, tokens)
    ran, again, restored = _first_read(tmp_path / "two", model, tokens + [7], forwards)
    assert ran == 0 and again == pytest.approx(rate) and restored
    assert len([r for r in caplog.records if LINE in r.getMessage()]) == 1


def test_a_calibration_that_prices_no_token_says_so_and_restores(tmp_path, model, folder, monkeypatch, caplog):
    # Forwards that take as long whatever their tokens (a small model, a fast GPU's small
    # forwards) give no rate: said as such, not as "0 tokens/s", and nothing kept for the
    # machine (another store would take a rate from there), and the read restores.
    caplog.set_level(logging.INFO, logger="persistent_prefix_cache")
    tokens = random_tokens(PROMPT, seed=953)
    _filled(tmp_path / "one", model, tokens)
    forwards = counted_forwards(model, monkeypatch, seconds=lambda n: 0.01)
    ran, rate, restored = _first_read(tmp_path / "one", model, tokens + [7], forwards)
    assert ran > 0 and rate is None and restored
    (said,) = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert "no rate" in said and "tokens/s" not in said and "kept for this store only" in said, said
    assert not folder.exists()


def test_another_model_or_another_machine_measures_again(tmp_path, model, other_model, folder, forwards, monkeypatch):
    tokens = random_tokens(PROMPT, seed=952)
    _filled(tmp_path / "one", model, tokens)
    assert _first_read(tmp_path / "one", model, tokens + [7], forwards)[0] > 0
    _filled(tmp_path / "other", other_model, tokens)  # same shapes, other weights
    assert _first_read(tmp_path / "other", other_model, tokens + [7], forwards)[0] > 0
    # Another machine (a home folder shared over the network), or another MLX: its own rate.
    monkeypatch.setattr(machine_costs, "_this_machine", lambda: ("other-id", "other-host", "0.32.4", "0.32.2"))
    _filled(tmp_path / "two", model, tokens)
    assert _first_read(tmp_path / "two", model, tokens + [7], forwards)[0] > 0
    with open(folder / machine_costs.FILE_NAME) as f:
        assert len(json.load(f)["records"]) == 3


def _make_record(tmp_path, model, tokens, forwards) -> dict:
    """A real record of this model, as a first store's calibration wrote it."""
    _filled(tmp_path / "one", model, tokens)
    assert _first_read(tmp_path / "one", model, tokens + [7], forwards)[0] > 0
    with open(os.path.join(machine_costs.folder(), machine_costs.FILE_NAME)) as f:
        return json.load(f)


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")
    return entry.pw_uid, entry.pw_gid


def _damage(how: str, folder, data: dict) -> None:
    """Make the per-user file (or its folder) untrustworthy in one way."""
    path = folder / machine_costs.FILE_NAME
    ((key, record),) = data["records"].items()
    if how == "not json":
        path.write_text('{"format": "ppc-prefill/1", "records": {')
    elif how == "too large":
        path.write_text(json.dumps(data) + " " * machine_costs.MAX_FILE_BYTES)
    elif how in ("rate too high", "not finite", "too old", "from the future", "not a fit"):
        bad = dict(record)
        if how == "rate too high":  # a prefill that costs ~nothing: every restore would be skipped
            bad["prefill"] = record["prefill"][:9] + [1e-30, 1e-30, 1e-30]
        elif how == "not finite":
            bad["prefill"] = record["prefill"][:11] + [float("nan")]
        elif how == "too old":
            bad["saved"] = time.time() - machine_costs.MAX_AGE - 3600
        elif how == "from the future":
            bad["saved"] = time.time() + 7 * 24 * 3600
        else:
            bad["prefill"] = record["prefill"][:5]
        path.write_text(json.dumps({"format": machine_costs.FORMAT, "records": {key: bad}}))
    elif how == "a link":
        real = folder.parent / "elsewhere.json"
        real.write_text(json.dumps(data))
        os.chmod(real, 0o600)
        path.unlink()
        path.symlink_to(real)
    elif how == "a FIFO":
        path.unlink()
        os.mkfifo(path, 0o600)
    elif how == "group-writable file":
        os.chmod(path, 0o620)
    elif how == "world-writable folder":
        os.chmod(folder, 0o777)
    elif how == "file of another user":
        os.chown(path, *_nobody())
    elif how == "folder of another user":
        os.chown(folder, *_nobody())
    elif how == "folder is a link":
        os.rename(folder, folder.parent / "moved")
        folder.symlink_to(folder.parent / "moved")
    else:
        raise AssertionError(how)


HOW = [
    "not json", "too large", "rate too high", "not finite", "too old", "from the future", "not a fit", "a link",
    "a FIFO", "group-writable file", "world-writable folder", "file of another user", "folder of another user",
    "folder is a link",
]  # fmt: skip


@pytest.mark.parametrize("how", HOW)
def test_an_untrusted_or_damaged_record_is_ignored(tmp_path, model, folder, forwards, how):
    tokens = random_tokens(PROMPT, seed=953)
    data = _make_record(tmp_path, model, tokens, forwards)
    _damage(how, folder, data)
    _filled(tmp_path / "two", model, tokens)
    started = time.monotonic()
    ran, rate, restored = _first_read(tmp_path / "two", model, tokens + [7], forwards)
    assert ran > 0 and rate is not None and restored  # measured again, never an error or a hang
    assert time.monotonic() - started < 60
    path = folder / machine_costs.FILE_NAME
    if how in ("world-writable folder", "folder of another user", "folder is a link"):
        # Somebody else's folder (or one anybody can write): nothing written into it.
        assert os.listdir(folder) == [machine_costs.FILE_NAME]
    else:
        # Our own folder: the measurement replaced the bad file with a good one of ours.
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        assert machine_costs.recall(next(iter(data["records"]))) is not None


def test_the_same_file_is_taken_once_it_is_trustworthy_again(tmp_path, model, folder, forwards):
    # The control of the ownership check: the file another user owned is the very one taken back.
    tokens = random_tokens(PROMPT, seed=954)
    _make_record(tmp_path, model, tokens, forwards)
    path = folder / machine_costs.FILE_NAME
    os.chown(path, *_nobody())
    (key,) = json.loads(path.read_text())["records"]
    assert machine_costs.recall(key) is None
    os.chown(path, os.geteuid(), os.getegid())
    assert machine_costs.recall(key) is not None


def test_a_record_planted_by_another_user_is_never_read(tmp_path, model, forwards, monkeypatch):
    # XDG_CACHE_HOME in a folder every user may write (as /tmp): another user makes the
    # records' folder first, with a well-formed record under the right key. Never read,
    # never written into.
    uid, gid = _nobody()
    tokens = random_tokens(PROMPT, seed=955)
    monkeypatch.setattr(calibration, "_announced", set())
    monkeypatch.setattr(machine_costs, "FOLDER", str(tmp_path / "ours" / machine_costs.FOLDER_NAME))
    planted = _make_record(tmp_path, model, tokens, forwards)
    base = tempfile.mkdtemp(prefix="ppc-xdg-", dir="/tmp")
    try:
        os.chmod(base, 0o1777)
        monkeypatch.setattr(machine_costs, "FOLDER", None)
        monkeypatch.setenv("XDG_CACHE_HOME", base)
        pid = os.fork()
        if pid == 0:  # the other user: only file work here, then out
            try:
                os.setgid(gid)
                os.setuid(uid)
                os.mkdir(machine_costs.folder(), 0o755)
                with open(os.path.join(machine_costs.folder(), machine_costs.FILE_NAME), "w") as f:
                    json.dump(planted, f)
                os.chmod(f.name, 0o644)
                os._exit(0)
            except BaseException:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.stat(machine_costs.folder()).st_uid == uid
        _filled(tmp_path / "two", model, tokens)
        ran, rate, restored = _first_read(tmp_path / "two", model, tokens + [7], forwards)
        assert ran > 0 and rate is not None and restored
        with open(os.path.join(machine_costs.folder(), machine_costs.FILE_NAME)) as f:
            assert json.load(f) == planted  # left as the other user wrote it
        assert os.listdir(machine_costs.folder()) == [machine_costs.FILE_NAME]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _counted_calibration(model, monkeypatch, seconds, *, stake: int, tokens: int = 256) -> list[int]:
    """`calibrate` for a fetch of `stake` tokens on the real model, timed by a clock that
    a forward of ``n`` tokens moves by ``seconds(n)``: the forwards' token counts."""
    from mlx_lm.models.cache import make_prompt_cache

    calls = counted_forwards(model, monkeypatch, seconds)
    measured = calibration.calibrate(Costs(), model, lambda: make_prompt_cache(model), tokens, stake=stake)
    assert measured == bool(calls)
    return calls


def test_a_calibration_for_a_fetch_costs_a_share_of_what_it_decides_about(model, monkeypatch):
    per_token = lambda n: 0.001 * n  # noqa: E731  (bound by its tokens: a CPU, a Mac)
    # A prefix too short to be worth one set of forwards: none at all (restored blind).
    assert _counted_calibration(model, monkeypatch, per_token, stake=287) == []
    for stake in (288, 400, 1000, 4000):
        calls = _counted_calibration(model, monkeypatch, per_token, stake=stake)
        assert calls and sum(calls) <= calibration.SHARE * stake, (stake, calls)
    # A long prefix gets the whole calibration (as an explicit one), a short one less of it.
    assert len(_counted_calibration(model, monkeypatch, per_token, stake=100_000)) == 12
    assert len(_counted_calibration(model, monkeypatch, per_token, stake=400)) == 4
    # Bound by its calls (a GPU: 12 ms for 32 tokens as for 512): the first set only,
    # never the doubling an explicit calibration runs there.
    assert len(_counted_calibration(model, monkeypatch, lambda n: 0.012, stake=8192)) == 4


def test_the_per_user_record_keeps_the_newest_and_writes_atomically(tmp_path, folder, monkeypatch):
    monkeypatch.setattr(machine_costs, "MAX_RECORDS", 3)
    record = {"prefill": [1.0] * machine_costs.PREFILL_SUMS, "fastest_forward": 0.01}
    for i in range(5):
        assert machine_costs.remember(f"{i:032x}", record)
    with open(folder / machine_costs.FILE_NAME) as f:
        kept = json.load(f)["records"]
    assert sorted(kept) == [f"{i:032x}" for i in (2, 3, 4)]
    assert os.listdir(folder) == [machine_costs.FILE_NAME]  # no temporary file left
    assert machine_costs.recall(f"{4:032x}")["prefill"] == record["prefill"]
    assert machine_costs.recall(f"{0:032x}") is None


def test_a_read_that_restored_a_prefix_still_teaches_the_prefill_after_it(tmp_path, model, folder, monkeypatch):
    # A server's prompts share a template's first blocks: a read restores those, then
    # the server prefills the rest. Taught nothing after such reads, a restarted
    # `ppc serve` on an H100 knew no rate and calibrated inside a request (1.2 s).
    from persistent_prefix_cache.core import costs as costs_module

    monkeypatch.setattr(costs_module, "_restored_here", {"forward"})  # not this process's first forward
    tokens = random_tokens(PROMPT, seed=952)
    _filled(tmp_path / "store", model, tokens[: 2 * BLOCK])  # the template: 32 tokens, too few to calibrate for
    manager = PrefixCacheManager(model, store=str(tmp_path / "store"))
    try:
        cache, rest = manager.fetch_cache(tokens)
        assert cache is not None and len(rest) == len(tokens) - 2 * BLOCK
        assert manager.store.stats()["prefill_tokens_per_s"] is None
        manager.store_cache(tokens, prefill(model, tokens)[1])  # the server's prefill of the rest, then its write
        assert manager.store.stats()["prefill_tokens_per_s"] is not None  # taught, as a request
        assert manager.store.costs.learned.fastest_forward is None
    finally:
        manager.close()
