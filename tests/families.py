"""Tiny random-weight models of every mlx-lm cache family, built from ``ModelArgs``.

Each builder returns a float32 model small enough for a 2-core CPU. Window sizes are
shrunk (sliding window 24, attention chunk 40) so that prompts of a few hundred tokens
wrap them several times.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_map

from persistent_prefix_cache.layers.mlx_lm_versions import CHUNKED_PIECEWISE_PREFILL, MLX_LM_VERSION

VOCAB = 256

FAMILIES = {
    # name: (module, ModelArgs overrides)
    "llama": (
        "llama",
        dict(
            model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        ),
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=VOCAB,
            query_pre_attn_scalar=16, sliding_window=24, sliding_window_pattern=3,
        ),
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            model_type="qwen3_next", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
            shared_expert_intermediate_size=0, mlp_only_layers=[0, 1], moe_intermediate_size=0,
            rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
            partial_rotary_factor=0.25, max_position_embeddings=4096, head_dim=16,
            full_attention_interval=2,
        ),
    ),
    "mamba2": (
        "mamba2",
        dict(
            model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32,
            intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
            conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
            tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank=8,
        ),
    ),
    "falcon_h1": (
        "falcon_h1",
        dict(
            model_type="falcon_h1", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            head_dim=16, num_attention_heads=4, num_key_value_heads=2, mamba_d_conv=4,
            mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4,
            mamba_n_groups=1, mamba_chunk_size=32, vocab_size=VOCAB,
        ),
    ),
    "deepseek_v32": (
        "deepseek_v32",
        dict(
            model_type="deepseek_v32", vocab_size=VOCAB, hidden_size=64, index_head_dim=16,
            index_n_heads=2, index_topk=32, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            n_routed_experts=None, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
            v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=2,
        ),
    ),
    "llama4": (
        "llama4",
        dict(
            model_type="llama4",
            text_config=dict(
                model_type="llama4_text", attention_bias=False, attention_chunk_size=40,
                head_dim=16, hidden_size=64, interleave_moe_layer_step=100,
                intermediate_size=64, intermediate_size_mlp=128, max_position_embeddings=4096,
                num_attention_heads=4, num_experts_per_tok=1, num_hidden_layers=4,
                num_key_value_heads=2, num_local_experts=1, rms_norm_eps=1e-5,
                rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, vocab_size=VOCAB,
            ),
        ),
    ),
}  # fmt: skip

# Families the installed mlx-lm cannot prefill block-aligned by itself (mlx-lm's doing, not
# the store's): skipped, with the reason, where a test needs that prefill.
BROKEN = (
    {}
    if CHUNKED_PIECEWISE_PREFILL
    else {"llama4": f"mlx-lm {MLX_LM_VERSION}'s ChunkedKVCache fails when prefilled in pieces (fixed in 0.32)"}
)
RUNNABLE = [name for name in FAMILIES if name not in BROKEN]


def family_params(names=None):
    """pytest parameters of `names` (default: every family), those in BROKEN skipped."""
    import pytest

    return [
        pytest.param(n, marks=pytest.mark.skip(reason=BROKEN[n])) if n in BROKEN else n
        for n in (FAMILIES if names is None else names)
    ]


def build(name: str, *, seed: int = 0):
    """A tiny float32 model of family `name`, deterministic in `seed`."""
    module_name, overrides = FAMILIES[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = module.ModelArgs.from_dict(overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model
