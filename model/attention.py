"""Attention over the paged KV cache: the one place a kernel plugs in.

Layout of the cache (`KVCache`): for each of K and V one array

    [layers, kv_heads, num_pages, page_size, head_dim]

Page 0 is the dummy page: padding tokens write there and padded page-table entries point there, so
no real page is ever touched by padding. A sequence's token at position p lives in page
`page_table[p // page_size]`, slot `p % page_size`.

A step is a tuple of sub-batches (`SubBatch`), each padded to its own `[B, T]` bucket: a prefill
chunk batch and a decode batch (T = 1) can run in one compiled step. Tokens of all sub-batches are
flattened to one axis `n` for the matmuls; attention runs per sub-batch.

Writes happen before reads, so a prefill chunk attends to the pages its earlier chunks wrote and to
itself; decode is the T = 1 case of the same code.

`paged_attention` is the portable gather-based implementation (CPU and GPU). `dense_attention` is
the reference that tests compare it with. Neither knows about batching policy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# Finite, so fully masked rows (padding) give uniform weights instead of NaN.
MASK_VALUE = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, K, P, S, h]
    v: jax.Array  # [L, K, P, S, h]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def init_kv_cache(*, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                  head_dim: int, dtype) -> KVCache:
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SubBatch:
    """B sequences with T new tokens each, padded. All int32.

    tokens      [B, T]  new token ids (padding: 0)
    positions   [B, T]  absolute position of each new token (padding: 0)
    num_new     [B]     real new tokens per row; 0 for a padding row
    kv_lens     [B]     context length after this step (cached + new); 0 for padding
    page_table  [B, M]  pages of each sequence; entries past its length are 0 (the dummy)
    targets     [B, T]  next-token ids whose logprobs to return, or None (prompt logprobs)
    """

    tokens: jax.Array
    positions: jax.Array
    num_new: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    targets: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMeta:
    """What every layer needs about a step, computed once per step outside the layer scan."""

    write_slots: jax.Array  # [N] flat slot (page * page_size + offset) of each new token
    masks: tuple[jax.Array, ...]  # per sub-batch [B, T, M * page_size] bool
    page_tables: tuple[jax.Array, ...]  # per sub-batch [B, M]


def attention_meta(batches: tuple[SubBatch, ...], page_size: int) -> AttentionMeta:
    slots = [_write_slots(b, page_size).reshape(-1) for b in batches]
    return AttentionMeta(
        write_slots=jnp.concatenate(slots),
        masks=tuple(_paged_mask(b, page_size) for b in batches),
        page_tables=tuple(b.page_table for b in batches),
    )


def _write_slots(b: SubBatch, page_size: int) -> jax.Array:
    t = jnp.arange(b.tokens.shape[1])
    is_real = t[None, :] < b.num_new[:, None]  # [B, T]
    page = jnp.take_along_axis(b.page_table, b.positions // page_size, axis=1, mode="clip")
    slot = page * page_size + b.positions % page_size
    return jnp.where(is_real, slot, 0)


def _paged_mask(b: SubBatch, page_size: int) -> jax.Array:
    key_pos = jnp.arange(b.page_table.shape[1] * page_size)  # [S]
    causal = key_pos[None, None, :] <= b.positions[:, :, None]  # [B, T, S]
    in_context = key_pos[None, None, :] < b.kv_lens[:, None, None]
    return causal & in_context


def write_kv(cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, k: jax.Array,
             v: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters new k/v [N, K, h] into layer `layer` of the caches at flat slots [N]."""
    page_size = cache_k.shape[3]
    pages, offsets = slots // page_size, slots % page_size
    # Index (layer, :, pages, offsets): the advanced indices lead, so the update is [N, K, h].
    new_k = cache_k.at[layer, :, pages, offsets].set(k, mode="promise_in_bounds")
    new_v = cache_v.at[layer, :, pages, offsets].set(v, mode="promise_in_bounds")
    return new_k, new_v


