"""``ppc precompute`` and ``ppc generate`` run as a user runs them.

Every test starts a real interpreter (``python -m persistent_prefix_cache ...``) on real
files and a tiny model folder written with `write_tiny_model`. The random-weight model
repeats itself under greedy decoding, so warm and cold runs are compared on the
log-probabilities of the generated tokens too, not only on the text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.tiny_model import DEMO_TEXT, TEST_MODEL, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
LINES = DEMO_TEXT.splitlines()
SYSTEM = "\n".join(LINES[:8])  # a long shared system prompt: ~15 blocks of 16 tokens
QUESTION = "The closer the shelf, the smaller it is. Why?"

TINY = dict(TEST_MODEL)
HYBRID = dict(
    family="qwen3_next",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=512,
    extra_config=dict(
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
        num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
        mlp_only_layers=[0, 1], moe_intermediate_size=0, partial_rotary_factor=0.25,
        head_dim=16, full_attention_interval=2,
    ),
)  # fmt: skip


def chat_row(user: str) -> str:
    """A JSONL line: the shared system prompt, then `user`."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return json.dumps({"messages": messages})


def ppc(*args, stdin: str | None = None, cwd: Path | None = None, tool: bool = False):
    """Run ``python -m persistent_prefix_cache ARGS`` (or ``tools/precompute.py ARGS``)."""
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the network
    if tool:
        cmd = [sys.executable, str(ROOT / "tools" / "precompute.py"), *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)]
    return subprocess.run(
        cmd,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def ok_json(proc) -> dict:
    """The JSON a successful run printed."""
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def generate(model: Path, store: Path, *extra, stdin: str | None = None):
    """``ppc generate`` with the shared system prompt, greedy, 12 tokens."""
    return ppc(
        "generate", "--model", model, "--store", store, "--block-size", BLOCK,
        "--system-prompt", SYSTEM, "--max-tokens", 12, "--temp", 0, *extra, stdin=stdin,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny llama folder `mlx_lm.load` opens offline (tokenizer and chat template)."""
    return write_tiny_model(tmp_path_factory.mktemp("cli_model"), seed=0, **TINY)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of input files: chats sharing a system prompt, a plain prompt row, a text file."""
    folder = tmp_path_factory.mktemp("inputs")
    rows = [chat_row(LINES[10]), chat_row(LINES[12]), json.dumps({"prompt": LINES[20]})]
    (folder / "chats.jsonl").write_text("\n".join(rows) + "\n\n")  # a blank line is skipped
    (folder / "row1.jsonl").write_text(rows[0] + "\n")
    (folder / "row2.jsonl").write_text(rows[1] + "\n")
    (folder / "both.jsonl").write_text(rows[0] + "\n" + rows[1] + "\n")
    (folder / "doc.txt").write_text("\n".join(LINES[25:35]) + "\n")
    (folder / "bad.jsonl").write_text(rows[2] + "\n" + '{"prompt": "x",}\n')
    (folder / "empty.txt").write_text("")
    (folder / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    return folder


@pytest.fixture(scope="module")
def filled(model_dir, inputs, tmp_path_factory) -> tuple[Path, dict]:
    """A store filled by one precompute of a JSONL file, a text file and stdin."""
    store = tmp_path_factory.mktemp("filled") / "store"
    proc = ppc(
        "precompute", "--model", model_dir, "--store", store, "--block-size", BLOCK, "--json",
        inputs / "chats.jsonl", inputs / "doc.txt", "-",
        stdin="The weather in the mountains changes.\n",
    )  # fmt: skip
    return store, ok_json(proc)


# -- precompute ---------------------------------------------------------------------------


def test_precompute_reads_text_jsonl_and_stdin(filled, inputs):
    store, out = filled
    assert out["prompts"] == 5 and out["duplicates"] == 0
    names = {p["input"] for p in out["per_prompt"]}
    chats = str(inputs / "chats.jsonl")
    assert names == {f"{chats}:1", f"{chats}:2", f"{chats}:3", str(inputs / "doc.txt"), "<stdin>"}
    assert out["tokens"] == sum(p["tokens"] for p in out["per_prompt"])
    assert out["tokens_computed"] + out["tokens_restored"] == out["tokens"]
    assert out["blocks_in_store"] > 0 and out["bytes_on_disk"] > 0
    # Superseded partial blocks and compaction only ever take bytes away.
    assert 0 < out["bytes_on_disk"] <= out["bytes_written"]
    assert (store / "index").is_dir()


@pytest.mark.parametrize("beside", [False, True])
def test_precompute_writes_each_block_once(model_dir, inputs, tmp_path, monkeypatch, capsys, beside):
    # prefill() stores a prompt whole, or on a GPU all but its last token beside the last
    # forward (`device.target.forwards_run_beside`); precompute then stores nothing more, so
    # no block is written twice (a partial last block superseded by a longer one).
    import importlib

    from persistent_prefix_cache.cli import main

    prefill_module = importlib.import_module(
        "persistent_prefix_cache.prefill"
    )  # (the package's `prefill` is the function)
    monkeypatch.setattr(prefill_module, "forwards_run_beside", lambda: beside)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = tmp_path / "store"
    code = main(["precompute", "--model", str(model_dir), "--store", str(store), "--block-size", str(BLOCK),
                 "--json", str(inputs / "doc.txt")])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    (prompt,) = out["per_prompt"]
    assert prompt["new_blocks"] == out["blocks_in_store"] == -(-(prompt["tokens"] - beside) // BLOCK)
    assert out["bytes_on_disk"] == out["bytes_written"]


@pytest.mark.slow
def test_shared_system_prompt_is_prefilled_once(model_dir, inputs, tmp_path):
    # One chat alone, read from piped stdin with no inputs (JSONL is recognised).
    alone1 = ok_json(
        ppc(
            "precompute", "--model", model_dir, "--store", tmp_path / "one", "--block-size",
            BLOCK, "--json", stdin=(inputs / "row1.jsonl").read_text(),
        )
    )  # fmt: skip
    # The other chat alone, through the checkout's tools/precompute.py.
    alone2 = ok_json(
        ppc(
            "--model", model_dir, "--store", tmp_path / "two", "--block-size", BLOCK, "--json",
            inputs / "row2.jsonl", tool=True,
        )
    )  # fmt: skip
    # Both chats together (row 1 twice: a duplicate is skipped), in the table output.
    both = ppc(
        "precompute", "--model", model_dir, "--store", tmp_path / "both", "--block-size", BLOCK,
        inputs / "row1.jsonl", inputs / "both.jsonl",
    )  # fmt: skip
    assert both.returncode == 0, both.stderr
    rows = both.stdout.splitlines()[1:]
    in_store = next(r for r in rows if r.startswith("blocks in store (all writers)"))
    table = dict(line.rsplit(None, 1) for line in rows if line is not in_store)
    table["blocks in store"] = in_store.rsplit(None, 1)[1]
    reused = int(table["blocks reused"].replace(",", ""))
    on_disk = int(table["bytes on disk (all writers)"].replace(",", ""))
    # The second chat restored the system prompt the first one stored.
    system_blocks = 200 // BLOCK  # the system prompt is well over 200 tokens
    assert table["prompts"] == "2" and table["duplicates skipped"] == "1"
    assert reused >= system_blocks
    assert int(table["tokens restored"].replace(",", "")) >= system_blocks * BLOCK
    assert alone1["blocks_reused"] == alone2["blocks_reused"] == 0
    assert on_disk < alone1["bytes_on_disk"] + alone2["bytes_on_disk"]
    assert int(table["blocks in store"]) < alone1["blocks_in_store"] + alone2["blocks_in_store"]


# -- generate -----------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_warm_matches_cold_and_stores_the_new_prefix(filled, model_dir, tmp_path):
    store, _ = filled
    warm = ok_json(generate(model_dir, store, "--prompt", QUESTION, "--json"))
    cold = ok_json(generate(model_dir, tmp_path / "empty", "--prompt", QUESTION, "--json"))
    assert cold["restored_tokens"] == 0
    assert warm["restored_tokens"] >= 200  # the precomputed system prompt
    assert warm["prompt_tokens"] == cold["prompt_tokens"]
    assert warm["tokens"] == cold["tokens"] and len(warm["tokens"]) > 0
    # A new process: its RAM tier is empty, so the segment files served every block.
    assert warm["restored_blocks"]["disk"] > 0 and warm["restored_blocks"]["ram"] == 0
    assert cold["restored_blocks"] == {"ram": 0, "disk": 0, "remote": 0}
    assert warm["text"] == cold["text"]
    assert warm["logprobs"] == cold["logprobs"]  # float32, bit for bit
    assert warm["ttft_s"] > 0 and warm["new_blocks"] > 0

    # The same prompt again, from stdin and in text mode: the prompt was stored after
    # the first run, so all of it is restored but the last two tokens (one is fed for
    # the logits, one by the generator).
    again = generate(model_dir, store, "--prompt", "-", stdin=QUESTION)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("=" * 10 + "\n" + cold["text"] + "\n" + "=" * 10 + "\n")
    ours = again.stderr  # our table; mlx-lm's summary lines are on stdout, as mlx-lm prints them
    stats = dict(line.rsplit(None, 1) for line in ours.splitlines() if line.strip())
    assert int(stats["restored from the store"].replace(",", "")) == cold["prompt_tokens"] - 2


@pytest.mark.slow
def test_hybrid_model_resumes_from_precomputed_blocks(inputs, tmp_path):
    hybrid = write_tiny_model(tmp_path / "hybrid", seed=0, **HYBRID)
    store = tmp_path / "store"
    ok_json(
        ppc(
            "precompute", "--model", hybrid, "--store", store, "--block-size", BLOCK, "--json",
            inputs / "both.jsonl",
        )
    )  # fmt: skip
    warm = ok_json(generate(hybrid, store, "--prompt", QUESTION, "--json"))
    cold = ok_json(generate(hybrid, tmp_path / "cold", "--prompt", QUESTION, "--json"))
    # Recurrent layers resume only where a snapshot was stored: at a block boundary.
    assert warm["restored_tokens"] >= 200 and warm["restored_tokens"] % BLOCK == 0
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]


# -- mistakes -----------------------------------------------------------------------------


def _error_cases(model, store, inputs, tmp):
    """(argv, stdin, words the message must contain) for each user mistake."""
    pre = ["precompute", "--model", model, "--store", tmp / "new"]
    gen = ["generate", "--model", model, "--store", store, "--prompt", "hi"]
    return {
        "missing input": (pre + [inputs / "nope.txt"], None, ["nope.txt", "no such file"]),
        "bad jsonl line": (pre + [inputs / "bad.jsonl"], None, ["bad.jsonl:2", "invalid JSON"]),
        "empty file": (pre + [inputs / "empty.txt"], None, ["empty.txt", "empty"]),
        "empty stdin": (pre, "", ["<stdin>", "empty"]),
        "not utf-8": (pre + [inputs / "latin1.txt"], None, ["latin1.txt", "UTF-8"]),
        "input is a folder": (pre + [inputs], None, ["is a directory"]),
        "no model folder": (
            ["precompute", "--model", tmp / "no-model", "--store", tmp / "s", inputs / "doc.txt"],
            None,
            ["no-model", "no such folder"],
        ),
        "block size of another store": (
            [
                "precompute",
                "--model",
                model,
                "--store",
                store,
                "--block-size",
                32,
                inputs / "doc.txt",
            ],
            None,
            ["--block-size 16, not 32", "omit --block-size"],
        ),
        "kv-bits mismatch": (
            gen + ["--kv-bits", 4, "--kv-group-size", 32],
            None,
            ["no --kv-bits", "--kv-bits 4", "same options"],
        ),
        "empty prompt": (gen[:-1] + [""], None, ["--prompt", "empty"]),
        "store is a file": (
            ["generate", "--model", model, "--store", inputs / "doc.txt", "--prompt", "hi"],
            None,
            ["not a directory"],
        ),
        "bad max tokens": (gen + ["--max-tokens", 0], None, ["--max-tokens"]),
    }


ERROR_CASES = list(_error_cases(Path("m"), Path("s"), Path("i"), Path("t")))


@pytest.mark.slow
@pytest.mark.parametrize("case", ERROR_CASES)
def test_user_mistakes_exit_2_with_a_clear_message(case, filled, model_dir, inputs, tmp_path):
    store, _ = filled
    argv, stdin, words = _error_cases(model_dir, store, inputs, tmp_path)[case]
    proc = ppc(*argv, stdin=stdin)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for word in words:
        assert word in proc.stderr
    assert proc.stdout == ""
