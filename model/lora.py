"""LoRA adapters on the device: fixed-shape slabs beside the projections they modify.

A served model with LoRA holds, in every targeted `Dense` of its layers, a `LoraSlab`: the A and
B matrices of `max_loras` adapters at once, stacked over layers like the base weights, so the
layer scan slices them with the rest of the layer:

    a  [L, in..., S, r]    the input axes of the kernel first, then slot and rank
    b  [L, S, r, out...]   slot and rank, then the output axes of the kernel

S is `max_loras` and r `max_lora_rank`; a smaller adapter is zero-padded to r. B holds the
adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded in, so the delta is just
x A B. Each axis keeps its logical name (`lora_slots`, `lora_rank` and the kernel's own), so the
sharding rules place A and B as they place the kernel: under tensor parallelism B of a
column-parallel projection (q, k, v, gate, up) splits its output like the kernel, and A of a
row-parallel one (o, down) splits its input, whose partial products XLA sums with one small
all-reduce of [N, S * r].

Every token of a step carries its adapter's slot (`RaggedBatch.adapters`, int32 [T]): 0 for the
base model, s in 1..S for slab row s - 1. `token_selection` turns them into a one-hot [T, S] once
per step, and each slab computes its delta for the whole ragged batch in two plain matmuls:

    h = x [N, I] @ a [I, S * r]                every slot's down-projection
    h = h * one-hot, repeated r times          keep only the token's own slot (none for slot 0)
    y = h [N, S * r] @ b [S * r, O]            the up-projection of that slot

This costs S times the work of one adapter, against gathering each token's A and B ([N, I, r]
and [N, r, O] copies, per projection per layer). On a CPU the two dense matmuls beat the batched
matrix-vector products of the gather but at a handful of tokens (docs/lora.md has the numbers,
scripts/lora_delta_bench.py measures them), and a long prefill chunk never materialises
per-token weights. The shapes are fixed by S and r alone, so no mix of adapters
compiles anything new, and loading one is a device update of one slab row
(`meshserve.model.executor.lora_slabs`).

Without LoRA nothing here is reached: no `Dense` has a slab and no step has `adapters`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshserve.model.layers import Dense

# The projections an adapter may modify: the canonical path of each `Dense`, and the number of
# its kernel's leading axes that are inputs (o's input is its heads and head_dim).
LORA_TARGETS: dict[str, int] = {
    "layers/attn/q": 1,
    "layers/attn/k": 1,
    "layers/attn/v": 1,
    "layers/attn/o": 2,
    "layers/mlp/gate": 1,
    "layers/mlp/up": 1,
    "layers/mlp/down": 1,
}


@dataclasses.dataclass(frozen=True)
class LoraShape:
    """The slabs' fixed sizes: `num_slots` adapters at once, each of rank up to `max_rank`."""

    num_slots: int
    max_rank: int

    def __post_init__(self):
        for name in ("num_slots", "max_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class LoraWeight(nnx.Variable):
    """A slab of adapter weights: a variable of its own type, so that nothing mistakes it for a
    base weight."""


class LoraSlab(nnx.Module):
    """The A and B matrices of every adapter slot for one projection (see the module
    docstring), for a kernel of `kernel_shape` with logical axes `kernel_axes` (the layer axis
    first, then `num_inputs` input axes, then the outputs)."""

    def __init__(self, kernel_shape: tuple[int, ...], kernel_axes: tuple[str, ...],
                 num_inputs: int, shape: LoraShape, *, dtype: str):
        assert kernel_axes[0] == "layers" and len(kernel_shape) == len(kernel_axes)
        num_layers, ins, outs = kernel_shape[0], kernel_shape[1:1 + num_inputs], \
            kernel_shape[1 + num_inputs:]
        in_axes, out_axes = kernel_axes[1:1 + num_inputs], kernel_axes[1 + num_inputs:]
        s, r = shape.num_slots, shape.max_rank
        self.a = LoraWeight(jnp.zeros((num_layers, *ins, s, r), dtype),
                            axes=("layers", *in_axes, "lora_slots", "lora_rank"))
        self.b = LoraWeight(jnp.zeros((num_layers, s, r, *outs), dtype),
                            axes=("layers", "lora_slots", "lora_rank", *out_axes))

    def __call__(self, x: jax.Array, selection: jax.Array) -> jax.Array:
        """The delta of each token's own adapter, for one layer's slices a [in..., S, r] and
        b [S, r, out...]: x [N, in...], selection [N, S] one-hot -> [N, out...]."""
        a, b = self.a[...], self.b[...]
        num_slots, rank = b.shape[0], b.shape[1]
        n, out_shape = x.shape[0], b.shape[2:]
        h = x.reshape(n, -1).astype(a.dtype) @ a.reshape(-1, num_slots * rank)  # [N, S * r]
        h = h * jnp.repeat(selection.astype(a.dtype), rank, axis=1)
        y = h @ b.reshape(num_slots * rank, -1)  # [N, O]
        return y.reshape(n, *out_shape)


def with_lora(model: nnx.Module, shape: LoraShape) -> nnx.Module:
    """A model that shares `model`'s weights (no copy) with a zero `LoraSlab` on every projection
    of `LORA_TARGETS` it has; `model` itself is left as it was. The slabs are float, in the
    model's dtype, whether the kernels are float or quantized."""
    if model.config.arch != "llama":
        raise ValueError(f"enable_lora needs a model of the llama architecture, not "
                         f"{model.config.arch}")
    graphdef, state = nnx.split(model)
    served = nnx.merge(graphdef, state)
    for path, dense in target_denses(served).items():
        kernel = dense.kernel
        axes = kernel.axes  # a float kernel's, or a quantized one's float axes
        dense.lora = LoraSlab(tuple(kernel.shape), tuple(axes), LORA_TARGETS[path], shape,
                              dtype=model.config.dtype)
    return served


def target_denses(model: nnx.Module) -> dict[str, Dense]:
    """Canonical path -> the `Dense` of each projection in `LORA_TARGETS` that `model` has."""
    found = {}
    for path, module in nnx.iter_graph(model):
        key = "/".join(map(str, path))
        if isinstance(module, Dense) and key in LORA_TARGETS:
            found[key] = module
    return found


def lora_shape(model: nnx.Module) -> LoraShape | None:
    """The slabs' sizes, or None for a model served without LoRA."""
    for dense in target_denses(model).values():
        if dense.lora is not None:
            b = dense.lora.b
            return LoraShape(num_slots=b.shape[1], max_rank=b.shape[2])
    return None


def token_selection(adapters: jax.Array, num_slots: int) -> jax.Array:
    """Each token's adapter slot [T] (0: none) -> one-hot [T, S] float32 (a zero row for 0)."""
    return jax.nn.one_hot(adapters - 1, num_slots, dtype=jnp.float32)
