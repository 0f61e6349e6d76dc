"""Model families: one module per family, and `FAMILIES`, the one table that registers them.

A family module reads its models' files; it defines

    hf_config(hf) -> ModelConfig                 the config of a parsed HF config.json
    gguf_config(fields) -> ModelConfig           the config of a GGUF's metadata {key: value}
    hf_layout(config, hf, checkpoint) -> CheckpointLayout
    gguf_layout(config, fields, checkpoint) -> CheckpointLayout
                                                 which tensor fills each canonical param, and
                                                 how (`meshserve.model.canonical`)

`FAMILIES` names, for each, the HF `model_type`s and the GGUF `general.architecture`s it reads.
`config_from_hf` and `config_from_gguf` read a config through the table; the loaders
(`meshserve.model.loading`) look a file's family up the same way and do the rest (reading,
converting, checking). Adding a family is one module and one row (docs/models.md).

This package imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

from meshserve.model.canonical import Checkpoint, CheckpointLayout
from meshserve.model.config import ModelConfig
from meshserve.model.families import gemma, gpt2, llama, mixtures, phi3, qwen3


class FamilyReaders(Protocol):
    """What a family module defines (see the package docstring)."""

    def hf_config(self, hf: Mapping[str, Any]) -> ModelConfig: ...

    def gguf_config(self, fields: Mapping[str, Any]) -> ModelConfig: ...

    def hf_layout(self, config: ModelConfig, hf: Mapping[str, Any],
                  checkpoint: Checkpoint) -> CheckpointLayout: ...

    def gguf_layout(self, config: ModelConfig, fields: Mapping[str, Any],
                    checkpoint: Checkpoint) -> CheckpointLayout: ...


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    readers: FamilyReaders  # the family's module
    hf: tuple[str, ...]  # the HF `model_type`s it reads
    gguf: tuple[str, ...]  # the GGUF `general.architecture`s it reads
    # Architectures it reads when the GGUF has experts (`{arch}.expert_count`), taking them
    # from the family that reads the architecture otherwise: llama.cpp writes Mixtral as `llama`.
    gguf_with_experts: tuple[str, ...] = ()
    # HF `model_type`s it refuses, each with the reason.
    hf_refused: Mapping[str, str] = dataclasses.field(default_factory=dict)


FAMILIES: tuple[Family, ...] = (
    Family("llama", llama, hf=("llama", "mistral", "qwen2"), gguf=("llama", "qwen2")),
    Family("gpt2", gpt2, hf=("gpt2",), gguf=("gpt2",)),
    Family("qwen3", qwen3, hf=("qwen3",), gguf=("qwen3",)),
    Family("gemma", gemma, hf=("gemma2", "gemma3_text"), gguf=("gemma2", "gemma3"),
           hf_refused=gemma.HF_REFUSED),
    Family("phi3", phi3, hf=("phi3",), gguf=("phi3",)),
    Family("mixtures", mixtures, hf=("mixtral", "qwen2_moe", "qwen3_moe"),
           gguf=("qwen2moe", "qwen3moe"), gguf_with_experts=("llama",)),
)


def _by_key(keys: str) -> dict[str, Family]:
    table: dict[str, Family] = {}
    for family in FAMILIES:
        for key in getattr(family, keys):
            if key in table:
                raise ValueError(f"FAMILIES: {keys} {key!r} is claimed by both "
                                 f"{table[key].name} and {family.name}")
            table[key] = family
    return table


_HF, _GGUF, _GGUF_WITH_EXPERTS = _by_key("hf"), _by_key("gguf"), _by_key("gguf_with_experts")
_HF_REFUSED = {key: reason for family in FAMILIES for key, reason in family.hf_refused.items()}


def hf_family(hf: Mapping[str, Any]) -> Family:
    """The family that reads a parsed HF config.json; ValueError naming the supported types."""
    model_type = hf.get("model_type", "")
    if model_type in _HF_REFUSED:
        raise ValueError(_HF_REFUSED[model_type])
    if model_type not in _HF:
        raise ValueError(f"HF model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(_HF)}")
    return _HF[model_type]


def gguf_family(fields: Mapping[str, Any]) -> Family:
    """The family that reads a GGUF of these metadata; ValueError naming the supported
    architectures."""
    arch = fields.get("general.architecture")
    if arch in _GGUF_WITH_EXPERTS and fields.get(f"{arch}.expert_count"):
        return _GGUF_WITH_EXPERTS[arch]
    if arch not in _GGUF:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(_GGUF)}")
    return _GGUF[arch]


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The config of a parsed HF `config.json`, with `overrides` (any `ModelConfig` field)."""
    return hf_family(hf).readers.hf_config(hf).replace(**overrides)


def config_from_gguf(fields: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The config of a GGUF's metadata, given as a plain `{key: value}` mapping.

    GGUF metadata does not say whether embeddings are tied; the loader completes that from the
    tensor list (`gguf_layout`), as it does Phi-3's LongRoPE factors.
    """
    return gguf_family(fields).readers.gguf_config(fields).replace(**overrides)
