"""The mixtures of experts: Mixtral, Qwen2-MoE (q, k and v biases, and a shared expert behind a
sigmoid gate) and Qwen3-MoE (q/k norms). Their attention is Llama's; every layer's MLP is a
mixture (`meshserve.model.moe`), whose `intermediate_size` is the width of each expert.

HF saves one tensor per expert (`{e}` in the names below); the loader reads them as one stacked
`[E, ...]` tensor. llama.cpp's GGUF holds them stacked already (`ffn_*_exps`, `[E, out, in]`),
writes Mixtral as the `llama` architecture with `llama.expert_count` (its Q and K rows permuted,
as Llama's), and Qwen's as `qwen2moe` and `qwen3moe`.

This module imports neither jax nor flax.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshserve.model.canonical import (Checkpoint, CheckpointLayout, Conversion, reshaped,
                                       swap_last_two, transposed)
from meshserve.model.config import ModelConfig, MoeConfig
from meshserve.model.families.common import gguf_get
from meshserve.model.families.llama import (gguf_llama_config, gguf_llama_layout, hf_llama_config,
                                            hf_llama_layout, reject_rope_factors)

# Whether llama.cpp renormalises the top-k weights, per architecture, where the file does not say
# (`{arch}.expert_weights_norm`).
GGUF_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}

HF_MIXTRAL_NAMES = {
    "layers/mlp/router/kernel": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers/mlp/experts/gate": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w1.weight",
    "layers/mlp/experts/up": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w3.weight",
    "layers/mlp/experts/down": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w2.weight",
}
HF_QWEN_NAMES = {
    "layers/mlp/router/kernel": "model.layers.{i}.mlp.gate.weight",
    "layers/mlp/experts/gate": "model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight",
    "layers/mlp/experts/up": "model.layers.{i}.mlp.experts.{{e}}.up_proj.weight",
    "layers/mlp/experts/down": "model.layers.{i}.mlp.experts.{{e}}.down_proj.weight",
    "layers/mlp/shared/gate/kernel": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "layers/mlp/shared/up/kernel": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "layers/mlp/shared/down/kernel": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "layers/mlp/shared/scale/kernel": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
GGUF_NAMES = {
    "layers/mlp/router/kernel": "blk.{i}.ffn_gate_inp.weight",
    "layers/mlp/experts/gate": "blk.{i}.ffn_gate_exps.weight",
    "layers/mlp/experts/up": "blk.{i}.ffn_up_exps.weight",
    "layers/mlp/experts/down": "blk.{i}.ffn_down_exps.weight",
    "layers/mlp/shared/gate/kernel": "blk.{i}.ffn_gate_shexp.weight",
    "layers/mlp/shared/up/kernel": "blk.{i}.ffn_up_shexp.weight",
    "layers/mlp/shared/down/kernel": "blk.{i}.ffn_down_shexp.weight",
    "layers/mlp/shared/scale/kernel": "blk.{i}.ffn_gate_inp_shexp.weight",
}


# --- Config -------------------------------------------------------------------------------------


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    model_type = hf["model_type"]
    _require_all_layers_sparse(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} expert activation {hf['hidden_act']!r} is not supported; "
                         "meshserve's experts are SwiGLU (silu)")
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if model_type == "mixtral":
        moe = MoeConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                        renormalize=True)
        return hf_llama_config(hf).replace(moe=moe)
    moe = MoeConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                    renormalize=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_size=hf.get("shared_expert_intermediate_size", 0))
    return hf_llama_config(hf, window_opt_in=True).replace(
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


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    arch = fields["general.architecture"]
    p = arch + "."
    base = gguf_llama_config(fields, arch)
    width = fields.get(p + "expert_feed_forward_length") or base.intermediate_size
    moe = MoeConfig(
        num_experts=int(gguf_get(fields, p + "expert_count")),
        experts_per_token=int(gguf_get(fields, p + "expert_used_count")),
        renormalize=bool(fields.get(p + "expert_weights_norm", GGUF_RENORMALIZE[arch])),
        shared_expert_size=int(fields.get(p + "expert_shared_feed_forward_length", 0)))
    return base.replace(intermediate_size=int(width), qkv_bias=arch == "qwen2moe",
                        qk_norm=arch == "qwen3moe", moe=moe)


# --- Tensors ------------------------------------------------------------------------------------


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    names = HF_MIXTRAL_NAMES if hf.get("model_type") == "mixtral" else HF_QWEN_NAMES
    return hf_llama_layout(config, names, _expert_conversions(config, gguf=False))


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    reject_rope_factors(checkpoint)
    permuted = fields.get("general.architecture") == "llama"
    return gguf_llama_layout(config, checkpoint, permuted_qk=permuted, names=GGUF_NAMES,
                             conversions=_expert_conversions(config, gguf=True))


def _expert_conversions(c: ModelConfig, *, gguf: bool) -> dict[str, Conversion]:
    """Conversions from stacked `[E, out, in]` expert weights and `[out, in]` Linear weights."""
    D, F, E, S = c.hidden_size, c.intermediate_size, c.moe.num_experts, c.moe.shared_expert_size
    # llama.cpp keeps the shared expert's gate as a vector [D]; HF as a Linear [1, D].
    scale = Conversion((D,), reshaped(D, 1)) if gguf else Conversion((1, D), transposed)
    return {
        "layers/mlp/router/kernel": Conversion((E, D), transposed),
        "layers/mlp/experts/gate": Conversion((E, F, D), swap_last_two),
        "layers/mlp/experts/up": Conversion((E, F, D), swap_last_two),
        "layers/mlp/experts/down": Conversion((E, D, F), swap_last_two),
        "layers/mlp/shared/gate/kernel": Conversion((S, D), transposed),
        "layers/mlp/shared/up/kernel": Conversion((S, D), transposed),
        "layers/mlp/shared/down/kernel": Conversion((D, S), transposed),
        "layers/mlp/shared/scale/kernel": scale,
    }
