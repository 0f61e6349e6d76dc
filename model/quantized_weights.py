"""A model's quantized kernels: which kernels a scheme quantizes, and turning them so.

`dense_kernels` finds every `Dense` whose kernel a scheme quantizes (all but `FLOAT_KERNELS`),
`expert_kernels` a mixture's routed expert stacks (quantized per expert, the expert axis in front
like a layer axis), and `quantizable_kernels` is both. The embedding tables (`table_kernels`) and
an untied LM head (`head_kernels`) are quantized only by a file's own blocks
(`file_block_plans`); `held_kernels`, every weight that may be held quantized, is what
`install`, `model_weights` and `quantized_arrays` cover.
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

from meshserve.model.layers import Dense, Embed
from meshserve.model.moe import Experts
from meshserve.model.quant_formats import (ARRAY_NAMES, KernelPlan, LayerMix, MixedArray,
                                           QuantFormat, QuantizedArray, auto_keep_bits,
                                           check_groups, quantize, scheme_format, stored_dtypes,
                                           stored_shapes, uniform_stack)
from meshserve.model.quantized_kernel import MixedKernel, QuantizedKernel, quantized_axes

HELD = (QuantizedKernel, MixedKernel)  # a kernel held quantized


# Dense modules whose kernels no scheme quantizes, by their attribute name. An untied LM head:
# only a file's own blocks are kept in it, and not on the CPU (`file_block_plans`). A mixture's
# router and its shared expert's sigmoid gate: a few columns each, and a rounding that moves a
# router logit past another changes which experts run, so routing stays the float model's. (The
# routed experts themselves are quantized: `expert_kernels`.)
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


class ExpertStack:
    """One stack of a mixture's routed experts (gate, up or down of an `Experts`,
    [*layers, E, in, out]: one contracted axis, one output axis), read and replaced through
    `kernel` as a Dense's kernel is."""

    def __init__(self, experts: Experts, name: str):
        self.experts, self.name = experts, name

    @property
    def kernel(self) -> Any:
        return getattr(self.experts, self.name)

    @kernel.setter
    def kernel(self, value: Any) -> None:
        setattr(self.experts, self.name, value)


def expert_kernels(model: nnx.Module) -> dict[str, tuple[ExpertStack, int, int]]:
    """Canonical path -> (its stack, 1 contracted axis, 1 output axis) for every routed expert
    stack of `model`."""
    found = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Experts):
            prefix = "/".join(map(str, path))
            for name in ("gate", "up", "down"):
                found[f"{prefix}/{name}"] = (ExpertStack(module, name), 1, 1)
    return found


def quantizable_kernels(model: nnx.Module) -> dict[str, tuple[Any, int, int]]:
    """Every kernel a scheme quantizes: the Dense ones and the routed experts', each as
    (what holds it as `kernel`, number of contracted axes, number of output axes)."""
    return {**dense_kernels(model), **expert_kernels(model)}


class TableKernel:
    """An `Embed`'s table, read and replaced through `kernel` as a Dense's kernel is."""

    def __init__(self, embed: Embed):
        self.embed = embed

    @property
    def kernel(self) -> Any:
        return self.embed.embedding

    @kernel.setter
    def kernel(self, value: Any) -> None:
        self.embed.embedding = value


def table_kernels(model: nnx.Module) -> dict[str, tuple[TableKernel, int, int]]:
    """Canonical path -> (its table, 1 contracted axis, no output axis) for every embedding
    table of `model` (`[V, D]`, the vocabulary in front like a stack axis). Schemes never
    quantize a float table; a file's quantized blocks are kept (`file_block_plans`,
    `meshserve.model.quantized_table`)."""
    return {"/".join(map(str, path)) + "/embedding": (TableKernel(module), 1, 0)
            for path, module in nnx.iter_graph(model) if isinstance(module, Embed)}


def head_kernels(model: nnx.Module) -> dict[str, tuple[Any, int, int]]:
    """The untied LM head's kernel `[D, V]` (one contracted axis, one output axis), if the model
    has one: like a table, only a file's own blocks quantize it (`file_block_plans`)."""
    head = getattr(model, "lm_head", None)
    return {} if head is None else {"lm_head/kernel": (head, 1, 1)}


