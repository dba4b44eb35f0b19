"""One meaning for ``0`` in every size option, a question before ``ppc gc`` removes every
block, and no empty segment sub-folder left behind (issue 31, item 2).

Stores are filled in-process with the real model; commands run as real ``ppc``
subprocesses, the question on a real pseudo-terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BLOCK, random_tokens, read_terminal

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli import common
from persistent_prefix_cache.cli.common import SIZE_UNITS_HELP, disk_budget_option, parse_disk_budget, parse_size
from persistent_prefix_cache.disk import segment as segment_module
from persistent_prefix_cache.disk.segment import SegmentFiles
from persistent_prefix_cache.disk.store_dir import TempFile
from persistent_prefix_cache.prefill import prefill

ROOT = Path(__file__).resolve().parent.parent
PPC = [sys.executable, "-m", "persistent_prefix_cache"]


def ppc(*args, expect: int, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PPC, *map(str, args)], capture_output=True, text=True, timeout=120, stdin=stdin)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def on_a_terminal(args, answer: bytes) -> tuple[str, int]:
    """Run ``ppc`` on a new pseudo-terminal, answer its question, return (what it wrote, status)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
        os.execv(sys.executable, [*PPC, *map(str, args)])
    out = read_terminal(fd, until=b"[y/N]")
    if b"[y/N]" in out:
        os.write(fd, answer)
    out += read_terminal(fd)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return out.decode().replace("\r\n", "\n"), os.waitstatus_to_exitcode(status)


def segment_folders(store) -> dict[str, int]:
    """Sub-folder of ``segments/`` -> how many entries it holds."""
    top = Path(store) / "segments"
    return {sub.name: len(os.listdir(sub)) for sub in top.iterdir()}


@pytest.fixture
def chains(store_dir, model, separate_segments):
    """A store of several chains, one segment each (so in several sub-folders)."""
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for seed in range(6):
            prefill(model, random_tokens(3 * BLOCK, seed=40 + seed, first=3 + seed), store)
        store.flush()
        stats = store.stats()
    assert stats["blocks"] == 18 and len(segment_folders(store_dir)) >= 3
    return store_dir


def test_zero_is_zero_bytes_in_every_size_option():
    # --store-disk-bytes: 0 keeps nothing, so it is refused; "unlimited" lifts the budget.
    with pytest.raises(argparse.ArgumentTypeError, match="0 would keep no block on disk.*'unlimited' for none"):
        parse_disk_budget("0")
    with pytest.raises(argparse.ArgumentTypeError, match="0 would keep no block"):
        parse_disk_budget("0K")
    assert disk_budget_option(argparse.Namespace(store_disk_bytes=parse_disk_budget("Unlimited"))) == {
        "disk_bytes": None
    }
    assert disk_budget_option(argparse.Namespace(store_disk_bytes=parse_disk_budget("2G"))) == {"disk_bytes": 2 << 30}
    assert parse_size("0") == 0  # gc --max-bytes 0 and --store-memory-bytes 0: zero bytes


def test_every_size_option_is_in_the_one_paragraph_of_docs_that_says_what_0_means():
    """Every option of cli/ parsed as a size is named in docs/cli.md's section on sizes,
    which says what 0 means for each."""
    options = set()
    for path in (ROOT / "persistent_prefix_cache" / "cli").glob("*.py"):
        text = path.read_text()
        options |= set(re.findall(r'"(--[a-z-]+)",\s*type=parse_(?:size|disk_budget)\b', text))
    assert options == {"--store-disk-bytes", "--store-memory-bytes", "--max-bytes"}, options
    docs = (ROOT / "docs" / "cli.md").read_text()
    section = docs.split("### Sizes", 1)[1].split("\n### ", 1)[0]
    for option in options:
        assert f"`{option} 0`" in section, option


def test_the_help_of_sizes_says_what_the_parser_does():
    # Each "X = N" example of the help text is what parse_size makes of X.
    examples = re.findall(r"(\w+) = ([\d,*]+)", SIZE_UNITS_HELP)
    assert len(examples) == 2
    for text, value in examples:
        assert parse_size(text) == eval(value.replace(",", "")), text  # noqa: S307 (our own help text)
    assert (
        common.SIZE_UNITS_HELP
        in subprocess.run(
            [*PPC, "gc", "--help"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "1000"}
        ).stdout
    )


@pytest.mark.slow
def test_store_disk_bytes_0_is_refused_with_the_remedy(tmp_path, tiny_model_dir):
    prompt = tmp_path / "p.txt"
    prompt.write_text("A cache is a promise.")
    err = ppc("precompute", "--model", tiny_model_dir, "--store", tmp_path / "s", "--store-disk-bytes", "0", prompt,
              expect=2).stderr  # fmt: skip
    assert "argument --store-disk-bytes: 0 would keep no block on disk" in err and "'unlimited' for none" in err
    assert not (tmp_path / "s").exists()
    out = json.loads(ppc("precompute", "--model", tiny_model_dir, "--store", tmp_path / "s", "--store-disk-bytes",
                         "unlimited", prompt, "--json", expect=0).stdout)  # fmt: skip
    assert out["blocks_written"] > 0


