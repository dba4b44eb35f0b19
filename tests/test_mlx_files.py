"""mlx-lm's prompt-cache files in and out: ``ppc import-mlx``, ``ppc export-mlx``, ``ppc generate --prompt-cache-file``.

The files in ``tests/data/mlx_files.tar.gz`` were written by mlx-lm 0.31.3's and 0.32's own
``cache_prompt`` (``tests/data/make_mlx_files.py``); their model folders are rebuilt here
with `write_tiny_model` from the recorded arguments. Files written during a test come
from the installed mlx-lm's own tools, run as subprocesses, and mlx-lm's
``generate --prompt-cache-file`` is run the same way to compare with ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import mlx.core as mx
import pytest

from persistent_prefix_cache.layers import cache_length, signature_of
from persistent_prefix_cache.layers.mlx_files import leaf_tensors, read_prompt_cache
from persistent_prefix_cache.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "mlx_files.tar.gz"
VERSIONS = ("0.31.3", "0.32.2")
CASES = ("llama", "llama_kv8", "gemma3_text", "qwen3_next", "falcon_h1", "llama4")
LOST = "did not record this ChunkedKVCache's length"  # what mlx-lm 0.31 leaves of a chunked layer
SUFFIX = "Old librarians knew this long before"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    """The unpacked files and the rebuilt model folders (``models/<case>``), in one folder."""
    root = tmp_path_factory.mktemp("mlx_files")
    with tarfile.open(DATA) as tar:
        tar.extractall(root, filter="data")
    cases = json.loads((root / "cases.json").read_text())
    for name, case in cases.items():
        write_tiny_model(root / "models" / name, family=case["family"], **case["model"])
    return root


def cases(root: Path) -> dict:
    return json.loads((root / "cases.json").read_text())


def ppc(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def mlx_lm(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "mlx_lm", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def assert_same(got: list, want: list) -> None:
    a, b = leaf_tensors(got), leaf_tensors(want)
    assert a.keys() == b.keys()
    for leaf in a:
        assert len(a[leaf]) == len(b[leaf]) > 0, leaf
        for x, y in zip(a[leaf], b[leaf]):
            assert x.dtype == y.dtype and x.shape == y.shape, (leaf, x.shape, y.shape)
            assert mx.array_equal(x, y).item(), f"layer {leaf} differs"


def stored(store: Path, model_dir: Path, tokens: list[int], **options) -> list:
    """The cache the store restores for all of `tokens` (one token more is asked for: a
    full hit keeps one back)."""
    from mlx_lm import load

    from persistent_prefix_cache import PersistentPrefixCache

    model, _ = load(str(model_dir))
    with PersistentPrefixCache(str(store), model, model_path=str(model_dir), **options) as cache_store:
        cache, remaining = cache_store.fetch(tokens + [tokens[-1]])
    assert cache is not None and len(remaining) == 1
    return cache


# -- reading both layouts ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_both_layouts_read_to_the_same_layers(fixtures, case):
    """Each version's file reads; the installed mlx-lm opens only its own version's file."""
    from mlx_lm.models.cache import load_prompt_cache

    import mlx_lm as installed

    from persistent_prefix_cache.errors import PromptCacheFileError

    tokens = cases(fixtures)[case]["tokens"]
    if case == "llama4":  # 0.31 saved a chunk whose length it then lost (its own loader restores it wrong)
        with pytest.raises(PromptCacheFileError, match=LOST):
            read_prompt_cache(str(fixtures / "files" / "0.31.3" / f"{case}.safetensors"))
        file = read_prompt_cache(str(fixtures / "files" / "0.32.2" / f"{case}.safetensors"))
        assert file.layout == "0.32" and cache_length(file.cache) == len(tokens)
        return
    files = {v: read_prompt_cache(str(fixtures / "files" / v / f"{case}.safetensors")) for v in VERSIONS}
    assert files["0.31.3"].layout == "0.31" and files["0.32.2"].layout == "0.32"
    assert signature_of(files["0.31.3"].cache) == signature_of(files["0.32.2"].cache)
    for f in files.values():
        assert cache_length(f.cache) == len(tokens)
        assert f.metadata["model"] == f"models/{case}"
    own = "0.32.2" if installed.__version__.startswith("0.32") else "0.31.3"
    other = next(v for v in VERSIONS if v != own)
    assert_same(files[own].cache, load_prompt_cache(str(fixtures / "files" / own / f"{case}.safetensors")))
    with pytest.raises((ValueError, KeyError)):  # the incompatibility this module exists for
        load_prompt_cache(str(fixtures / "files" / other / f"{case}.safetensors"))
    if case != "qwen3_next":  # the two versions' gated-delta code differs in its last bits
        assert_same(files["0.31.3"].cache, files["0.32.2"].cache)


# -- import-mlx ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_import_then_restore_equals_the_file(fixtures, tmp_path, case, version):
    info = cases(fixtures)[case]
    file = fixtures / "files" / version / f"{case}.safetensors"
    store = tmp_path / "store"
    proc = ppc("import-mlx", file, "--store", store, "--model", f"models/{case}", "--prompt", info["prompt"],
               "--json", cwd=fixtures)  # fmt: skip
    if case == "llama4" and version == "0.31.3":
        assert proc.returncode == 2 and LOST in proc.stderr and not store.exists()
        return
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens"] == len(info["tokens"]) and result["new_blocks"] >= 1
    assert result["layout"] == f"mlx-lm {version[:4]}"
    options = {"kv_bits": 8, "kv_group_size": 32} if case == "llama_kv8" else {}
    assert_same(
        stored(store, fixtures / "models" / case, info["tokens"], **options), read_prompt_cache(str(file)).cache
    )


@pytest.fixture
def in_fixtures(fixtures, monkeypatch):
    """Run in the fixtures' folder: the files record their models as ``models/<case>``."""
    monkeypatch.chdir(fixtures)
    return fixtures


