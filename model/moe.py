"""The mixture-of-experts MLP: a router sends each token to k of E SwiGLU experts, and only those
experts run on it.

Routing, as the families define it: the router's logits [N, E] go through a float32 softmax over
every expert and the k largest are kept; Mixtral and Qwen3-MoE renormalise those k weights to
sum to 1, Qwen2-MoE and OLMoE keep them as they are (`MoeConfig.renormalize`). A token's output
is the weighted sum of its k experts' outputs. A shared expert (Qwen2-MoE) runs on every token
besides, scaled by a sigmoid gate of its own.

Grouped matmuls by sorted-token dispatch (`grouped_swiglu`). The N * k (token, expert)
assignments are sorted by expert, so that each expert's tokens are contiguous rows. Those rows are
cut into tiles of B rows that belong to one expert each, and a loop runs only the tiles that
hold tokens: one SwiGLU of B rows on its expert's weights per tile. Work and weight reads follow
the routing: a decode step of a few tokens reads only the experts they chose, and no token is
computed on an expert it did not choose. Each expert wastes at most B - 1 padding rows.
`jax.lax.ragged_dot` states the same product (`grouped_swiglu_ragged`, kept as a cross-check),
but XLA:CPU, and XLA:GPU outside cuDNN's fused path, lower it to a masked product over every
expert: E / k times the work, the dense compute a mixture exists to avoid.

Quantized experts. Each of gate, up and down is a float stack or a `QuantizedKernel` holding the
codes, scales and mins of every expert (stacked as the float weights are, expert axis in front of
the kernel's own axes; `meshserve.model.quantized_weights` makes them, the loaders keep a GGUF's
expert blocks in them). A tile then reads its one expert's codes and scales out of the stack and
dequantizes only that expert's kernel, inside the tile loop, by the matmul every quantized `Dense`
runs (`quantized_matmul`: int8 as one dot, int4 as two over each group's low and high nibbles):
no buffer holds more than one expert's kernel in float, as the float path reads one expert's
weights per tile.

Splitting the experts over the mesh is decided outside, by `meshserve.sharding.experts`, which
sets `ExpertSplit` on the module: the mesh axis that splits the experts (expert parallelism:
each device holds E / m whole experts) and the one that splits each expert's width (tensor
parallelism inside every expert). The routed experts then run under `jax.shard_map` over those
axes: every device routes all tokens (they are replicated there, as the residual stream is),
computes the assignments that fall on its own experts, or its slice of every expert, and one
`psum` adds the partial outputs: the token exchange, one all-reduce of [N, D] per layer.

Einsum letters as in `meshserve.model.layers`, plus e experts and k the chosen experts of a token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from meshserve.model.config import ModelConfig
from meshserve.model.layers import Dense, param
from meshserve.model.quant_formats import QuantizedArray, dequantize
from meshserve.model.quantized_kernel import quantized_axes, quantized_matmul, with_layer_kernels

# Rows of one grouped-matmul tile at most: large enough for efficient matmuls in prefill, while
# small steps get tiles near their expected rows per expert (`tile_rows`).
MAX_TILE_ROWS = 128
EXPERT_AXES = ("expert", "embed", "expert_ffw")  # gate and up [E, D, F]
EXPERT_DOWN_AXES = ("expert", "expert_ffw", "embed")  # down [E, F, D]
# One stack of expert kernels [E, in, out]: float, or every expert's codes and scales.
Stack = jax.Array | QuantizedArray


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """Mesh axes that split the routed experts: `expert_axis` the experts themselves, `width_axis`
    each expert's width; either may be None. Static: it is part of the model's graph."""

    mesh: Mesh
    expert_axis: str | None = None
    width_axis: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a in (self.expert_axis, self.width_axis) if a is not None)


class MoeMLP(nnx.Module):
    """Router, E experts (SwiGLU, stacked on a leading `expert` axis) and an optional shared
    expert with its gate, in place of a llama layer's MLP."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, stack: tuple[int, ...]):
        assert c.moe is not None
        self.moe = c.moe
        kw = dict(dtype=c.dtype, rngs=rngs, stack=stack)
        d, f, e = c.hidden_size, c.intermediate_size, c.moe.num_experts
        self.router = Dense("nd,de->ne", (d, e), ("embed", "router"), **kw)
        self.experts = Experts(e, d, f, **kw)
        self.shared = SharedExpert(d, c.moe.shared_expert_size, **kw) \
            if c.moe.shared_expert_size else None
        self.split: ExpertSplit | None = None  # set by meshserve.sharding.experts

    def __call__(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
        del adapters  # LoRA adapters of a mixture modify its attention only
        logits = self.router(x).astype(jnp.float32)  # [N, E]
        weights, chosen = route(logits, self.moe.experts_per_token, self.moe.renormalize)
        y = self.experts.run(lambda gate, up, down: routed_experts(
            x, chosen, weights, gate, up, down, self.split))
        if self.shared is not None:
            y = y + self.shared(x)
        return y


class Experts(nnx.Module):
    """The routed experts' weights: gate and up [E, D, F], down [E, F, D] (a layer axis in
    front when stacked), each a float `nnx.Param` or a `QuantizedKernel` of every expert (or a
    `MixedKernel` of the layers' stacks, where a file's layers differ in block type)."""

    def __init__(self, num_experts: int, dim: int, width: int, *, dtype: str, rngs: nnx.Rngs,
                 stack: tuple[int, ...]):
        kw = dict(dtype=dtype, stack=stack)
        self.gate = param(rngs, (num_experts, dim, width), EXPERT_AXES, **kw)
        self.up = param(rngs, (num_experts, dim, width), EXPERT_AXES, **kw)
        self.down = param(rngs, (num_experts, width, dim), EXPERT_DOWN_AXES, **kw)

    def run(self, fn):
        """`fn(gate, up, down)` on the stacks as the grouped matmul reads them (of a mixed stack
        of layers, the layer's own part: `with_layer_kernels`)."""
        return with_layer_kernels([self.gate, self.up, self.down], fn)


class SharedExpert(nnx.Module):
    """Qwen2-MoE's shared expert: a SwiGLU every token runs, times sigmoid(x . gate)."""

    def __init__(self, dim: int, width: int, *, dtype: str, rngs: nnx.Rngs,
                 stack: tuple[int, ...]):
        kw = dict(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = Dense("nd,df->nf", (dim, width), ("embed", "ffw"), **kw)
        self.up = Dense("nd,df->nf", (dim, width), ("embed", "ffw"), **kw)
        self.down = Dense("nf,fd->nd", (width, dim), ("ffw", "embed"), **kw)
        self.scale = Dense("nd,do->no", (dim, 1), ("embed", None), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.down(jax.nn.silu(self.gate(x)) * self.up(x))  # [N, D]
        return jax.nn.sigmoid(self.scale(x)) * y


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts, then the top k. logits [N, E] f32 -> (weights [N, k] f32,
    experts [N, k] int32)."""
    weights, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, chosen.astype(jnp.int32)


def routed_experts(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: Stack, up: Stack,
                   down: Stack, split: ExpertSplit | None) -> jax.Array:
    """Each token's weighted sum over its chosen experts. x [N, D], chosen/weights [N, k],
    gate/up [E, D, F], down [E, F, D] -> [N, D]. With a split, under `jax.shard_map`."""
    if split is None:
        return local_experts(x, chosen, weights, gate, up, down, first_expert=0)
    ea = split.expert_axis
    num_local = gate.shape[0] // split.mesh.shape[ea] if ea else gate.shape[0]

    def partial_sum(x, chosen, weights, gate, up, down):
        first = jax.lax.axis_index(ea) * num_local if ea else 0
        y = local_experts(x, chosen, weights, gate, up, down, first_expert=first)
        return jax.lax.psum(y, split.axes)  # the token exchange: every device's share, added

    # Inside a step mapped over the data axis the context mesh has that axis manual already.
    context = jax.sharding.get_abstract_mesh()
    mesh = split.mesh if context.empty else context
    replicated = PartitionSpec()
    return jax.shard_map(
        partial_sum, mesh=mesh, axis_names=set(split.axes), check_vma=False,
        in_specs=(replicated, replicated, replicated, _split_spec(gate, EXPERT_AXES, split),
                  _split_spec(up, EXPERT_AXES, split), _split_spec(down, EXPERT_DOWN_AXES, split)),
        out_specs=replicated)(x, chosen, weights, gate, up, down)


def _split_spec(stack: Stack, axes: tuple[str, ...], split: ExpertSplit
                ) -> PartitionSpec | QuantizedArray:
    """How `split` cuts a stack of logical axes `axes`: a quantized stack's codes, scales, mins
    and super scales each by their own logical axes (`quantized_axes`), so every device holds
    its experts' (or its slice of every expert's) codes with their scales."""
    mesh_axes = {"expert": split.expert_axis, "expert_ffw": split.width_axis}
    spec = lambda names: PartitionSpec(*(mesh_axes.get(a) for a in names))  # noqa: E731
    if not isinstance(stack, QuantizedArray):
        return spec(axes)
    named = quantized_axes(stack.format, axes)
    return dataclasses.replace(stack, **{name: spec(named[name]) for name in stack.arrays()})


def local_experts(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: Stack, up: Stack,
                  down: Stack, *, first_expert) -> jax.Array:
    """The part of `routed_experts` that experts first_expert .. first_expert + E_local - 1
    (`gate.shape[0]` of them) compute. -> [N, D], zero for the other assignments."""
    num_tokens, k = chosen.shape
    num_local = gate.shape[0]
    local = chosen.reshape(-1) - first_expert  # [A], A = N * k assignments
    # Assignments to other devices' experts form one more group, sorted last and never run.
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(local, stable=True)  # [A]: assignment ids grouped by expert
    sizes = jnp.bincount(local, length=num_local + 1)[:num_local]  # [E_local]
    rows = jnp.take(x, order // k, axis=0)  # [A, D]
    out = grouped_swiglu(rows, sizes, gate, up, down,
                         tile=tile_rows(num_tokens * k, num_local))  # [A, D]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    per_choice = jnp.take(out, inverse, axis=0).reshape(num_tokens, k, -1)  # [N, k, D]
    y = jnp.einsum("nkd,nk->nd", per_choice.astype(jnp.float32), weights)
    return y.astype(x.dtype)


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile: the expected rows of one expert, rounded up to a power of two, at most
    MAX_TILE_ROWS."""
    expected = max(1, -(-num_assignments // num_experts))
    return min(MAX_TILE_ROWS, 1 << (expected - 1).bit_length())


def grouped_swiglu(rows: jax.Array, sizes: jax.Array, gate: Stack, up: Stack, down: Stack, *,
                   tile: int) -> jax.Array:
    """SwiGLU of each group of rows on its expert: rows [A, D] sorted by expert, the first
    sizes[0] on expert 0 and so on (rows past sum(sizes) are left 0); gate/up [E, D, F], down
    [E, F, D] -> [A, D].

    Each expert's rows are cut into tiles of `tile` rows; a loop runs only the tiles that exist,
    each reading its own expert's weights (`expert_matmul`).
    """
    num_rows, num_experts = rows.shape[0], sizes.shape[0]
    tiles = tile_table(sizes, tile, max_tiles=-(-(num_rows + num_experts * (tile - 1)) // tile))
    padded = jnp.pad(rows, ((0, tile), (0, 0)))  # a tile may start at the last row

    def one_tile(i, out):
        expert, start, count = tiles.expert[i], tiles.start[i], tiles.count[i]
        x = jax.lax.dynamic_slice_in_dim(padded, start, tile)  # [B, D]
        h = jax.nn.silu(expert_matmul(x, gate, expert)) * expert_matmul(x, up, expert)  # [B, F]
        y = expert_matmul(h, down, expert).astype(out.dtype)  # [B, D]
        # Rows past this tile's count belong to the next group (or to none): keep them.
        keep = (jnp.arange(tile) < count)[:, None]
        kept = jax.lax.dynamic_slice_in_dim(out, start, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, kept), start, 0)

    out = jax.lax.fori_loop(0, tiles.num_tiles, one_tile, jnp.zeros_like(padded))
    return out[:num_rows]


def expert_matmul(x: jax.Array, stack: Stack, expert: jax.Array) -> jax.Array:
    """x [B, I] times the kernel [I, O] of expert `expert` (a scalar) of `stack` [E, I, O]. Of
    a quantized stack only that expert's codes, scales and mins are read, and dequantized as
    a quantized `Dense` kernel is."""
    if isinstance(stack, QuantizedArray):
        return quantized_matmul("bi,io->bo", x, stack.map(lambda a: a[expert]))
    return x @ stack[expert]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileTable:
    """The tiles of a grouped matmul, each within one expert's rows; entries past `num_tiles`
    are unused."""

    expert: jax.Array  # [T] the tile's expert
    start: jax.Array  # [T] its first row
    count: jax.Array  # [T] its rows (<= tile)
    num_tiles: jax.Array  # [] the tiles that exist


def tile_table(sizes: jax.Array, tile: int, *, max_tiles: int) -> TileTable:
    """Tiles of `tile` rows over groups of `sizes` [E] contiguous rows. `max_tiles` bounds
    sum(ceil(sizes / tile)) for every split of the rows: (rows + E * (tile - 1)) / tile."""
    per_expert = -(-sizes // tile)  # [E]
    tiles_end = jnp.cumsum(per_expert)  # [E]
    t = jnp.arange(max_tiles)
    expert = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), sizes.shape[0] - 1)
    index = t - (tiles_end - per_expert)[expert]  # the tile's place within its expert
    group_start = jnp.cumsum(sizes) - sizes
    start = group_start[expert] + index * tile
    count = jnp.clip(sizes[expert] - index * tile, 0, tile)
    return TileTable(expert=expert.astype(jnp.int32), start=start.astype(jnp.int32),
                     count=count.astype(jnp.int32), num_tiles=tiles_end[-1])


def grouped_swiglu_ragged(rows: jax.Array, sizes: jax.Array, gate: Stack, up: Stack,
                          down: Stack) -> jax.Array:
    """`grouped_swiglu` with `jax.lax.ragged_dot`: the same result (see the module docstring
    for why it is not the one served). A cross-check, not a served path: a quantized stack is
    dequantized whole, to float32, first."""
    gate, up, down = (dequantize(w, xp=jnp).astype(rows.dtype) if isinstance(w, QuantizedArray)
                      else w for w in (gate, up, down))
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    return jax.lax.ragged_dot(h, down, sizes).astype(rows.dtype)
