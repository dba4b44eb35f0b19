"""What a new user meets first (issue 31, items 6, 11 and 12): one parser behaviour for
every ``ppc`` command, output that says what it counts and lines up, and one behaviour
for an older store, a model folder that is not one, and a server without a Hugging Face
cache. CLI tests run ``ppc`` as a real subprocess and check the exact line and status.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import BLOCK, prefill, random_tokens

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli import COMMANDS
from persistent_prefix_cache.cli import main as ppc_main
from persistent_prefix_cache.cli.common import first_unknown_option, load_model
from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.disk.schema import SCHEMA_VERSION
from persistent_prefix_cache.weights_hash import named_parameters

ROOT = Path(__file__).resolve().parent.parent
UNSET = "KV_TEST_SURELY_UNSET"  # (no PPC_ name: tests/test_layout.py counts those)


def _ppc(*args, env: dict | None = None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PPC_") and k != UNSET}
    return subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})}, cwd=cwd,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _one_error(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    """The one line a refused command prints: nothing else on stderr, no traceback."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture
def filled(store_dir, model):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for seed in (1, 2):
            tokens = random_tokens(40, seed=seed, first=seed)
            store.store(tokens, prefill(model, tokens)[1])
        store.fetch(random_tokens(40, seed=1, first=1) + [5])  # a query hit
        store.fetch(random_tokens(20, seed=9, first=9))  # and a miss
    return store_dir


# -- item 6: one parser behaviour ----------------------------------------------------------


@pytest.mark.slow
def test_every_command_names_a_misspelt_option_in_one_line(tmp_path):
    """``--stroe`` is named, with the nearest option, before anything else is checked
    (``pull`` and ``generate`` also lack their required ``--model``), by every command."""
    for command in COMMANDS:
        line = _one_error(_ppc(command, "--stroe", tmp_path / "s"))
        # demo has no --store (it takes --workdir; its hidden --store is not suggested)
        near = "(see `ppc demo --help`)" if command == "demo" else "(did you mean --store?)"
        assert line == f"error: unknown option --stroe {near}", command
    assert not (tmp_path / "s").exists()