def _bad_import(fixtures, tmp_path, file, *extra, model="llama"):
    from persistent_prefix_cache.cli import main

    store = tmp_path / "store"
    argv = ["import-mlx", str(file), "--store", str(store), "--model", f"models/{model}", *extra]
    if not any(a.startswith("--prompt") or a == "--tokens-file" for a in extra):
        argv += ["--prompt", cases(fixtures)["llama"]["prompt"]]
    return main(argv), store


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_bad_files_are_one_line_and_write_nothing(in_fixtures, tmp_path, capsys):
    fixtures = in_fixtures
    good = (fixtures / "files" / "0.32.2" / "llama.safetensors").read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good[: len(good) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    weights = fixtures / "models" / "llama" / "model.safetensors"  # a safetensors file, not a cache
    unknown = tmp_path / "unknown.safetensors"  # a cache class mlx-lm knows and ppc does not store
    mx.save_safetensors(str(unknown), {"0.0": mx.zeros((1, 1, 4, 16)), "0.1": mx.zeros((1, 1, 4, 16))},
                        {"0.model": "models/llama", "1.0": "ConcatenateKVCache", "2.0": ""})  # fmt: skip
    later = tmp_path / "later.safetensors"  # a layout neither version writes
    mx.save_safetensors(str(later), {"0.0": mx.zeros((1, 1, 4, 16))}, {"0.model": "x", "1.0": "KVCache", "2.0": "v3"})
    expect = {
        truncated: "not a readable safetensors file",
        garbage: "not a readable safetensors file",
        weights: "not an mlx-lm prompt-cache file",
        unknown: "ConcatenateKVCache, which ppc cannot store",
        later: "a prompt-cache layout this version cannot read",
        tmp_path / "missing.safetensors": "no such file",
    }
    for file, words in expect.items():
        code, store = _bad_import(fixtures, tmp_path, file, "--ignore-recorded-model")
        assert code == 2, file
        line = _one_error_line(capsys)
        assert words in line, line
        assert not store.exists(), file


def test_hostile_headers_are_one_line(in_fixtures, tmp_path, capsys):
    """Names nested 3,000 parts deep (mlx-lm's tree_unflatten recursed once per part), JSON
    nested 3,000 levels, a header larger than the file or than any mlx-lm file's (issue 29,
    item 13): one error line each, nothing written, no RecursionError."""
    import struct

    fixtures = in_fixtures
    deep = ".".join(["0"] * 3000)
    kv = {"0.0": mx.zeros((1, 1, 4, 16)), "0.1": mx.zeros((1, 1, 4, 16))}
    meta = {"0.model": "models/llama", "1.0": "KVCache", "2.0": ""}
    named = tmp_path / "deep_metadata.safetensors"
    mx.save_safetensors(str(named), kv, {**meta, deep: "x"})
    tensor = tmp_path / "deep_tensor.safetensors"
    mx.save_safetensors(str(tensor), {"0.0": kv["0.0"], deep: kv["0.1"]}, meta)

    def raw(name: str, header: bytes, length: int | None = None) -> Path:
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header)
        return path

    nested = raw("nested.safetensors", b'{"__metadata__": {"x": ' + b"[" * 3000 + b"]" * 3000 + b"}}")
    huge = raw("huge.safetensors", b"{}" + b" " * 64, length=1 << 40)
    expect = {
        named: "a path of more than 8 parts",
        tensor: "a path of more than 8 parts",
        nested: "nests deeper than 4 levels",
        huge: "not a readable safetensors file (truncated or another format)",
    }
    for file, words in expect.items():
        code, store = _bad_import(fixtures, tmp_path, file, "--ignore-recorded-model")
        line = _one_error_line(capsys)
        assert code == 2 and words in line, (file, line)
        assert not store.exists()


