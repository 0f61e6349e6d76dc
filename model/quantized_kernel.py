"""A quantized kernel in the model: the weights `Dense` reads when its kernel is quantized.

A `QuantizedKernel` is a small module of weights (`values`, `scales` and optionally `mins`, and
in super groups `super_scales` and `super_mins`, in the layout of
`meshserve.model.quant_formats`), each an `nnx.Param` with logical axes, so the sharding rules,
the loaders and the checkpoints see them as ordinary weights. The codes keep the float kernel's
axes (an int4 kernel halves its last contracted axis), and grouped scales and super scales keep
them too, so a tensor-parallel split of the float kernel splits the codes and their scales alike
(`quantized_axes`).

`quantized_matmul` is the one matmul of every quantized kernel (a `Dense`'s, or one routed
expert's, which `meshserve.model.moe` slices out of its stack). Activations stay in their dtype,
and codes become values right before the dot, in the layer scan, one layer's kernel at a time
(integer scales in super groups become float32 ones there too, `group_scales`):
- int8: the layer's whole kernel is dequantized (per-channel scales multiply the dot's output
  instead) and runs as one dot. XLA:CPU writes that one layer's values to a buffer, in cache,
  before its dot; on GPUs XLA fuses the conversion into the dot.
- 5 and 6 bits: the layer's kernel is unpacked and dequantized, then one dot, as int8.
- int4: the sum runs in two halves of each group, the low nibbles (codes 0..group/2 - 1) and the
  high ones, so a kernel is unpacked with a mask and a shift, never a shuffle, and no buffer
  ever holds more than half of a layer's kernel in float (XLA:CPU runs the two halves' dots on
  separate cores).
`scripts/quant_matmul_bench.py` times both against float32; `tests/model/test_quant.py` reads the
compiled HLO to hold both layouts.

On devices a `QuantizedArray` is a pytree (its arrays the leaves, its format static), so a
stack of them can pass through `jax.shard_map` and be sliced like an array.

With `native_kernels` on (one CPU device), a grouped kernel (int8, or packed in 4, 5 or 6 bits)
runs through a native kernel instead, which reads each code once (`meshserve.model.native_dot`);
in the layer scan it reads the layer's codes from the whole stacks, in place
(`QuantizedKernel.layer`).

Which kernels of a model are quantized, and turning them so, is `meshserve.model.quantized_weights`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.model import native_dot
from meshserve.model.quant_formats import (ARRAY_NAMES, LayerMix, MixedArray, QuantFormat,
                                           QuantizedArray, dequantize, group_scales,
                                           last_contracted_axis)

jax.tree_util.register_dataclass(QuantizedArray, data_fields=list(ARRAY_NAMES),
                                 meta_fields=["format"])
jax.tree_util.register_dataclass(MixedArray, data_fields=["parts"], meta_fields=["format"])


class _HeldKernel(nnx.Module):
    """What a quantized kernel and a mixed stack share: the float kernel's shape, from the arrays
    they hold (`held`), less the layer axis while they read one layer (`layer` set)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float kernel it stands for."""
        shape = self.held().shape
        return shape if self.layer is None else shape[1:]


class QuantizedKernel(_HeldKernel):
    """The weights of one quantized kernel; `fmt` is static (part of the graph). Each array of
    `ARRAY_NAMES` is an attribute, None where the format has no such array.

    `layer` None: the arrays are the kernel's own (stacked over the layers in a model, which the
    layer scan slices). Set (an int32 scalar, traced): the arrays are every layer's kernels
    stacked, and this is layer `layer`'s of them (`read_layers_in_place`), so a native kernel
    reads that layer's codes where the stack holds them, with no copy of the layer's slice."""

    def __init__(self, q: QuantizedArray, axes: tuple[str | None, ...]):
        self.fmt = q.format
        named = quantized_axes(q.format, axes)
        for name in ARRAY_NAMES:
            array = getattr(q, name)
            setattr(self, name, None if array is None else nnx.Param(array, axes=named[name]))
        self.layer = nnx.data(None)

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The float kernel's logical axes (its codes carry them)."""
        return self.values.axes

    def held(self) -> QuantizedArray:
        """The arrays as the kernel holds them: its own, or with `layer` set every layer's."""
        return QuantizedArray.from_arrays({name: getattr(self, name)[...] for name in ARRAY_NAMES
                                           if getattr(self, name) is not None}, self.fmt)

    def array(self) -> QuantizedArray:
        """The kernel (with `layer` set, that layer's slice of the stacks)."""
        return _layer_of(self.held(), self.layer)