def test_a_misspelt_option_comes_before_a_missing_one(capsys):
    with pytest.raises(SystemExit) as done:
        ppc_main(["pull", "--modle", "m"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: unknown option --modle (did you mean --model?)\n"


@pytest.mark.parametrize(
    "argv, line",
    [
        (["pull"], "error: the following arguments are required: --model (see `ppc pull --help`)"),
        (["inspect", "--top", "x"], "error: argument --top: invalid int value: 'x'"),
        (["forget"], "error: one of the arguments --model-path --all is required (see `ppc forget --help`)"),
        (["gc", "-x"], "error: unknown option -x (see `ppc gc --help`)"),
        (["stats", "--store", "/tmp", "extra"], "error: unrecognized arguments: extra (see `ppc stats --help`)"),
        (
            ["serve", "--admit", "never"],
            "error: argument --admit: invalid choice: 'never' (choose from 'always', 'seen', 'reuse')",
        ),  # fmt: skip
    ],
)
def test_every_parser_mistake_is_one_line_without_the_usage(argv, line, capsys):
    with pytest.raises(SystemExit) as done:
        ppc_main(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_values_that_start_with_a_dash_are_not_options():
    known = {"--temp", "-m", "--max-tokens", "--prompt", "-p", "--store", "--store-shared"}
    values = ["--temp", "-1", "--temp", "-.5", "-m5", "--max", "--prompt=-x", "-p", "- a list", "-", "--stor"]
    assert first_unknown_option(values, known) is None
    assert first_unknown_option(["--", "--zzz"], known) is None  # after "--": positionals
    assert first_unknown_option(["-m", "3", "--tmp", "1"], known) == "--tmp"
    assert first_unknown_option(["--stor"], known, abbrev=False) == "--stor"  # serve takes no prefixes
    assert first_unknown_option(["-x"], known) == "-x"


@pytest.mark.slow
def test_an_unset_variable_in_ppc_store_is_said_of_ppc_store(filled):
    line = _one_error(_ppc("stats", env={"PPC_STORE": f"${UNSET}/kv"}))
    assert line == (f"error: $PPC_STORE '${UNSET}/kv' names an environment variable that is not set: ${UNSET} "
                    "(set the variable, or write the path out)")  # fmt: skip
    line = _one_error(_ppc("stats", "--store", f"${{{UNSET}}}/kv"))
    assert line == (f"error: argument --store: '${{{UNSET}}}/kv' names an environment variable that is not set: "
                    f"${{{UNSET}}} (set the variable, or write the path out)")  # fmt: skip
    # --store wins: the variable is not even read then.
    ok = _ppc("stats", "--store", filled, "--json", env={"PPC_STORE": f"${UNSET}/kv"})
    assert ok.returncode == 0 and json.loads(ok.stdout)["blocks"] > 0, ok.stderr


# -- item 11: output that says what it counts ---------------------------------------------


def _value_ends(text: str) -> dict[str, int]:
    """Label -> the column where a numeric value's digits end (a unit hangs past it)."""
    ends = {}
    for line in text.split("\n\n")[0].splitlines():
        label, value = re.split(r"\s{2,}", line, maxsplit=1)
        m = re.match(r"^([\d,.]+)( %| s)?$", value)
        if m:
            ends[label] = line.index(value) + len(m.group(1))
    return ends


def test_stats_numbers_line_up_whatever_the_store_path(filled, capsys):
    deep = filled.parent / ("a-long-folder-name-" * 4) / "store"
    shutil.copytree(filled, deep)
    assert ppc_main(["stats", "--store", str(deep)]) == 0
    out = capsys.readouterr().out
    first = out.split("\n\n")[0].splitlines()
    assert first[0].split()[1] == str(deep)
    ends = _value_ends(out)
    assert {"schema version", "blocks", "bytes on disk", "hit rate", "tokens saved"} <= set(ends)
    assert len(set(ends.values())) == 1, ends  # every number ends at one column
    column = first[0].index(str(deep))  # and text starts where the values start
    assert column == max(len(line.split("  ")[0]) for line in first) + 2
    assert max(ends.values()) - column < 12  # not pushed out by the path's length
    assert re.search(r"^hit rate\s+50\.0 %$", out, re.M), out


@pytest.mark.slow
def test_stats_remote_counts_only_what_this_host_can_authenticate(tmp_path, filled, redis_server):
    url = redis_server.url
    mine, theirs = {"PPC_REMOTE_SECRET": "fleet-one"}, {"PPC_REMOTE_SECRET": "fleet-two"}
    pushed = json.loads(_ppc("push", "--store", filled, "--remote", url, "--json", env=mine).stdout)["pushed"]
    assert pushed > 1
    assert _ppc("push", "--store", filled, "--remote", url, env=theirs).returncode == 0
    assert _ppc("push", "--store", filled, "--remote", url, "--remote-insecure").returncode == 0
    out = _ppc("stats", "--store", filled, "--remote", url, env=mine)
    assert out.returncode == 0, out.stderr
    remote = out.stdout.split("\n\n")[1].splitlines()
    assert re.split(r"\s{2,}", remote[0]) == ["remote", url]
    assert re.split(r"\s{2,}", remote[2]) == ["blocks under this secret's key id", str(pushed)]
    assert re.split(r"\s{2,}", remote[3]) == ["blocks under other secrets or none", str(2 * pushed)]
    nodes = out.stdout.split("\n\n")[2].splitlines()
    assert nodes[0].split() == ["node", "memory", "used", "(bytes)", "maxmemory", "policy", "evicted", "keys"]
    assert nodes[2].startswith(url)
    # A value under this host's key id that its secret did not make: --verify counts it apart.
    from persistent_prefix_cache.tiers import remote_wire as wire

    client = redis_server.client()
    keys = list(client.scan_iter(match=b"ppc:b1:*"))
    kid = json.loads(_ppc("stats", "--store", filled, "--remote", url, "--json", env=mine).stdout)["remote"]["secret"]
    other = {wire.split_key(k)[1]: k for k in keys if wire.split_key(k)[0] not in (None, kid)}
    forged = next(k for k in keys if wire.split_key(k)[0] == kid)
    client.set(forged, client.get(other[wire.split_key(forged)[1]]))
    verified = _ppc("stats", "--store", filled, "--remote", url, "--verify", env=mine)
    remote = verified.stdout.split("\n\n")[1].splitlines()
    assert re.split(r"\s{2,}", remote[2]) == ["blocks under this secret, verified", str(pushed - 1)]
    assert re.split(r"\s{2,}", remote[3]) == ["", "failing their checks", "1"]  # indented under it
    as_json = json.loads(_ppc("stats", "--store", filled, "--remote", url, "--verify", "--json", env=mine).stdout)
    assert (as_json["remote"]["blocks"], as_json["remote"]["failed"]) == (pushed - 1, 1)
    # A host without a secret: the blocks without one are its own, the others apart.
    insecure = _ppc("stats", "--store", filled, "--remote", url, "--remote-insecure").stdout.split("\n\n")[1]
    assert re.search(rf"^blocks without a secret\s+{pushed}$", insecure, re.M), insecure
    assert re.search(rf"^blocks under secrets\s+{2 * pushed}$", insecure, re.M), insecure
    line = _one_error(_ppc("stats", "--store", filled, "--verify"))
    assert line == "error: --verify checks the values on the remote: give --remote URL (or set $PPC_REMOTE)"


def test_persistent_stats_says_unbounded_and_counts_every_insert_kept_in_memory(model, tmp_path):
    tokens = random_tokens(40, seed=3, first=3)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK) as store:
        unbounded = PersistentLRUPromptCache(store)
        stats = unbounded.persistent_stats()
        assert stats["memory_budget"] is None and "9223372036854775808" not in json.dumps(stats, default=str)
        assert PersistentLRUPromptCache(store, max_bytes=1 << 20).persistent_stats()["memory_budget"] == 1 << 20

    def no_store(model_key):
        return None if model_key == "memory-only" else PersistentPrefixCache(tmp_path / "t", model, block_size=BLOCK)

    def broken(model_key):
        raise OSError("cannot open")

    for source, key in ((no_store, "memory-only"), (broken, "m")):
        cache = PersistentLRUPromptCache(source)
        cache.insert_cache(key, tokens, prefill(model, tokens)[1])
        cache.insert_cache(key, tokens[:20], prefill(model, tokens[:20])[1])
        stats = cache.persistent_stats()
        assert (stats["store_skipped"], stats["stored_sequences"], len(cache)) == (2, 0, 2), stats
        cache.close()


@pytest.mark.slow
def test_generate_prints_rates_with_the_precision_they_have(tmp_path, tiny_model_dir):
    args = ("generate", "--model", tiny_model_dir, "--store", tmp_path / "s", "--prompt", "A cache is a promise",
            "-m", "4", "--ignore-chat-template")  # fmt: skip
    as_json = _ppc(*args, "--json")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout)
    for rate in ("prompt_tps", "generation_tps"):  # as measured, not rounded to 0.1
        assert result[rate] > 0 and result[rate] != round(result[rate], 1), result
    assert result["prompt_tps"] == pytest.approx(result["prompt_tokens"] / result["ttft_s"], rel=1e-2)
    text = _ppc(*args)
    rates = re.findall(r"^(?:Prompt|Generation): \d+ tokens, (\d+\.\d{3}) tokens-per-sec$", text.stdout, re.M)
    assert len(rates) == 2 and not all(r.endswith("00") for r in rates), text.stdout


@pytest.mark.slow
def test_make_install_prints_no_editable_install_box(tmp_path):
    """The Makefile's editable install, in a fresh venv from a copy of the checkout:
    setuptools' boxed note (a flat layout's) does not reach the output."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "Makefile"):
        shutil.copy(ROOT / name, src / name)
    for name in ("persistent_prefix_cache", "migrations"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    plan = subprocess.run(["make", "-n", "-B", "install", f"VENV={venv}"], cwd=src, capture_output=True, text=True,
                          timeout=60, check=True).stdout.splitlines()  # fmt: skip
    install = [line for line in plan if "pip install" in line and " -e " in line]
    assert len(install) == 1 and "PYTHONWARNINGS=" in install[0], plan
    # Without the dependencies (what the box is about is the build of this package).
    done = subprocess.run(install[0] + " --no-deps", shell=True, cwd=src, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"pip could not build the editable install here (no package index?): {done.stderr[-300:]}")
    said = done.stdout + done.stderr
    assert "Please be careful" not in said and "Editable installation" not in said, said


def test_segments_open_as_the_readme_says(filled):
    """The README: safe_open opens any segment; mx.load does with format="safetensors"
    (the .seg suffix alone tells it nothing)."""
    import mlx.core as mx
    from safetensors import safe_open

    readme = (ROOT / "README.md").read_text()
    assert 'mx.load(path, format="safetensors")' in readme and "one per `store()` call" in readme
    segments = sorted((filled / "segments").glob("*/*.seg"))
    assert segments
    for path in segments:
        with safe_open(str(path), "numpy") as f:
            names = set(f.keys())
        assert set(mx.load(str(path), format="safetensors")) == names
        with pytest.raises(ValueError, match="Unknown file format"):
            mx.load(str(path))


# -- item 12: one behaviour, said once ----------------------------------------------------


@pytest.mark.slow
def test_a_folder_that_is_no_model_is_refused_at_start(tmp_path, tiny_model_dir):
    empty, no_weights = tmp_path / "empty", tmp_path / "no-weights"
    empty.mkdir()
    no_weights.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", no_weights / "config.json")
    for folder, what in ((empty, "no config.json"), (no_weights, "no model*.safetensors weights")):
        want = f"error: --model {folder}: {what} in that folder (not an mlx-lm model folder)"
        served = _ppc("serve", "--model", folder, "--store", tmp_path / "s", "--port", "1")
        assert _one_error(served) == want and "Starting httpd" not in served.stdout
        generated = _ppc("generate", "--model", folder, "--store", tmp_path / "s", "--prompt", "hi")
        assert _one_error(generated) == want
    assert not (tmp_path / "s").exists()


def test_load_model_without_the_tokenizer_loads_the_folders_weights(tiny_model_dir, model):
    # mlx-lm's load_model takes a Path: given the folder as a str it failed on every
    # call ("cannot load model": TypeError in mlx-lm), which mypy found.
    loaded, tokenizer, local = load_model(str(tiny_model_dir), with_tokenizer=False)
    assert tokenizer is None and local == str(tiny_model_dir)
    got, want = dict(named_parameters(loaded)), dict(named_parameters(model))
    assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]).item() for k in want)


def test_the_models_route_without_a_hub_cache_lists_no_downloads(tmp_path):
    """The patched ``scan_cache_dir``: no cache folder is no downloaded model, not an
    exception; the server's own function comes back after the server returns."""
    from mlx_lm import server

    from persistent_prefix_cache.compat.server_patch import patched_server

    original = server.scan_cache_dir
    with patched_server(server, lambda *a: None):
        assert server.scan_cache_dir is not original
        assert list(server.scan_cache_dir(cache_dir=tmp_path / "no-hub-cache").repos) == []
        (tmp_path / "hub").mkdir()
        assert list(server.scan_cache_dir(cache_dir=tmp_path / "hub").repos) == []  # an empty one: the real scan
    assert server.scan_cache_dir is original


@pytest.mark.slow
def test_server_without_a_hub_cache_answers_the_models_route_without_a_traceback(tmp_path, tiny_model_dir, monkeypatch):
    from test_serve import Server

    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))  # the server process inherits it
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with Server(tiny_model_dir, tmp_path / "store", tmp_path / "serve.log") as server:
        with urllib.request.urlopen(server.url("/v1/models"), timeout=30) as r:
            assert r.status == 200
            models = json.loads(r.read())
        assert [m["id"] for m in models["data"]] == [str(Path(tiny_model_dir).resolve())]
        assert server.stop() == 0
        log = server.log()
    assert "Traceback" not in log and "Exception occurred" not in log, log


