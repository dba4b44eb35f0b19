"""Write the mlx-lm prompt-cache files of ``tests/data/mlx_files.tar.gz`` (run once per mlx-lm version).

Each file is written by the installed mlx-lm's own ``cache_prompt`` command (run as a
subprocess), on tiny model folders from `write_tiny_model`, so the files are exactly
what users of that version hold. Run it with the python of each version, then pack::

    python tests/data/make_mlx_files.py /tmp/mlxfix        # mlx-lm 0.32.x (the project's venv)
    /tmp/venv031/bin/python tests/data/make_mlx_files.py /tmp/mlxfix   # mlx-lm 0.31.3
    tar -C /tmp/mlxfix -czf tests/data/mlx_files.tar.gz files cases.json   # not models/: tests rebuild them

(``PYTHONPATH=.`` lets a scratch venv import `write_tiny_model` from the checkout.)
Files land in ``<out>/files/<mlx-lm version>/<case>.safetensors`` (each records its model as
``models/<case>``); ``cases.json`` says how each model folder and prompt was made and the
tokens cache_prompt fed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx_lm

from persistent_prefix_cache.tiny_model import write_tiny_model

PROMPT = "A cache is a promise that the second time will be cheaper than the first."

# case: (model family, write_tiny_model arguments, extra cache_prompt arguments)
CASES = {
    "llama": ("llama", {}, []),
    # mx.quantize's groups are 32 at least: a head of 32
    "llama_kv8": ("llama", dict(hidden_size=64), ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]),
    # sliding-window layers (RotatingKVCache) that the 29-token prompt wraps, beside full ones
    "gemma3_text": (
        "gemma3_text",
        dict(extra_config=dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2)),
        [],
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
            extra_config=dict(
                linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
                mlp_only_layers=[0, 1], moe_intermediate_size=0, partial_rotary_factor=0.25,
                head_dim=16, full_attention_interval=2,
            ),
        ),
        [],
    ),
    # CacheList(ArraysCache, KVCache) per layer
    "falcon_h1": (
        "falcon_h1",
        dict(
            hidden_size=64, num_heads=4, num_kv_heads=2,
            extra_config=dict(
                head_dim=16, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16,
                mamba_n_heads=4, mamba_n_groups=1, mamba_chunk_size=32,
            ),
        ),
        [],
    ),
    # ChunkedKVCache layers (chunks of 8) beside a full one; mlx-lm 0.31 loses their length
    "llama4": (
        "llama4",
        dict(
            num_layers=4,
            extra_config=dict(text_config=dict(
                model_type="llama4_text", attention_bias=False, attention_chunk_size=8, head_dim=16,
                hidden_size=32, interleave_moe_layer_step=100, intermediate_size=64, intermediate_size_mlp=64,
                max_position_embeddings=4096, num_attention_heads=2, num_experts_per_tok=1, num_hidden_layers=4,
                num_key_value_heads=1, num_local_experts=1, rms_norm_eps=1e-5, rope_scaling=None,
                rope_theta=10000.0, use_qk_norm=True, vocab_size=512,
            )),
        ),
        [],
    ),
}  # fmt: skip
SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


def model_folder(root: Path, name: str, family: str, kwargs: dict) -> Path:
    """The tiny model of a case (written once, shared by every mlx-lm version's run), as
    ``models/<case>`` relative to `root`: cache_prompt records --model as given."""
    folder = Path("models") / name
    if not (root / folder / "config.json").exists():
        write_tiny_model(root / folder, family=family, **{**SMALL, **kwargs})
    return folder


def cache_prompt_tokens(folder: Path) -> list[int]:
    """The tokens mlx_lm.cache_prompt feeds: the chat template, the user's message left open."""
    from mlx_lm import load

    _, tokenizer = load(str(folder))
    messages = [{"role": "user", "content": PROMPT}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True))


def main(out: str) -> None:
    root = Path(out)
    files = root / "files" / mlx_lm.__version__
    files.mkdir(parents=True, exist_ok=True)
    cases_path = root / "cases.json"
    cases = json.loads(cases_path.read_text()) if cases_path.exists() else {}
    for name, (family, kwargs, extra) in CASES.items():
        folder = model_folder(root, name, family, kwargs)
        target = (files / f"{name}.safetensors").resolve()
        subprocess.run(
            [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(folder), "--prompt", PROMPT,
             "--prompt-cache-file", str(target), *extra],
            check=True, cwd=root, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        cases[name] = {
            "family": family,
            "model": {**SMALL, **kwargs},
            "cache_prompt_args": extra,
            "prompt": PROMPT,
            "tokens": cache_prompt_tokens(root / folder),
        }
    cases_path.write_text(json.dumps(cases, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
