"""``ppc generate`` with the model options of ``mlx_lm.generate``: ``--adapter-path``,
``--trust-remote-code``, ``--max-kv-size``, ``--draft-model``/``--num-draft-tokens``,
``--verbose``, and mlx-lm's summary lines.

Each option runs twice in real processes on one store: the second run must restore
the prompt and generate exactly what the first did (tokens and float32 log-probs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

PROMPT = (
    "The closer the shelf, the smaller it is. Why do librarians keep the most requested "
    "books on a cart beside the desk, near the door, where everyone can reach them?"
)
BLOCK = "16"


def ppc(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "generate", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def twice(model_dir, store, *extra) -> tuple[dict, dict]:
    """A cold and a warm ``--json`` run of the same prompt."""
    args = ["--model", model_dir, "--store", store, "--block-size", BLOCK, "--prompt", PROMPT]
    args += ["-m", "6", "--ignore-chat-template", "--json", *extra]
    runs = []
    for _ in range(2):
        proc = ppc(*args)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    cold, warm = runs
    assert cold["restored_tokens"] == 0 and warm["restored_tokens"] >= cold["prompt_tokens"] - 2
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
    return cold, warm


def _layouts(store) -> list[str]:
    with StoreAdmin(store, readonly=True) as admin:
        return [m["layout"] for m in admin.summary()["models"]]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A family without its own ``make_cache``: mlx-lm honours --max-kv-size there."""
    spec = {**TEST_MODEL, "family": "qwen2"}
    return write_tiny_model(tmp_path_factory.mktemp("qwen2"), seed=0, **spec)


@pytest.mark.slow
def test_max_kv_size_stores_the_rotating_cache_apart(tmp_path, qwen2_dir):
    store = tmp_path / "store"
    twice(qwen2_dir, store, "--max-kv-size", "40")  # shorter than the prompt: it wraps
    layouts = _layouts(store)
    assert len(layouts) == 1 and layouts[0].count("RotatingKVCache(max_size=40") == 2
    proc = ppc("--model", qwen2_dir, "--store", store, "--prompt", PROMPT, "-m", "6",
               "--ignore-chat-template", "--json")  # fmt: skip
    # The full cache is another layout of the same model: refused, as another --kv-bits is.
    assert proc.returncode == 2 and "holds this model's KV made with RotatingKVCache" in proc.stderr


@pytest.mark.slow
def test_max_kv_size_is_noted_where_mlx_lm_ignores_it(tmp_path, tiny_model_dir):
    # llama builds its own cache: mlx_lm.generate drops --max-kv-size there, and so do we.
    proc = ppc("--model", tiny_model_dir, "--store", tmp_path / "store", "--prompt", PROMPT,
               "-m", "2", "--max-kv-size", "40", "--quiet")  # fmt: skip
    assert proc.returncode == 0 and "note: --max-kv-size has no effect on this model" in proc.stderr
    assert "Rotating" not in _layouts(tmp_path / "store")[0]


@pytest.mark.slow
def test_draft_model_keeps_both_models_kv(tmp_path, tiny_model_dir, other_model_dir):
    store = tmp_path / "store"
    cold, _ = twice(tiny_model_dir, store, "--draft-model", other_model_dir, "--num-draft-tokens", "2")
    (layout,) = _layouts(store)
    assert layout.count("KVCache") == 4  # two layers of the model, two of the draft
    plain = ppc("--model", tiny_model_dir, "--store", tmp_path / "plain", "--prompt", PROMPT,
                "-m", "6", "--ignore-chat-template", "--json")  # fmt: skip
    # Greedy speculative decoding accepts only the model's own choices.
    assert json.loads(plain.stdout)["tokens"] == cold["tokens"]


@pytest.fixture
def adapter_dir(tmp_path, tiny_model_dir):
    """A LoRA adapter for the tiny model, as mlx_lm.lora saves one (non-zero B)."""
    model = load_tiny_model(tiny_model_dir)
    config = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, config)
    weights = {}
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if not name.endswith(("lora_a", "lora_b")):
            continue  # what mlx_lm.lora saves: the adapter's own weights only
        if name.endswith("lora_b"):
            value = mx.random.normal(value.shape, key=mx.random.key(i)) * 0.05
        weights[name] = value
    path = tmp_path / "adapter"
    path.mkdir()
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": config})
    )
    return path


@pytest.mark.slow
def test_adapter_path_is_a_model_of_its_own(tmp_path, tiny_model_dir, adapter_dir):
    store = tmp_path / "store"
    plain, _ = twice(tiny_model_dir, store)
    adapted, _ = twice(tiny_model_dir, store, "--adapter-path", adapter_dir)
    assert adapted["logprobs"] != plain["logprobs"]  # the adapter changed the model
    with StoreAdmin(store, readonly=True) as admin:
        fingerprints = {m["fingerprint"] for m in admin.summary()["models"]}
    assert len(fingerprints) == 2  # never shares a block with the plain model
    missing = ppc("--model", tiny_model_dir, "--store", store, "--prompt", "x", "--adapter-path", tmp_path / "nope")
    assert missing.returncode == 2 and "--adapter-path" in missing.stderr and "no such folder" in missing.stderr