def file_block_kernels(model: nnx.Module) -> dict[str, tuple[Any, int, int]]:
    """The weights no scheme quantizes but a file's quantized blocks may stay in: the embedding
    tables and the untied LM head."""
    return {**table_kernels(model), **head_kernels(model)}


def file_block_plans(model: nnx.Module, scheme: str, platform: str, *, native: bool = False
                     ) -> dict[str, KernelPlan]:
    """What loading does with each of `file_block_kernels` under `scheme` on `platform`: a
    file's blocks are kept where their codes fit the scheme's containers (for the int4 schemes,
    4 bits, else 8: a Q8_0 table is kept as it is rather than left float); float weights stay
    float. On the CPU what the LM head reads (its own kernel, or a tied table) is dequantized at
    load instead: XLA:CPU converts every code of it every step before its product, which costs
    more than reading float32 (docs/models.md#quantized-weights: SmolLM2 and Gemma 3 270M decode
    slower with their kept tables), so there only a table that is just gathered is kept, unless
    `native` (native kernels, `meshserve.model.native_dot`, read the codes themselves); on the
    CPU what the head reads is kept in 8 bits, which the native head reads. A table that is only
    gathered (an untied model's) is kept in the file's own bits under `auto` on every platform:
    a step dequantizes only its rows."""
    keep = (auto_keep_bits(platform) if scheme == "auto"  # on the CPU, 8 bits: the native head's
            else (4, 8) if scheme.startswith("int4") else (8,))
    read_by_head = {"lm_head/kernel", "embed/embedding" if not head_kernels(model) else None}
    gathered = auto_keep_bits("gpu") if scheme == "auto" else keep  # the file's own bits
    return {key: KernelPlan(fmt=None, keep_bits=keep if key in read_by_head else gathered,
                            num_contracted=n, num_out=out)
            for key, (_, n, out) in file_block_kernels(model).items()
            if native or not (platform == "cpu" and key in read_by_head)}


def held_kernels(model: nnx.Module) -> dict[str, tuple[Any, int, int]]:
    """Every weight that may be held quantized: the kernels schemes quantize, and the
    embedding tables and untied LM head kept in a file's blocks."""
    return {**quantizable_kernels(model), **file_block_kernels(model)}


def kernel_formats(model: nnx.Module, scheme: str) -> dict[str, QuantFormat]:
    """The format `scheme` gives each quantizable kernel of `model` (none for "none"), checked
    against the kernel's shape."""
    formats = {}
    for key, (dense, n, out) in quantizable_kernels(model).items():
        fmt = scheme_format(scheme, n, out)
        if fmt is not None:
            check_groups(fmt, tuple(dense.kernel.shape), key)
            formats[key] = fmt
    return formats