def paged_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
                    page_table: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, H, h] over the pages of `page_table` [B, M]; mask [B, T, M*S]. -> [B, T, H, h]."""
    k = _gather_pages(cache_k, layer, page_table)  # [B, K, M*S, h]
    v = _gather_pages(cache_v, layer, page_table)
    return _masked_attention(q, k, v, mask)


def _gather_pages(cache: jax.Array, layer: jax.Array, page_table: jax.Array) -> jax.Array:
    pages = cache[layer, :, page_table]  # one gather: [B, M, K, S, h]
    batch, num_slots, kv_heads, page_size, head_dim = pages.shape
    pages = pages.transpose(0, 2, 1, 3, 4)  # [B, K, M, S, h]
    return pages.reshape(batch, kv_heads, num_slots * page_size, head_dim)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Reference attention. q [B, T, H, h]; k, v [B, S, K, h]; mask [B, T, S]."""
    return _masked_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, H, h]; k, v [B, K, S, h]; mask [B, T, S] -> [B, T, H, h]."""
    batch, tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, tokens, kv_heads, num_heads // kv_heads, head_dim)  # [B, T, K, G, h]
    scores = _einsum_f32("btkgh,bksh->bkgts", q, k)
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = _einsum_f32("bkgts,bksh->btkgh", weights, v)
    return out.reshape(batch, tokens, num_heads, head_dim).astype(q.dtype)


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """An einsum accumulated and returned in float32, for any input dtype."""
    if jax.default_backend() == "cpu" and a.dtype != jnp.float32:
        # XLA:CPU has no bf16 x bf16 -> f32 dot; upcasting is exact and CPU runs f32 anyway.
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedContext:
    """What attention reads and writes in a paged step: the caches and the step's metadata."""

    k: jax.Array
    v: jax.Array
    meta: AttentionMeta
    shapes: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               layer: jax.Array) -> tuple[jax.Array, "PagedContext"]:
        """q [N, H, h], k/v [N, K, h] of all sub-batches, flattened -> [N, H, h]."""
        cache_k, cache_v = write_kv(self.k, self.v, layer, k, v, self.meta.write_slots)
        outs = []
        for (b, t), q_sub, table, mask in zip(self.shapes, _split_rows(q, self.shapes),
                                              self.meta.page_tables, self.meta.masks):
            out = paged_attention(q_sub.reshape(b, t, *q.shape[1:]), cache_k, cache_v, layer,
                                  table, mask)
            outs.append(out.reshape(b * t, *q.shape[1:]))
        return jnp.concatenate(outs), dataclasses.replace(self, k=cache_k, v=cache_v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseContext:
    """Full causal attention over one padded batch, with no cache: the reference path."""

    mask: jax.Array  # [B, T, T]
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               layer: jax.Array) -> tuple[jax.Array, "DenseContext"]:
        del layer
        b, t = self.shape
        out = dense_attention(q.reshape(b, t, *q.shape[1:]), k.reshape(b, t, *k.shape[1:]),
                              v.reshape(b, t, *v.shape[1:]), self.mask)
        return out.reshape(q.shape), self


def paged_context(cache: KVCache, batches: tuple[SubBatch, ...]) -> PagedContext:
    return PagedContext(k=cache.k, v=cache.v, meta=attention_meta(batches, cache.page_size),
                        shapes=tuple(b.shape for b in batches))


def dense_context(lengths: jax.Array, num_tokens: int) -> DenseContext:
    """Causal mask for B rows padded to `num_tokens`, each with its real length."""
    pos = jnp.arange(num_tokens)
    causal = pos[None, :, None] >= pos[None, None, :]
    real = pos[None, None, :] < lengths[:, None, None]
    return DenseContext(mask=causal & real, shape=(lengths.shape[0], num_tokens))


