"""The README and docs/ pages: every relative link resolves, and the examples marked runnable run.

A code block runs when the line before its opening fence is `<!-- runnable -->`. Python blocks run
with this interpreter, `sh` blocks with bash (`set -e`, the venv's `ppc` first on PATH), each in a
fresh temporary folder that holds a tiny random-weight model at `path/to/model` (the path the
examples name), with HOME pointing into that folder so `~/...` stores land there too. A block must
stand alone: nothing carries over from one block to the next.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.tiny_model import TEST_MODEL, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
# A block that runs longer than this is a bug in the example (the model is tiny).
BLOCK_TIMEOUT_S = 300

_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, with their 1-based numbers, inline code spans blanked."""
    out: list[tuple[int, str]] = []
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line.strip())
        if match and (fence is None or match.group(1).startswith(fence)):
            fence = None if fence else match.group(1)
            continue
        if fence is None:
            out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Every anchor of a page's headings, duplicates numbered as GitHub does (`x`, `x-1`, ...)."""
    anchors = set()
    seen: dict[str, int] = {}
    fence = None
    for line in page.read_text().splitlines():
        match = _FENCE.match(line.strip())
        if match and (fence is None or match.group(1).startswith(fence)):
            fence = None if fence else match.group(1)
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line) if fence is None else None
        if heading:
            slug = _slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links() -> list[tuple[Path, int, str]]:
    """Every relative link target (a path, an `#anchor`, or both) of every page."""
    found = []
    for page in PAGES:
        for number, line in _prose_lines(page.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                found.append((page, number, target))
    return found


def test_every_relative_link_resolves():
    """A link names a file that exists and, with `#anchor`, a heading of that file."""
    links = _links()
    assert len(links) >= 20, "the pages link each other; finding so few links means the parser broke"
    broken = []
    for page, number, target in links:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_fits_on_a_screen():
    """The README says what it is and how to start; the reference lives in docs/ (issue 21: about 300 lines)."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move reference material into a page of docs/"


def test_slug_matches_github():
    """The anchors the link check expects are the ones GitHub makes."""
    assert _slug("`ppc serve`: mlx_lm.server that remembers prompts across restarts") == (
        "ppc-serve-mlx_lmserver-that-remembers-prompts-across-restarts"
    )
    assert (
        _slug("The remote tier (loopback redis-server, same run)") == "the-remote-tier-loopback-redis-server-same-run"
    )
    assert _slug("`ppc check [--fix]`: verify a store") == "ppc-check---fix-verify-a-store"


def test_every_page_is_linked_from_the_readme():
    """No page of docs/ is an orphan: the README links each one."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for p, _, t in _links() if p.name == "README.md"}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def _runnable_blocks() -> tuple[list[tuple[str, str, str]], list[str]]:
    """(id, language, code) of every block whose fence follows a `<!-- runnable -->` line outside code,
    and the markers that do not (a marker before no fence, or before a block of another language)."""
    blocks, problems = [], []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in _prose_lines(page.read_text()):
            if line.strip() != MARKER:
                continue
            where = f"{page.relative_to(ROOT)}:{number + 1}"
            fence = _FENCE.match(lines[number].strip()) if number < len(lines) else None
            if not fence:
                problems.append(f"{where}: {MARKER} must be the line right before a code fence")
            elif fence.group(2) not in LANGUAGES:
                problems.append(f"{where}: a runnable block must be one of {sorted(LANGUAGES)}")
            else:
                end = next(j for j in range(number + 1, len(lines)) if lines[j].strip().startswith(fence.group(1)))
                blocks.append((where, LANGUAGES[fence.group(2)], "\n".join(lines[number + 1 : end]) + "\n"))
    return blocks, problems


BLOCKS, MARKER_PROBLEMS = _runnable_blocks()


def test_every_runnable_marker_marks_a_block_that_runs():
    """A marker that marks nothing (a typo, a language we cannot run) would let an example go untested."""
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)


def test_the_readme_has_runnable_examples():
    """The README's library example and its command-line example are among the blocks that run."""
    readme = {language for block_id, language, _ in BLOCKS if block_id.startswith("README.md:")}
    assert readme == {"python", "sh"}
    assert len(BLOCKS) >= 4  # and the library and CLI pages each show one that runs


@pytest.fixture(scope="module")
def docs_model(tmp_path_factory):
    """The tiny model the examples load as `path/to/model`."""
    return write_tiny_model(tmp_path_factory.mktemp("docs_model"), seed=0, **TEST_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("block_id,language,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_runnable_block(block_id, language, code, docs_model, tmp_path):
    """The block exits with status 0 in a folder holding the tiny model at `path/to/model`."""
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "model").symlink_to(docs_model, target_is_directory=True)
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    env.update(HOME=str(tmp_path / "home"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    if language == "python":
        (tmp_path / "example.py").write_text(code)
        argv = [sys.executable, "example.py"]
    else:
        (tmp_path / "example.sh").write_text("set -euo pipefail\n" + code)
        argv = ["bash", "example.sh"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, f"{block_id} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"


def _console_output(page: Path, command: str) -> list[str]:
    """The lines a ``console`` block of `page` shows after ``$ <command>``, up to the next
    prompt or the block's end."""
    lines = page.read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("$ ", "```")))
    return lines[start:end]


def _stats_layout(lines: list[str]) -> tuple[list[str], set[int], list[str]]:
    """A ``ppc stats`` output's labels, the columns its numbers end at, and its models
    table's header: what must not drift, whatever the store, paths and figures."""
    text = "\n".join(lines).strip("\n")
    first, _, rest = text.partition("\n\n")
    labels, ends = [], set()
    for line in first.splitlines():
        label, value = re.split(r"\s{2,}", line, maxsplit=1)
        labels.append(label)
        number = re.match(r"^[\d,.]+", value)
        if number and label != "store":
            ends.add(line.index(value) + number.end())
    return labels, ends, rest.splitlines()[0].split() if rest else []


@pytest.mark.slow
def test_the_stats_example_is_what_ppc_stats_prints(docs_model, tmp_path):
    """docs/cli.md's ``ppc stats`` example has the rows, the alignment and the schema
    version the command prints today (made as its prose says: a precompute, then a
    generate of the prompt and a question)."""
    shown = _console_output(ROOT / "docs" / "cli.md", "ppc stats --store store")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}

    def ppc(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = "A cache is a promise that the second time will be cheaper than the first."
    (tmp_path / "prompt.txt").write_text(text + "\n")
    ppc("precompute", "--model", str(docs_model), "--store", "store", "prompt.txt", "--no-progress")
    ppc("generate", "--model", str(docs_model), "--store", "store", "--prompt", text + " And the third time?",
        "-m", "4", "--quiet")  # fmt: skip
    real = ppc("stats", "--store", "store").splitlines()
    from persistent_prefix_cache.disk.schema import SCHEMA_VERSION

    labels, ends, header = _stats_layout(shown)
    assert (labels, ends, header) == _stats_layout(real)
    assert len(ends) == 1  # every number ends at one column
    version = next(line for line in shown if line.startswith("schema version"))
    assert version.split()[-1] == str(SCHEMA_VERSION)