@pytest.mark.slow
def test_a_hostile_header_is_one_line_from_ppc(fixtures, tmp_path):
    """The same, as a real ``ppc`` process (a RecursionError would be a traceback there)."""
    deep = ".".join(["0"] * 3000)
    named = tmp_path / "deep_metadata.safetensors"
    mx.save_safetensors(str(named), {"0.0": mx.zeros((1, 1, 4, 16)), "0.1": mx.zeros((1, 1, 4, 16))},
                        {"0.model": "models/llama", "1.0": "KVCache", "2.0": "", deep: "x"})  # fmt: skip
    proc = ppc("import-mlx", named, "--store", tmp_path / "s", "--model", "models/llama", "--prompt", "x", cwd=fixtures)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "a path of more than 8 parts" in proc.stderr
    assert not (tmp_path / "s").exists()


def test_another_models_or_prompts_file_is_refused(in_fixtures, tmp_path, capsys):
    fixtures = in_fixtures
    gemma = fixtures / "files" / "0.31.3" / "gemma3_text.safetensors"
    llama = fixtures / "files" / "0.31.3" / "llama.safetensors"
    # the file names another model: refused as mlx_lm generate refuses it
    code, store = _bad_import(fixtures, tmp_path, gemma)
    assert code == 2 and "was written for model 'models/gemma3_text'" in _one_error_line(capsys)
    # told to ignore the name, the layers still do not fit
    code, store = _bad_import(fixtures, tmp_path, gemma, "--ignore-recorded-model")
    assert code == 2 and "another model's file" in _one_error_line(capsys)
    # same classes, other head count (llama_kv8's model has 64-wide heads): shapes differ
    code, store = _bad_import(fixtures, tmp_path, llama, "--ignore-recorded-model", model="llama_kv8")
    assert code == 2 and "another model's file" in _one_error_line(capsys)
    # the right model, another prompt: the token count tells
    code, store = _bad_import(fixtures, tmp_path, llama, "--prompt", "A cache is a promise.")
    assert code == 2 and "holds the KV of 29 tokens, the prompt has" in _one_error_line(capsys)
    assert not store.exists()
    # the tokens given directly work
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(cases(fixtures)["llama"]["tokens"]))
    code, store = _bad_import(fixtures, tmp_path, llama, "--tokens-file", str(tokens))
    assert code == 0 and store.is_dir(), capsys.readouterr().err


