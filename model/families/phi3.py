"""Phi-3, Phi-3.5 and Phi-4-mini: Llama with LongRoPE (and its attention factor), partial
rotary, and a window on every layer.

HF fuses q, k and v into one `qkv_proj` and gate and up into one `gate_up_proj` (gate first);
each canonical param takes its rows. llama.cpp's GGUF keeps both fusions (`attn_qkv`,
`ffn_up`), does not permute Q and K, and carries the LongRoPE factors as two tensors, which
complete the config rather than the params.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from meshserve.model.canonical import (Checkpoint, CheckpointLayout, Conversion, fused_rows,
                                       transposed, transposed_reshaped)
from meshserve.model.config import ModelConfig, RopeScaling
from meshserve.model.families.common import gguf_get, rope_scaling_from_hf
from meshserve.model.families.llama import (gguf_llama_config, gguf_llama_layout, hf_llama_config,
                                            hf_llama_layout)

HF_NAMES = {
    "layers/attn/q/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/attn/k/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/attn/v/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/mlp/gate/kernel": "model.layers.{i}.mlp.gate_up_proj.weight",
    "layers/mlp/up/kernel": "model.layers.{i}.mlp.gate_up_proj.weight",
}
GGUF_NAMES = {
    "layers/attn/q/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/k/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/v/kernel": "blk.{i}.attn_qkv.weight",
    "layers/mlp/gate/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
}
GGUF_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


# --- Config -------------------------------------------------------------------------------------


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    original = rope.get("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings"))
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    scaling = rope_scaling_from_hf(rope, original_max=original)
    if scaling.rope_type == "longrope":
        scaling = dataclasses.replace(
            scaling, attention_factor=_longrope_attention_factor(hf, rope, scaling))
    base = hf_llama_config(dict(hf, rope_parameters=None, rope_scaling=None))
    return base.replace(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)


def _longrope_attention_factor(hf: Mapping[str, Any], rope: Mapping[str, Any],
                               s: RopeScaling) -> float:
    """HF's: the config's own, else sqrt(1 + ln(factor) / ln(original)), factor being the
    context's growth (max_position_embeddings / original) unless the config names it."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = s.original_max_position_embeddings
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    """Phi-3 without its LongRoPE factors, which are tensors (`gguf_layout` adds them)."""
    base = gguf_llama_config(fields, "phi3").replace(qkv_bias=False, tie_embeddings=False)
    rotary = int(fields.get("phi3.rope.dimension_count", base.head_dim))
    return base.replace(sliding_window=int(fields.get("phi3.attention.sliding_window", 0)),
                        partial_rotary_factor=rotary / base.head_dim)


def gguf_longrope(fields: Mapping[str, Any], short: Any, long: Any) -> RopeScaling:
    """Phi-3's LongRoPE from its GGUF: the factor tensors and the scaling metadata."""
    return RopeScaling(
        rope_type="longrope", short_factor=tuple(float(x) for x in short),
        long_factor=tuple(float(x) for x in long),
        original_max_position_embeddings=int(gguf_get(
            fields, "phi3.rope.scaling.original_context_length")),
        attention_factor=float(fields.get("phi3.rope.scaling.attn_factor", 1.0)))


# --- Tensors ------------------------------------------------------------------------------------


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    return hf_llama_layout(config, HF_NAMES, _fused_conversions(config))


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    short, long = GGUF_ROPE_FACTORS
    if short in checkpoint.names:
        config = config.replace(rope_scaling=gguf_longrope(
            fields, checkpoint.read(short).reshape(-1), checkpoint.read(long).reshape(-1)))
    return gguf_llama_layout(config, checkpoint, names=GGUF_NAMES,
                             conversions=_fused_conversions(config),
                             ignored=frozenset(GGUF_ROPE_FACTORS))


def _fused_conversions(c: ModelConfig) -> dict[str, Conversion]:
    """The fused `[out, in]` weights, each canonical param taking its rows: q, k, v of
    [(H + 2K) h, D], and gate then up of [2F, D]."""
    D, F, H, K, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    qkv, gate_up = ((H + 2 * K) * h, D), (2 * F, D)
    q_end, k_end = H * h, (H + K) * h
    return {
        "layers/attn/q/kernel": Conversion(qkv, fused_rows(0, q_end,
                                                           transposed_reshaped(D, H, h))),
        "layers/attn/k/kernel": Conversion(qkv, fused_rows(q_end, k_end,
                                                           transposed_reshaped(D, K, h))),
        "layers/attn/v/kernel": Conversion(qkv, fused_rows(k_end, qkv[0],
                                                           transposed_reshaped(D, K, h))),
        "layers/mlp/gate/kernel": Conversion(gate_up, fused_rows(0, F, transposed)),
        "layers/mlp/up/kernel": Conversion(gate_up, fused_rows(F, 2 * F, transposed)),
    }