def stored_weights(model: nnx.Module, formats: Mapping[str, QuantFormat | LayerMix]
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


def grouped_params(params: Mapping[str, Any], formats: Mapping[str, QuantFormat | LayerMix]
                   ) -> dict[str, Any]:
    """Flat arrays (`stored_weights`' paths) -> canonical params, the arrays of each kernel in
    `formats` gathered into its `QuantizedArray` (or `MixedArray`)."""
    names = {key: {name: f"{key}/{name}" for name in stored_dtypes(fmt)}
             for key, fmt in formats.items()}
    taken = {path for named in names.values() for path in named.values()}
    grouped = {k: v for k, v in params.items() if k not in taken}
    for key, fmt in formats.items():
        arrays = {name: params[path] for name, path in names[key].items()}
        held = MixedArray if isinstance(fmt, LayerMix) else QuantizedArray
        grouped[key] = held.from_arrays(arrays, fmt)
    return grouped


def quantize_model(model: nnx.Module, scheme: str) -> nnx.Module:
    """`model` with every float kernel quantized by `scheme`, on the kernel's own device (float
    kernels go; a kernel already quantized stays as it is). Returns the same model object."""
    for key, fmt in kernel_formats(model, scheme).items():
        dense = quantizable_kernels(model)[key][0]
        if isinstance(dense.kernel, HELD):
            continue
        q = quantize(dense.kernel[...], fmt, xp=jnp)
        dense.kernel = QuantizedKernel(q, dense.kernel.axes)
    return model


def install(model: nnx.Module, params: Mapping[str, Any]) -> None:
    """Gives each kernel (a Dense's, an expert stack) whose key holds a `QuantizedArray` in
    `params` a quantized kernel of those arrays (the model's float kernel, abstract or not,
    only lends its axes)."""
    kernels = held_kernels(model)
    for key, value in params.items():
        if not isinstance(value, (QuantizedArray, MixedArray)):
            continue
        if key not in kernels:
            raise ValueError(f"{key} is quantized, but it is not a kernel that the quantized "
                             "matmul runs (a Dense's, or a routed expert stack)")
        dense = kernels[key][0]
        if tuple(value.shape) != tuple(dense.kernel.shape):
            raise ValueError(f"quantized weight {key} stands for shape {value.shape}, expected "
                             f"{tuple(dense.kernel.shape)}")
        held = QuantizedKernel if isinstance(value, QuantizedArray) else MixedKernel
        dense.kernel = held(value.map(jnp.asarray), dense.kernel.axes)


def model_weights(model: nnx.Module, fn=lambda value, axes: value) -> dict[str, Any]:
    """Canonical path -> each weight of `model` passed through `fn(value, logical_axes)`, a
    quantized kernel as one `QuantizedArray` or `MixedArray` (each of its arrays passed through
    `fn`): what `model_from_params` takes to build the model again."""
    quantized = {key: dense.kernel for key, (dense, _, _) in held_kernels(model).items()
                 if isinstance(dense.kernel, HELD)}
    _, state = nnx.split(model)
    weights = {}
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        # A quantized kernel's array: `{kernel}/values`, a mixed stack's `{kernel}/parts/0/values`
        kernel = next((k for k in quantized if key.startswith(f"{k}/")), None)
        if kernel is not None:
            if kernel not in weights:
                weights[kernel] = _mapped(quantized[kernel], fn)
        else:
            weights[key] = fn(var[...], var.axes)
    return weights


def _mapped(kernel: QuantizedKernel | MixedKernel, fn) -> QuantizedArray | MixedArray:
    if isinstance(kernel, MixedKernel):
        return MixedArray(parts=tuple(_mapped(part, fn) for part in kernel.parts),
                          format=kernel.mix)
    return QuantizedArray.from_arrays({name: fn(p[...], p.axes) for name in ARRAY_NAMES
                                       if (p := getattr(kernel, name)) is not None}, kernel.fmt)


def quantized_arrays(model: nnx.Module) -> dict[str, QuantizedArray | MixedArray]:
    """Canonical kernel path -> the `QuantizedArray` (a mixed stack's `MixedArray`) of every
    quantized kernel of `model`."""
    kernels = held_kernels(model)
    return {key: dense.kernel.array() for key, (dense, _, _) in kernels.items()
            if isinstance(dense.kernel, HELD)}


def uniform_layers(model: nnx.Module) -> nnx.Module:
    """`model` with every mixed stack (`MixedKernel`) held as one stack in the format that
    holds each of its layers (`LayerMix.uniform`; the weights unchanged), on its devices: what
    a split of the layer axis (pipeline stages) needs. New modules over the same other weights:
    the caller's model keeps its mixed stacks."""
    model = nnx.merge(*nnx.split(model))
    for dense, _, _ in held_kernels(model).values():
        if isinstance(dense.kernel, MixedKernel):
            dense.kernel = QuantizedKernel(uniform_stack(dense.kernel.held(), xp=jnp),
                                           dense.kernel.axes)
    return model


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of every weight of `model` as stored (codes, scales and float weights)."""
    _, state = nnx.split(model)
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in jax.tree.leaves(state))