def _split_rows(x: jax.Array, shapes: tuple[tuple[int, int], ...]) -> list[jax.Array]:
    sizes = [b * t for b, t in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [x[o:o + n] for o, n in zip(offsets, sizes)]


# The ragged step: one flat batch of tokens, prefill chunks and decodes mixed.

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """T token slots of S sequences, flattened. All int32; T and S are the compiled shape.

    A sequence's tokens sit in consecutive slots. Padding slots have `is_real = 0`: they write to
    the dummy page 0 and no real token attends to them. A padding sequence has `kv_lens = 0`.

    tokens      [T]     new token ids
    positions   [T]     absolute position of each token
    token_seq   [T]     the sequence slot each token belongs to
    is_real     [T]     1 for a real new token, 0 for padding
    write_slots [T]     flat cache slot (page * page_size + offset) each token writes
    kv_lens     [S]     context length after this step (cached + new)
    num_new     [S]     real new tokens of each sequence
    last        [S]     slot of each sequence's last real token (its logits are sampled)
    page_table  [S, M]  pages of each sequence; entries past its length are 0 (the dummy)
    targets     [T]     next-token ids whose logprobs to return, or None (prompt logprobs)
    """

    tokens: jax.Array
    positions: jax.Array
    token_seq: jax.Array
    is_real: jax.Array
    write_slots: jax.Array
    kv_lens: jax.Array
    num_new: jax.Array
    last: jax.Array
    page_table: jax.Array
    targets: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(token slots, sequence slots): the compiled shape."""
        return self.tokens.shape[0], self.kv_lens.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMeta:
    """What every layer's attention needs about a ragged step, computed once per step."""

    write_slots: jax.Array  # [T]
    positions: jax.Array  # [T]
    token_pages: jax.Array  # [T, M] the page table of each token's sequence
    cached_lens: jax.Array  # [T] tokens of its sequence cached before this step
    step_mask: jax.Array  # [T, T] bool: token t may attend to this step's token u
    num_context_blocks: jax.Array  # [] blocks of the cached context the longest one reads


def ragged_meta(batch: RaggedBatch, *, page_size: int, block_pages: int) -> RaggedMeta:
    assert batch.page_table.shape[1] % block_pages == 0, "page table width must be whole blocks"
    seq = batch.token_seq
    cached = (batch.kv_lens - batch.num_new)[seq] * batch.is_real  # [T]
    same = seq[:, None] == seq[None, :]
    causal = batch.positions[None, :] <= batch.positions[:, None]
    step_mask = same & causal & (batch.is_real[None, :] > 0)  # [T, T]
    block_tokens = block_pages * page_size
    return RaggedMeta(
        write_slots=batch.write_slots, positions=batch.positions,
        token_pages=batch.page_table[seq], cached_lens=cached, step_mask=step_mask,
        num_context_blocks=(jnp.max(cached) + block_tokens - 1) // block_tokens)


def ragged_attention_jnp(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                         cache_v: jax.Array, layer: jax.Array, meta: RaggedMeta, *,
                         block_pages: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The portable backend: q [T, H, h], this step's k/v [T, K, h] -> ([T, H, h], caches).

    Two parts joined by one online softmax: this step's own keys (dense, causal within each
    sequence, no gather), then the cached context, read `block_pages` pages at a time and only as
    many blocks as the longest cached context needs (a `fori_loop` with a traced trip count), so
    a step never reads pages nobody asked for. The caches ride through the loop and come back:
    a loop that only closed over them would make XLA copy them for it, every layer.
    """
    tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = (q * head_dim ** -0.5).reshape(tokens, kv_heads, num_heads // kv_heads, head_dim)
    scores = _einsum_f32("tkgh,ukh->tkgu", q, k)  # [T, K, G, T]
    scores = jnp.where(meta.step_mask[:, None, None, :], scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)  # [T, K, G]
    p = jnp.exp(scores - m[..., None])
    state = (m, jnp.sum(p, axis=-1), _einsum_f32("tkgu,ukh->tkgh", p.astype(v.dtype), v),
             cache_k, cache_v)
    page_size = cache_k.shape[3]
    block_tokens = block_pages * page_size

    def context_block(j, state):
        m, l, acc, cache_k, cache_v = state
        pages = jax.lax.dynamic_slice_in_dim(meta.token_pages, j * block_pages, block_pages,
                                             axis=1)  # [T, bp]
        kb = _gather_token_pages(cache_k, layer, pages)  # [T, K, bp * S, h]
        vb = _gather_token_pages(cache_v, layer, pages)
        scores = _einsum_f32("tkgh,tksh->tkgs", q, kb)  # [T, K, G, bp * S]
        key_pos = j * block_tokens + jnp.arange(block_tokens)
        visible = key_pos[None, :] < meta.cached_lens[:, None]  # [T, bp * S]
        scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        acc = acc * rescale[..., None] + _einsum_f32("tkgs,tksh->tkgh", p.astype(vb.dtype), vb)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc, cache_k, cache_v

    _, l, acc, cache_k, cache_v = jax.lax.fori_loop(0, meta.num_context_blocks, context_block,
                                                    state)
    out = (acc / l[..., None]).reshape(tokens, num_heads, head_dim).astype(q.dtype)
    return out, cache_k, cache_v


def _gather_token_pages(cache: jax.Array, layer: jax.Array, pages: jax.Array) -> jax.Array:
    """cache [L, K, P, S, h] at `layer`, pages [T, bp] -> [T, K, bp * S, h]."""
    blocks = cache[layer, :, pages]  # one gather: [T, bp, K, S, h]
    tokens, num_pages, kv_heads, page_size, head_dim = blocks.shape
    return blocks.transpose(0, 2, 1, 3, 4).reshape(tokens, kv_heads, num_pages * page_size,
                                                   head_dim)


def ragged_attention_pallas_gpu(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                                cache_v: jax.Array, layer: jax.Array, meta: RaggedMeta, *,
                                block_pages: int, interpret: bool = False
                                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The NVIDIA GPU backend: JAX's Pallas (Triton) paged-attention kernel, one query per token.

    The kernel serves one query per row, so each token is a row with its own sequence's page
    table and a length of `position + 1`: this step's keys were written first, so the kernel
    reads them from the cache too and causality falls out of the lengths. It does not scale the
    scores: q is pre-scaled. `interpret=True` runs it on the CPU (slowly), for the parity test.
    """
    del k, v, block_pages
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    head_dim = q.shape[-1]
    num_pages = meta.token_pages.shape[1]
    k_splits = math.gcd(num_pages, 16)
    out = pallas_paged.paged_attention(
        q * head_dim ** -0.5, cache_k[layer], cache_v[layer], meta.token_pages,
        meta.positions + 1, k_splits=k_splits,
        pages_per_compute_block=min(8, num_pages // k_splits), interpret=interpret)
    return out.astype(q.dtype), cache_k, cache_v


ATTENTION_BACKENDS = {"jnp": ragged_attention_jnp, "pallas-gpu": ragged_attention_pallas_gpu}


def default_backend(platform: str) -> str:
    """The attention backend `auto` means on `platform` ("cpu", "gpu", "tpu")."""
    return "pallas-gpu" if platform == "gpu" else "jnp"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedContext:
    """What attention reads and writes in a ragged step: the caches, the step's metadata, and the
    backend (static)."""

    k: jax.Array
    v: jax.Array
    meta: RaggedMeta
    backend: str = dataclasses.field(metadata=dict(static=True))
    block_pages: int = dataclasses.field(metadata=dict(static=True))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               layer: jax.Array) -> tuple[jax.Array, "RaggedContext"]:
        """q [T, H, h], k/v [T, K, h] -> [T, H, h]. Writes before it reads."""
        cache_k, cache_v = write_kv(self.k, self.v, layer, k, v, self.meta.write_slots)
        out, cache_k, cache_v = ATTENTION_BACKENDS[self.backend](
            q, k, v, cache_k, cache_v, layer, self.meta, block_pages=self.block_pages)
        return out, dataclasses.replace(self, k=cache_k, v=cache_v)


def ragged_context(cache: KVCache, batch: RaggedBatch, *, backend: str,
                   block_pages: int) -> RaggedContext:
    meta = ragged_meta(batch, page_size=cache.page_size, block_pages=block_pages)
    return RaggedContext(k=cache.k, v=cache.v, meta=meta, backend=backend,
                         block_pages=block_pages)
