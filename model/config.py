"""Model shapes: the one `ModelConfig` every part of meshserve reads.

A config is built three ways: from a named preset (`ModelConfig.preset`), from an HF `config.json`
(`meshserve.model.families.config_from_hf`), or from GGUF metadata
(`meshserve.model.families.config_from_gguf`). It is frozen and validated on construction, so a
config that exists is a config the model code can run. Nothing here knows a family's files: each
family's readers are its module in `meshserve.model.families`.

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
partial rotary, a sliding window), and Mistral's window.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
    # The llama architecture's switches; the defaults are Llama's.
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
