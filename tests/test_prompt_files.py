"""One way to read a prompt (issue 31, items 3 and 4): ``--prompt-file F`` and ``--prompt -``
read as ``--prompt "$(cat F)"`` passes the text (trailing newlines dropped), in every command
that takes a prompt; text that is not UTF-8 (a file, stdin, an argument, a JSON string) is
one ``error:`` line and exit 2, never a traceback.

The commands run as real processes on real files; mlx-lm's own ``cache_prompt`` and
``generate`` run beside them. The docs' example (docs/mlx-lm-files.md, Import and Export)
runs as written, with the tiny model in a folder of the name it gives.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.cli.common import UserError
from persistent_prefix_cache.cli.prompting import check_text, decode_text, prompt_of
from persistent_prefix_cache.layers import cache_length
from persistent_prefix_cache.layers.mlx_files import leaf_tensors, read_prompt_cache
from persistent_prefix_cache.tiny_model import DEMO_TEXT, TEST_MODEL, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "mlx-lm-files.md"
# A prompt as an editor saves it: the text, then a newline.
MANUAL = "\n".join(DEMO_TEXT.splitlines()[:3]) + "\n"
LATIN1 = "caf\xe9 au lait".encode("latin-1")  # byte 3 is not UTF-8
NOT_UTF8 = "not UTF-8 text (bad byte at offset 3)"


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    out.update(HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    return out


def ppc(*args, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """``ppc ARGS`` in a real interpreter; an argument may be bytes (not UTF-8)."""
    argv = [sys.executable, "-m", "persistent_prefix_cache", *(a if isinstance(a, bytes) else str(a) for a in args)]
    return subprocess.run(
        argv, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, capture_output=True,
        cwd=cwd, env=env(), timeout=300,
    )  # fmt: skip


def one_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The one ``error:`` line a refused command printed (exit 2, nothing on stdout)."""
    err = proc.stderr.decode()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert proc.stdout == b""
    for word in words:
        assert word in err, err
    return err.strip()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder holding the tiny model as ``Qwen3-4B`` (the docs' name) and ``manual.txt``."""
    root = tmp_path_factory.mktemp("prompt_files")
    write_tiny_model(root / "Qwen3-4B", seed=0, **TEST_MODEL)
    (root / "manual.txt").write_text(MANUAL)
    (root / "latin1.txt").write_bytes(LATIN1)
    (root / "home").mkdir()
    return root


# -- the one reading rule, in process -----------------------------------------------------


def test_a_prompt_file_reads_as_cat_does():
    """Trailing newlines go, as ``"$(cat F)"`` drops them; nothing else changes (a ``\\r``
    before them and a byte-order mark stay, as the shell keeps them)."""
    assert prompt_of("a\nb\n\n\n", "f") == "a\nb"
    assert prompt_of("a\r\n", "f") == "a\r"
    assert prompt_of(decode_text("\ufeffa\n".encode(), "f"), "f") == "\ufeffa"
    out = subprocess.run(["bash", "-c", 'printf %s "$(printf "a\\r\\n\\n")" | od -c'], capture_output=True, text=True)
    assert "a  \\r" in out.stdout  # what the rule copies: bash keeps the \r
    with pytest.raises(UserError, match="f: empty"):
        prompt_of("\n\n", "f")


def test_bytes_and_arguments_that_are_not_utf8_are_one_rule():
    with pytest.raises(UserError) as file_error:
        decode_text(LATIN1, "x.txt")
    assert str(file_error.value).startswith(f"x.txt: {NOT_UTF8}")
    # An argument arrives surrogate-escaped: the same message, the same byte offset.
    argument = LATIN1.decode("utf-8", "surrogateescape")
    with pytest.raises(UserError) as arg_error:
        check_text(argument, "--prompt")
    assert str(arg_error.value) == str(file_error.value).replace("x.txt", "--prompt")
    # A JSON string can spell a lone surrogate: not text either.
    with pytest.raises(UserError, match=r"x.jsonl:1: not valid text \(a lone surrogate '\\ud800' at character 2\)"):
        check_text(json.loads('"ab\\ud800"'), "x.jsonl:1", argument=False)
    assert check_text("café", "--prompt") == "café"


# -- the docs' example, as written ----------------------------------------------------------


def _blocks(heading: str) -> str:
    """The first code block under `heading` in docs/mlx-lm-files.md."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def _expected(comment: str) -> re.Pattern:
    """A ``# output`` line of the docs as a pattern: ``<...>`` is any value, a version any version."""
    parts = re.split(r"(<[^>]+>|\d+\.\d+(?:\.\d+)?)", comment.removeprefix("# "))
    return re.compile("".join(".+?" if i % 2 else re.escape(p) for i, p in enumerate(parts)) + "$")


def _run_block(block: str, cwd: Path) -> None:
    """Each command of a docs block, in order, through bash; a ``# ...`` line after a command
    is the output it must print (its first line)."""
    lines = block.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            continue
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env={**env(), "HOME": str(cwd / "home")},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        if i + 1 < len(lines) and lines[i + 1].startswith("# "):
            first = done.stdout.splitlines()[0]
            assert _expected(lines[i + 1]).match(first), (first, lines[i + 1])


@pytest.mark.slow
def test_the_docs_import_and_export_example_runs_as_written(work):
    """docs/mlx-lm-files.md: ``cache_prompt --prompt "$(cat manual.txt)"``, then
    ``import-mlx --prompt-file manual.txt`` (one token too many before: refused), then
    ``export-mlx --prompt-file`` writes the file cache_prompt wrote (its length, its KV),
    which ``mlx_lm generate`` continues."""
    imported, exported = _blocks("Import"), _blocks("Export")
    assert 'mlx_lm.cache_prompt --model ./Qwen3-4B --prompt "$(cat manual.txt)"' in imported
    assert "ppc import-mlx manual.safetensors --store ~/kv --model ./Qwen3-4B --prompt-file manual.txt" in imported
    assert "--prompt-file manual.txt" in exported and "mlx_lm generate" in exported
    _run_block(imported, work)
    theirs = read_prompt_cache(str(work / "manual.safetensors"))
    os.rename(work / "manual.safetensors", work / "cache_prompt.safetensors")
    _run_block(exported, work)  # writes manual.safetensors again: ppc's export
    ours = read_prompt_cache(str(work / "manual.safetensors"))
    assert cache_length(ours.cache) == cache_length(theirs.cache) > 10
    a, b = leaf_tensors(ours.cache), leaf_tensors(theirs.cache)
    assert a.keys() == b.keys()
    assert all(x.shape == y.shape and (x == y).all().item() for leaf in a for x, y in zip(a[leaf], b[leaf]))


@pytest.mark.slow
def test_a_file_made_from_stdin_keeps_its_newline_and_still_imports(work, tmp_path):
    """``cache_prompt --prompt - < F`` keeps F's trailing newline (mlx-lm reads stdin as it
    is): the file's recorded length tells, and ``--prompt-file F`` imports it too."""
    model = work / "Qwen3-4B"
    with open(work / "manual.txt", "rb") as f:
        made = subprocess.run(
            [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(model), "--prompt", "-",
             "--prompt-cache-file", str(tmp_path / "raw.safetensors")],
            stdin=f, capture_output=True, text=True, env=env(), timeout=300,
        )  # fmt: skip
    assert made.returncode == 0, made.stderr
    raw = cache_length(read_prompt_cache(str(tmp_path / "raw.safetensors")).cache)
    proc = ppc("import-mlx", tmp_path / "raw.safetensors", "--store", tmp_path / "s", "--model", model,
               "--prompt-file", work / "manual.txt", "--json", cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["tokens"] == raw


@pytest.mark.slow
def test_generate_reads_a_prompt_file_stdin_and_cat_alike(work, tmp_path):
    """``--prompt-file F``, ``--prompt - < F`` and ``--prompt "$(cat F)"``: one prompt, one
    text; and ``precompute F`` stored what ``generate --prompt-file F`` restores."""
    model, manual = work / "Qwen3-4B", work / "manual.txt"
    common = ["generate", "--model", model, "-m", "4", "--json", "--ignore-chat-template", "--block-size", "16"]
    pre = ppc("precompute", manual, "--model", model, "--store", tmp_path / "s", "--block-size", "16",
              "--ignore-chat-template", "--json", cwd=work)  # fmt: skip
    assert pre.returncode == 0, pre.stderr.decode()
    stored = json.loads(pre.stdout)["tokens"]
    runs = [
        ppc(*common, "--store", tmp_path / "s", "--prompt-file", manual, cwd=work),
        ppc(*common, "--store", tmp_path / "s", "--prompt", "-", cwd=work, stdin=manual.read_bytes()),
        ppc(*common, "--store", tmp_path / "cold", "--prompt", MANUAL.rstrip("\n"), cwd=work),
    ]
    out = []
    for proc in runs:
        assert proc.returncode == 0, proc.stderr.decode()
        out.append(json.loads(proc.stdout))
    assert out[0]["prompt_tokens"] == out[1]["prompt_tokens"] == out[2]["prompt_tokens"] == stored
    assert out[0]["tokens"] == out[1]["tokens"] == out[2]["tokens"]
    # All but the last two tokens (one is fed for the logits, one by the generator).
    assert out[0]["restored_tokens"] == out[1]["restored_tokens"] == stored - 2
    assert out[2]["restored_tokens"] == 0
    both = ppc(*common, "--store", tmp_path / "s", "--prompt", "x", "--prompt-file", manual, cwd=work)
    assert both.returncode == 2 and b"--prompt-file" in both.stderr  # one or the other


# -- text that is not UTF-8: one line, exit 2 -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["argument", "stdin", "prompt-file", "system-prompt", "prefill-response", "import-mlx", "export-mlx"]
)
def test_text_that_is_not_utf8_is_one_error_line(work, tmp_path, how):
    model, store = work / "Qwen3-4B", tmp_path / "s"
    gen = ["generate", "--model", model, "--store", store, "-m", "2"]
    cases = {
        "argument": (gen + ["--prompt", LATIN1], None, "--prompt: "),
        "stdin": (gen + ["--prompt", "-"], LATIN1 + b"\n", "--prompt - (stdin): "),
        "prompt-file": (gen + ["--prompt-file", work / "latin1.txt"], None, f"--prompt-file {work / 'latin1.txt'}: "),
        "system-prompt": (gen + ["--prompt", "hi", "--system-prompt", LATIN1], None, "--system-prompt: "),
        "prefill-response": (gen + ["--prompt", "hi", "--prefill-response", LATIN1], None, "--prefill-response: "),
        "import-mlx": (["import-mlx", work / "nope.safetensors", "--store", store, "--model", model, "--prompt-file",
                        work / "latin1.txt"], None, None),
        "export-mlx": (["export-mlx", tmp_path / "o.safetensors", "--store", store, "--model", model, "--prompt",
                        LATIN1], None, "--prompt: "),
    }  # fmt: skip
    argv, stdin, where = cases[how]
    if how == "import-mlx":  # the file is read first: give it one mlx-lm wrote
        made = subprocess.run(
            [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(model), "--prompt", "hello",
             "--prompt-cache-file", str(tmp_path / "f.safetensors")], capture_output=True, env=env(), timeout=300,
        )  # fmt: skip
        assert made.returncode == 0
        argv[1], where = tmp_path / "f.safetensors", f"--prompt-file {work / 'latin1.txt'}: "
    if how == "export-mlx":
        assert ppc("generate", "--model", model, "--store", store, "-m", "1", "--prompt", "x", cwd=work).returncode == 0
    line = one_error(ppc(*argv, cwd=work, stdin=stdin), NOT_UTF8)
    assert line.startswith("error: " + where), line
    assert not (store / "index").exists() or how == "export-mlx"  # nothing was made for a refused prompt


@pytest.mark.slow
def test_precompute_refuses_a_jsonl_string_that_is_no_text(work, tmp_path):
    """A JSON row may spell a lone surrogate (valid JSON, not text): its line, in one line."""
    rows = work / "rows.jsonl"
    rows.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user", "content": "bad \\udc80 here"}]}\n')
    proc = ppc("precompute", rows, "--model", work / "Qwen3-4B", "--store", tmp_path / "s", cwd=work)
    one_error(proc, f"{rows}:2: not valid text (a lone surrogate '\\udc80' at character 4)")
    latin = ppc("precompute", work / "latin1.txt", "--model", work / "Qwen3-4B", "--store", tmp_path / "s", cwd=work)
    one_error(latin, f"{work / 'latin1.txt'}: {NOT_UTF8}")
