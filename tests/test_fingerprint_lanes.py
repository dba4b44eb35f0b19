"""The lanes fingerprint (issue 18 item 4): weights hashed where they live, not weaker.

On this CPU the lanes scheme is computed by the same MLX ops a GPU runs (integer sums
wrap the same on every device), forced by ``scheme=`` or ``PPC_FINGERPRINT_SCHEME``:

- the lane sums are what the module docstring says (an independent numpy reference);
- one changed weight (several positions, bf16/f16/f32/4-bit quantized) changes the
  fingerprint and every lane sum of its chunk; moved words change it too;
- the value is the same across processes, and a store's blocks are found after a restart;
- a "fine-tune" (a copy of the folder with one weight nudged) never shares its base's blocks;
- a store written by main's code (xxh3 fingerprints; ``tests/data/xxh3_store.tar.gz``)
  keeps its blocks: the older value is found once and remembered under the lanes value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_same_logits, cold_logits, prefill, run_python_json, warm_logits
from mlx.utils import tree_flatten, tree_unflatten

import persistent_prefix_cache.fingerprint as fingerprint
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache import weights_hash as wh
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.errors import InvalidArgumentError
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

DATA = os.path.join(os.path.dirname(__file__), "data")
LANES = wh.LANES_SCHEME


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lanes") / "base", seed=11, **TEST_MODEL)


def _reference(buf: bytes, chunk: int) -> bytes:
    """The lane sums as the module docstring defines them, in numpy (uint64, mod 2**32)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    words = np.concatenate([raw, np.zeros(-len(raw) % 4, np.uint8)]).view("<u4").astype(np.uint64)
    mod, out = 1 << 32, []
    for start in range(0, len(words), chunk):
        w = words[start : start + chunk]
        i = np.arange(start, start + len(w), dtype=np.uint64) % mod
        sums = []
        for lane in range(wh.LANES):
            x = w ^ ((i * wh._P[lane] + wh._Q[lane]) % mod)
            x = (x * wh._M1) % mod
            x ^= x >> 15
            x = (x * wh._M2[lane]) % mod
            x ^= x >> 13
            sums.append(int(x.sum() % mod))
        out.append(np.array(sums, dtype="<u4").tobytes())
    return b"".join(out)


def _flip(value: mx.array, at: int) -> mx.array:
    """`value` with the lowest bit of element `at` flipped: the smallest change a
    fine-tune can make to one weight."""
    unsigned = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[value.itemsize]
    flat = value.reshape(-1).view(unsigned) if value.dtype != mx.bool_ else value.reshape(-1).astype(mx.uint8)
    delta = mx.zeros(flat.shape, dtype=unsigned).at[at].add(mx.array(1, dtype=unsigned))
    out = mx.bitwise_xor(flat, delta)
    out = out.astype(mx.bool_) if value.dtype == mx.bool_ else out.view(value.dtype)
    mx.eval(out)
    return out.reshape(value.shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "uint32", "bool_", "complex64"])
@pytest.mark.parametrize("shape", [(3,), (37, 51), (2500,)])
@pytest.mark.parametrize("term_words", [1000, 333, 2])
def test_lane_sums_follow_their_definition(dtype, shape, term_words, monkeypatch):
    monkeypatch.setattr(wh, "_CHUNK_WORDS", 1000)  # several chunks, the last one short
    monkeypatch.setattr(wh, "_EVAL_WORDS", 1500)
    # A chunk reduced in pieces, one value: 333 leaves a last word, which joins the piece
    # before (a piece of one word would go through the host).
    monkeypatch.setattr(wh, "_TERM_WORDS", term_words)
    rng = np.random.default_rng(sum(shape))
    value = mx.array(rng.integers(0, 1 << 31, size=shape, dtype=np.int64)).astype(getattr(mx, dtype))
    if dtype in ("bfloat16", "float16", "float32", "complex64"):
        value = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(getattr(mx, dtype))
    mx.eval(value)
    got = wh.lane_sums(value)
    assert got == _reference(bytes(wh.bytes_of(value)), 1000) == wh.host_lane_sums(value)
    assert len(got) == 16 * -(-((value.nbytes + 3) // 4) // 1000)


def test_the_host_reference_agrees_across_its_own_blocks(monkeypatch):
    monkeypatch.setattr(wh, "_CHUNK_WORDS", 3 << 20)  # chunks the host splits into 1M-word parts
    value = mx.random.randint(0, 1 << 30, ((3 << 20) + (1 << 20) + 5,)).astype(mx.uint32)
    mx.eval(value)
    assert len(wh.lane_sums(value)) == 32 and wh.lane_sums(value) == wh.host_lane_sums(value)


def _model(folder, kind: str):
    model = load_tiny_model(folder)
    if kind == "quantized":
        nn.quantize(model, group_size=32, bits=4)
    else:
        model.set_dtype(getattr(mx, kind))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "float32", "quantized"])
