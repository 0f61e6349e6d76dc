"""Quantized kernels in the model: the weights `Dense` reads when its kernel is quantized.

A `QuantizedKernel` is a small module of weights (`values`, `scales` and optionally `mins`, in the
layout of `meshserve.model.quantization`), each an `nnx.Param` with logical axes, so the sharding
rules, the loaders and the checkpoints see them as ordinary weights. The codes keep the float
kernel's axes (an int4 kernel halves its last contracted axis), and grouped scales keep them too,
so a tensor-parallel split of the float kernel splits the codes and their scales alike.

`quantized_matmul` is the one matmul of every quantized kernel. Activations stay in their dtype,
and codes become values right before the dot, in the layer scan, one layer's kernel at a time:
- int8: the layer's whole kernel is dequantized (per-channel scales multiply the dot's output
  instead) and runs as one dot. XLA:CPU writes that one layer's values to a buffer, in cache,
  before its dot; on GPUs XLA fuses the conversion into the dot.
- int4: the sum runs in two halves of each group, the low nibbles (codes 0..group/2 - 1) and the
  high ones, so a kernel is unpacked with a mask and a shift, never a shuffle, and no buffer
  ever holds more than half of a layer's kernel in float (XLA:CPU runs the two halves' dots on
  separate cores).
`scripts/quant_matmul_bench.py` measures SmolLM2's down projection in a 30-layer scan on a
2-core CPU (ms of CPU time at 1 / 16 / 128 rows): float32 6.0 / 9.9 / 39.3, int8 3.4 / 6.7 /
38.0, int4 2.9 / 7.6 / 41.8; an int8 kernel split into halves too measured 5.5 / 11.0 / 40.8.
`tests/model/test_quant.py` reads the compiled HLO to hold both layouts.

`quantize_model` turns a float model's kernels into quantized ones in place (load-time
quantization of weights already on a device); `install` puts loaded `QuantizedArray`s into a
model's structure.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.quantization import (KernelPlan, QuantFormat, QuantizedArray,
                                          check_groups, last_contracted_axis, quantize,
                                          scheme_format, scheme_plan, stored_dtypes,
                                          stored_shapes)


class QuantizedKernel(nnx.Module):
    """The weights of one quantized kernel; `fmt` is static (part of the graph)."""

    def __init__(self, q: QuantizedArray, axes: tuple[str | None, ...]):
        fmt = self.fmt = q.format
        self.values = nnx.Param(q.values, axes=axes)
        scale_axes = axes if fmt.group is not None else _per_channel_axes(axes, fmt)
        self.scales = nnx.Param(q.scales, axes=scale_axes)
        self.mins = None if q.mins is None else nnx.Param(q.mins, axes=scale_axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float kernel it stands for."""
        return self.array().shape

    def array(self) -> QuantizedArray:
        return QuantizedArray(values=self.values[...], scales=self.scales[...],
                              mins=None if self.mins is None else self.mins[...], format=self.fmt)


def _per_channel_axes(axes: tuple, fmt: QuantFormat) -> tuple:
    """A kernel's axes without its contracted ones: those of per-channel scales."""
    stack = len(axes) - fmt.num_out - fmt.num_contracted
    return axes[:stack] + axes[len(axes) - fmt.num_out:]


def quantized_matmul(spec: str, x: jax.Array, kernel: QuantizedKernel) -> jax.Array:
    """`jnp.einsum(spec, x, dequantized kernel)`, for a spec whose contracted axes end `x` and
    begin the kernel (every `Dense` of the model): one dot for int8, two for int4."""
    fmt = kernel.fmt
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    n = fmt.num_contracted
    assert lhs[-n:] == rhs[:n], f"{spec}: the contracted axes must end x and begin the kernel"
    m = next(a for a in "abcdefghijklmnopqrstuvwxyz" if a not in spec)  # the merged axis
    flat = f"{lhs[:len(lhs) - n]}{m},{m}{rhs[n:]}->{out}"
    with jax.named_scope(f"quantized {spec}"):
        if fmt.bits == 8:
            y = jnp.einsum(flat, _flat_lhs(x, n), _flat_rhs(_dequantized(kernel, x.dtype), n))
        else:
            y = sum(jnp.einsum(flat, _flat_lhs(xh, n + 1), _flat_rhs(wh, n + 1))
                    for xh, wh in zip(_split_x(x, fmt), _dequantized_halves(kernel, x.dtype)))
        if fmt.group is None:  # per-channel scales multiply the output, not the weights
            y = y * kernel.scales[...].astype(y.dtype)
    return y


def _flat_lhs(x: jax.Array, k: int) -> jax.Array:
    """x [..., *c] -> [..., prod(c)], its k trailing (contracted) axes merged."""
    return x.reshape(*x.shape[:x.ndim - k], math.prod(x.shape[x.ndim - k:]))


def _flat_rhs(w: jax.Array, k: int) -> jax.Array:
    """w [*c, *out] -> [prod(c), *out], its k leading (contracted) axes merged."""
    return w.reshape(math.prod(w.shape[:k]), *w.shape[k:])


