"""A model's quantized kernels: which kernels a scheme quantizes, and turning them so.

`dense_kernels` finds every `Dense` whose kernel a scheme quantizes (all but `FLOAT_KERNELS`).
`quantize_model` is the one step that quantizes a model's float kernels by a scheme, on the
kernels' own devices; kernels already quantized (loaded so) stay as they are, so it can run on
any model. `install` puts loaded `QuantizedArray`s into a model's structure, `model_weights` and
`quantized_arrays` take them out again, and `stored_weights` / `grouped_params` are the flat
arrays a checkpoint stores of them and their regrouping.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.model.layers import Dense
from meshserve.model.quant_formats import (QuantFormat, QuantizedArray, check_groups, quantize,
                                           scheme_format, stored_dtypes, stored_shapes)
from meshserve.model.quantized_kernel import QuantizedKernel, quantized_axes


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