@pytest.mark.slow
def test_trust_remote_code_is_accepted(tmp_path, tiny_model_dir):
    cold, _ = twice(tiny_model_dir, tmp_path / "store", "--trust-remote-code")
    assert cold["generation_tokens"] == 6


@pytest.mark.slow
def test_summary_lines_and_verbose(tmp_path, tiny_model_dir):
    args = ["--model", tiny_model_dir, "--store", tmp_path / "store", "--prompt", PROMPT, "-m", "4",
            "--ignore-chat-template"]  # fmt: skip
    shown = ppc(*args)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout  # mlx_lm.generate's layout: the text framed, then its summary lines
    assert re.search(r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$", out, re.M), out
    assert re.search(r"^Generation: 4 tokens, [\d.]+ tokens-per-sec$", out, re.M), out
    assert re.search(r"^Peak memory: [\d.]+ GB$", out, re.M), out
    assert "restored from the store" in shown.stderr and "Prompt:" not in shown.stderr
    quiet = ppc(*args, "--verbose", "False")
    assert quiet.returncode == 0 and quiet.stderr.strip() == ""
    assert quiet.stdout.strip() and out.startswith("=" * 10 + "\n" + quiet.stdout + "=" * 10 + "\n")
    bad = ppc(*args, "--verbose", "maybe")
    assert bad.returncode == 2 and "not a boolean" in bad.stderr


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--max-kv-size", "40", "--draft-model", "."], "--max-kv-size cannot be combined with --draft-model"),
        (["--max-kv-size", "40", "--kv-bits", "4"], "--max-kv-size cannot be combined with --kv-bits"),
        (["--max-kv-size", "0"], "--max-kv-size must be at least 1"),
    ],
)
@pytest.mark.slow
def test_combinations_that_cannot_work_are_refused(tmp_path, tiny_model_dir, extra, says):
    proc = ppc("--model", tiny_model_dir, "--store", tmp_path / "store", "--prompt", "x", *extra)
    assert proc.returncode == 2 and says in proc.stderr
    assert not (tmp_path / "store").exists()  # refused before anything was made


def _framed_text(stdout: str) -> str:
    """The text mlx_lm.generate prints between its two ``==========`` lines."""
    lines = stdout.split("\n")
    first = lines.index("=" * 10)
    last = lines.index("=" * 10, first + 1)
    return "\n".join(lines[first + 1 : last])


@pytest.mark.slow
def test_seed_samples_what_mlx_lm_samples(tmp_path, tiny_model_dir):
    """Same flags, same text: `ppc generate --seed S --temp T` cold and warm, and
    mlx-lm's own `generate` (which seeds before it loads the model)."""
    flags = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "-m", "12", "--ignore-chat-template",
             "--seed", "7", "--temp", "0.9"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    theirs = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *flags],
        capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert theirs.returncode == 0, theirs.stderr
    want = _framed_text(theirs.stdout)
    runs = [ppc(*flags, "--store", tmp_path / "store", "--block-size", BLOCK) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert _framed_text(run.stdout) == want
    other = ppc(*flags[:-4], "--seed", "8", "--temp", "0.9", "--store", tmp_path / "store")
    assert _framed_text(other.stdout) != want  # the seed is what makes them agree


def test_every_mlx_lm_generate_flag_is_taken():
    """Each option of the installed `mlx_lm generate` is one of ours (or refused by us
    with a sentence: see the next test)."""
    from mlx_lm.generate import setup_arg_parser

    from persistent_prefix_cache.cli.generate import build_parser

    ours = set(build_parser()._option_string_actions)
    theirs = {o for a in setup_arg_parser()._actions for o in a.option_strings}
    assert theirs - ours == set()


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--quantized-kv-start", "5000"], "--quantized-kv-start: only 0 is supported"),
        (["--prompt-cache-file", "x.safetensors"], "x.safetensors: no such file"),  # read, not refused
        (["--image", "a.png"], "--image is not supported"),
    ],
)
@pytest.mark.slow
def test_flags_we_cannot_honour_are_refused_with_a_reason(tmp_path, tiny_model_dir, extra, says):
    proc = ppc("--model", tiny_model_dir, "--store", tmp_path / "store", "--prompt", "x", *extra)
    assert proc.returncode == 2 and says in proc.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_xtc_and_activation_flags_sample_what_mlx_lm_samples(tmp_path, tiny_model_dir):
    flags = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "-m", "10", "--ignore-chat-template",
             "--seed", "3", "--temp", "0.8", "--xtc-probability", "0.5", "--xtc-threshold", "0.05",
             "--quantized-kv-start", "0", "--use-default-chat-template"]  # fmt: skip
    from persistent_prefix_cache.cli.generate import _mlx_lm_has

    if _mlx_lm_has("--quantize-activations"):
        flags.append("-qa")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    theirs = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *flags],
        capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert theirs.returncode == 0, theirs.stderr
    for _ in range(2):  # cold, then warm
        ours = ppc(*flags, "--store", tmp_path / "store", "--block-size", BLOCK)
        assert ours.returncode == 0, ours.stderr
        assert _framed_text(ours.stdout) == _framed_text(theirs.stdout)
