"""Qwen3: Llama with an RMSNorm over each head's q and k before RoPE (`qk_norm`), no qkv bias,
and a window only with `use_sliding_window`. Its tensors are Llama's, q/k norms included, and
its GGUF Q and K rows are not permuted.

This module imports neither jax nor flax.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshserve.model.canonical import Checkpoint, CheckpointLayout
from meshserve.model.config import ModelConfig
from meshserve.model.families.common import hf_activation
from meshserve.model.families.llama import (gguf_llama_config, gguf_llama_layout, hf_llama_config,
                                            hf_llama_layout)


def hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    return hf_llama_config(hf, window_opt_in=True).replace(
        qk_norm=True, mlp_activation=hf_activation(hf, "silu"))


def gguf_config(fields: Mapping[str, Any]) -> ModelConfig:
    return gguf_llama_config(fields, "qwen3").replace(qk_norm=True, qkv_bias=False)


def hf_layout(config: ModelConfig, hf: Mapping[str, Any], checkpoint: Checkpoint
              ) -> CheckpointLayout:
    return hf_llama_layout(config)


def gguf_layout(config: ModelConfig, fields: Mapping[str, Any], checkpoint: Checkpoint
                ) -> CheckpointLayout:
    return gguf_llama_layout(config, checkpoint)
