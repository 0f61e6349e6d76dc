"""Splitting the layer stack over pipeline stages, exactly, whatever the layer count.

Stage s holds a contiguous share of the layers: the counts differ by at most one, the first
stages taking the extra ones (SmolLM2's 30 layers over 4 stages: 8, 8, 7, 7). Under SPMD every
stage must hold the same number of layers, so a stage with fewer real layers gets identity layers
appended to its block: layers whose weights are all zero. Such a layer adds exactly 0 to the
residual stream (its norms output 0, so its attention and MLP outputs are 0, biases included), so
the tokens do not change; it costs one layer's compute and memory (30 -> 32 layers: 7%).

A padded model is an ordinary model with more layers; `stage_layout` says which are real. What
is stacked over the real layers after that (a LoRA adapter's A and B) is padded the same way
(`StageLayout.layer_index`), and `unpadded_config` gives back the real layers' config.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.config import ModelConfig
from meshserve.model.quantized_weights import model_weights
from meshserve.model.transformer import model_from_params


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which layers each stage holds: real ones, then identity padding up to `layers_per_stage`."""

    num_stages: int
    real_layers: tuple[int, ...]  # per stage

    @property
    def layers_per_stage(self) -> int:
        return max(self.real_layers)

    @property
    def num_padded_layers(self) -> int:
        return self.num_stages * self.layers_per_stage

    @property
    def num_layers(self) -> int:
        """The real layers."""
        return sum(self.real_layers)

    def layer_index(self) -> np.ndarray:
        """[num_layers] int: where each real layer sits in the padded stack."""
        return np.array([self.padded_index(i) for i in range(self.num_layers)], np.int64)

    def padded_index(self, layer: int) -> int:
        """Where real layer `layer` sits in the padded stack."""
        stage = 0
        while layer >= self.real_layers[stage]:
            layer -= self.real_layers[stage]
            stage += 1
        return stage * self.layers_per_stage + layer


def stage_layout(num_layers: int, num_stages: int) -> StageLayout:
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the model "
                         f"has {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    return StageLayout(num_stages, tuple(base + (s < extra) for s in range(num_stages)))


def pad_layers(model: nnx.Module, num_stages: int) -> nnx.Module:
    """The same model with identity layers appended to each stage's block, so that every stage
    holds `layers_per_stage` layers. Unchanged when the stages divide the layers."""
    config = model.config
    layout = stage_layout(config.num_layers, num_stages)
    if layout.num_padded_layers == config.num_layers:
        return model
    index = layout.layer_index()

    def pad(value, axes):
        if not axes or axes[0] != "layers":
            return value
        padded = jnp.zeros((layout.num_padded_layers, *value.shape[1:]), value.dtype)
        return padded.at[index].set(value)

    return model_from_params(padded_config(config, num_stages), model_weights(model, pad))


def padded_config(config: ModelConfig, num_stages: int) -> ModelConfig:
    """`config` with the padded layer count; per-layer types follow their layers (an identity
    layer is "full": it adds 0 whatever it attends to), so each stage's share of the stack
    keeps its layers' sliding windows."""
    layout = stage_layout(config.num_layers, num_stages)
    if not config.layer_types:
        return config.replace(num_layers=layout.num_padded_layers)
    types = ["full"] * layout.num_padded_layers
    for layer, kind in enumerate(config.layer_types):
        types[layout.padded_index(layer)] = kind
    return config.replace(num_layers=layout.num_padded_layers, layer_types=tuple(types))


def unpadded_config(config: ModelConfig, layer_index: np.ndarray) -> ModelConfig:
    """The config of the real layers of a padded model `config`, which sit at `layer_index`
    (`StageLayout.layer_index`): what files written for the unpadded model (a LoRA adapter's)
    are checked against."""
    if len(layer_index) == config.num_layers:
        return config
    types = tuple(config.layer_types[i] for i in layer_index) if config.layer_types else ()
    return config.replace(num_layers=len(layer_index), layer_types=types)
