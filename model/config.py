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

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

ARCHITECTURES = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALING_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as HF `rope_scaling` names it. `default` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; use one of {ROPE_SCALING_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


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
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3-MoE)
    moe: MoeConfig | None = None  # a mixture of experts in place of each layer's MLP (llama)

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
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.moe is not None and self.arch != "llama":
            raise ValueError(f"a mixture of experts needs the llama architecture, not {self.arch}")

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included once when tied."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = d * self.num_heads * self.head_dim
        kv = 2 * d * self.num_kv_heads * self.head_dim
        if self.arch == "llama":
            mlp = 3 * d * f if self.moe is None else self.moe.params_per_layer(d, f)
            per_layer = 2 * q + kv + mlp + 2 * d + 2 * self.head_dim * self.qk_norm
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
        raise ValueError(
            f"HF model_type {model_type!r} is not supported; supported: llama, qwen2, mistral, "
            f"gpt2, {', '.join(HF_MOE_TYPES)}"
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
        if arch not in ("llama", "qwen2", "gpt2"):
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2, gpt2, "
                f"{', '.join(GGUF_MOE_ARCHS)}"
            )
        return _from_gguf(fields, arch).replace(**overrides)


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_scaling_from_hf(scaling: Mapping[str, Any] | None) -> RopeScaling:
    if not scaling:
        return RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in scaling.items() if k in known and k != "rope_type"}
    return RopeScaling(rope_type=rope_type, **kwargs)


def _from_hf_llama(hf: Mapping[str, Any]) -> ModelConfig:
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
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
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling_from_hf(hf.get("rope_scaling")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
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