def test_one_changed_weight_changes_the_fingerprint(folder, kind, monkeypatch):
    monkeypatch.setattr(wh, "_CHUNK_WORDS", 512)  # chunk boundaries inside the weights
    model = _model(folder, kind)
    params = dict(tree_flatten(model.parameters()))
    base = wh.fingerprint_model(model, scheme=LANES)
    assert base.startswith(LANES + ":") and base == wh.fingerprint_model(model, scheme=LANES)
    largest = max(params, key=lambda n: params[n].nbytes)
    smallest = min(params, key=lambda n: params[n].nbytes)
    if kind == "quantized":
        assert params[largest].dtype == mx.uint32 and any(n.endswith(".scales") for n in params)
        scales = next(n for n in params if n.endswith(".scales"))
        targets = [(largest, 0), (largest, 1023), (scales, params[scales].size - 1)]
    else:
        per_word = 4 // params[largest].itemsize if params[largest].itemsize < 4 else 1
        targets = [(largest, 0), (largest, 512 * per_word - 1), (largest, 512 * per_word),
                   (largest, params[largest].size // 2 + 1), (largest, params[largest].size - 1),
                   (smallest, params[smallest].size - 1)]  # fmt: skip
    seen = {base}
    for name, at in targets:
        value = params[name]
        changed = _flip(value, at)
        model.update(tree_unflatten([(name, changed)]))
        fp = wh.fingerprint_model(model, scheme=LANES)
        assert fp not in seen, f"{kind}: flipping {name}[{at}] left the fingerprint unchanged"
        seen.add(fp)
        # By construction: every lane sum of the chunk holding the word changes.
        chunk = (at * value.itemsize // 4) // 512
        before, after = wh.lane_sums(value)[16 * chunk : 16 * chunk + 16], wh.lane_sums(changed)[16 * chunk :][:16]
        assert all(before[4 * k : 4 * k + 4] != after[4 * k : 4 * k + 4] for k in range(wh.LANES))
        model.update(tree_unflatten([(name, value)]))
    assert wh.fingerprint_model(model, scheme=LANES) == base


def test_moved_words_change_the_fingerprint(folder):
    model = _model(folder, "float32")
    params = dict(tree_flatten(model.parameters()))
    name = max(params, key=lambda n: params[n].nbytes)
    value = params[name]
    base = wh.fingerprint_model(model, scheme=LANES)
    swapped = np.array(value.reshape(-1))
    assert swapped[3] != swapped[10]
    swapped[[3, 10]] = swapped[[10, 3]]
    model.update(tree_unflatten([(name, mx.array(swapped).reshape(value.shape))]))
    assert wh.fingerprint_model(model, scheme=LANES) != base
    model.update(tree_unflatten([(name, value.T.reshape(value.shape))]))  # transposed, same bytes multiset
    assert wh.fingerprint_model(model, scheme=LANES) != base


def test_the_measured_alternative_settings_give_the_same_value_and_go_back(folder, monkeypatch):
    monkeypatch.setattr(wh, "_CHUNK_WORDS", 1 << 12)  # small pieces that really split this model's chunks
    model = _model(folder, "float32")
    base = wh.fingerprint_model(model, scheme=LANES)
    before = {k: getattr(wh, k) for k in wh.SMALL_PIECES}
    with wh.lane_settings({**wh.SMALL_PIECES, "_TERM_WORDS": 1000}):
        assert wh._TERM_WORDS == 1000 and wh.CLEAR_AFTER is False
        assert wh.fingerprint_model(model, scheme=LANES) == base
    assert {k: getattr(wh, k) for k in wh.SMALL_PIECES} == before
    with pytest.raises(KeyError):
        with wh.lane_settings({"_NO_SUCH_SETTING": 1}):
            pass


_IN_A_CHILD = """
import json, sys
from persistent_prefix_cache.tiny_model import load_tiny_model
from persistent_prefix_cache.weights_hash import fingerprint_model
model = load_tiny_model(sys.argv[1])
print(json.dumps([fingerprint_model(model, scheme="lanes1"), fingerprint_model(model, scheme="xxh3")]))
"""


def test_the_same_value_in_every_process(folder):
    model = load_tiny_model(folder)
    here = [wh.fingerprint_model(model, scheme=LANES), wh.fingerprint_model(model, scheme=wh.XXH3)]
    assert here[0] != here[1]
    assert run_python_json(_IN_A_CHILD, str(folder)) == here
    assert run_python_json(_IN_A_CHILD, str(folder)) == here


_STORE_IN_A_CHILD = """
import json, sys
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.tiny_model import load_tiny_model
model = load_tiny_model(sys.argv[1])
tokens = list(range(1, 50))
with PersistentPrefixCache(sys.argv[2], model, block_size=16) as store:
    cache, rest = store.fetch(tokens)
    if sys.argv[3] == "store":
        cache = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=cache)
        store.store(tokens, cache)
    print(json.dumps([store.fingerprint, len(tokens) - len(rest)]))
"""


def test_blocks_are_found_after_a_restart(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(wh.SCHEME_ENV, LANES)  # the children inherit it
    store = str(tmp_path / "store")
    fp, restored = run_python_json(_STORE_IN_A_CHILD, str(folder), store, "store")
    assert fp.startswith(LANES + ":") and restored == 0
    assert run_python_json(_STORE_IN_A_CHILD, str(folder), store, "fetch") == [fp, 48]


def _fine_tune(folder, dest):
    """A copy of the model folder with one weight nudged (one element, lowest bit)."""
    shutil.copytree(folder, dest)
    path = os.path.join(dest, "model.safetensors")
    weights = mx.load(path)
    name = max(weights, key=lambda n: weights[n].nbytes)
    weights[name] = _flip(weights[name], weights[name].size // 2 + 7)  # past the sampled pages' start
    mx.save_safetensors(path, weights)
    return dest


@pytest.mark.parametrize("with_path", [False, True])
def test_a_fine_tune_never_shares_its_base_blocks(folder, tmp_path, monkeypatch, with_path):
    monkeypatch.setenv(wh.SCHEME_ENV, LANES)
    tuned_folder = _fine_tune(folder, tmp_path / "tuned")
    base, tuned = load_tiny_model(folder), load_tiny_model(tuned_folder)
    assert wh.fingerprint_model(base) != wh.fingerprint_model(tuned)
    tokens = list(range(1, 50))
    store = tmp_path / "store"
    with PersistentPrefixCache(store, base, block_size=16, model_path=folder if with_path else None) as s:
        s.store(tokens, prefill(base, tokens)[1])
        s.flush()
        base_fp = s.fingerprint
    with PersistentPrefixCache(store, tuned, block_size=16, model_path=tuned_folder if with_path else None) as s:
        assert s.fingerprint != base_fp
        cache, rest = s.fetch(tokens)
        assert cache is None and len(rest) == len(tokens)


# -- a store written before the lanes fingerprint ----------------------------------------------


@pytest.fixture
def old(tmp_path, monkeypatch):
    """main's store (xxh3 fingerprints), extracted; the lanes scheme forced; every
    `fingerprint_model` call `fingerprint` makes recorded (the scheme asked for)."""
    with tarfile.open(os.path.join(DATA, "xxh3_store.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    spec = json.load(open(tmp_path / "spec.json"))
    monkeypatch.setenv(wh.SCHEME_ENV, LANES)
    calls: list = []
    real = fingerprint.fingerprint_model

    def recorded(model, **kwargs):
        calls.append(kwargs.get("scheme"))
        return real(model, **kwargs)

    monkeypatch.setattr(fingerprint, "fingerprint_model", recorded)
    return dict(spec=spec, store=tmp_path / "store", model=tmp_path / "model", calls=calls)


def _remembered(store) -> list[dict]:
    index = Index(os.path.join(store, "index"), readonly=True)
    try:
        return index.remembered_fingerprints()
    finally:
        index.close()


def _continues_like_cold(model, store, tokens) -> None:
    cache, rest = store.fetch(tokens)
    assert cache is not None and len(rest) == 1  # all but the last token, which the caller feeds
    assert_same_logits(warm_logits(model, cache, rest), cold_logits(model, tokens))


def test_a_store_written_by_main_keeps_its_blocks(old):
    model = load_tiny_model(old["model"])
    lanes = wh.fingerprint_model(model)
    assert lanes.startswith(LANES + ":") and old["spec"]["fingerprint"] == wh.fingerprint_model(model, scheme=wh.XXH3)
    with PersistentPrefixCache(old["store"], model) as s:
        assert s.fingerprint == old["spec"]["fingerprint"]  # the older value, found by hashing once
        for tokens in old["spec"]["prompts"]:
            _continues_like_cold(model, s, tokens)
    assert old["calls"] == [None, wh.XXH3]
    (alias,) = _remembered(old["store"])
    assert alias["alias_of"] == lanes and alias["fingerprint"] == old["spec"]["fingerprint"]
    old["calls"].clear()
    with PersistentPrefixCache(old["store"], model) as s:  # reopened: the lanes hash only
        assert s.fingerprint == old["spec"]["fingerprint"]
        _continues_like_cold(model, s, old["spec"]["prompts"][0])
    assert old["calls"] == [None]
    shown = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "inspect", "--store", str(old["store"])],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert f"(weights hashed {lanes[:20]})" in shown and old["spec"]["fingerprint"][:16] in shown


def test_a_model_path_keeps_its_older_value_and_is_never_hashed_again(old):
    model = load_tiny_model(old["model"])
    with PersistentPrefixCache(old["store"], model, model_path=old["model"]) as s:
        assert s.fingerprint == old["spec"]["fingerprint"]
        _continues_like_cold(model, s, old["spec"]["prompts"][1])
    remembered = {r.get("folder"): r for r in _remembered(old["store"])}
    assert remembered[os.path.realpath(old["model"])]["fingerprint"] == old["spec"]["fingerprint"]
    old["calls"].clear()
    with PersistentPrefixCache(old["store"], model, model_path=old["model"]) as s:
        assert s.fingerprint == old["spec"]["fingerprint"]
    assert old["calls"] == []  # the remembered value, verified by its sample: no hash at all


def test_another_model_on_that_store_gets_the_lanes_value_and_nothing_of_theirs(old, tmp_path):
    model = load_tiny_model(write_tiny_model(tmp_path / "third", seed=9, **TEST_MODEL))
    with PersistentPrefixCache(old["store"], model) as s:
        assert s.fingerprint == wh.fingerprint_model(model)
        assert s.fingerprint not in (old["spec"]["fingerprint"], old["spec"]["other_fingerprint"])
        for tokens in old["spec"]["prompts"] + old["spec"]["other_prompts"]:
            assert s.fetch(tokens)[0] is None
    old["calls"].clear()
    with PersistentPrefixCache(old["store"], model) as s:  # its outcome remembered too
        assert s.fingerprint == wh.fingerprint_model(model)
    assert old["calls"] == [None]


def test_a_read_only_open_finds_the_older_value_and_writes_nothing(old):
    model = load_tiny_model(old["model"])
    # The store was written at schema v4: migrated first (a read-only open refuses an
    # older schema), which remembers no fingerprint.
    Index(os.path.join(old["store"], "index")).close()
    assert _remembered(old["store"]) == []
    with PersistentPrefixCache(old["store"], model, readonly=True) as s:
        assert s.fingerprint == old["spec"]["fingerprint"]
        _continues_like_cold(model, s, old["spec"]["prompts"][0])
    assert _remembered(old["store"]) == []


def test_an_unknown_scheme_is_a_typed_error(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(wh.SCHEME_ENV, "sha1")
    with pytest.raises(InvalidArgumentError) as raised:
        PersistentPrefixCache(tmp_path / "store", load_tiny_model(folder))
    assert wh.SCHEME_ENV in str(raised.value) and "lanes1" in str(raised.value)
    with pytest.raises(InvalidArgumentError):
        wh.fingerprint_model(load_tiny_model(folder), scheme="md5")


# -- the benchmarks print both schemes ----------------------------------------------------------

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def test_bench_fingerprint_times_both_schemes():
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_fingerprint.py"), "--hidden", "128", "--layers", "1",
         "--vocab", "500", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for key in ("fingerprint_model_s", "lanes_s", "xxh3_threads_s", "sample_digest_s", "compare_with_folder_s"):
        assert result[key] > 0, key


def test_bench_fingerprint_lanes_only_times_the_lanes_both_ways_and_nothing_on_the_host():
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_fingerprint.py"), "--hidden", "128", "--layers", "1",
         "--vocab", "500", "--repeat", "1", "--json", "--lanes-only"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for key in ("lanes_s", "lanes_pieces_s", "lanes_peak_bytes", "lanes_pieces_peak_bytes"):
        assert result[key] > 0, key
    assert not [key for key in result if "xxh3" in key or "sample" in key or "compare" in key or "model_s" in key]
    both = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_fingerprint.py"), "--lanes-only", "--no-lanes"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert both.returncode == 2 and "leave nothing to time" in both.stderr


def test_gpu_bench_fingerprint_row_checks_the_device_sums():
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "gpu_bench.py"), "--small", "--tokens", "64", "--repeat", "1",
         "--precompute", "", "--fingerprint", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    fp = json.loads(proc.stdout)["fingerprint"]
    assert fp["same_value"] is True and fp["lanes_matches_cpu"] is True
    assert len(fp["lanes_hash_s"]) == len(fp["prefetch_True_hash_s"]) == 1
    assert "lanes1" in proc.stderr


def test_plain_mlx_ops_give_the_fused_kernels_value(folder, monkeypatch):
    """The fallback used where the fused kernel fails: the same value, unfused."""
    model = load_tiny_model(folder)
    fused = wh.fingerprint_model(model, scheme=LANES)
    monkeypatch.setattr(wh, "_FUSED", [False])
    assert wh.fingerprint_model(model, scheme=LANES) == fused


def test_the_lane_terms_buffers_go_back_with_the_fingerprint(folder):
    # The open pays for its fingerprint's temporaries: MLX's buffer cache holds none of
    # them after it (the first mx.clear_cache() of a prefill freed GBs on a GPU).
    model = load_tiny_model(folder)
    mx.eval(model.parameters())
    mx.clear_cache()
    wh.fingerprint_model(model, scheme=wh.LANES_SCHEME)
    assert mx.get_cache_memory() == 0


# -- the lane kernel (CUDA): one kernel a weight, no terms' buffers --------------------------


def _kernel_stand_in(value, chunk_words, source):
    """What `lane_kernel.lane_sums` returns, made by the numpy reference: a flat uint32
    array, four sums a chunk (on the CPU the PTX cannot run)."""
    assert source == wh.lane_kernel.ptx(wh._P, wh._Q, wh._M1, wh._M2)
    return mx.array(np.frombuffer(_reference(bytes(wh.bytes_of(value)), chunk_words), dtype="<u4"))


def test_weights_the_kernel_takes_give_the_ops_value_and_leave_mlx_cache_as_it_was(folder, monkeypatch):
    """With the kernel in force (a stand-in here), every weight of whole words goes to it,
    a weight of a padded last word goes by MLX ops, the value is the ops' value, and MLX's
    buffer cache is cleared only where ops made terms' buffers."""
    model = load_tiny_model(folder)
    by_ops = wh.fingerprint_model(model, scheme=LANES)
    taken: list[int] = []

    def stand_in(value, chunk_words, source):
        taken.append(value.nbytes)
        return _kernel_stand_in(value, chunk_words, source)

    clears: list[int] = []
    monkeypatch.setattr(wh, "_kernel_works", [True])
    monkeypatch.setattr(wh.lane_kernel, "lane_sums", stand_in)
    monkeypatch.setattr(wh.mx, "clear_cache", lambda: clears.append(1))
    monkeypatch.setattr(wh, "_CHUNK_WORDS", wh.lane_kernel.BLOCK_WORDS)  # several chunks a weight
    params = wh.named_parameters(model)
    with_kernel = wh.fingerprint_model(model, scheme=LANES)
    assert sorted(taken) == sorted(p.nbytes for _, p in params) and not clears
    with wh.lane_settings({"DEVICE_KERNEL": False}):
        assert wh.fingerprint_model(model, scheme=LANES) == with_kernel  # the same chunks by ops
    assert clears == [1] and with_kernel != by_ops  # (chunks of another size: another value)

    # A weight of a padded last word (3 bytes) goes by ops, and the cache is cleared.
    model.odd_weight = mx.array([1, 2, 3], dtype=mx.uint8)
    clears.clear()
    taken.clear()
    mixed = wh.fingerprint_model(model, scheme=LANES)
    assert 3 not in taken and len(taken) == len(params) and clears == [1]
    with wh.lane_settings({"DEVICE_KERNEL": False}):
        assert wh.fingerprint_model(model, scheme=LANES) == mixed


def test_off_cuda_the_kernel_is_not_tried(monkeypatch):
    monkeypatch.setattr(wh, "_kernel_works", [None])
    assert wh._kernel_source() is None and wh._kernel_works == [False]


@pytest.mark.parametrize(
    "nbytes, chunk, fits",
    [(4, 1 << 24, True), (6, 1 << 24, False), (0, 1 << 24, False), (1 << 20, 1 << 13, False),
     (1 << 20, 3 << 14, False), (1 << 20, 1 << 14, True), (8 << 30, 1 << 24, False)],
)  # fmt: skip
def test_the_kernel_takes_whole_words_in_power_of_two_chunks(nbytes, chunk, fits):
    assert wh.lane_kernel.fits(nbytes, chunk) is fits


@pytest.mark.skipif(not wh.lane_kernel.runs_here(), reason="the lane kernel is PTX: it runs on a CUDA GPU only")
def test_the_lane_kernel_gives_the_numpy_reference_on_cuda():
    """The real kernel, on a CUDA GPU: aligned and unaligned views, partial threadgroups,
    several chunks, against the independent numpy reference."""
    source = wh.lane_kernel.ptx(wh._P, wh._Q, wh._M1, wh._M2)
    for words in (1, 255, 16384, 16385, 3 * 16384 + 17):
        for offset in range(5):
            raw = np.random.default_rng(words * 8 + offset).integers(0, 256, 4 * words + offset, dtype=np.uint8)
            value = mx.array(raw)[offset:]
            for chunk in (wh.lane_kernel.BLOCK_WORDS, 1 << 24):
                got = wh.lane_kernel.lane_sums(value, chunk, source)
                want = _reference(raw[offset:].tobytes(), chunk)
                assert np.asarray(got).astype("<u4").tobytes() == want, (words, offset, chunk)
    assert wh._kernel_source() is not None  # the open's probe passes here too
