"""`LoraSlabs`: a runner's LoRA slabs on the devices, and the one program that loads an adapter.

The slabs (`meshserve.model.lora`) are variables of the runner's params, placed by the layout
like every weight. Loading an adapter into slot s writes row s - 1 of every slab in place: the
slabs are donated to one jitted `dynamic_update_slice` per slab whose slot is a traced int32, so
every slot and every adapter run the same program, compiled at warm-up. The adapter's arrays
travel to the devices already split like the slab rows they fill.

What a slot holds for an adapter (`slot_values`): its A [L, in..., r] and scaled B [L, r, out...]
per projection, zero-padded at the end of every axis to the slab's shape, which is exact for the
axes that can differ: the rank (up to `max_lora_rank`) and the heads (padded heads are appended,
`meshserve.sharding.head_padding`); zeros for a projection the adapter leaves alone, so nothing of
the slot's previous adapter is left.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshserve.model.executor.device_layout import DeviceLayout, to_devices
from meshserve.model.lora import LoraWeight

Weights = Mapping[str, tuple[np.ndarray, np.ndarray]]  # projection path -> (A, scaled B)


class LoraSlabs:
    def __init__(self, params: nnx.State, layout: DeviceLayout | None):
        """The slabs among `params` (a runner's placed params: their variables are updated in
        place)."""
        self.layout = layout
        self.slabs = slab_variables(params)
        assert self.slabs, "the model has no LoRA slabs"
        self.axes = tuple(slot_axis(key) for key in self.slabs)
        self.num_slots = next(iter(self.slabs.values())).shape[self.axes[0]]
        self._program: tuple[Any, Any, Any] | None = None  # (program, slot place, value places)

    def write(self, slot: int, weights: Weights) -> None:
        """Row `slot` (1..num_slots) of every slab becomes the adapter's (`slot_values`)."""
        assert 1 <= slot <= self.num_slots, slot
        program, slot_place, value_places = self.compile()
        values = tuple(slot_values(self.slabs, weights))
        written = program(self._arrays(), to_devices(np.int32(slot), slot_place),
                          to_devices(values, value_places))
        for var, value in zip(self.slabs.values(), written):
            var.set_value(value)

    def compile(self) -> tuple[Any, Any, Any]:
        """The slot write, compiled on first use (the runner's warm-up calls it)."""
        if self._program is None:
            slabs = self._arrays()
            values = tuple(np.zeros(_without(s.shape, a), s.dtype)
                           for s, a in zip(slabs, self.axes))
            write = functools.partial(write_slot, axes=self.axes)
            if self.layout is None:
                places = (None, None)
                jitted = jax.jit(write, donate_argnums=0)
            else:
                shardings = tuple(s.sharding for s in slabs)
                places = (NamedSharding(self.layout.mesh, PartitionSpec()),
                          tuple(_without_axis(s.sharding, a, s.ndim)
                                for s, a in zip(slabs, self.axes)))
                jitted = jax.jit(write, in_shardings=(shardings, *places),
                                 out_shardings=shardings, donate_argnums=0)
            program = jitted.lower(slabs, to_devices(np.int32(1), places[0]),
                                   to_devices(values, places[1])).compile()
            self._program = (program, *places)
        return self._program

    def _arrays(self) -> tuple[jax.Array, ...]:
        return tuple(var.get_value() for var in self.slabs.values())


def slab_variables(params: nnx.State) -> dict[str, LoraWeight]:
    """"layers/attn/q/lora/a" -> its variable, for every slab among `params`."""
    return {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(params)
            if isinstance(var, LoraWeight)}


def slot_axis(key: str) -> int:
    """The slot axis of slab `key`: a [L, in..., S, r] second to last, b [L, S, r, out...] 1."""
    return -2 if key.endswith("/a") else 1


def slot_values(slabs: Mapping[str, LoraWeight], weights: Weights) -> list[np.ndarray]:
    """What one slot of each slab holds for an adapter (see the module docstring), in `slabs`'
    order."""
    targets = {key.rsplit("/lora/", 1)[0] for key in slabs}
    assert set(weights) <= targets, f"no slab for {sorted(set(weights) - targets)}"
    values = []
    for key, var in slabs.items():
        target, which = key.rsplit("/lora/", 1)
        shape = _without(var.shape, slot_axis(key))
        pair = weights.get(target)
        value = np.zeros(shape, var.dtype) if pair is None else np.asarray(
            pair[which == "b"], var.dtype)
        assert value.ndim == len(shape) and all(v <= s for v, s in zip(value.shape, shape)), \
            (key, value.shape, shape)
        values.append(np.pad(value, [(0, s - v) for v, s in zip(value.shape, shape)]))
    return values


def write_slot(slabs: tuple[jax.Array, ...], slot: jax.Array, values: tuple[jax.Array, ...],
               *, axes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Each slab with its row for `slot` (traced, 1..S) replaced by the value at the same
    position; `axes` are the slabs' slot axes."""
    return tuple(
        jax.lax.dynamic_update_slice_in_dim(
            slab, jnp.expand_dims(value, axis).astype(slab.dtype), slot - 1, axis % slab.ndim)
        for slab, value, axis in zip(slabs, values, axes))


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(dim for i, dim in enumerate(shape) if i != axis % len(shape))


def _without_axis(sharding: NamedSharding, axis: int, ndim: int) -> NamedSharding:
    """`sharding` of an array of `ndim` axes, for that array less its axis `axis` (unsplit)."""
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    assert spec[axis % ndim] is None, "a slab's slot axis is never split"
    del spec[axis % ndim]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))