@pytest.mark.slow
def test_an_older_store_is_refused_by_every_command_alike_and_left_untouched(tmp_path, legacy_v4):
    from test_reliability import _snapshot

    from mlx_lm.models.cache import save_prompt_cache

    store, model = legacy_v4["v4"], legacy_v4["model_dir"]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("A cache is a promise.\n")
    mlx_file = tmp_path / "hi.safetensors"  # a readable mlx-lm file: import-mlx checks it before the store
    save_prompt_cache(str(mlx_file), prefill(legacy_v4["model"], [1, 2])[1])
    before = _snapshot(store)
    remote = ("--remote", "redis://127.0.0.1:9", "--remote-insecure")  # never reached: the store is refused first
    runs = {
        "stats": (), "inspect": (), "check": (), "gc": ("--unused-for", "1d"), "forget": ("--all",),
        "export": (tmp_path / "x.tar",), "import": (legacy_v4["pack"], "--trust"), "push": remote,
        "pull": ("--model", model, *remote), "precompute": ("--model", model, prompt),
        "generate": ("--model", model, "--prompt", "hi"), "import-mlx": ("--model", model, "--prompt", "hi", mlx_file),
        "export-mlx": ("--model", model, "--prompt", "hi", tmp_path / "out.safetensors"),
        "serve": ("--model", model, "--port", "1"),
    }  # fmt: skip
    assert set(runs) | {"demo", "migrate"} == set(COMMANDS)
    for command, extra in runs.items():
        line = _one_error(_ppc(command, "--store", store, *extra))
        assert line == (f"error: store {store} has schema v4, older than this version's v{SCHEMA_VERSION} (run "
                        f"`ppc migrate --store {store}` while no other process uses the store; it was left "
                        "untouched)"), command  # fmt: skip
    assert _snapshot(store) == before
    assert not (tmp_path / "x.tar").exists() and not (tmp_path / "out.safetensors").exists()
    migrated = _ppc("migrate", "--store", store)
    assert migrated.returncode == 0 and f"now v{SCHEMA_VERSION}" in migrated.stdout, migrated.stderr
    done = _ppc("generate", "--model", model, "--store", store, "--prompt", "hi", "-m", "2", "--json")
    assert done.returncode == 0, done.stderr