class MixedKernel(_HeldKernel):
    """The weights of a stack of layers' kernels of different formats (`MixedArray`): one
    `QuantizedKernel` stack per format in `parts`, and which part holds each layer (`mix`,
    static). The layer scan never slices it (`layer_stacked_kernels`): each layer sets `layer`,
    and each part's `layer` to the layer's index in that part (`read_layers_in_place`), and
    `select` runs a layer's computation on its part's kernel under one `lax.switch` over the
    parts: each branch reads one format's kernel, as a stack of one format would."""

    def __init__(self, m: MixedArray, axes: tuple[str | None, ...]):
        self.mix = m.format
        self.parts = nnx.List([QuantizedKernel(part, axes) for part in m.parts])
        self.layer = nnx.data(None)

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The float kernel's logical axes (each part's codes carry them)."""
        return self.parts[0].axes

    def held(self) -> MixedArray:
        """Every part's whole stack."""
        return MixedArray(parts=tuple(part.held() for part in self.parts), format=self.mix)

    def array(self) -> MixedArray:
        """The whole mixed stack: a layer of it is only ever read through `select`."""
        assert self.layer is None, "read a layer of a mixed stack through select"
        return self.held()

    def select(self, fn):
        """`fn(kernel)` for the kernel of layer `layer`: a `QuantizedKernel` of its part reading
        the layer where the part holds it."""
        assert self.layer is not None, "a mixed stack is read one layer at a time"
        part_of = jnp.asarray(self.mix.part_of, jnp.int32)[self.layer]
        return jax.lax.switch(part_of, [lambda part=part: fn(part) for part in self.parts])

    def read_layer(self, layer: jax.Array) -> None:
        """Makes `select` read layer `layer` (an int32 scalar): each part reads the layer's
        index in it (an index of another part's layer is in range, and never read)."""
        self.layer = layer
        index = jnp.asarray(self.mix.index, jnp.int32)[layer]
        for part in self.parts:
            part.layer = index


def with_layer_kernels(kernels, fn):
    """`fn(*arrays)` for `kernels`, each a float `nnx.Param` (its value), a `QuantizedKernel`
    (its `array()`) or a `MixedKernel` (its layer's kernel's array, through `select`: one
    switch a mixed kernel, nested)."""
    for i, kernel in enumerate(kernels):
        if isinstance(kernel, MixedKernel):
            rest = list(kernels)

            def chosen(part, i=i, rest=rest):
                rest = rest[:i] + [part] + rest[i + 1:]
                return with_layer_kernels(rest, fn)
            return kernel.select(chosen)
    return fn(*(k.array() if isinstance(k, QuantizedKernel) else k[...] for k in kernels))


def _layer_of(q: QuantizedArray, layer: jax.Array | None) -> QuantizedArray:
    """Layer `layer` of a stack of kernels (a leading layer axis); q itself for None."""
    if layer is None:
        return q
    return q.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False))


def layer_stacked_kernels(layers: nnx.Module, *, native: bool) -> frozenset[tuple]:
    """The paths in `layers` (a model's stacked layers) of the kernels the layer scan passes
    whole, each layer reading its own of them (`read_layers_in_place`): every mixed stack
    (`MixedKernel`, whose parts differ in length), and with `native` kernels the quantized
    kernels stacked over the layers alone, which a native kernel reads a layer of in place: a
    `Dense`'s, not a mixture's routed experts (stacked over the experts too, which
    `meshserve.model.moe` slices one expert at a time)."""
    graph = list(nnx.iter_graph(layers))
    mixed = frozenset(path for path, module in graph if isinstance(module, MixedKernel))
    if not native:
        return mixed
    return mixed | frozenset(
        path for path, module in graph
        if isinstance(module, QuantizedKernel)
        and module.values.ndim == 1 + module.fmt.num_contracted + module.fmt.num_out
        and not any(path[:len(m)] == m for m in mixed))


def read_layers_in_place(block: nnx.Module, kernels: frozenset[tuple], layer: jax.Array) -> None:
    """Makes the kernels at `kernels` (`layer_stacked_kernels`) of `block`, a layer merged with
    those kernels' whole stacks, read layer `layer` (an int32 scalar) of them."""
    for path, module in nnx.iter_graph(block):
        if path in kernels and isinstance(module, MixedKernel):
            module.read_layer(layer)
        elif path in kernels:
            module.layer = layer


def _per_channel_axes(axes: tuple, fmt: QuantFormat) -> tuple:
    """A kernel's axes without its contracted ones: those of per-channel scales."""
    stack = len(axes) - fmt.num_out - fmt.num_contracted
    return axes[:stack] + axes[len(axes) - fmt.num_out:]


