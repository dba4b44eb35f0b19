"""Small random-weight model folders that `mlx_lm.load` opens, built offline.

Tests and the demo need a real mlx-lm model with a real tokenizer, but nothing may
come from the Hugging Face hub. `write_tiny_model` builds one from the mlx-lm model
class of a family, seeds its weights, and trains a byte-level BPE tokenizer on the
short corpus below (`DEMO_TEXT`). The same arguments always give the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, load_model

from .files import replace_beside
from .weights_hash import named_parameters

DEMO_TEXT = """\
A cache is a promise that the second time will be cheaper than the first.
When a program keeps an answer it has already worked out, it trades memory for time.
The trade is only good if the answer is asked for again before it grows stale.
Old librarians knew this long before anyone wrote a line of code.
They kept the most requested books on a cart beside the front desk.
Readers who wanted a popular novel found it there in a moment.
Rare books stayed deep in the stacks, where a walk of ten minutes was acceptable.
A computer does the same thing with fast memory close to the processor.
The closer the shelf, the smaller it is, and the more carefully it must be chosen.
Every cache needs a rule for what to throw away when it becomes full.
Some rules remove the item that was used least recently.
Others count how often each item is used and remove the least popular one.
No rule is perfect, because nobody can see which question will come next.
A library that keeps its catalogue on cards has an index of its own.
The index does not hold the books; it only tells you where each one lives.
If a card is lost, the book is still there, but nobody can find it quickly.
That is why careful systems can rebuild an index from the things it points to.
The weather in the mountains changes faster than the forecast can follow.
In the morning the sky may be clear and the air cold and still.
By noon clouds gather over the ridge and the wind begins to push at the trees.
In the afternoon a short storm may pass, with rain that drums on the roof.
Then the evening turns bright again, and the wet stones shine in the low sun.
People who live there learn to carry a coat even on a warm day.
A forecast is a kind of cache as well, a guess saved from yesterday's numbers.
It is useful until the weather moves on and the old guess no longer fits.
Good software treats its saved answers the same way a walker treats the sky.
It checks whether the answer still matches the question before trusting it.
It labels each saved item with the version of the world that produced it.
When the version changes, the item is dropped instead of quietly reused.
A small library in a quiet town once lent the same atlas to three readers a week.
The librarian kept a note of who had it and when it was due back.
On rainy days more people came in, and the reading room was full by ten.
On sunny days the room was nearly empty, and the clock seemed to tick louder.
The librarian noticed that rain brought readers just as a sale brings buyers.
So she kept the favourite books ready on wet mornings and saved herself many walks.
Her method was a cache driven by the weather, though she never called it that.
Language models also repeat work when many prompts begin with the same words.
Keeping the attention state of a shared beginning lets the next prompt start late.
The saved state must match the model, the tokens and their order exactly.
A store that outlives the process turns yesterday's effort into today's head start.
"""

_SPECIAL_TOKENS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_EOS = "<|end|>"
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)


def _train_tokenizer(vocab_size: int) -> str:
    """Train a byte-level BPE on `DEMO_TEXT` and return its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(_SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(DEMO_TEXT.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise AssertionError("trained tokenizer vocabulary exceeds vocab_size")
    return tokenizer.to_str(pretty=True)


def _write_text(path: Path, text: str) -> None:
    # Never through a link somebody put in the folder: a new file, renamed into place.
    replace_beside(str(path), lambda f: f.write(text.encode("utf-8")), mode=0o644)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    _write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# The shape the tests, the soak tool and the server tests share: 1 KV head of width 32,
# the smallest head mlx's quantizer accepts (group size 32), so kv_bits works too.
TEST_MODEL = dict(
    family="llama",
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    vocab_size=512,
    dtype="float32",
)


def write_tiny_model(
    path: str | Path,
    *,
    family: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random-weight model folder that `mlx_lm.load` can open.

    Note that this calls `mx.random.seed(seed)`, which resets MLX's global
    random state for the rest of the process.

    Args:
        path: Folder to write into; created if missing. Existing files of the
            same names are overwritten.
        family: An mlx-lm `model_type` (a module in `mlx_lm.models`).
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Number of attention (query) heads.
        num_kv_heads: Number of key/value heads.
        intermediate_size: Width of the MLP; defaults to `2 * hidden_size`.
        vocab_size: Model vocabulary size, also the tokenizer's training target.
            Must be at least 260 (256 bytes plus the special tokens).
        seed: Seed for the weight initialisation.
        dtype: Name of the stored weight dtype, e.g. "float32" or "bfloat16".
        extra_config: Keys merged into config.json last (e.g. `sliding_window`
            or `head_dim` for families that need them).

    Returns:
        The folder path.

    Raises:
        ValueError: If the family or dtype is unknown, `vocab_size` is too
            small or the family's ModelArgs still lacks required fields.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _train_tokenizer(vocab_size)
    eos_id = json.loads(tokenizer_json)["model"]["vocab"][_EOS]

    config: dict[str, Any] = {
        "model_type": family,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "head_dim": hidden_size // num_heads,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        # Explicit ids keep transformers from assuming a family's defaults.
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    config.update(extra_config or {})

    model_class, args_class = _get_classes(config)
    missing = [
        f.name
        for f in dataclasses.fields(args_class)
        if f.name not in config and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{family} also needs {missing}; pass them in extra_config")
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    target = getattr(mx, dtype, None)
    if not isinstance(target, mx.Dtype):
        raise ValueError(f"unknown MLX dtype {dtype!r}")
    weights = {k: v.astype(target) for k, v in named_parameters(model)}
    weights = dict(sorted(weights.items()))
    mx.eval(weights)
    replace_beside(
        str(folder / "model.safetensors"),
        lambda f: mx.save_safetensors(f, weights, metadata={"format": "mlx"}),
        mode=0o644,
    )

    _write_json(folder / "config.json", config)
    _write_text(folder / "tokenizer.json", tokenizer_json)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": _EOS,
            "pad_token": _EOS,
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    _write_json(folder / "special_tokens_map.json", {"eos_token": _EOS, "pad_token": _EOS})
    return folder


def load_tiny_model(path: str | Path) -> nn.Module:
    """Load only the model (no tokenizer) from a folder made by `write_tiny_model`.

    Args:
        path: The model folder.

    Returns:
        The mlx-lm model with its weights evaluated.
    """
    model, _ = load_model(Path(path))
    return model
