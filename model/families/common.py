"""What the families' readers share: reading RoPE, windows, activations and token ids out of an HF
`config.json`, the metadata keys every GGUF architecture spells alike, and the buffers HF saves
next to the weights.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from meshserve.model.config import RopeScaling

GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh")
# Buffers HF saves next to the weights: RoPE frequencies, GPT-2's causal-mask constants.
HF_BUFFER_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


# --- HF config.json -----------------------------------------------------------------------------


def rope_scaling_from_hf(scaling: Mapping[str, Any] | None, *,
                         original_max: int | None = None) -> RopeScaling:
    """`RopeScaling` from HF's `rope_scaling` (or one `rope_parameters` entry, which carries
    `rope_theta` too; it is ignored here)."""
    if not scaling:
        return RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    known = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type", "long_context"}
    kwargs = {k: v for k, v in scaling.items() if k in known and v is not None}
    for key in ("short_factor", "long_factor"):
        if key in kwargs:
            kwargs[key] = tuple(float(x) for x in kwargs[key])
    if original_max is not None:
        kwargs.setdefault("original_max_position_embeddings", original_max)
    return RopeScaling(rope_type=rope_type, **kwargs)


def hf_rope(hf: Mapping[str, Any], section: str | None = None) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from a config.json of transformers 4 (`rope_theta`, `rope_scaling`)
    or 5 (`rope_parameters`, per layer type when `section` names one)."""
    params = hf.get("rope_parameters")
    if params and section is not None:
        params = params.get(section)
    if params:
        return float(params.get("rope_theta", 10000.0)), rope_scaling_from_hf(params)
    return float(hf.get("rope_theta", 10000.0)), rope_scaling_from_hf(hf.get("rope_scaling"))


def window_fields(window: int, layer_types: tuple[str, ...]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` in their one spelling: nothing when no layer slides,
    the window alone when every layer does, both only when full and sliding layers mix."""
    if not window or (layer_types and "sliding" not in layer_types):
        return {}
    if not layer_types or "full" not in layer_types:
        return dict(sliding_window=window)
    return dict(sliding_window=window, layer_types=layer_types)


def hf_layer_types(types: Any) -> tuple[str, ...]:
    """HF's per-layer "sliding_attention" / "full_attention" as LAYER_TYPES; () for none."""
    if types is None:
        return ()
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; meshserve runs "
                         f"{sorted(names)}")
    return tuple(names[t] for t in types)


def hf_activation(hf: Mapping[str, Any], default: str) -> str:
    """The gated MLP's activation: "silu" or "gelu_tanh"."""
    name = hf.get("hidden_activation") or hf.get("hidden_act") or default
    if name == "silu":
        return "silu"
    if name in GELU_TANH_NAMES:
        return "gelu_tanh"
    raise ValueError(f"{hf.get('model_type')} activation {name!r} is not supported; meshserve's "
                     f"gated MLPs use silu or the tanh GELU ({', '.join(GELU_TANH_NAMES)})")


def is_hf_buffer(name: str) -> bool:
    return name.endswith(HF_BUFFER_SUFFIXES)


# --- GGUF metadata ------------------------------------------------------------------------------


def gguf_get(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in fields:
        return fields[key]
    if default is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return default


def gguf_common_fields(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields every GGUF architecture stores under the same keys."""
    p = arch + "."
    hidden = int(gguf_get(fields, p + "embedding_length"))
    num_heads = int(gguf_get(fields, p + "attention.head_count"))
    num_kv = int(fields.get(p + "attention.head_count_kv", num_heads))
    vocab = fields.get(p + "vocab_size") or len(gguf_get(fields, "tokenizer.ggml.tokens"))
    return dict(
        name=str(fields.get("general.name", arch)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf_get(fields, p + "feed_forward_length")),
        num_layers=int(gguf_get(fields, p + "block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=int(fields.get(p + "attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(fields.get(p + "context_length", 2048)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_tuple(fields.get("tokenizer.ggml.eos_token_id")),
    )