def quantized_matmul(spec: str, x: jax.Array,
                     kernel: QuantizedKernel | MixedKernel | QuantizedArray) -> jax.Array:
    """`jnp.einsum(spec, x, dequantized kernel)`, for a spec whose contracted axes end `x` and
    begin the kernel (every `Dense` of the model, and one expert of a stack): one dot for int8
    (and 5 or 6 bits), two for int4. A kernel reading a layer of stacks (`QuantizedKernel.layer`)
    passes the native kernel the stacks and the index; every other path takes the layer's
    slice."""
    if isinstance(kernel, MixedKernel):
        return kernel.select(lambda part: quantized_matmul(spec, x, part))
    held, layer = (kernel.held(), kernel.layer) if isinstance(kernel, QuantizedKernel) \
        else (kernel, None)
    if native_dot.active():  # `native_kernels`
        with jax.named_scope(f"quantized {spec} (native)"):
            y = native_dot.matmul(spec, x, held, layer)
        if y is not None:
            return y
    q = _layer_of(held, layer)
    fmt = q.format
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    n = fmt.num_contracted
    assert lhs[-n:] == rhs[:n], f"{spec}: the contracted axes must end x and begin the kernel"
    m = next(a for a in "abcdefghijklmnopqrstuvwxyz" if a not in spec)  # the merged axis
    flat = f"{lhs[:len(lhs) - n]}{m},{m}{rhs[n:]}->{out}"
    with jax.named_scope(f"quantized {spec}"):
        if fmt.bits == 8:
            y = jnp.einsum(flat, _flat_lhs(x, n), _flat_rhs(_dequantized(q, x.dtype), n))
        elif fmt.is_packed:
            w = dequantize(q, xp=jnp).astype(x.dtype)
            y = jnp.einsum(flat, _flat_lhs(x, n), _flat_rhs(w, n))
        else:
            y = sum(jnp.einsum(flat, _flat_lhs(xh, n + 1), _flat_rhs(wh, n + 1))
                    for xh, wh in zip(_split_x(x, fmt), _dequantized_halves(q, x.dtype)))
        if fmt.group is None:  # per-channel scales multiply the output, not the weights
            y = y * q.scales.astype(y.dtype)
    return y


def _flat_lhs(x: jax.Array, k: int) -> jax.Array:
    """x [..., *c] -> [..., prod(c)], its k trailing (contracted) axes merged."""
    return x.reshape(*x.shape[:x.ndim - k], math.prod(x.shape[x.ndim - k:]))


def _flat_rhs(w: jax.Array, k: int) -> jax.Array:
    """w [*c, *out] -> [prod(c), *out], its k leading (contracted) axes merged."""
    return w.reshape(math.prod(w.shape[:k]), *w.shape[k:])


def _dequantized(q: QuantizedArray, dtype) -> jax.Array:
    """An int8 kernel's values [*c, *out] in `dtype` (per channel: its codes; the scales come
    after the dot)."""
    fmt = q.format
    if fmt.group is None:
        return q.values.astype(dtype)
    axis = q.values.ndim + last_contracted_axis(fmt)
    grouped = _split_axis(q.values, axis, fmt.group)  # [..., n, group, *out]
    scales, mins = _group_scales(q, axis, dtype)  # [..., n, 1, *out]
    return _values(grouped, scales, mins, dtype).reshape(q.values.shape)


def _split_x(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """x [..., *c] -> two halves [..., *c[:-1], n, group / 2]: each group's first and second
    half."""
    x = x.reshape(*x.shape[:-1], x.shape[-1] // fmt.group, fmt.group)
    return x[..., :fmt.group // 2], x[..., fmt.group // 2:]


def _dequantized_halves(q: QuantizedArray, dtype) -> tuple[jax.Array, jax.Array]:
    """An int4 kernel's two halves [*c[:-1], n, group / 2, *out] (its low and its high
    nibbles) as values in `dtype`."""
    fmt = q.format
    axis = q.values.ndim + last_contracted_axis(fmt)
    packed = _split_axis(q.values, axis, fmt.group // 2)  # [..., n, group / 2, *out]
    low, high = packed & 15, packed >> 4
    scales, mins = _group_scales(q, axis, dtype)  # [..., n, 1, *out]
    return tuple(_values(codes, scales, mins, dtype) for codes in (low, high))


def _group_scales(q: QuantizedArray, axis: int, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Grouped scales and mins [..., n, *out] (in super groups, their float32 products) ->
    [..., n, 1, *out] in `dtype`."""
    scales, mins = group_scales(q, jnp)
    scales = jnp.expand_dims(scales.astype(dtype), axis + 1)
    mins = None if mins is None else jnp.expand_dims(mins.astype(dtype), axis + 1)
    return scales, mins


def _split_axis(a: jax.Array, axis: int, width: int) -> jax.Array:
    return a.reshape(*a.shape[:axis], a.shape[axis] // width, width, *a.shape[axis + 1:])


def _values(codes: jax.Array, scales: jax.Array, mins: jax.Array | None, dtype) -> jax.Array:
    w = codes.astype(dtype) * scales
    return w if mins is None else w + mins


def quantized_axes(fmt: QuantFormat | LayerMix, axes: tuple[str | None, ...]
                   ) -> dict[str, tuple]:
    """The logical axes of each array of a kernel with float axes `axes` (of a mixed stack,
    every part's arrays by "parts/{part}/{name}": each part a stack over the layers like the
    whole)."""
    if isinstance(fmt, LayerMix):
        return {f"parts/{p}/{name}": a for p, part in enumerate(fmt.formats)
                for name, a in quantized_axes(part, axes).items()}
    scale_axes = axes if fmt.group is not None else _per_channel_axes(axes, fmt)
    named = {"values": axes, "scales": scale_axes}
    if fmt.has_mins:
        named["mins"] = scale_axes
    if fmt.super_group is not None:  # split like the scales: a super group holds whole groups
        named["super_scales"] = scale_axes
        if fmt.has_mins:
            named["super_mins"] = scale_axes
    return named
