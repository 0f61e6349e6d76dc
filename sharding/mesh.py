"""The device mesh: `MeshConfig(data, stage, model)` and the `jax.sharding.Mesh` it builds.

The three axes, outermost first:

    data    replicas. Each owns a slice of the batch rows and of the KV page pool, and a full copy
            of the weights (split over `model`).
    stage   pipeline stages over the layer stack: each holds a contiguous share of the layers
            and their KV pages (`meshserve.sharding.pipeline_stages`,
            `meshserve.model.executor.pipeline_runner`).
    model   tensor parallelism: heads, MLP width and vocabulary split Megatron-style.

The mesh is always three-dimensional, with size-1 axes where a strategy is off, so the same
partition specs serve every shape. Axis types are Auto: the compiler propagates shardings from
the weights, and `meshserve.sharding.rules` pins the few that matter.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from meshserve.model.config import ModelConfig

AXES = ("data", "stage", "model")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    stage: int = 1
    model: int = 1

    def __post_init__(self):
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh axis {axis} must be an int >= 1, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """`"data=2,model=4"` -> MeshConfig(data=2, stage=1, model=4); axes left out are 1."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in AXES:
                raise ValueError(f"bad mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS "
                                 f"in {AXES}, e.g. 'data=2,model=4'")
            if name in sizes:
                raise ValueError(f"bad mesh {text!r}: axis {name} is given twice")
            if not re.fullmatch(r"-?[0-9]+", value.strip()):
                raise ValueError(f"bad mesh {text!r}: size of {name} must be an integer, "
                                 f"got {value.strip()!r}")
            sizes[name] = int(value)
        return cls(**sizes)

    @classmethod
    def coerce(cls, value: "MeshConfig | str | None") -> "MeshConfig":
        if value is None:
            return cls()
        if isinstance(value, MeshConfig):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        raise TypeError(f"mesh must be a MeshConfig or a string like 'data=2,model=4', "
                        f"got {type(value).__name__}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.stage, self.model)

    @property
    def num_devices(self) -> int:
        return self.data * self.stage * self.model

    def __str__(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in zip(AXES, self.shape))

    def check_model(self, config: ModelConfig) -> None:
        """Raises ValueError, naming the fix, if this mesh cannot run `config` exactly."""
        if self.stage > config.num_layers:
            raise ValueError(f"mesh {self}: {config.name} has {config.num_layers} layers, fewer "
                             f"than its {self.stage} pipeline stages; use stage <= "
                             f"{config.num_layers}")
        # Heads that do not divide are padded (meshserve.sharding.head_padding); GPT-2 has no
        # grouped-query attention to pad within, so its heads must divide.
        if config.arch == "gpt2" and config.num_heads % self.model:
            raise ValueError(f"mesh {self}: {config.name} has {config.num_heads} heads, which do "
                             f"not divide over model={self.model}; pick a model size that divides "
                             f"{config.num_heads}")

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh on `devices` (default: the first `num_devices` of `jax.devices()`)."""
        available = jax.devices() if devices is None else list(devices)
        if devices is None and len(available) < self.num_devices:
            hint = (f"; to try it on fake CPU devices, start with XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={self.num_devices}"
                    if available[0].platform == "cpu" else "")
            raise ValueError(f"mesh {self} needs {self.num_devices} devices, but only "
                             f"{len(available)} are visible ({available[0].platform}){hint}")
        if devices is not None and len(available) != self.num_devices:
            raise ValueError(f"mesh {self} needs {self.num_devices} devices, got "
                             f"{len(available)}")
        return jax.make_mesh(self.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                             devices=available[:self.num_devices])
