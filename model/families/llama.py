"""Llama, and the dense models that are Llama to meshserve: Mistral (a window on every layer),
SmolLM2 (tied embeddings) and Qwen2 (q, k and v biases; a window only with
`use_sliding_window`).

It is also the base of every other family of the llama architecture: `hf_llama_config` and
`gguf_llama_config` read what they all share, and `hf_llama_layout` / `gguf_llama_layout` give
Llama's tensor names and conversions, to which a family adds its own.

GGUF: llama.cpp's converter permutes the Q and K rows of `llama` files (not of `qwen2` ones) for
its interleaved RoPE; `unpermute_rows` restores HF's rotate_half layout. A GGUF says whether
the head is tied by having `output.weight` or not.

This module imports neither jax nor flax.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshserve.model.canonical import (Checkpoint, CheckpointLayout, Conversion, Convert, identity,
                                       reshaped, transposed, transposed_reshaped)
from meshserve.model.config import ModelConfig, RopeScaling
from meshserve.model.families.common import (eos_tuple, gguf_common_fields, hf_layer_types, hf_rope,
                                             is_hf_buffer, window_fields)

HF_NAMES = {
    "embed/embedding": "model.embed_tokens.weight",
    "layers/attn_norm/scale": "model.layers.{i}.input_layernorm.weight",
    "layers/attn/q/kernel": "model.layers.{i}.self_attn.q_proj.weight",
    "layers/attn/k/kernel": "model.layers.{i}.self_attn.k_proj.weight",
    "layers/attn/v/kernel": "model.layers.{i}.self_attn.v_proj.weight",
    "layers/attn/q_norm/scale": "model.layers.{i}.self_attn.q_norm.weight",
    "layers/attn/k_norm/scale": "model.layers.{i}.self_attn.k_norm.weight",
    "layers/attn/q/bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers/attn/k/bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers/attn/v/bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers/attn/o/kernel": "model.layers.{i}.self_attn.o_proj.weight",
    "layers/mlp_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/mlp/gate/kernel": "model.layers.{i}.mlp.gate_proj.weight",
    "layers/mlp/up/kernel": "model.layers.{i}.mlp.up_proj.weight",
    "layers/mlp/down/kernel": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm/scale": "model.norm.weight",
    "lm_head/kernel": "lm_head.weight",
}

GGUF_NAMES = {
    "embed/embedding": "token_embd.weight",
    "layers/attn_norm/scale": "blk.{i}.attn_norm.weight",
    "layers/attn/q/kernel": "blk.{i}.attn_q.weight",
    "layers/attn/k/kernel": "blk.{i}.attn_k.weight",
    "layers/attn/v/kernel": "blk.{i}.attn_v.weight",
    "layers/attn/q_norm/scale": "blk.{i}.attn_q_norm.weight",
    "layers/attn/k_norm/scale": "blk.{i}.attn_k_norm.weight",
    "layers/attn/q/bias": "blk.{i}.attn_q.bias",
    "layers/attn/k/bias": "blk.{i}.attn_k.bias",
    "layers/attn/v/bias": "blk.{i}.attn_v.bias",
    "layers/attn/o/kernel": "blk.{i}.attn_output.weight",
    "layers/mlp_norm/scale": "blk.{i}.ffn_norm.weight",
    "layers/mlp/gate/kernel": "blk.{i}.ffn_gate.weight",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/down/kernel": "blk.{i}.ffn_down.weight",
    "final_norm/scale": "output_norm.weight",
    "lm_head/kernel": "output.weight",
}
# Llama 3.1-style per-dimension RoPE factors, which meshserve does not read from GGUF.
GGUF_ROPE_FACTORS = "rope_freqs.weight"


# --- Config -------------------------------------------------------------------------------------


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    qwen2 = hf.get("model_type") == "qwen2"
    config = hf_llama_config(hf, window_opt_in=qwen2)
    return config.replace(qkv_bias=True) if qwen2 else config


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    arch = fields.get("general.architecture")
    return gguf_llama_config(fields, arch).replace(qkv_bias=arch == "qwen2")


def hf_llama_config(hf: Mapping[str, Any], *, tie_default: bool = False,
                    window_opt_in: bool = False) -> ModelConfig:
    """The fields every llama-architecture config.json spells alike. `window_opt_in`: the
    config's `sliding_window` applies only with `use_sliding_window` (the Qwen families:
    Qwen1.5-MoE ships 32768 with it off)."""
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope_theta, rope_scaling = hf_rope(hf)
    return ModelConfig(
        name=hf.get("_name_or_path") or hf.get("model_type", "llama"),
        arch="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_tuple(hf.get("eos_token_id")),
        **_hf_sliding(hf, opt_in=window_opt_in),
    )


def _hf_sliding(hf: Mapping[str, Any], *, opt_in: bool) -> dict[str, Any]:
    """Mistral's window (every layer), or an opt-in one (`use_sliding_window`: layers from
    `max_window_layers` on), or the per-layer `layer_types` a transformers 5 config spells out."""
    window = hf.get("sliding_window") or 0
    if opt_in and not hf.get("use_sliding_window", False):
        window = 0
    if not window:
        return {}
    types = hf.get("layer_types")
    if types is None and "max_window_layers" in hf:
        types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    return window_fields(int(window), hf_layer_types(types))


def gguf_llama_config(fields: Mapping[str, Any], arch: str) -> ModelConfig:
    """The fields every llama-architecture GGUF spells alike (under `{arch}.`); the head is
    tied until the tensors say otherwise (`gguf_llama_layout`)."""
    p = arch + "."
    rope_type = fields.get(p + "rope.scaling.type", "none")
    scaling = RopeScaling()
    if rope_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(fields[p + "rope.scaling.factor"]))
    elif rope_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported; use none or linear")
    return ModelConfig(
        arch="llama",
        rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,
        **gguf_common_fields(fields, arch),
    )


# --- Tensors ------------------------------------------------------------------------------------


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    return hf_llama_layout(config)


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    reject_rope_factors(checkpoint)
    permuted = fields.get("general.architecture") == "llama"
    return gguf_llama_layout(config, checkpoint, permuted_qk=permuted)


def hf_llama_layout(config: ModelConfig, names: Mapping[str, str] | None = None,
                    conversions: Mapping[str, Conversion] | None = None) -> CheckpointLayout:
    """Llama's HF names and conversions, updated by a family's `names` and `conversions`.
    Buffers are ignored, and the head when tied (then it is a copy of the embedding)."""
    head = HF_NAMES["lm_head/kernel"]

    def ignored(name: str) -> bool:
        return is_hf_buffer(name) or (config.tie_embeddings and name == head)

    return CheckpointLayout(
        config=config, names=HF_NAMES | dict(names or {}),
        conversions=llama_conversions(config, permuted_qk=False) | dict(conversions or {}),
        ignored=ignored)


def gguf_llama_layout(config: ModelConfig, checkpoint: Checkpoint, *, permuted_qk: bool = False,
                      names: Mapping[str, str] | None = None,
                      conversions: Mapping[str, Conversion] | None = None,
                      ignored: frozenset[str] = frozenset()) -> CheckpointLayout:
    """Llama's GGUF names and conversions, updated by a family's, with the head tied unless
    the file has `output.weight`."""
    tied = GGUF_NAMES["lm_head/kernel"] not in checkpoint.names
    config = config.replace(tie_embeddings=tied)
    return CheckpointLayout(
        config=config, names=GGUF_NAMES | dict(names or {}),
        conversions=llama_conversions(config, permuted_qk=permuted_qk) | dict(conversions or {}),
        ignored=ignored.__contains__)


def llama_conversions(c: ModelConfig, *, permuted_qk: bool) -> dict[str, Conversion]:
    """Conversions from `[out, in]` Linear weights (HF, and GGUF after dequantizing)."""
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    H, K, h = c.num_heads, c.num_kv_heads, c.head_dim
    q, k = transposed_reshaped(D, H, h), transposed_reshaped(D, K, h)
    if permuted_qk:
        q, k = _unpermuted(H, q), _unpermuted(K, k)
    return {
        "embed/embedding": Conversion((V, D), identity),
        "layers/attn_norm/scale": Conversion((D,), identity),
        "layers/attn/q/kernel": Conversion((H * h, D), q),
        "layers/attn/k/kernel": Conversion((K * h, D), k),
        "layers/attn/v/kernel": Conversion((K * h, D), transposed_reshaped(D, K, h)),
        "layers/attn/q_norm/scale": Conversion((h,), identity),
        "layers/attn/k_norm/scale": Conversion((h,), identity),
        "layers/attn/q/bias": Conversion((H * h,), reshaped(H, h)),
        "layers/attn/k/bias": Conversion((K * h,), reshaped(K, h)),
        "layers/attn/v/bias": Conversion((K * h,), reshaped(K, h)),
        "layers/attn/o/kernel": Conversion((D, H * h), transposed_reshaped(H, h, D)),
        "layers/mlp_norm/scale": Conversion((D,), identity),
        "layers/mlp/gate/kernel": Conversion((F, D), transposed),
        "layers/mlp/up/kernel": Conversion((F, D), transposed),
        "layers/mlp/down/kernel": Conversion((D, F), transposed),
        "final_norm/scale": Conversion((D,), identity),
        "lm_head/kernel": Conversion((V, D), transposed),
    }


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute(w, n_heads)` of Q/K rows: interleaved RoPE -> rotate_half.

    llama.cpp reorders each head's rows from `(2, h/2)` to `(h/2, 2)`; this reorders them back.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(n_heads: int, then: Convert) -> Convert:
    return lambda w: then(unpermute_rows(w, n_heads))


def reject_rope_factors(checkpoint: Checkpoint) -> None:
    if GGUF_ROPE_FACTORS in checkpoint.names:
        raise ValueError(
            f"{checkpoint.origin} carries per-dimension RoPE frequency factors "
            f"({GGUF_ROPE_FACTORS!r}, Llama 3.1-style scaling), which meshserve does not read "
            "from GGUF; load the HF safetensors checkpoint of this model instead."
        )
