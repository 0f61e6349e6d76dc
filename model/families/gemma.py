"""Gemma 2 and Gemma 3 (its text model): Llama with the (1 + w) norm, GeGLU, norms after
attention and after the MLP too (sandwich norms), embeddings scaled by sqrt(hidden),
soft-capping, a query scale of their own, and sliding-window layers among full ones (Gemma 3's
with a RoPE base of their own, unscaled; its q and k are normed as Qwen3's).

HF: `post_attention_layernorm` is Gemma's norm after attention (Llama's is the one before the
MLP). GGUF (llama.cpp's converter): norms are stored as 1 + w, Q and K rows are not permuted, and
what the metadata does not say is llama.cpp's: the window period, Gemma 3's local RoPE base, and
the query scale (head_dim, but hidden / heads for the 27B models, known by their layer count).

This module imports neither jax nor flax.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshserve.model.canonical import Checkpoint, CheckpointLayout, Conversion, identity
from meshserve.model.config import ModelConfig
from meshserve.model.families.common import hf_activation, hf_layer_types, hf_rope, window_fields
from meshserve.model.families.llama import (gguf_llama_config, gguf_llama_layout, hf_llama_config,
                                            hf_llama_layout)

# HF model types of the family's name that meshserve refuses, and why.
HF_REFUSED = {
    "gemma3": "HF model_type 'gemma3' is Gemma 3's image-text model; meshserve serves the "
              "text-only form (model_type 'gemma3_text', as in gemma-3-1b-it)",
}
# HF's defaults for keys a Gemma config.json may leave out: Gemma2Config's and
# Gemma3TextConfig's class defaults.
GEMMA_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=4096),
    "gemma3_text": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None,
                        final_logit_softcapping=None, sliding_window=4096),
}
GGUF_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}
GGUF_GEMMA3_LOCAL_THETA = 10000.0
GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

HF_NAMES = {
    "layers/post_attn_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/mlp_norm/scale": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers/post_mlp_norm/scale": "model.layers.{i}.post_feedforward_layernorm.weight",
}
GGUF_NAMES = {
    "layers/post_attn_norm/scale": "blk.{i}.post_attention_norm.weight",
    "layers/post_mlp_norm/scale": "blk.{i}.post_ffw_norm.weight",
}


# --- Config -------------------------------------------------------------------------------------


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    if hf["model_type"] == "gemma2":
        return _hf_gemma2(hf)
    return _hf_gemma3(hf)


def _hf_gemma2(hf: Mapping[str, Any]) -> ModelConfig:
    base = hf_llama_config(dict(hf, sliding_window=None), tie_default=True)
    return base.replace(**_switches(hf), **_window(hf, period=2))


def _hf_gemma3(hf: Mapping[str, Any]) -> ModelConfig:
    """Gemma 3's text model; its local layers have a RoPE base of their own, unscaled."""
    unrotated = dict(hf, sliding_window=None, rope_parameters=None, rope_scaling=None)
    base = hf_llama_config(unrotated, tie_default=True)
    theta, scaling = hf_rope(hf, "full_attention")
    if hf.get("rope_parameters"):
        local_theta, _ = hf_rope(hf, "sliding_attention")
    else:
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    period = int(hf.get("sliding_window_pattern", 6))
    return base.replace(**_switches(hf), **_window(hf, period=period), qk_norm=True,
                        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _switches(hf: Mapping[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: the (1 + w) norm, GeGLU, sandwich norms, scaled embeddings,
    soft-capping and the query scale."""
    _require_causal(hf)
    hf = GEMMA_DEFAULTS[hf["model_type"]] | dict(hf)
    return dict(
        norm_kind="rms_one_plus", mlp_activation=hf_activation(hf, "gelu_pytorch_tanh"),
        sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"] or 0),
        attn_logit_softcap=float(hf["attn_logit_softcapping"] or 0),
        final_logit_softcap=float(hf["final_logit_softcapping"] or 0))


def _require_causal(hf: Mapping[str, Any]) -> None:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{hf.get('model_type')} with use_bidirectional_attention is an encoder "
                         "(an embedding model); meshserve serves causal decoders only")


def _window(hf: Mapping[str, Any], *, period: int) -> dict[str, Any]:
    """The window and which layers use it: HF's `layer_types`, else its default, every
    `period`-th layer full and the others sliding."""
    window = int(hf.get("sliding_window", GEMMA_DEFAULTS[hf["model_type"]]["sliding_window"])
                 or 0)
    if hf.get("layer_types") is not None:
        return window_fields(window, hf_layer_types(hf["layer_types"]))
    types = tuple("full" if (i + 1) % period == 0 else "sliding"
                  for i in range(hf["num_hidden_layers"]))
    return window_fields(window, types)


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    arch = fields["general.architecture"]
    p = arch + "."
    base = gguf_llama_config(fields, arch).replace(qkv_bias=False)
    window = int(fields.get(p + "attention.sliding_window", 0))
    heads_scalar = base.hidden_size // base.num_heads
    scalar = heads_scalar if base.num_layers == GGUF_GEMMA_27B_LAYERS[arch] else base.head_dim
    if p + "attention.scale" in fields:
        scalar = float(fields[p + "attention.scale"]) ** -2
    config = base.replace(
        norm_kind="rms_one_plus", mlp_activation="gelu_tanh", sandwich_norms=True,
        scale_embeddings=True, query_pre_attn_scalar=float(scalar),
        attn_logit_softcap=float(fields.get(p + "attn_logit_softcapping", 0.0)),
        final_logit_softcap=float(fields.get(p + "final_logit_softcapping", 0.0)),
        **window_fields(window, _gguf_layer_types(fields, arch, base.num_layers)))
    if arch == "gemma3":
        local = float(fields.get("gemma3.rope.freq_base_swa", GGUF_GEMMA3_LOCAL_THETA))
        config = config.replace(qk_norm=True, local_rope_theta=local)
    return config


def _gguf_layer_types(fields: Mapping[str, Any], arch: str, num_layers: int) -> tuple[str, ...]:
    """From `{arch}.attention.sliding_window_pattern` (a period, or one bool per layer, true
    for sliding), else llama.cpp's period for the architecture."""
    pattern = fields.get(arch + ".attention.sliding_window_pattern", GGUF_GEMMA_PERIOD[arch])
    if isinstance(pattern, (list, tuple)):
        return tuple("sliding" if bool(x) else "full" for x in pattern)
    return tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(num_layers))


# --- Tensors ------------------------------------------------------------------------------------


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    return hf_llama_layout(config, HF_NAMES, _sandwich_conversions(config))


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    layout = gguf_llama_layout(config, checkpoint, names=GGUF_NAMES,
                               conversions=_sandwich_conversions(config))
    conversions = {key: _less_one(conv) if key.endswith("norm/scale") else conv
                   for key, conv in layout.conversions.items()}
    return CheckpointLayout(config=layout.config, names=layout.names, conversions=conversions,
                            ignored=layout.ignored)


def _sandwich_conversions(c: ModelConfig) -> dict[str, Conversion]:
    """The norms after attention and after the MLP: vectors, kept as they are."""
    D = c.hidden_size
    return {
        "layers/post_attn_norm/scale": Conversion((D,), identity),
        "layers/post_mlp_norm/scale": Conversion((D,), identity),
    }


def _less_one(conversion: Conversion) -> Conversion:
    """llama.cpp stores Gemma's norm weights as 1 + w; the canonical layout keeps w."""
    return Conversion(conversion.source_shape, lambda w: conversion.convert(w) - 1.0)