def test_another_prompts_file_of_the_same_length_is_refused(in_fixtures, tmp_path, capsys):
    """The length agrees, the tokens do not: spans computed again from the file's own
    prefix differ from the file where the tokens differ (issue 29, item 6)."""
    fixtures = in_fixtures
    tokens = cases(fixtures)["llama"]["tokens"]
    llama = fixtures / "files" / "0.32.2" / "llama.safetensors"
    variants = {
        "last token": tokens[:-1] + [(tokens[-1] + 1) % 512],
        "first token": [(tokens[0] + 1) % 512] + tokens[1:],
        "another prompt": [(t * 7 + 3) % 512 for t in tokens],
    }
    for name, ids in variants.items():
        given = tmp_path / f"{name}.json"
        given.write_text(json.dumps(ids))
        code, store = _bad_import(fixtures, tmp_path, llama, "--tokens-file", str(given))
        line = _one_error_line(capsys)
        assert code == 2 and "is not this model's KV of this prompt" in line, (name, line)
        assert not store.exists(), name
    # A token in a block no span computes again is not seen (the documented limit); a span
    # per block computes the whole prompt again and sees it.
    middle = tmp_path / "middle.json"
    middle.write_text(json.dumps(tokens[:12] + [(tokens[12] + 1) % 512] + tokens[13:]))
    code, store = _bad_import(fixtures, tmp_path, llama, "--tokens-file", str(middle), "--block-size", "4",
                              "--check-spans", "8")  # fmt: skip
    assert code == 2 and "positions 12..16 differs by" in _one_error_line(capsys)
    assert not store.exists()


def test_another_models_file_is_refused_even_when_its_name_is_ignored(in_fixtures, tmp_path, capsys):
    """Model A's file for model B of the same shape (other weights): --ignore-recorded-model
    skips the name comparison only; the recompute refuses the KV (issue 29, item 8)."""
    fixtures = in_fixtures
    case = cases(fixtures)["llama"]
    twin = fixtures / "models" / "llama_twin"
    if not twin.exists():
        write_tiny_model(twin, family=case["family"], seed=1, **case["model"])
    llama = fixtures / "files" / "0.32.2" / "llama.safetensors"
    code, store = _bad_import(fixtures, tmp_path, llama, model="llama_twin")
    assert code == 2 and "was written for model 'models/llama'" in _one_error_line(capsys)
    code, store = _bad_import(fixtures, tmp_path, llama, "--ignore-recorded-model", model="llama_twin")
    line = _one_error_line(capsys)
    assert code == 2 and "is not this model's KV of this prompt" in line and "differs by" in line, line
    assert not store.exists()
    code, store = _bad_import(fixtures, tmp_path, llama, "--ignore-recorded-model", "--json")  # its own model
    assert code == 0 and json.loads(capsys.readouterr().out)["checked"]["difference"] == 0.0


# -- export-mlx and generate --prompt-cache-file ----------------------------------------------


