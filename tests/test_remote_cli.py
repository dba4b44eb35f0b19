"""``--remote`` on the commands, ``ppc push`` and ``ppc pull``, through ``ppc``'s own entry
point (in this process: starting an interpreter with MLX per command would cost seconds
each; the hosts-as-processes tests are in test_remote_fleet.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from persistent_prefix_cache.cli import main as ppc_main


@pytest.fixture
def ppc(capsys, monkeypatch):
    monkeypatch.setenv("PPC_REMOTE_TIMEOUT", "10")  # a loaded machine must not make a fetch miss
    monkeypatch.setenv("PPC_REMOTE_SECRET", "the fleet's secret")  # a fleet has one

    def call(*args, env=None):
        capsys.readouterr()
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        code = ppc_main([str(a) for a in args])
        for k in env or {}:
            monkeypatch.delenv(k)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


@pytest.mark.parametrize("command", ["precompute", "generate", "stats", "push", "pull", "serve"])
def test_a_bad_remote_url_is_one_line_and_exit_2(tmp_path, tiny_model_dir, ppc, command):
    store = tmp_path / "s"
    store.mkdir()
    (tmp_path / "p.txt").write_text("hello")
    extra = {
        "precompute": ["--model", tiny_model_dir, tmp_path / "p.txt"],
        "generate": ["--model", tiny_model_dir, "--prompt", "hi"],
        "pull": ["--model", tiny_model_dir],
        "serve": ["--model", tiny_model_dir],
    }.get(command, [])
    if command in ("stats", "push"):
        ppc("precompute", "--model", tiny_model_dir, "--store", store, tmp_path / "p.txt")
    out = ppc(command, "--store", store, *extra, env={"PPC_REMOTE": "localhost:6379"})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "remote URL" in lines[0] and "Traceback" not in out.stderr


@pytest.mark.slow
def test_precompute_push_pull_between_hosts(tmp_path, tiny_model_dir, redis_server, ppc):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"document {i} " * 40}) + "\n" for i in range(3)))
    a = tmp_path / "a"
    out = ppc("precompute", "--model", tiny_model_dir, "--store", a, "--block-size", 16, prompts, "--json")
    assert out.returncode == 0, out.stderr
    blocks = json.loads(out.stdout)["blocks_in_store"]
    # A store precomputed without a remote reaches the fleet with ppc push (twice: safe).
    url = redis_server.url
    first = ppc("push", "--store", a, "--remote", url, "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["pushed"] == blocks
    again = json.loads(ppc("push", "--store", a, "--json", env={"PPC_REMOTE": url}).stdout)
    assert (again["pushed"], again["already"]) == (0, blocks)
    stats = ppc("stats", "--store", a, "--remote", url, "--json")
    assert json.loads(stats.stdout)["remote"]["blocks"] == blocks
    # Host B pulls the prompts' prefixes; host C pulls the whole model.
    b = tmp_path / "b"
    out = ppc("pull", "--model", tiny_model_dir, "--store", b, "--remote", url, "--block-size", 16, prompts, "--json")
    assert out.returncode == 0, out.stderr
    pulled = json.loads(out.stdout)
    assert pulled["blocks_in_store"] == blocks and pulled["tokens_restored"] > 0
    c = tmp_path / "c"
    out = ppc("pull", "--model", tiny_model_dir, "--store", c, "--remote", url, "--block-size", 16, "--json")
    assert out.returncode == 0, out.stderr
    whole = json.loads(out.stdout)
    assert (whole["found"], whole["pulled"], whole["blocks_in_store"]) == (blocks, blocks, blocks)
    rerun = json.loads(ppc("pull", "--model", tiny_model_dir, "--store", c, "--remote", url, "--json").stdout)
    assert (rerun["pulled"], rerun["present"]) == (0, blocks)
    # C now serves the prompts from its own disk, exactly: generate with no remote.
    gen = ppc("generate", "--model", tiny_model_dir, "--store", c, "--prompt", "document 1 " * 40, "--max-tokens", 3)
    gen_a = ppc("generate", "--model", tiny_model_dir, "--store", a, "--prompt", "document 1 " * 40, "--max-tokens", 3)
    # The text between mlx-lm's ========== lines (its summary lines after them hold timings).
    assert gen.returncode == 0 and gen.stdout.split("=" * 10)[1] == gen_a.stdout.split("=" * 10)[1]


def test_pull_counts_add_up_and_pulled_blocks_are_used_now(tmp_path, tiny_model_dir, redis_server, ppc):
    """Precompute with --remote publishes a prompt's partial last block and then the
    longer block of a prompt that extends it (the server keeps both); a pull of the model brings both, and the
    counts say so: the store grows by pulled - replaced. Every pulled block carries the
    pull's time as its last use (never 1970)."""
    import time

    from persistent_prefix_cache.admin import StoreAdmin

    short, longer = tmp_path / "short.txt", tmp_path / "longer.txt"
    short.write_text("a prompt with a partial last block " * 2 + "and a few")  # 37 tokens: 5 in a partial block
    longer.write_text("a prompt with a partial last block " * 2 + "and a few more words")  # extends it
    a = tmp_path / "a"
    out = ppc("precompute", "--model", tiny_model_dir, "--store", a, "--block-size", 16, "--remote", redis_server.url,
              "--ignore-chat-template", short, longer, "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout)
    assert stored["blocks_written"] > stored["blocks_in_store"]  # a partial block was replaced here too
    started = time.time_ns()
    out = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "b", "--block-size", 16,
              "--remote", redis_server.url, "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    pulled = json.loads(out.stdout)
    assert pulled["found"] == pulled["pulled"] + pulled["present"] + pulled["rejected"] + pulled["orphans"]
    assert pulled["replaced"] >= 1  # the shorter partial block gave way to the longer one
    assert pulled["pulled"] - pulled["replaced"] == pulled["blocks_in_store"]
    with StoreAdmin(str(tmp_path / "b"), readonly=True) as admin:
        (model,) = admin.summary()["models"]
        prefixes = admin.summary(longest=10)["longest_prefixes"]
    assert model["last_used"] >= started and all(p["last_access"] >= started for p in prefixes)