@pytest.mark.slow
def test_gc_that_would_remove_every_block_asks_first(chains):
    before = ppc("stats", "--store", chains, "--json", expect=0).stdout
    files = segment_folders(chains)
    line = (
        f"error: this would remove every block of store {chains} (18 blocks, {json.loads(before)['block_bytes']:,} "
        "bytes): pass --yes to remove them all; nothing was removed\n"
    )
    # Without a terminal: refused in one line, whatever selects every block.
    for select in (("--max-bytes", "0"), ("--max-bytes", "1"), ("--unused-for", "0s"), ("--max-bytes", "0", "--json")):
        assert ppc("gc", "--store", chains, *select, expect=2).stderr == line
    model = json.loads(before)["models"][0]["root"][:12]
    assert ppc("gc", "--store", chains, "--model", model, expect=2).stderr == line  # its only model
    assert ppc("stats", "--store", chains, "--json", expect=0).stdout == before and segment_folders(chains) == files

    # On a terminal: asked; anything but yes removes nothing (status 1).
    said, status = on_a_terminal(["gc", "--store", chains, "--max-bytes", "0"], b"n\n")
    assert said == (
        f"this would remove every block of store {chains} (18 blocks, {json.loads(before)['block_bytes']:,} bytes). "
        "Remove them all? [y/N] n\nnothing was removed\n"
    )
    assert status == 1 and segment_folders(chains) == files
    said, status = on_a_terminal(["gc", "--store", chains, "--max-bytes", "0"], b"y\n")
    assert status == 0 and said.endswith(
        "removed 18 block(s), " + f"{json.loads(before)['block_bytes']:,} bytes; "
        "0 bytes in 0 block(s) remain (budget 0), 0 bytes of segment files\n"
    )
    assert segment_folders(chains) == {}  # no empty sub-folder left behind
    assert json.loads(ppc("check", "--store", chains, "--json", expect=0).stdout)["clean"]


@pytest.mark.slow
def test_gc_with_yes_and_partial_gc_leave_no_empty_segment_folders(chains):
    blocks = json.loads(ppc("stats", "--store", chains, "--json", expect=0).stdout)["block_bytes"]
    # Part of the store: no question; what remains sits in folders that hold files.
    out = json.loads(ppc("gc", "--store", chains, "--max-bytes", str(blocks // 2), "--json", expect=0).stdout)
    assert 0 < out["removed_blocks"] < 18
    assert segment_folders(chains) and all(segment_folders(chains).values())
    assert json.loads(ppc("check", "--store", chains, "--json", expect=0).stdout)["clean"]
    out = json.loads(ppc("gc", "--store", chains, "--max-bytes", "0", "--yes", "--json", expect=0).stdout)
    assert out["blocks_after"] == 0 and segment_folders(chains) == {}
    # An empty store: nothing to remove, nothing to ask.
    out = json.loads(ppc("gc", "--store", chains, "--max-bytes", "0", "--json", expect=0).stdout)
    assert out["removed_blocks"] == 0


def test_a_writer_makes_again_a_folder_pruned_under_it(tmp_path, monkeypatch):
    """The race a pruned folder opens: a writer opened segments/ab/ while it was empty,
    another process removed it before the rename; the writer makes it again."""
    files = SegmentFiles(str(tmp_path / "store"))
    segment = bytes.fromhex("ab" * 16)
    os.makedirs(tmp_path / "store" / "segments" / "ab")
    opened = segment_module.subfolder
    calls = []

    def pruned_after_open(top, name, root):
        fd, made = opened(top, name, root)
        calls.append(made)
        if len(calls) == 1:
            files.prune([name])  # what a gc in another process does to an empty folder
        return fd, made

    monkeypatch.setattr(segment_module, "subfolder", pruned_after_open)
    tmp = TempFile(files.root, "tmp", segment.hex())
    os.write(tmp.fd, b"the segment's bytes")
    files.publish(tmp, segment)
    tmp.discard()
    assert calls == [False, True]  # opened, gone, made again
    assert Path(files.path_of(segment)).read_bytes() == b"the segment's bytes"
    assert os.listdir(tmp_path / "store" / "tmp") == []


def test_prune_removes_only_empty_folders_and_never_follows_a_link(tmp_path):
    files = SegmentFiles(str(tmp_path / "store"))
    top = tmp_path / "store" / "segments"
    (top / "aa").mkdir()
    (top / "bb").mkdir()
    (top / "bb" / "x.seg").write_bytes(b"kept")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, top / "cc")
    files.prune(["aa", "bb", "cc", "dd"])
    assert sorted(os.listdir(top)) == ["bb", "cc"] and outside.is_dir() and os.path.islink(top / "cc")