def _cold(model_dir: Path, tokens: list[int]) -> list:
    """mlx_lm.cache_prompt's prefill: all but the last token in one pass, then the last."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    cache = make_prompt_cache(model)
    model(mx.array([tokens[:-1]]), cache=cache)
    model(mx.array([tokens[-1:]]), cache=cache)
    mx.eval([c.state for c in cache])
    return model, cache


def test_export_opens_in_mlx_lm_and_generates_as_cold(fixtures, tmp_path):
    from mlx_lm import generate, load
    from mlx_lm.models.cache import load_prompt_cache

    from persistent_prefix_cache import PersistentPrefixCache

    info = cases(fixtures)["llama"]
    model_dir, tokens, store = fixtures / "models" / "llama", info["tokens"], tmp_path / "store"
    model, cold = _cold(model_dir, tokens)
    with PersistentPrefixCache(str(store), model, model_path=str(model_dir), block_size=8) as cache_store:
        cache_store.store(tokens, cold)
    out = tmp_path / "out.safetensors"
    proc = ppc("export-mlx", out, "--store", store, "--model", "models/llama", "--prompt", info["prompt"],
               "--stored-only", "--json", cwd=fixtures)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["tokens"], result["restored_tokens"], result["bytes"]) == (
        len(tokens),
        len(tokens),
        out.stat().st_size,
    )
    loaded, metadata = load_prompt_cache(str(out), return_metadata=True)  # the installed mlx-lm's own loader
    assert metadata["model"] == "models/llama"
    assert_same(loaded, cold)
    assert all(layer.keys.shape[2] == len(tokens) for layer in loaded)  # no unwritten buffer rows in the file

    args = ["--model", "models/llama", "--prompt-cache-file", out, "--prompt", SUFFIX, "--max-tokens", "16"]
    theirs = mlx_lm("generate", *args, "--verbose", "False", cwd=fixtures)
    ours = ppc("generate", *args, "--verbose", "False", cwd=fixtures)
    assert theirs.returncode == 0 and ours.returncode == 0, (theirs.stderr, ours.stderr)
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    # a cold run of the same tokens (the cached prompt, then the suffix as mlx_lm.generate
    # renders it) gives the same text
    _, tokenizer = load(str(model_dir))
    from persistent_prefix_cache.cli.generate import build_parser
    from persistent_prefix_cache.cli.mlx_files import suffix_tokens

    parsed = build_parser().parse_args(["--model", "m", "--prompt", SUFFIX])
    text = generate(model, tokenizer, tokens + suffix_tokens(SUFFIX, tokenizer, parsed), max_tokens=16)
    assert ours.stdout == text + "\n"


def test_export_computes_what_the_store_lacks(fixtures, tmp_path):
    """An empty store: --stored-only refuses; without it the prompt is computed, stored and written."""
    info = cases(fixtures)["gemma3_text"]
    store, out = tmp_path / "store", tmp_path / "g.safetensors"
    assert ppc("import-mlx", fixtures / "files" / "0.32.2" / "llama.safetensors", "--store", store, "--model",
               "models/llama", "--prompt", info["prompt"], cwd=fixtures).returncode == 0  # fmt: skip
    args = ["export-mlx", out, "--store", store, "--model", "models/gemma3_text", "--prompt", info["prompt"]]
    refused = ppc(*args, "--stored-only", cwd=fixtures)
    assert refused.returncode == 2 and "the store holds 0 of the prompt's 29 tokens" in refused.stderr
    assert not out.exists()
    proc = ppc(*args, "--json", cwd=fixtures)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["computed_tokens"] == 29
    computed = read_prompt_cache(str(out)).cache
    assert cache_length(computed) == 29
    again = ppc(*args, "--stored-only", "--json", cwd=fixtures)
    assert again.returncode == 0 and json.loads(again.stdout)["restored_tokens"] == 29, again.stderr
    assert_same(read_prompt_cache(str(out)).cache, computed)  # the sliding windows restored exactly


def test_generate_reads_a_031_file_mlx_lm_032_cannot(fixtures):
    """ppc generate --prompt-cache-file on a 0.31 file gives what it gives on the same cache in 0.32's layout."""
    args = ["--model", "models/llama", "--prompt", SUFFIX, "--max-tokens", "12", "--verbose", "False"]
    old = ppc("generate", *args, "--prompt-cache-file", "files/0.31.3/llama.safetensors", cwd=fixtures)
    new = ppc("generate", *args, "--prompt-cache-file", "files/0.32.2/llama.safetensors", cwd=fixtures)
    assert old.returncode == 0 and new.returncode == 0, (old.stderr, new.stderr)
    assert old.stdout == new.stdout and old.stdout.strip()
    wrong = ppc("generate", *args[2:], "--model", "models/gemma3_text", "--prompt-cache-file",
                "files/0.31.3/llama.safetensors", cwd=fixtures)  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: ") and "Traceback" not in wrong.stderr


