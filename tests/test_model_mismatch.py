"""A fingerprint is never attached to a model it was not computed from (issue 17, item 1).

The repro of the issue: two model folders of one shape (seeds 5 and 7). Loading A with
``model_path=<B's folder>`` used to remember A's fingerprint under B's files, and every
later open of B (every ``ppc`` command too) restored A's KV. Now:

- the first wrong call is refused (`ModelMismatchError`, naming the folder and the
  loaded model) and nothing is remembered;
- an entry that does not verify against the loaded model (remembered by an earlier
  version, or files rewritten in place with the same size and mtime) is discarded on
  the next open, with a warning, and the loaded model is hashed;
- on every path (library, ``ppc generate``, ``ppc serve``, the compat layers) B's
  continuation after a store poisoned the old way equals B's own cold prefill.

A poisoned store is made as version 1fd2b40 left it: A's KV under A's fingerprint,
and A's bare fingerprint remembered under B's files' signature.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import warnings

import mlx.core as mx
import pytest
from helpers import assert_same_logits, cold_logits, prefill, random_tokens, warm_logits
from mlx.utils import tree_flatten

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.disk.index_tables import FINGERPRINTS
from persistent_prefix_cache.errors import InvalidArgumentError, ModelMismatchError, ReadOnlyStoreError
from persistent_prefix_cache.fingerprint import (
    compare_with_folder,
    fingerprint_model,
    sample_digest,
    weight_files_signature,
)
from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.prefix_cache import PrefixCacheManager
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

BLOCK = 16
PROMPT = random_tokens(100, seed=3)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Model folders A (seed 5) and B (seed 7) of one shape, and the loaded models."""
    root = tmp_path_factory.mktemp("two_models")
    a = write_tiny_model(root / "A", seed=5, **TEST_MODEL)
    b = write_tiny_model(root / "B", seed=7, **TEST_MODEL)
    return types.SimpleNamespace(a=a, b=b, model_a=load_tiny_model(a), model_b=load_tiny_model(b))


def _remember_raw(store, folder, fingerprint: str) -> None:
    """Write the bare fingerprint entry version 1fd2b40 wrote, under `folder`'s files."""
    index = Index(os.path.join(store, "index"))
    try:
        index.write(lambda w: w.txn.put(FINGERPRINTS + weight_files_signature(str(folder)), fingerprint.encode()))
    finally:
        index.close()


def _poison(store, two) -> str:
    """A's KV of PROMPT under A's fingerprint, and A's fingerprint remembered for B's files."""
    with PersistentPrefixCache(store, two.model_a, block_size=BLOCK) as s:
        s.store(PROMPT, prefill(two.model_a, PROMPT)[1])
        s.flush()
        fp_a = s.fingerprint
    _remember_raw(store, two.b, fp_a)
    return fp_a


def _assert_b_continues_like_its_cold_prefill(two, cache, rest) -> None:
    assert_same_logits(warm_logits(two.model_b, cache, rest), cold_logits(two.model_b, PROMPT))


def _remembered(store) -> list[dict]:
    index = Index(os.path.join(store, "index"), readonly=True)
    try:
        return index.remembered_fingerprints()
    finally:
        index.close()


# -- the library --------------------------------------------------------------------------


def test_the_repro_a_wrong_model_path_is_refused_naming_both(two, tmp_path):
    store = tmp_path / "store"
    with PersistentPrefixCache(store, two.model_a, block_size=BLOCK) as s:  # A's KV, keyed by A
        s.store(PROMPT, prefill(two.model_a, PROMPT)[1])
    with pytest.raises(ModelMismatchError) as raised:
        PersistentPrefixCache(store, two.model_a, model_path=two.b)
    message = str(raised.value)
    assert os.path.realpath(two.b) in message and "llama.Model" in message
    assert "model_path" in raised.value.hint
    assert _remembered(store) == []  # nothing attached to B's files
    # On a new store the refused call leaves nothing behind.
    with pytest.raises(ModelMismatchError):
        PersistentPrefixCache(tmp_path / "new", two.model_a, model_path=two.b)
    assert not (tmp_path / "new").exists()
    # Nor the folders above it that the open made (as `mkdir -p`).
    with pytest.raises(ModelMismatchError):
        PersistentPrefixCache(tmp_path / "made" / "by" / "open" / "new", two.model_a, model_path=two.b)
    assert not (tmp_path / "made").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelMismatchError):
        PersistentPrefixCache(tmp_path / "empty", two.model_a, model_path=two.b)
    assert os.listdir(tmp_path / "empty") == []  # the user's empty folder stays, empty

    with PersistentPrefixCache(store, two.model_b, model_path=two.b) as s:
        assert s.fingerprint == fingerprint_model(two.model_b)
        cache, rest = s.fetch(PROMPT)
    assert cache is None  # B never gets A's blocks
    _assert_b_continues_like_its_cold_prefill(two, cache, rest)


