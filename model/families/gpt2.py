"""GPT-2 (the `gpt2` architecture, the GPT-3 shape): learned positions, LayerNorm, GELU, fused
qkv, and the head always tied to the embedding.

HF stores its Linear layers as Conv1D weights (`[in, out]`), with or without a `transformer.`
prefix, and may save the tied head; llama.cpp's GGUF stores `[out, in]` weights and writes the
tied head as `output.weight`, a copy of `token_embd`.

This module imports neither jax nor flax.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshserve.model.canonical import (Checkpoint, CheckpointLayout, Conversion, identity, reshaped,
                                       transposed_reshaped)
from meshserve.model.config import ModelConfig
from meshserve.model.families.common import eos_tuple, gguf_common_fields, is_hf_buffer

HF_NAMES = {
    "embed/embedding": "wte.weight",
    "pos_embed/embedding": "wpe.weight",
    "layers/attn_norm/scale": "h.{i}.ln_1.weight",
    "layers/attn_norm/bias": "h.{i}.ln_1.bias",
    "layers/attn/qkv/kernel": "h.{i}.attn.c_attn.weight",
    "layers/attn/qkv/bias": "h.{i}.attn.c_attn.bias",
    "layers/attn/o/kernel": "h.{i}.attn.c_proj.weight",
    "layers/attn/o/bias": "h.{i}.attn.c_proj.bias",
    "layers/mlp_norm/scale": "h.{i}.ln_2.weight",
    "layers/mlp_norm/bias": "h.{i}.ln_2.bias",
    "layers/mlp/up/kernel": "h.{i}.mlp.c_fc.weight",
    "layers/mlp/up/bias": "h.{i}.mlp.c_fc.bias",
    "layers/mlp/down/kernel": "h.{i}.mlp.c_proj.weight",
    "layers/mlp/down/bias": "h.{i}.mlp.c_proj.bias",
    "final_norm/scale": "ln_f.weight",
    "final_norm/bias": "ln_f.bias",
}
HF_PREFIX = "transformer."
HF_HEAD = "lm_head.weight"  # saved by HF although GPT-2 always ties it to `wte`

GGUF_NAMES = {
    "embed/embedding": "token_embd.weight",
    "pos_embed/embedding": "position_embd.weight",
    "layers/attn_norm/scale": "blk.{i}.attn_norm.weight",
    "layers/attn_norm/bias": "blk.{i}.attn_norm.bias",
    "layers/attn/qkv/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/qkv/bias": "blk.{i}.attn_qkv.bias",
    "layers/attn/o/kernel": "blk.{i}.attn_output.weight",
    "layers/attn/o/bias": "blk.{i}.attn_output.bias",
    "layers/mlp_norm/scale": "blk.{i}.ffn_norm.weight",
    "layers/mlp_norm/bias": "blk.{i}.ffn_norm.bias",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/up/bias": "blk.{i}.ffn_up.bias",
    "layers/mlp/down/kernel": "blk.{i}.ffn_down.weight",
    "layers/mlp/down/bias": "blk.{i}.ffn_down.bias",
    "final_norm/scale": "output_norm.weight",
    "final_norm/bias": "output_norm.bias",
}
GGUF_IGNORED = frozenset({"output.weight"})


# --- Config -------------------------------------------------------------------------------------


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    hidden = hf["n_embd"]
    num_heads = hf["n_head"]
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"gpt2 activation {hf['activation_function']!r} is not supported; use gelu_new"
        )
    return ModelConfig(
        name=hf.get("_name_or_path") or "gpt2",
        arch="gpt2",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        max_position_embeddings=hf.get("n_positions", 1024),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=True,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_tuple(hf.get("eos_token_id")),
    )


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    return ModelConfig(
        arch="gpt2", tie_embeddings=True,
        norm_eps=float(fields.get("gpt2.attention.layer_norm_epsilon", 1e-5)),
        **gguf_common_fields(fields, "gpt2"),
    )


# --- Tensors ------------------------------------------------------------------------------------


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    uses_prefix = HF_PREFIX + HF_NAMES["embed/embedding"] in checkpoint.names
    prefix = HF_PREFIX if uses_prefix else ""
    return CheckpointLayout(
        config=config, names={key: prefix + name for key, name in HF_NAMES.items()},
        conversions=gpt2_conversions(config, conv1d=True),
        ignored=lambda name: is_hf_buffer(name) or name == HF_HEAD)


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    return CheckpointLayout(config=config, names=GGUF_NAMES,
                            conversions=gpt2_conversions(config, conv1d=False),
                            ignored=GGUF_IGNORED.__contains__)


def gpt2_conversions(c: ModelConfig, *, conv1d: bool) -> dict[str, Conversion]:
    """Conversions from HF GPT-2 Conv1D weights (`[in, out]`) or GGUF gpt2 weights (`[out, in]`)."""
    D, F, V, P = c.hidden_size, c.intermediate_size, c.vocab_size, c.max_position_embeddings
    H, h = c.num_heads, c.head_dim

    def linear(in_dim: int, out_dim: int, *canonical: int) -> Conversion:
        if conv1d:
            return Conversion((in_dim, out_dim), reshaped(*canonical))
        return Conversion((out_dim, in_dim), transposed_reshaped(*canonical))

    return {
        "embed/embedding": Conversion((V, D), identity),
        "pos_embed/embedding": Conversion((P, D), identity),
        "layers/attn_norm/scale": Conversion((D,), identity),
        "layers/attn_norm/bias": Conversion((D,), identity),
        "layers/attn/qkv/kernel": linear(D, 3 * D, D, 3, H, h),
        "layers/attn/qkv/bias": Conversion((3 * D,), reshaped(3, H, h)),
        "layers/attn/o/kernel": linear(D, D, H, h, D),
        "layers/attn/o/bias": Conversion((D,), identity),
        "layers/mlp_norm/scale": Conversion((D,), identity),
        "layers/mlp_norm/bias": Conversion((D,), identity),
        "layers/mlp/up/kernel": linear(D, F, D, F),
        "layers/mlp/up/bias": Conversion((F,), identity),
        "layers/mlp/down/kernel": linear(F, D, F, D),
        "layers/mlp/down/bias": Conversion((D,), identity),
        "final_norm/scale": Conversion((D,), identity),
        "final_norm/bias": Conversion((D,), identity),
    }
