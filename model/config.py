"""Model shapes: the one `ModelConfig` every part of meshserve reads.

A config is built three ways: from a named preset (`ModelConfig.preset`), from an HF `config.json`
(`ModelConfig.from_hf`), or from GGUF metadata (`ModelConfig.from_gguf_fields`). It is frozen and
validated on construction, so a config that exists is a config the model code can run.

Two architectures share it:
- `llama`: RMSNorm, RoPE, grouped-query attention, SwiGLU; optional qkv bias (Qwen2) and tied
  embeddings (SmolLM2).
- `gpt2`: learned positions, LayerNorm, GELU, fused qkv (the GPT-3 shape).

A llama config with `moe` set swaps each layer's SwiGLU for a mixture of experts
(`meshserve.model.moe`): Mixtral, Qwen2-MoE (with its gated shared expert) and Qwen3-MoE (with
`qk_norm`, per-head q/k RMSNorms). Its `intermediate_size` is then the width of each expert.

The other dense families are `llama` with switches (the fields after `moe`): Qwen3
(q/k norms), Gemma 2 and 3 (the (1 + w) norm, GeGLU, sandwich norms, scaled embeddings,
soft-capping, sliding-window layers, Gemma 3's with a RoPE base of their own), Phi-3 (LongRoPE,
partial rotary, a sliding window), and Mistral's window. Their HF and GGUF readers are the
"Dense families" section below.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALING_TYPES = ("default", "linear", "llama3", "longrope")
NORM_KINDS = ("rms", "rms_one_plus")  # x * w, or Gemma's x * (1 + w)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU
LAYER_TYPES = ("full", "sliding")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as HF `rope_scaling` names it. `default` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE (Phi-3): per-frequency divisors for short and long contexts, and the factor that
    # scales cos and sin. Which set applies is `long_context`: as in vLLM, the long one when the
    # served context (max_model_len) exceeds original_max_position_embeddings, for every token
    # (`for_context` sets it). HF instead switches per sequence length, recomputing the cache.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    long_context: bool = False

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; use one of {ROPE_SCALING_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and (
                not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("longrope scaling needs short_factor and long_factor lists of one "
                             "length (half the rotary dimensions)")

    def for_context(self, max_model_len: int) -> "RopeScaling":
        """This scaling for a server whose sequences reach `max_model_len` tokens."""
        if self.rope_type != "longrope":
            return self
        long = max_model_len > self.original_max_position_embeddings
        return dataclasses.replace(self, long_context=long)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token's router picks `experts_per_token` of `num_experts`.

    The router's softmax runs over all experts; `renormalize` rescales the chosen k weights to sum
    to 1 (Mixtral, Qwen3-MoE) instead of keeping their softmax values (Qwen2-MoE, OLMoE). A shared
    expert (`shared_expert_size` > 0, Qwen2-MoE) is a SwiGLU every token runs, scaled by a sigmoid
    gate of its own.
    """

    num_experts: int
    experts_per_token: int
    renormalize: bool
    shared_expert_size: int = 0

    def __post_init__(self):
        for field in ("num_experts", "experts_per_token"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"moe {field} must be an int >= 1, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"moe experts_per_token ({self.experts_per_token}) must be at most "
                             f"num_experts ({self.num_experts})")
        if self.shared_expert_size < 0:
            raise ValueError(f"moe shared_expert_size must be >= 0, got {self.shared_expert_size}")

    def params_per_layer(self, hidden: int, expert_width: int) -> int:
        """Router, experts and shared expert (with its gate) of one layer."""
        shared = 3 * hidden * self.shared_expert_size + hidden if self.shared_expert_size else 0
        return hidden * self.num_experts + self.num_experts * 3 * hidden * expert_width + shared

    def active_params_per_layer(self, hidden: int, expert_width: int) -> int:
        """What one token runs: the router, its k experts and the shared expert."""
        every = self.params_per_layer(hidden, expert_width)
        idle = (self.num_experts - self.experts_per_token) * 3 * hidden * expert_width
        return every - idle


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and numerics of one model. Changing any field changes the compiled steps."""

    name: str = "custom"
    arch: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # a mixture of experts in place of each layer's MLP (llama)
    # The llama architecture's switches; the defaults are Llama's ("Dense families" below).
    norm_kind: str = "rms"  # NORM_KINDS: "rms_one_plus" scales by (1 + w), Gemma's
    mlp_activation: str = "silu"  # MLP_ACTIVATIONS: the gated MLP's, SwiGLU or GeGLU (Gemma)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2, 3)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float = 0.0  # scores scale by its -1/2 power; 0: by head_dim's (Gemma)
    attn_logit_softcap: float = 0.0  # attention scores become cap * tanh(s / cap); 0: none
    final_logit_softcap: float = 0.0  # the same on the output logits (Gemma 2); 0: none
    sliding_window: int = 0  # keys a sliding layer's query sees, its own included; 0: none
    layer_types: tuple[str, ...] = ()  # LAYER_TYPES per layer; (): all sliding if sliding_window
    local_rope_theta: float = 0.0  # RoPE base of the sliding layers, unscaled (Gemma 3); 0: same
    partial_rotary_factor: float = 1.0  # the leading share of head_dim that RoPE rotates

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch {self.arch!r} is not supported; use one of {ARCHITECTURES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {DTYPES}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.arch == "gpt2" and self.num_kv_heads != self.num_heads:
            raise ValueError("gpt2 has no grouped-query attention: num_kv_heads must equal num_heads")
        if self.arch == "llama" and self.rotary_dim % 2:
            raise ValueError(f"RoPE needs an even number of rotary dimensions, got "
                             f"{self.rotary_dim} (head_dim {self.head_dim} x "
                             f"partial_rotary_factor {self.partial_rotary_factor})")
        if self.moe is not None and self.arch != "llama":
            raise ValueError(f"a mixture of experts needs the llama architecture, not {self.arch}")
        _check_family_switches(self)

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included once when tied."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = d * self.num_heads * self.head_dim
        kv = 2 * d * self.num_kv_heads * self.head_dim
        if self.arch == "llama":
            mlp = 3 * d * f if self.moe is None else self.moe.params_per_layer(d, f)
            per_layer = 2 * q + kv + mlp + 2 * d
            per_layer += 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norms
            if self.qkv_bias:
                per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            head = 0 if self.tie_embeddings else d * v
            return v * d + self.num_layers * per_layer + d + head
        per_layer = 2 * q + kv + 2 * d * f + f + 6 * d
        per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return v * d + self.max_position_embeddings * d + self.num_layers * per_layer + 2 * d

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: all of them, less the experts its router skips."""
        if self.moe is None:
            return self.num_params
        skipped = self.moe.params_per_layer(self.hidden_size, self.intermediate_size) \
            - self.moe.active_params_per_layer(self.hidden_size, self.intermediate_size)
        return self.num_params - self.num_layers * skipped

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def query_scale(self) -> float:
        """What attention scores are multiplied by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through the sliding window."""
        if self.layer_types:
            return tuple(t == "sliding" for t in self.layer_types)
        return (self.sliding_window > 0,) * self.num_layers

    @property
    def attention_window(self) -> int:
        """The window every layer keeps to (0: some layer sees the whole context), so KV pages
        behind it are never read again."""
        return self.sliding_window if all(self.sliding_layers) else 0

    def for_context(self, max_model_len: int) -> "ModelConfig":
        """This config for a server whose sequences reach `max_model_len` tokens (LongRoPE
        picks its factors by it; nothing else depends on it)."""
        return self.replace(rope_scaling=self.rope_scaling.for_context(max_model_len))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Builds a config from a parsed HF `config.json`."""
        model_type = hf.get("model_type", "")
        if model_type in HF_MOE_TYPES:
            return _from_hf_moe(hf).replace(**overrides)
        if model_type == "gpt2":
            return _from_hf_gpt2(hf).replace(**overrides)
        if model_type in ("llama", "qwen2", "mistral"):
            return _from_hf_llama(hf).replace(**overrides)
        if model_type in HF_FAMILIES:
            return HF_FAMILIES[model_type](hf).replace(**overrides)
        if model_type == "gemma3":
            raise ValueError(
                "HF model_type 'gemma3' is Gemma 3's image-text model; meshserve serves the "
                "text-only form (model_type 'gemma3_text', as in gemma-3-1b-it)")
        raise ValueError(
            f"HF model_type {model_type!r} is not supported; supported: llama, qwen2, mistral, "
            f"gpt2, {', '.join(HF_MOE_TYPES + tuple(HF_FAMILIES))}"
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Builds a config from GGUF metadata, given as a plain `{key: value}` mapping.

        GGUF metadata does not say whether embeddings are tied; the loader knows from the tensor
        list and passes `tie_embeddings=` as an override.
        """
        arch = fields.get("general.architecture")
        if arch in GGUF_MOE_ARCHS or (arch == "llama" and fields.get("llama.expert_count")):
            return _from_gguf_moe(fields, arch).replace(**overrides)
        if arch in GGUF_FAMILIES:
            return GGUF_FAMILIES[arch](fields).replace(**overrides)
        if arch not in ("llama", "qwen2", "gpt2"):
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2, gpt2, "
                f"{', '.join(GGUF_MOE_ARCHS + tuple(GGUF_FAMILIES))}"
            )
        return _from_gguf(fields, arch).replace(**overrides)


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_scaling_from_hf(scaling: Mapping[str, Any] | None, *,
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


def _hf_rope(hf: Mapping[str, Any], section: str | None = None) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from a config.json of transformers 4 (`rope_theta`, `rope_scaling`)
    or 5 (`rope_parameters`, per layer type when `section` names one)."""
    params = hf.get("rope_parameters")
    if params and section is not None:
        params = params.get(section)
    if params:
        return float(params.get("rope_theta", 10000.0)), _rope_scaling_from_hf(params)
    return float(hf.get("rope_theta", 10000.0)), _rope_scaling_from_hf(hf.get("rope_scaling"))


# Qwen configs carry a `sliding_window` that applies only with `use_sliding_window` (Qwen1.5-MoE
# ships 32768 with it off).
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _hf_sliding(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Mistral's window (every layer), or the Qwen families' (`use_sliding_window`: layers from
    `max_window_layers` on), or the per-layer `layer_types` a transformers 5 config spells out."""
    window = hf.get("sliding_window") or 0
    if hf.get("model_type") in QWEN_TYPES and not hf.get("use_sliding_window", False):
        window = 0
    if not window:
        return {}
    types = hf.get("layer_types")
    if types is None and "max_window_layers" in hf:
        types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    return window_fields(int(window), _layer_types(types))


def window_fields(window: int, layer_types: tuple[str, ...]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` in their one spelling: nothing when no layer slides,
    the window alone when every layer does, both only when full and sliding layers mix."""
    if not window or (layer_types and "sliding" not in layer_types):
        return {}
    if not layer_types or "full" not in layer_types:
        return dict(sliding_window=window)
    return dict(sliding_window=window, layer_types=layer_types)


def _layer_types(types: Any) -> tuple[str, ...]:
    """HF's per-layer "sliding_attention" / "full_attention" as LAYER_TYPES; () for none."""
    if types is None:
        return ()
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; meshserve runs "
                         f"{sorted(names)}")
    return tuple(names[t] for t in types)


def _from_hf_llama(hf: Mapping[str, Any], *, tie_default: bool = False) -> ModelConfig:
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope_theta, rope_scaling = _hf_rope(hf)
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
        qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
        **_hf_sliding(hf),
    )


def _from_hf_gpt2(hf: Mapping[str, Any]) -> ModelConfig:
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
        eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
    )


def _gguf_get(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in fields:
        return fields[key]
    if default is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return default


def _from_gguf(fields: Mapping[str, Any], arch: str) -> ModelConfig:
    p = arch + "."
    hidden = int(_gguf_get(fields, p + "embedding_length"))
    num_heads = int(_gguf_get(fields, p + "attention.head_count"))
    num_kv = int(fields.get(p + "attention.head_count_kv", num_heads))
    vocab = fields.get(p + "vocab_size") or len(_gguf_get(fields, "tokenizer.ggml.tokens"))
    rope_type = fields.get(p + "rope.scaling.type", "none")
    scaling = RopeScaling()
    if rope_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(fields[p + "rope.scaling.factor"]))
    elif rope_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported; use none or linear")
    common = dict(
        name=str(fields.get("general.name", arch)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_gguf_get(fields, p + "feed_forward_length")),
        num_layers=int(_gguf_get(fields, p + "block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=int(fields.get(p + "attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(fields.get(p + "context_length", 2048)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(fields.get("tokenizer.ggml.eos_token_id")),
    )
    if arch == "gpt2":
        return ModelConfig(
            arch="gpt2", tie_embeddings=True,
            norm_eps=float(fields.get(p + "attention.layer_norm_epsilon", 1e-5)), **common,
        )
    return ModelConfig(
        arch="llama",
        rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,
        qkv_bias=arch == "qwen2",
        **common,
    )


# --- Dense families: Qwen3, Gemma 2, Gemma 3, Phi-3 ---------------------------------------------
#
# Each is the llama architecture with some switches on; the readers below turn an HF config.json
# or a llama.cpp GGUF's metadata into those switches.

GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh")


def _check_family_switches(c: ModelConfig) -> None:
    if c.norm_kind not in NORM_KINDS:
        raise ValueError(f"norm_kind {c.norm_kind!r} is not supported; use one of {NORM_KINDS}")
    if c.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"mlp_activation {c.mlp_activation!r} is not supported; use one of "
                         f"{MLP_ACTIVATIONS}")
    for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                  "sliding_window", "local_rope_theta"):
        if getattr(c, field) < 0:
            raise ValueError(f"{field} must be >= 0 (0 turns it off), got {getattr(c, field)}")
    if not 0 < c.partial_rotary_factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {c.partial_rotary_factor}")
    if c.layer_types and len(c.layer_types) != c.num_layers:
        raise ValueError(f"layer_types has {len(c.layer_types)} entries for {c.num_layers} layers")
    if any(t not in LAYER_TYPES for t in c.layer_types):
        raise ValueError(f"layer_types must each be one of {LAYER_TYPES}, got {c.layer_types}")
    if "sliding" in c.layer_types and not c.sliding_window:
        raise ValueError("layer_types has sliding layers but sliding_window is 0; set the window")
    if c.moe is not None and c.mlp_activation != "silu":
        raise ValueError("a mixture of experts runs SwiGLU experts: mlp_activation must be silu")
    if c.arch == "gpt2" and (c.sliding_window or c.qk_norm or c.sandwich_norms
                             or c.norm_kind != "rms" or c.mlp_activation != "silu"):
        raise ValueError("the family switches (norms, windows, activations) are the llama "
                         "architecture's; gpt2 takes none of them")
    if c.rope_scaling.rope_type == "longrope" and len(c.rope_scaling.short_factor) * 2 != \
            c.rotary_dim:
        raise ValueError(f"longrope factors have {len(c.rope_scaling.short_factor)} entries; "
                         f"the {c.rotary_dim} rotary dimensions need {c.rotary_dim // 2}")


def _hf_activation(hf: Mapping[str, Any], default: str) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or default
    if name == "silu":
        return "silu"
    if name in GELU_TANH_NAMES:
        return "gelu_tanh"
    raise ValueError(f"{hf.get('model_type')} activation {name!r} is not supported; meshserve's "
                     f"gated MLPs use silu or the tanh GELU ({', '.join(GELU_TANH_NAMES)})")


def _require_causal(hf: Mapping[str, Any]) -> None:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{hf.get('model_type')} with use_bidirectional_attention is an encoder "
                         "(an embedding model); meshserve serves causal decoders only")


def _from_hf_qwen3(hf: Mapping[str, Any]) -> ModelConfig:
    return _from_hf_llama(hf).replace(qk_norm=True, mlp_activation=_hf_activation(hf, "silu"))


# HF's defaults for keys a Gemma config.json may leave out: Gemma2Config's and
# Gemma3TextConfig's class defaults.
GEMMA_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=4096),
    "gemma3_text": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None,
                        final_logit_softcapping=None, sliding_window=4096),
}


def _gemma_switches(hf: Mapping[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: the (1 + w) norm, GeGLU, sandwich norms, scaled embeddings,
    soft-capping and the query scale."""
    _require_causal(hf)
    hf = GEMMA_DEFAULTS[hf["model_type"]] | dict(hf)
    return dict(
        norm_kind="rms_one_plus", mlp_activation=_hf_activation(hf, "gelu_pytorch_tanh"),
        sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"] or 0),
        attn_logit_softcap=float(hf["attn_logit_softcapping"] or 0),
        final_logit_softcap=float(hf["final_logit_softcapping"] or 0))


def _from_hf_gemma2(hf: Mapping[str, Any]) -> ModelConfig:
    base = _from_hf_llama(dict(hf, sliding_window=None), tie_default=True)
    return base.replace(**_gemma_switches(hf), **_gemma_window(hf, period=2))


def _from_hf_gemma3(hf: Mapping[str, Any]) -> ModelConfig:
    """Gemma 3's text model; its local layers have a RoPE base of their own, unscaled."""
    unrotated = dict(hf, sliding_window=None, rope_parameters=None, rope_scaling=None)
    base = _from_hf_llama(unrotated, tie_default=True)
    theta, scaling = _hf_rope(hf, "full_attention")
    if hf.get("rope_parameters"):
        local_theta, _ = _hf_rope(hf, "sliding_attention")
    else:
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    period = int(hf.get("sliding_window_pattern", 6))
    return base.replace(**_gemma_switches(hf), **_gemma_window(hf, period=period), qk_norm=True,
                        rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _gemma_window(hf: Mapping[str, Any], *, period: int) -> dict[str, Any]:
    """The window and which layers use it: HF's `layer_types`, else its default, every
    `period`-th layer full and the others sliding."""
    window = int(hf.get("sliding_window", GEMMA_DEFAULTS[hf["model_type"]]["sliding_window"])
                 or 0)
    if hf.get("layer_types") is not None:
        return window_fields(window, _layer_types(hf["layer_types"]))
    types = tuple("full" if (i + 1) % period == 0 else "sliding"
                  for i in range(hf["num_hidden_layers"]))
    return window_fields(window, types)


def _from_hf_phi3(hf: Mapping[str, Any]) -> ModelConfig:
    """Phi-3, Phi-3.5 and Phi-4-mini: LongRoPE with its attention factor, partial rotary, a
    window on every layer. Fused qkv and gate_up weights are split by the loader."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    original = rope.get("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings"))
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    scaling = _rope_scaling_from_hf(rope, original_max=original)
    if scaling.rope_type == "longrope":
        scaling = dataclasses.replace(
            scaling, attention_factor=_longrope_attention_factor(hf, rope, scaling))
    base = _from_hf_llama(dict(hf, rope_parameters=None, rope_scaling=None))
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


HF_FAMILIES = {"qwen3": _from_hf_qwen3, "gemma2": _from_hf_gemma2,
               "gemma3_text": _from_hf_gemma3, "phi3": _from_hf_phi3}


# llama.cpp fixes what these GGUF files do not say: Gemma's sliding-window period, Gemma 3's
# local RoPE base, and Gemma's query scale (head_dim, but hidden / heads for the 27B models,
# which llama.cpp recognises by their layer count).
GGUF_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}
GGUF_GEMMA3_LOCAL_THETA = 10000.0
GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _from_gguf_qwen3(fields: Mapping[str, Any]) -> ModelConfig:
    return _from_gguf(fields, "qwen3").replace(qk_norm=True, qkv_bias=False)


def _from_gguf_gemma(fields: Mapping[str, Any], arch: str) -> ModelConfig:
    p = arch + "."
    base = _from_gguf(fields, arch).replace(qkv_bias=False)
    window = int(fields.get(p + "attention.sliding_window", 0))
    heads_scalar = base.hidden_size // base.num_heads
    scalar = heads_scalar if base.num_layers == GGUF_GEMMA_27B_LAYERS[arch] else base.head_dim
    if p + "attention.scale" in fields:
        scalar = float(fields[p + "attention.scale"]) ** -2
    return base.replace(
        norm_kind="rms_one_plus", mlp_activation="gelu_tanh", sandwich_norms=True,
        scale_embeddings=True, query_pre_attn_scalar=float(scalar),
        attn_logit_softcap=float(fields.get(p + "attn_logit_softcapping", 0.0)),
        final_logit_softcap=float(fields.get(p + "final_logit_softcapping", 0.0)),
        **window_fields(window, _gguf_layer_types(fields, arch, base.num_layers)))


def _gguf_layer_types(fields: Mapping[str, Any], arch: str, num_layers: int) -> tuple[str, ...]:
    """From `{arch}.attention.sliding_window_pattern` (a period, or one bool per layer, true
    for sliding), else llama.cpp's period for the architecture."""
    pattern = fields.get(arch + ".attention.sliding_window_pattern", GGUF_GEMMA_PERIOD[arch])
    if isinstance(pattern, (list, tuple)):
        return tuple("sliding" if bool(x) else "full" for x in pattern)
    return tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(num_layers))


def _from_gguf_gemma3(fields: Mapping[str, Any]) -> ModelConfig:
    local = float(fields.get("gemma3.rope.freq_base_swa", GGUF_GEMMA3_LOCAL_THETA))
    return _from_gguf_gemma(fields, "gemma3").replace(qk_norm=True, local_rope_theta=local)


def _from_gguf_phi3(fields: Mapping[str, Any]) -> ModelConfig:
    """Phi-3 without its LongRoPE factors, which are tensors: the loader adds them."""
    base = _from_gguf(fields, "phi3").replace(qkv_bias=False, tie_embeddings=False)
    rotary = int(fields.get("phi3.rope.dimension_count", base.head_dim))
    return base.replace(sliding_window=int(fields.get("phi3.attention.sliding_window", 0)),
                        partial_rotary_factor=rotary / base.head_dim)


def gguf_longrope(fields: Mapping[str, Any], short: Any, long: Any) -> RopeScaling:
    """Phi-3's LongRoPE from its GGUF: the factor tensors and the scaling metadata."""
    return RopeScaling(
        rope_type="longrope", short_factor=tuple(float(x) for x in short),
        long_factor=tuple(float(x) for x in long),
        original_max_position_embeddings=int(_gguf_get(
            fields, "phi3.rope.scaling.original_context_length")),
        attention_factor=float(fields.get("phi3.rope.scaling.attn_factor", 1.0)))


GGUF_FAMILIES = {"qwen3": _from_gguf_qwen3,
                 "gemma2": lambda fields: _from_gguf_gemma(fields, "gemma2"),
                 "gemma3": _from_gguf_gemma3, "phi3": _from_gguf_phi3}


def _llama2(name: str, hidden: int, ffw: int, layers: int, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        name=name, arch="llama", vocab_size=32000, hidden_size=hidden, intermediate_size=ffw,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=4096, rope_theta=10000.0, norm_eps=1e-5, bos_token_id=1,
        eos_token_ids=(2,),
    )


def _gpt(name: str, hidden: int, layers: int, heads: int, vocab: int, positions: int) -> ModelConfig:
    return ModelConfig(
        name=name, arch="gpt2", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=positions, tie_embeddings=True, bos_token_id=50256,
        eos_token_ids=(50256,),
    )


def _small_mixtral(name: str, *, intermediate_size: int, moe: MoeConfig | None) -> ModelConfig:
    return ModelConfig(
        name=name, arch="llama", vocab_size=8192, hidden_size=512,
        intermediate_size=intermediate_size, num_layers=8, num_heads=8, num_kv_heads=4,
        head_dim=64, max_position_embeddings=2048, rope_theta=1e6, norm_eps=1e-5,
        eos_token_ids=(2,), moe=moe)


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        name="tiny-llama", arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=10000.0, norm_eps=1e-5, eos_token_ids=(1,),
    ),
    "tiny-gpt2": _gpt("tiny-gpt2", hidden=64, layers=2, heads=4, vocab=512, positions=1024),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", arch="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-2-7b": _llama2("llama-2-7b", 4096, 11008, 32, 32, 32),
    # Llama-2-7B's widths with 4 of its 32 layers: real layer sizes in 4.3 GB of f32, for
    # stress runs on a CPU (the full model is 27 GB in f32).
    "llama-2-7b-4l": _llama2("llama-2-7b-4l", 4096, 11008, 4, 32, 32),
    "llama-2-13b": _llama2("llama-2-13b", 5120, 13824, 40, 40, 40),
    "llama-2-70b": _llama2("llama-2-70b", 8192, 28672, 80, 64, 8),
    "gpt2": _gpt("gpt2", hidden=768, layers=12, heads=12, vocab=50257, positions=1024),
    "gpt2-medium": _gpt("gpt2-medium", hidden=1024, layers=24, heads=16, vocab=50257, positions=1024),
    "gpt3-175b": _gpt("gpt3-175b", hidden=12288, layers=96, heads=96, vocab=50257, positions=2048),
    # Mixtures of experts (model/moe.py): tiny-llama's shape with 4 experts of which each token
    # runs 2, and Mixtral-8x7B's published shape (mistralai/Mixtral-8x7B-v0.1 config.json).
    "tiny-mixtral": ModelConfig(
        name="tiny-mixtral", arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=10000.0, norm_eps=1e-5, eos_token_ids=(1,),
        moe=MoeConfig(num_experts=4, experts_per_token=2, renormalize=True),
    ),
    # A mixture big enough for its matmuls to count on a CPU, and its dense twin: one MLP as wide
    # as the two experts a token runs, so both run the same active parameters (less the router).
    "small-mixtral": _small_mixtral("small-mixtral", intermediate_size=1024, moe=MoeConfig(
        num_experts=8, experts_per_token=2, renormalize=True)),
    "small-mixtral-dense": _small_mixtral("small-mixtral-dense", intermediate_size=2048,
                                          moe=None),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", arch="llama", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=32768, rope_theta=1e6, norm_eps=1e-5, bos_token_id=1,
        eos_token_ids=(2,), moe=MoeConfig(num_experts=8, experts_per_token=2, renormalize=True),
    ),
}


def bytes_per_element(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of all weights at the config's dtype."""
    return config.num_params * bytes_per_element(config.dtype)


def kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    per_layer = 2 * config.num_kv_heads * config.head_dim * bytes_per_element(config.dtype)
    return per_layer * config.num_layers


# --- Mixtures of experts ------------------------------------------------------------------------

# HF model types whose layers are all sparse: attention as in `llama` (Qwen2-MoE with qkv bias),
# and a mixture of experts for the MLP.
HF_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# GGUF architectures of llama.cpp's converter for them; Mixtral is `llama` with `expert_count`.
GGUF_MOE_ARCHS = ("qwen2moe", "qwen3moe")
# Whether llama.cpp renormalises the top-k weights, per architecture, where the file does not say
# (`{arch}.expert_weights_norm`).
GGUF_MOE_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def _from_hf_moe(hf: Mapping[str, Any]) -> ModelConfig:
    model_type = hf["model_type"]
    _require_all_layers_sparse(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} expert activation {hf['hidden_act']!r} is not supported; "
                         "meshserve's experts are SwiGLU (silu)")
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if model_type == "mixtral":
        moe = MoeConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                        renormalize=True)
        return _from_hf_llama(hf).replace(moe=moe)
    moe = MoeConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                    renormalize=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_size=hf.get("shared_expert_intermediate_size", 0))
    return _from_hf_llama(hf).replace(
        intermediate_size=hf["moe_intermediate_size"], moe=moe,
        qkv_bias=model_type == "qwen2_moe" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3_moe")


def _require_all_layers_sparse(hf: Mapping[str, Any]) -> None:
    """meshserve stacks identical layers, so a dense MLP between sparse ones cannot be run."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(
            f"{hf['model_type']} config has dense MLP layers among the sparse ones "
            f"(decoder_sparse_step={step}, mlp_only_layers={list(dense)}); meshserve runs a "
            "stack of identical layers, so every layer must be sparse (decoder_sparse_step=1, "
            "mlp_only_layers=[])")


def _from_gguf_moe(fields: Mapping[str, Any], arch: str) -> ModelConfig:
    base = _from_gguf(fields, arch)
    p = arch + "."
    width = fields.get(p + "expert_feed_forward_length") or base.intermediate_size
    return base.replace(intermediate_size=int(width), qkv_bias=arch == "qwen2moe",
                        qk_norm=arch == "qwen3moe", moe=_gguf_moe(fields, arch))


def _gguf_moe(fields: Mapping[str, Any], arch: str) -> MoeConfig:
    p = arch + "."
    return MoeConfig(
        num_experts=int(_gguf_get(fields, p + "expert_count")),
        experts_per_token=int(_gguf_get(fields, p + "expert_used_count")),
        renormalize=bool(fields.get(p + "expert_weights_norm", GGUF_MOE_RENORMALIZE[arch])),
        shared_expert_size=int(fields.get(p + "expert_shared_feed_forward_length", 0)))