def test_an_entry_an_earlier_version_attached_to_the_wrong_files_is_discarded(two, tmp_path):
    store = tmp_path / "store"
    fp_a = _poison(store, two)
    with pytest.warns(UserWarning, match="computed from another model"):
        s = PersistentPrefixCache(store, two.model_b, model_path=two.b)
    with s:
        assert s.fingerprint == fingerprint_model(two.model_b) != fp_a
        cache, rest = s.fetch(PROMPT)
    _assert_b_continues_like_its_cold_prefill(two, cache, rest)
    (entry,) = _remembered(store)  # replaced by B's own, verified entry
    assert entry["fingerprint"] == fingerprint_model(two.model_b)
    assert entry["sample"] == sample_digest(two.model_b) and entry["folder"] == os.path.realpath(two.b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next open trusts the verified entry
        with PersistentPrefixCache(store, two.model_b, model_path=two.b) as s:
            assert s.fingerprint == fingerprint_model(two.model_b)


def test_a_legit_entry_of_an_earlier_version_is_upgraded_silently(two, tmp_path):
    store = tmp_path / "store"
    _remember_raw(store, two.a, fingerprint_model(two.model_a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PersistentPrefixCache(store, two.model_a, model_path=two.a) as s:
            assert s.fingerprint == fingerprint_model(two.model_a)
    assert [e.get("sample") for e in _remembered(store)] == [sample_digest(two.model_a)]


def test_files_rewritten_in_place_with_the_same_size_and_mtime(two, tmp_path):
    # `rsync --inplace -t` or a restored backup: the folder's signature (path, size,
    # mtime, inode) is unchanged, the weights are B's now.
    folder = shutil.copytree(two.a, tmp_path / "model")
    store = tmp_path / "store"
    with PersistentPrefixCache(store, load_tiny_model(folder), model_path=folder, block_size=BLOCK) as s:
        s.store(PROMPT, prefill(two.model_a, PROMPT)[1])
    weights = os.path.join(folder, "model.safetensors")
    before, signature = os.stat(weights), weight_files_signature(folder)
    with open(os.path.join(two.b, "model.safetensors"), "rb") as src, open(weights, "r+b") as dst:
        dst.write(src.read())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weight_files_signature(folder) == signature  # the same key as before
    now_b = load_tiny_model(folder)
    with pytest.warns(UserWarning, match="computed from another model"):
        s = PersistentPrefixCache(store, now_b, model_path=folder)
    with s:
        assert s.fingerprint == fingerprint_model(two.model_b)
        cache, rest = s.fetch(PROMPT)
    _assert_b_continues_like_its_cold_prefill(two, cache, rest)


def test_a_model_changed_after_loading_is_hashed_and_never_remembered(two, tmp_path):
    # Adapters fused into one projection after loading: the folder's files hold some of
    # the weights only. Not proven another model (a `sanitize` may rewrite a weight
    # too), so no error: hashed at every open, with a warning.
    changed = load_tiny_model(two.a)
    layer = changed.model.layers[0].self_attn.q_proj
    layer.weight = layer.weight + 0.5
    store = tmp_path / "store"
    with pytest.warns(UserWarning, match="1 of .* weights compared"):
        s = PersistentPrefixCache(store, changed, model_path=two.a)
    with s:
        assert s.fingerprint == fingerprint_model(changed) != fingerprint_model(two.model_a)
    assert _remembered(store) == []


def test_the_sample_digest_and_the_folder_comparison(two):
    assert sample_digest(two.model_a) == sample_digest(load_tiny_model(two.a))
    assert sample_digest(two.model_a) != sample_digest(two.model_b)
    same = compare_with_folder(two.model_a, two.a)
    assert same.compared == len(tree_flatten(two.model_a.parameters())) and same.differing == []
    other = compare_with_folder(two.model_a, two.b)
    assert other.proven_other and other.compared == same.compared
    # A single weight element changed in a sampled page changes the sample digest.
    changed = load_tiny_model(two.a)
    embed = changed.model.embed_tokens
    embed.weight = mx.concatenate([embed.weight[:1] + 1, embed.weight[1:]])
    assert sample_digest(changed) != sample_digest(two.model_a)


def test_forget_in_the_library(two, tmp_path):
    store = tmp_path / "store"
    with PersistentPrefixCache(store, two.model_a, model_path=two.a, block_size=BLOCK):
        pass
    with PersistentPrefixCache(store, two.model_b, model_path=two.b) as s:
        assert {e["folder"] for e in _remembered(store)} == {os.path.realpath(two.a), os.path.realpath(two.b)}
        assert s.forget_fingerprints(two.a) == 1
        assert [e["folder"] for e in _remembered(store)] == [os.path.realpath(two.b)]
        assert s.forget_fingerprints() == 1
        assert s.forget_fingerprints() == 0
    assert _remembered(store) == []
    with PersistentPrefixCache(store, two.model_b, readonly=True) as s:
        with pytest.raises(ReadOnlyStoreError):
            s.forget_fingerprints()


# -- ppc --------------------------------------------------------------------------------


def ppc(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m persistent_prefix_cache ARGS`` as a user runs it (offline)."""
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def ok_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


TEXT = "The persistent cache keeps what the model read. " * 4


def _generate(model, store, *, note: str | None = None):
    proc = ppc(
        "generate", "--model", model, "--store", store, "--block-size", BLOCK, "--prompt", TEXT,
        "--max-tokens", 8, "--temp", 0, "--json",
    )  # fmt: skip
    if note is not None:
        assert note in proc.stderr, proc.stderr
    return ok_json(proc)


@pytest.mark.slow
def test_ppc_generate_never_restores_another_models_kv(two, tmp_path):
    store = tmp_path / "store"
    as_a = _generate(two.a, store)  # A's KV of the prompt, under A's fingerprint
    (model,) = ok_json(ppc("inspect", "--store", store, "--json"))["models"]
    _remember_raw(store, two.b, model["fingerprint"])  # and the old poison for B's folder

    # The note names the model the store holds (the first run stored A's blocks, named by A's folder).
    poisoned = _generate(two.b, store, note=f"holds KV of 1 other model(s) ({os.path.abspath(two.a)})")
    cold = _generate(two.b, tmp_path / "empty")
    assert poisoned["restored_tokens"] == 0
    assert (poisoned["tokens"], poisoned["logprobs"]) == (cold["tokens"], cold["logprobs"])
    assert as_a["logprobs"] != cold["logprobs"]  # A's KV would have shown
    again = _generate(two.b, store)  # B's own blocks now: restored, same output
    assert again["restored_tokens"] > 0 and again["logprobs"] == cold["logprobs"]


@pytest.mark.slow
def test_ppc_inspect_and_stats_name_each_model_and_forget_forgets(two, tmp_path):
    store = tmp_path / "store"
    _generate(two.a, store)
    with PersistentPrefixCache(store, two.model_b, model_name="example-org/model-b") as s:
        s.store(PROMPT, prefill(two.model_b, PROMPT)[1])
    names = {m["fingerprint"]: m["name"] for m in ok_json(ppc("inspect", "--store", store, "--json"))["models"]}
    assert names == {
        fingerprint_model(two.model_a): os.path.abspath(two.a),
        fingerprint_model(two.model_b): "example-org/model-b",
    }
    stats = ok_json(ppc("stats", "--store", store, "--json"))
    assert {m["name"] for m in stats["models"]} == set(names.values())
    for command in ("inspect", "stats"):
        text = ppc(command, "--store", store).stdout
        for fp, name in names.items():
            line = next(line for line in text.splitlines() if fp[:16] in line)
            assert name in line, text  # the name beside its hash

    inspected = ok_json(ppc("inspect", "--store", store, "--json"))
    assert [r["folder"] for r in inspected["remembered"]] == [os.path.realpath(two.a)]
    assert "fingerprints remembered by model folder" in ppc("inspect", "--store", store).stdout
    assert ok_json(ppc("forget", "--store", store, "--model-path", two.b, "--json"))["forgotten"] == 0
    proc = ppc("forget", "--store", store, "--model-path", two.a)
    assert proc.returncode == 0 and "forgot 1 remembered fingerprint" in proc.stdout
    assert ok_json(ppc("inspect", "--store", store, "--json"))["remembered"] == []
    assert ok_json(ppc("forget", "--store", store, "--all", "--json"))["forgotten"] == 0
    assert ppc("forget", "--store", store).returncode == 2  # --model-path or --all
    assert "forget" in ppc("--help").stdout


# -- the compat layers ----------------------------------------------------------------------


def test_compat_layers_never_restore_another_models_kv(two, tmp_path):
    store = tmp_path / "store"
    _poison(store, two)
    with pytest.warns(UserWarning, match="computed from another model"):
        shared = PersistentPrefixCache(store, two.model_b, model_path=two.b)
    with shared:
        manager = PrefixCacheManager(two.model_b, store=shared)
        cache, rest = manager.fetch_for_generation(PROMPT)
        _assert_b_continues_like_its_cold_prefill(two, cache, rest)
        lru = PersistentLRUPromptCache(shared)
        cache, rest = lru.fetch_nearest_cache("b", list(PROMPT))
        _assert_b_continues_like_its_cold_prefill(two, cache, rest)
    # A compat layer given A's model with B's folder never opens.
    with pytest.raises(ModelMismatchError):
        PrefixCacheManager(two.model_a, store=PersistentPrefixCache(tmp_path / "other", two.model_a, model_path=two.b))


@pytest.mark.slow
def test_ppc_serve_never_restores_another_models_kv(two, tmp_path):
    from test_serve import FIRST, Server, _answer

    store = tmp_path / "store"
    with Server(two.a, store, tmp_path / "a.log") as server:  # A's KV of the chat
        as_a = server.chat(FIRST)
        assert server.stop() == 0, server.log()
    (model,) = ok_json(ppc("inspect", "--store", store, "--json"))["models"]
    assert model["name"] == os.path.abspath(two.a)
    _remember_raw(store, two.b, model["fingerprint"])  # the old poison for B's folder

    with Server(two.b, store, tmp_path / "b.log") as server:
        poisoned = server.chat(FIRST)
        assert server.stop() == 0, server.log()
    assert server.restored() == [], server.log()
    assert "computed from another model" in server.log()
    with Server(two.b, tmp_path / "empty", tmp_path / "cold.log") as server:
        cold = server.chat(FIRST)
        assert server.stop() == 0, server.log()
    assert _answer(poisoned) == _answer(cold)
    assert _answer(as_a) != _answer(cold)  # A's KV would have shown


def test_a_model_record_gets_the_first_name_it_is_stored_under(two, tmp_path):
    store = tmp_path / "store"
    with PersistentPrefixCache(store, two.model_a, block_size=BLOCK) as s:  # no name known
        s.store(PROMPT[:40], prefill(two.model_a, PROMPT[:40])[1])
        s.flush()
        assert [m["name"] for m in s.stored_models()] == [None]
    with PersistentPrefixCache(store, two.model_a, model_path=two.a) as s:
        s.store(PROMPT, prefill(two.model_a, PROMPT)[1])
        s.flush()
        assert [m["name"] for m in s.stored_models()] == [os.path.abspath(two.a)]
    with PersistentPrefixCache(store, two.model_a, model_name="elsewhere/a") as s:
        s.store(PROMPT[:60] + [1, 2, 3], prefill(two.model_a, PROMPT[:60] + [1, 2, 3])[1])
        s.flush()
        assert [m["name"] for m in s.stored_models()] == [os.path.abspath(two.a)]
    with pytest.raises(InvalidArgumentError):
        PersistentPrefixCache(store, two.model_a, model_name=3)


def test_a_weight_rewritten_by_the_models_own_sanitize_is_no_mismatch(tmp_path):
    # mlx-lm's baichuan_m1 normalizes lm_head on every load: the loaded weight is not
    # the file's, and is still this folder's model. Another seed stays refused.
    shape = {k: v for k, v in TEST_MODEL.items() if k != "family"}
    extra = dict(sliding_window=32, sliding_window_layers=[1], conv_window=2, tie_word_embeddings=False)
    folders = [
        write_tiny_model(tmp_path / f"m{seed}", family="baichuan_m1", seed=seed, extra_config=extra, **shape)
        for seed in (5, 7)
    ]
    model = load_tiny_model(folders[0])
    found = compare_with_folder(model, folders[0])
    assert found.explained == 1 and found.differing == [] and not found.proven_other
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PersistentPrefixCache(tmp_path / "store", model, model_path=folders[0]) as s:
            assert s.fingerprint == fingerprint_model(model)
    assert [e["folder"] for e in _remembered(tmp_path / "store")] == [os.path.realpath(folders[0])]
    with pytest.raises(ModelMismatchError):
        PersistentPrefixCache(tmp_path / "store", model, model_path=folders[1])