def _dequantized(kernel: QuantizedKernel, dtype) -> jax.Array:
    """An int8 kernel's values [*c, *out] in `dtype` (per channel: its codes; the scales come
    after the dot)."""
    fmt = kernel.fmt
    codes = kernel.values[...]
    if fmt.group is None:
        return codes.astype(dtype)
    axis = codes.ndim + last_contracted_axis(fmt)
    grouped = _split_axis(codes, axis, fmt.group)  # [..., n, group, *out]
    scales = jnp.expand_dims(kernel.scales[...].astype(dtype), axis + 1)  # [..., n, 1, *out]
    mins = None if kernel.mins is None else jnp.expand_dims(kernel.mins[...].astype(dtype),
                                                            axis + 1)
    return _values(grouped, scales, mins, dtype).reshape(codes.shape)


def _split_x(x: jax.Array, fmt: QuantFormat) -> tuple[jax.Array, jax.Array]:
    """x [..., *c] -> two halves [..., *c[:-1], n, group / 2]: each group's first and second
    half."""
    x = x.reshape(*x.shape[:-1], x.shape[-1] // fmt.group, fmt.group)
    return x[..., :fmt.group // 2], x[..., fmt.group // 2:]


def _dequantized_halves(kernel: QuantizedKernel, dtype) -> tuple[jax.Array, jax.Array]:
    """An int4 kernel's two halves [*c[:-1], n, group / 2, *out] (its low and its high
    nibbles) as values in `dtype`."""
    fmt = kernel.fmt
    values = kernel.values[...]
    axis = values.ndim + last_contracted_axis(fmt)
    packed = _split_axis(values, axis, fmt.group // 2)  # [..., n, group / 2, *out]
    low, high = packed & 15, packed >> 4
    scales = jnp.expand_dims(kernel.scales[...].astype(dtype), axis + 1)  # [..., n, 1, *out]
    mins = None if kernel.mins is None else jnp.expand_dims(kernel.mins[...].astype(dtype),
                                                            axis + 1)
    return tuple(_values(codes, scales, mins, dtype) for codes in (low, high))


def _split_axis(a: jax.Array, axis: int, width: int) -> jax.Array:
    return a.reshape(*a.shape[:axis], a.shape[axis] // width, width, *a.shape[axis + 1:])


def _values(codes: jax.Array, scales: jax.Array, mins: jax.Array | None, dtype) -> jax.Array:
    w = codes.astype(dtype) * scales
    return w if mins is None else w + mins


# -- turning a model's kernels into quantized ones -----------------------------------------------


# Dense modules whose kernels stay float under every scheme, by their attribute name. The LM
# head: a quantized table measured no faster (docs/models.md). A mixture's router and its shared
# expert's sigmoid gate: a few columns each, and a rounding that moves a router logit past
# another changes which experts run, so routing stays the float model's. (The routed experts
# themselves are stacked `[E, ...]` weights the grouped matmul reads, not `Dense` kernels: they
# stay float too.)
FLOAT_KERNELS = frozenset({"lm_head", "router", "scale"})


def dense_kernels(model: nnx.Module) -> dict[str, tuple[Any, int, int]]:
    """Canonical kernel path -> (its Dense, number of contracted axes, number of output axes),
    for every `Dense` of `model` whose kernel a scheme quantizes: the quantized matmul can run
    its spec, and it is not one of `FLOAT_KERNELS`."""
    from meshserve.model.layers import Dense  # layers imports this module

    found = {}
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, Dense) or (path and path[-1] in FLOAT_KERNELS):
            continue
        inputs, _ = module.spec.split("->")
        lhs, rhs = inputs.split(",")
        contracted = "".join(a for a in rhs if a in lhs)
        if lhs.endswith(contracted) and rhs.startswith(contracted):
            key = "/".join(map(str, path)) + "/kernel"
            found[key] = (module, len(contracted), len(rhs) - len(contracted))
    return found


def kernel_formats(model: nnx.Module, scheme: str) -> dict[str, QuantFormat]:
    """The format `scheme` gives each quantizable kernel of `model` (none for "none"), checked
    against the kernel's shape."""
    formats = {}
    for key, (dense, n, out) in dense_kernels(model).items():
        fmt = scheme_format(scheme, n, out)
        if fmt is not None:
            check_groups(fmt, tuple(dense.kernel.shape), key)
            formats[key] = fmt
    return formats


def scheme_plans(scheme: str, platform: str | None = None):
    """The loaders' `plans` for `scheme` on `platform` (default: JAX's default backend's):
    config -> {kernel key: KernelPlan}; None for "none"."""
    scheme_format(scheme, 1, 1)  # an unknown scheme fails here, before any file is read
    if scheme == "none":
        return None
    platform = platform or jax.default_backend()
    from meshserve.model.transformer import abstract_model  # transformer imports layers

    def plans(config) -> dict[str, KernelPlan]:
        model = abstract_model(config)
        kernel_formats(model, scheme)  # checks that the float kernels divide into groups
        return {key: scheme_plan(scheme, n, out, platform=platform)
                for key, (_, n, out) in dense_kernels(model).items()}

    return plans


def quantized_axes(fmt: QuantFormat, axes: tuple[str | None, ...]) -> dict[str, tuple]:
    """The logical axes of each array of a kernel with float axes `axes`."""
    scale_axes = axes if fmt.group is not None else _per_channel_axes(axes, fmt)
    named = {"values": axes, "scales": scale_axes}
    if fmt.has_mins:
        named["mins"] = scale_axes
    return named


def stored_weights(model: nnx.Module, formats: Mapping[str, QuantFormat]
                   ) -> dict[str, tuple[tuple, tuple[int, ...], str | None]]:
    """Flat path -> (logical axes, shape, dtype or None for the model's dtype) of every array a
    float (possibly abstract) `model` stores once the kernels in `formats` are quantized: what a
    checkpoint of it holds."""
    stored = {}
    _, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        fmt = formats.get(key)
        if fmt is None:
            stored[key] = (var.axes, tuple(var.shape), None)
            continue
        axes, shapes, dtypes = (quantized_axes(fmt, var.axes), stored_shapes(fmt, var.shape),
                                stored_dtypes(fmt))
        for name in shapes:
            stored[f"{key}/{name}"] = (axes[name], shapes[name], dtypes[name])
    return stored


def grouped_params(params: Mapping[str, Any], formats: Mapping[str, QuantFormat]
                   ) -> dict[str, Any]:
    """Flat arrays (`stored_weights`' paths) -> canonical params, the arrays of each kernel in
    `formats` gathered into its `QuantizedArray`."""
    grouped = {k: v for k, v in params.items() if k.rpartition("/")[0] not in formats}
    for key, fmt in formats.items():
        grouped[key] = QuantizedArray(values=params[f"{key}/values"],
                                      scales=params[f"{key}/scales"],
                                      mins=params.get(f"{key}/mins"), format=fmt)
    return grouped


def quantize_model(model: nnx.Module, scheme: str) -> nnx.Module:
    """`model` with every float kernel quantized by `scheme`, on the kernel's own device (float
    kernels go; a kernel already quantized stays as it is). Returns the same model object."""
    for key, fmt in kernel_formats(model, scheme).items():
        dense = dense_kernels(model)[key][0]
        if isinstance(dense.kernel, QuantizedKernel):
            continue
        q = quantize(dense.kernel[...], fmt, xp=jnp)
        dense.kernel = QuantizedKernel(q, dense.kernel.axes)
    return model


def install(model: nnx.Module, params: Mapping[str, Any]) -> None:
    """Gives each Dense whose kernel key holds a `QuantizedArray` in `params` a quantized kernel
    of those arrays (the model's float kernel, abstract or not, only lends its axes)."""
    kernels = dense_kernels(model)
    for key, value in params.items():
        if not isinstance(value, QuantizedArray):
            continue
        if key not in kernels:
            raise ValueError(f"{key} is quantized, but it is not the kernel of a Dense that "
                             "the quantized matmul runs")
        dense = kernels[key][0]
        if tuple(value.shape) != tuple(dense.kernel.shape):
            raise ValueError(f"quantized weight {key} stands for shape {value.shape}, expected "
                             f"{tuple(dense.kernel.shape)}")
        dense.kernel = QuantizedKernel(value.map(jnp.asarray), dense.kernel.axes)


def model_weights(model: nnx.Module, fn=lambda value, axes: value) -> dict[str, Any]:
    """Canonical path -> each weight of `model` passed through `fn(value, logical_axes)`, a
    quantized kernel as one `QuantizedArray` (each of its arrays passed through `fn`): what
    `model_from_params` takes to build the model again."""
    quantized = {key: dense.kernel for key, (dense, _, _) in dense_kernels(model).items()
                 if isinstance(dense.kernel, QuantizedKernel)}
    _, state = nnx.split(model)
    weights = {}
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        kernel = key.rpartition("/")[0]
        if kernel in quantized:
            if kernel not in weights:
                weights[kernel] = _mapped(quantized[kernel], fn)
        else:
            weights[key] = fn(var[...], var.axes)
    return weights


def _mapped(kernel: QuantizedKernel, fn) -> QuantizedArray:
    part = lambda p: None if p is None else fn(p[...], p.axes)  # noqa: E731
    return QuantizedArray(values=part(kernel.values), scales=part(kernel.scales),
                          mins=part(kernel.mins), format=kernel.fmt)


def quantized_arrays(model: nnx.Module) -> dict[str, QuantizedArray]:
    """Canonical kernel path -> the `QuantizedArray` of every quantized kernel of `model`."""
    return {key: dense.kernel.array() for key, (dense, _, _) in dense_kernels(model).items()
            if isinstance(dense.kernel, QuantizedKernel)}


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of every weight of `model` as stored (codes, scales and float weights)."""
    _, state = nnx.split(model)
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in jax.tree.leaves(state))