def test_options_that_contradict_the_file_are_refused(in_fixtures, tmp_path, capsys):
    """A file written with --max-kv-size, --kv-bits on unquantized KV: one line each, no store."""
    fixtures, prompt = in_fixtures, cases(in_fixtures)["llama"]["prompt"]
    qwen3 = tmp_path / "qwen3"  # a family whose cache --max-kv-size turns into rotating layers
    write_tiny_model(qwen3, family="qwen3", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    rotating = tmp_path / "rotating.safetensors"
    made = mlx_lm("cache_prompt", "--model", qwen3, "--prompt", prompt, "--prompt-cache-file", rotating,
                  "--max-kv-size", "8", cwd=tmp_path)  # fmt: skip
    assert made.returncode == 0, made.stderr
    from persistent_prefix_cache.cli import main

    store = tmp_path / "store"
    code = main(["import-mlx", str(rotating), "--store", str(store), "--model", str(qwen3), "--prompt", prompt])
    assert code == 2 and "was written with --max-kv-size" in _one_error_line(capsys)
    code, store = _bad_import(fixtures, tmp_path, fixtures / "files" / "0.32.2" / "llama.safetensors", "--kv-bits", "8")
    assert code == 2 and "holds KV that is not quantized: omit --kv-bits" in _one_error_line(capsys)
    assert not store.exists()


def test_a_store_named_relative_to_the_working_folder(fixtures, tmp_path):
    """``--store kv`` (a bare name) is made in the working folder."""
    info = cases(fixtures)["llama"]
    model = fixtures / "models" / "llama"
    proc = ppc("import-mlx", fixtures / "files" / "0.31.3" / "llama.safetensors", "--store", "kv", "--model", model,
               "--prompt", info["prompt"], "--ignore-recorded-model", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kv" / "index").is_dir()


def test_a_file_without_a_length_is_checked_by_a_full_recompute(tmp_path, capsys):
    """Mamba's cache is recurrent state only: no offset to compare the prompt with, and no
    earlier position to cut it back to, so the whole prompt is computed again and compared."""
    from persistent_prefix_cache.cli import main

    model = tmp_path / "mamba2"
    write_tiny_model(model, family="mamba2", hidden_size=32, num_layers=2, extra_config=dict(
        num_heads=4, head_dim=16, intermediate_size=64, state_size=16, layer_norm_epsilon=1e-5, conv_kernel=4,
        n_groups=1, use_bias=False, use_conv_bias=True, time_step_limit=(0.0, float("inf")), time_step_rank=8,
    ))  # fmt: skip
    file, prompt = tmp_path / "m.safetensors", "A cache is a promise"
    made = mlx_lm("cache_prompt", "--model", model, "--prompt", prompt, "--prompt-cache-file", file, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    from mlx_lm import load

    _, tokenizer = load(str(model))
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], continue_final_message=True))
    store = tmp_path / "store"
    argv = ["import-mlx", str(file), "--store", str(store), "--model", str(model)]
    # another prompt (its last token changed): the recurrent state the model computes differs
    other = tmp_path / "other.json"
    other.write_text(json.dumps(ids[:-1] + [(ids[-1] + 1) % 512]))
    assert main([*argv, "--tokens-file", str(other)]) == 2
    assert "is not this model's KV of this prompt" in _one_error_line(capsys)
    assert not store.exists()
    assert main([*argv, "--prompt", prompt, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == len(ids) and result["checked"]["full_recompute"] is False  # shorter than a block
    assert result["checked"]["spans"] == [[0, len(ids)]] and result["checked"]["difference"] < 1e-5
    assert_same(stored(store, model, ids), read_prompt_cache(str(file)).cache)


@pytest.mark.parametrize("case", ["llama_kv8", "gemma3_text", "falcon_h1"])
def test_generate_with_a_file_prints_what_mlx_lm_prints(fixtures, case):
    """Quantized, rotating and CacheList layers: the installed mlx-lm's own file, greedy, the same text."""
    import mlx_lm as installed

    own = "0.32.2" if installed.__version__.startswith("0.32") else "0.31.3"
    extra = ["--kv-group-size", "32"] if case == "llama_kv8" else []
    args = ["--model", f"models/{case}", "--prompt-cache-file", f"files/{own}/{case}.safetensors", "--prompt", SUFFIX,
            "--max-tokens", "12", *extra]  # fmt: skip
    theirs = mlx_lm("generate", *args, "--verbose", "False", cwd=fixtures)
    ours = ppc("generate", *args, "--verbose", "False", cwd=fixtures)
    assert theirs.returncode == 0 and ours.returncode == 0, (theirs.stderr, ours.stderr)
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    if case == "llama_kv8":  # mlx_lm generate's own check, as one line
        wrong = ppc("generate", *args[: -len(extra)], "--verbose", "False", cwd=fixtures)
        assert wrong.returncode == 2 and "error: --kv-group-size does not match" in wrong.stderr
