"""Attention over the paged KV cache: the one place a kernel plugs in.

Layout of the cache (`KVCache`): for each of K and V one array

    [layers, kv_heads, num_pages, page_size, head_dim]

Page 0 is the dummy page: padding tokens write there and padded page-table entries point there, so
no real page is ever touched by padding. A sequence's token at position p lives in page
`page_table[p // page_size]`, slot `p % page_size`.

A step is one flat batch of tokens (`RaggedBatch`): prefill chunks and decodes of many sequences
back to back, padded only to a token bucket. Writes happen before reads, so a prefill chunk
attends to the pages its earlier chunks wrote and to itself; decode is the one-token case of the
same code.

`ATTENTION_BACKENDS` are the implementations behind `RaggedContext.attend`: the portable
gather-based one (CPU and GPU) and the Pallas GPU kernel. `dense_attention` is the reference that
tests compare them with. None of them knows about batching policy.

Where native kernels are on (one CPU device, `meshserve.model.native_dot`), the portable backend
runs a native kernel over float32 caches instead (`native/paged_attention.cc`): each token reads
its sequence's keys up to its own where they lie in the pages, the step's own keys included
(written before the read), where XLA's path scores every token of the step against every other
and gathers the cached context's pages into a buffer, which costs more than its dots.
SmolLM2-135M's decode step (`scripts/native_attention_step.py`, medians of 11 interleaved
repeats on 2 loaded cores), the context through the kernel: one row after 512 cached tokens
24.95 -> 19.90 ms, 16 rows after 512 144.1 -> 96.8 ms.

What a layer asks of attention beyond q, k and v is an `AttentionSpec`: the query scale, the
soft-cap of the scores (Gemma 2), and the sliding window (keys within `window` positions of the
query, its own included). Every context and backend honours all three, or refuses by name.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model import native_dot

# Finite, so fully masked rows (padding) give uniform weights instead of NaN.
MASK_VALUE = -1e30
# The window of a layer that sees its whole context: larger than any position.
NO_WINDOW = 2 ** 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention beyond q, k and v.

    window    [] int32: query at position p sees keys at positions > p - window (so `window`
              keys, its own included); NO_WINDOW for a full layer. None: no layer of the model
              slides, and no window is computed at all.
    scale     what scores q.k are multiplied by
    softcap   scores become softcap * tanh(score / softcap) before masking; 0: none
    """

    window: jax.Array | None = None
    scale: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    softcap: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    def query_scale(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else self.scale


DEFAULT_SPEC = AttentionSpec()


def _soft_cap(scores: jax.Array, spec: AttentionSpec) -> jax.Array:
    if not spec.softcap:
        return scores
    return spec.softcap * jnp.tanh(scores / spec.softcap)


def _in_window(key_pos: jax.Array, query_pos: jax.Array, spec: AttentionSpec) -> jax.Array:
    """Whether each key is inside its query's window (shapes broadcast); True with no window."""
    if spec.window is None:
        return jnp.ones((), bool)
    return key_pos > query_pos - spec.window


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


def write_kv(cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, k: jax.Array,
             v: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters new k/v [N, K, h] into layer `layer` of the caches at flat slots [N]."""
    page_size = cache_k.shape[3]
    pages, offsets = slots // page_size, slots % page_size
    # Index (layer, :, pages, offsets): the advanced indices lead, so the update is [N, K, h].
    new_k = cache_k.at[layer, :, pages, offsets].set(k, mode="promise_in_bounds")
    new_v = cache_v.at[layer, :, pages, offsets].set(v, mode="promise_in_bounds")
    return new_k, new_v


def window_mask(query_pos: jax.Array, num_keys: int, spec: AttentionSpec) -> jax.Array:
    """[B, T, S] whether key position s is inside the window of the query at query_pos [B, T]."""
    return _in_window(jnp.arange(num_keys)[None, None, :], query_pos[:, :, None], spec)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    spec: AttentionSpec = DEFAULT_SPEC) -> jax.Array:
    """Reference attention. q [B, T, H, h]; k, v [B, S, K, h]; mask [B, T, S] (window included)."""
    return _masked_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, spec)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      spec: AttentionSpec = DEFAULT_SPEC) -> jax.Array:
    """q [B, T, H, h]; k, v [B, K, S, h]; mask [B, T, S] -> [B, T, H, h]."""
    batch, tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, tokens, kv_heads, num_heads // kv_heads, head_dim)  # [B, T, K, G, h]
    scores = _einsum_f32("btkgh,bksh->bkgts", q, k)
    scores = _soft_cap(scores * spec.query_scale(head_dim), spec)
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
class DenseContext:
    """Full causal attention over one padded batch, with no cache: the reference path."""

    mask: jax.Array  # [B, T, T]
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array,
               spec: AttentionSpec = DEFAULT_SPEC) -> tuple[jax.Array, "DenseContext"]:
        del layer
        b, t = self.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = self.mask & window_mask(positions, t, spec)
        out = dense_attention(q.reshape(b, t, *q.shape[1:]), k.reshape(b, t, *k.shape[1:]),
                              v.reshape(b, t, *v.shape[1:]), mask, spec)
        return out.reshape(q.shape), self


def dense_context(lengths: jax.Array, num_tokens: int) -> DenseContext:
    """Causal mask for B rows padded to `num_tokens`, each with its real length."""
    pos = jnp.arange(num_tokens)
    causal = pos[None, :, None] >= pos[None, None, :]
    real = pos[None, None, :] < lengths[:, None, None]
    return DenseContext(mask=causal & real, shape=(lengths.shape[0], num_tokens))


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
    adapters    [T]     LoRA adapter slot of each token (0: the base model), or None for a
                        model served without LoRA (`meshserve.model.lora`)
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
    adapters: jax.Array | None = None

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
    by_length: jax.Array  # [T] token slots in the order of their cached lengths (jnp backend)
    key_ends: jax.Array  # [T] a real token's position + 1, padding's 0 (the native kernel)


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
        num_context_blocks=(jnp.max(cached) + block_tokens - 1) // block_tokens,
        by_length=jnp.argsort(cached),
        key_ends=jnp.where(batch.is_real > 0, batch.positions + 1, 0))


# Tokens whose cached context one iteration of the context loop reads together, taken in the
# order of their cached lengths. A block of a fresh prompt's tokens (nothing cached) skips the
# loop; a block of decodes reads the context its longest sequence needs. Sorted blocks of 4 were
# the fastest measured on chat-mix (docs/benchmarks.md, "Default flags against every peer").
QUERY_BLOCK = 4


def ragged_attention_jnp(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                         cache_v: jax.Array, layer: jax.Array, meta: RaggedMeta, *,
                         block_pages: int, spec: AttentionSpec = DEFAULT_SPEC
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The portable backend: q [T, H, h], this step's k/v [T, K, h] -> ([T, H, h], caches).

    Two parts joined by one online softmax: this step's own keys (dense, causal within each
    sequence, no gather), then the cached context, read `block_pages` pages at a time. The
    context is read per block of `QUERY_BLOCK` token slots, each block reading only as many
    context blocks as its own tokens need (loops with traced trip counts): so the tokens of a
    fresh prompt read no pages, and a step never reads pages nobody asked for. With a sliding
    window each token's blocks start at the block holding its window's first key, so pages
    behind every window are never read. The caches ride through the loops and come back: a loop
    that only closed over them would make XLA copy them for it, every layer.

    Where native kernels are on and the caches are float32, both parts are the native kernel's
    (`_native_attention`), which reads each token's keys, the step's own ones included (the step
    wrote them before it attends), in place in their pages; neither part is traced then.
    """
    tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = (q * spec.query_scale(head_dim)).reshape(tokens, kv_heads, num_heads // kv_heads,
                                                  head_dim)
    if _native_serves(q, cache_k, cache_v):
        out = _native_attention(q, cache_k, cache_v, layer, meta, spec)
        return out.reshape(tokens, num_heads, head_dim), cache_k, cache_v
    scores = _soft_cap(_einsum_f32("tkgh,ukh->tkgu", q, k), spec)  # [T, K, G, T]
    step_mask = meta.step_mask & _in_window(meta.positions[None, :], meta.positions[:, None],
                                            spec)
    scores = jnp.where(step_mask[:, None, None, :], scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)  # [T, K, G]
    p = jnp.exp(scores - m[..., None])
    l = jnp.sum(p, axis=-1)
    acc = _einsum_f32("tkgu,ukh->tkgh", p.astype(v.dtype), v)
    block_tokens = block_pages * cache_k.shape[3]
    width = math.gcd(tokens, QUERY_BLOCK)
    # The context loop runs over token slots in the order of their cached lengths, so a block
    # of slots reads about as much context as each of its tokens needs, not the step's longest.
    order = meta.by_length
    by_length = lambda a: jnp.take(a, order, axis=0)  # noqa: E731
    q_s, pages_s, cached_s, positions_s = (by_length(a) for a in (
        q, meta.token_pages, meta.cached_lens, meta.positions))

    def query_block(b, state):
        m, l, acc, cache_k, cache_v = state
        rows = lambda a: jax.lax.dynamic_slice_in_dim(a, b * width, width)  # noqa: E731
        cached, positions = rows(cached_s), rows(positions_s)  # [Q]
        first_block, num_blocks = _context_blocks(cached, positions, spec, block_tokens)
        read = functools.partial(_context_block, rows(q_s), rows(pages_s), cached,
                                 positions, first_block, layer, block_pages, spec)
        m_b, l_b, acc_b, cache_k, cache_v = jax.lax.fori_loop(
            0, num_blocks, read, (rows(m), rows(l), rows(acc), cache_k, cache_v))
        put = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x, b * width, 0)  # noqa: E731
        return put(m, m_b), put(l, l_b), put(acc, acc_b), cache_k, cache_v

    # Slots with no cached context sort first and need no loop: start at the first block holding
    # one that has.
    first_query_block = (tokens - jnp.sum(cached_s > 0)) // width
    num_query_blocks = jnp.where(meta.num_context_blocks > 0, tokens // width, 0)
    _, l_s, acc_s, cache_k, cache_v = jax.lax.fori_loop(
        first_query_block, num_query_blocks, query_block,
        (by_length(m), by_length(l), by_length(acc), cache_k, cache_v))
    l, acc = l.at[order].set(l_s), acc.at[order].set(acc_s)
    out = (acc / l[..., None]).reshape(tokens, num_heads, head_dim).astype(q.dtype)
    return out, cache_k, cache_v


def _native_serves(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array) -> bool:
    """Whether the native kernel reads the context: native kernels are on (traced for one CPU
    device) and q and the caches are float32, the dtype it reads."""
    return native_dot.active() and all(a.dtype == jnp.float32 for a in (q, cache_k, cache_v))


def _native_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
                      meta: RaggedMeta, spec: AttentionSpec) -> jax.Array:
    """Attention [T, K, G, h] of q (scaled, [T, K, G, h]) over each token's keys up to its own
    (`meta.key_ends`: the cached context and the step's own keys, which the step has written),
    read by the native kernel in place in layer `layer` of the caches [L, K, P, S, h] (whole: a
    slice would be copied out for the call). Padding tokens get zeros."""
    window = NO_WINDOW if spec.window is None else spec.window
    call = jax.ffi.ffi_call(native_dot.ATTENTION_TARGET,
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, cache_k, cache_v, jnp.asarray(layer, jnp.int32), meta.token_pages,
                meta.key_ends, meta.positions, jnp.asarray(window, jnp.int32),
                softcap=np.float32(spec.softcap))


def _context_blocks(cached_lens: jax.Array, positions: jax.Array, spec: AttentionSpec,
                    block_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(first block, number of blocks) of cached context a block of token slots reads
    (cached_lens, positions [Q]). Without a window every token starts at block 0 and the longest
    context sets the count. With one, token t starts at the block holding its first visible key,
    max(0, position - window + 1), and needs the blocks from there to its cached length; the
    count is the most any token needs."""
    if spec.window is None:
        return jnp.zeros((), jnp.int32), (jnp.max(cached_lens) + block_tokens - 1) // block_tokens
    first_key = jnp.maximum(positions - spec.window + 1, 0)  # [Q]
    first = first_key // block_tokens
    needed = (cached_lens - first * block_tokens + block_tokens - 1) // block_tokens
    return first, jnp.max(jnp.maximum(needed, 0))


def _block_pages(token_pages: jax.Array, block: jax.Array, block_pages: int) -> jax.Array:
    """token_pages [Q, M] at each token's block `block` ([] shared, or [Q]) -> [Q, bp]."""
    if block.ndim == 0:
        return jax.lax.dynamic_slice_in_dim(token_pages, block * block_pages, block_pages,
                                            axis=1)
    index = block[:, None] * block_pages + jnp.arange(block_pages)  # [Q, bp]
    # A token that needs fewer blocks than the widest window runs past its table's end here;
    # those keys lie beyond its cached length, so clipping to the last page is never seen.
    return jnp.take_along_axis(token_pages, index, axis=1, mode="clip")


def _context_block(q, token_pages, cached_lens, positions, first_block, layer, block_pages,
                   spec, j, state):
    """Context block j (counted from each token's `first_block`) of a block of Q token slots:
    q [Q, K, G, h], token_pages [Q, M], cached_lens and positions [Q]; the online softmax state
    (m, l, acc) of those tokens, and the caches."""
    m, l, acc, cache_k, cache_v = state
    block_tokens = block_pages * cache_k.shape[3]
    block = first_block + j  # [] or [Q]
    pages = _block_pages(token_pages, block, block_pages)  # [Q, bp]
    kb = _gather_token_pages(cache_k, layer, pages)  # [Q, K, bp * S, h]
    vb = _gather_token_pages(cache_v, layer, pages)
    scores = _soft_cap(_einsum_f32("tkgh,tksh->tkgs", q, kb), spec)  # [Q, K, G, bp * S]
    key_pos = jnp.expand_dims(block * block_tokens, -1) + jnp.arange(block_tokens)
    visible = (key_pos < cached_lens[:, None]) & _in_window(
        key_pos, positions[:, None], spec)  # [Q, bp * S]
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.exp(scores - m_new[..., None])
    rescale = jnp.exp(m - m_new)
    acc = acc * rescale[..., None] + _einsum_f32("tkgs,tksh->tkgh", p.astype(vb.dtype), vb)
    return m_new, l * rescale + jnp.sum(p, axis=-1), acc, cache_k, cache_v


def _gather_token_pages(cache: jax.Array, layer: jax.Array, pages: jax.Array) -> jax.Array:
    """cache [L, K, P, S, h] at `layer`, pages [T, bp] -> [T, K, bp * S, h]."""
    blocks = cache[layer, :, pages]  # one gather: [T, bp, K, S, h]
    tokens, num_pages, kv_heads, page_size, head_dim = blocks.shape
    return blocks.transpose(0, 2, 1, 3, 4).reshape(tokens, kv_heads, num_pages * page_size,
                                                   head_dim)


def ragged_attention_pallas_gpu(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                                cache_v: jax.Array, layer: jax.Array, meta: RaggedMeta, *,
                                block_pages: int, spec: AttentionSpec = DEFAULT_SPEC,
                                interpret: bool = False
                                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The NVIDIA GPU backend: JAX's Pallas (Triton) paged-attention kernel, one query per token.

    The kernel serves one query per row, so each token is a row with its own sequence's page
    table and a length of `position + 1`: this step's keys were written first, so the kernel
    reads them from the cache too and causality falls out of the lengths. It does not scale the
    scores: q is pre-scaled. It soft-caps the scores itself. It masks keys by length only, so it
    cannot keep to a sliding window: a model with one is refused (`choose_backend`), and so is
    one it cannot tile. Triton tiles are powers of two, so the pages a tile reads (a divisor of
    the partition's pages, at most 8) are one too. `interpret=True` runs it on the CPU (slowly),
    for the parity test.
    """
    del k, v, block_pages
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    if spec.window is not None:  # not an assert: it must hold under `python -O` too
        raise ValueError("the pallas-gpu attention backend cannot apply a sliding window; "
                         "choose_backend refuses it for a model with one")
    num_pages = meta.token_pages.shape[1]
    k_splits = math.gcd(num_pages, 16)
    out = pallas_paged.paged_attention(
        q * spec.query_scale(q.shape[-1]), cache_k[layer], cache_v[layer], meta.token_pages,
        meta.positions + 1, k_splits=k_splits,
        pages_per_compute_block=math.gcd(num_pages // k_splits, 8),
        attn_logits_soft_cap=spec.softcap or None, interpret=interpret)
    return out.astype(q.dtype), cache_k, cache_v


ATTENTION_BACKENDS = {"jnp": ragged_attention_jnp, "pallas-gpu": ragged_attention_pallas_gpu}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def backend_limit(backend: str, *, sliding_window: int, head_dim: int,
                  page_size: int) -> str | None:
    """Why `backend` cannot run a model with this sliding window (0: no layer slides) and
    head_dim over pages of `page_size` tokens, or None when it can. Only the Pallas kernel has
    limits: it masks keys by length only, and Triton loads tiles whose sizes are powers of two."""
    if backend != "pallas-gpu":
        return None
    if sliding_window:
        return (f"JAX's Pallas paged-attention kernel masks keys by length only, so it cannot "
                f"apply a sliding window, and this model has a sliding window of "
                f"{sliding_window} tokens (sliding_window={sliding_window})")
    if not _power_of_two(head_dim):
        return (f"its Triton tiles need a head_dim that is a power of two, and this model's "
                f"head_dim is {head_dim}")
    if not _power_of_two(page_size):
        return f"its Triton tiles need a page_size that is a power of two, got {page_size}"
    return None


def choose_backend(attention: str, *, platform: str, sliding_window: int, head_dim: int,
                   page_size: int) -> str:
    """The attention backend a runner runs: the one decision, taken for every runner.

    `attention` is the option: "auto" or a name in `ATTENTION_BACKENDS`. On `platform` "gpu",
    "auto" is `pallas-gpu` when that kernel can run the model (`backend_limit`), else `jnp`;
    elsewhere ("cpu", "tpu") it is `jnp`. A named backend that cannot run the model is refused,
    on every platform, with a ValueError naming the option, the reason and the fix.
    """
    if attention == "auto":
        fast = "pallas-gpu"
        if platform == "gpu" and backend_limit(fast, sliding_window=sliding_window,
                                               head_dim=head_dim, page_size=page_size) is None:
            return fast
        return "jnp"
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be 'auto' or one of {tuple(ATTENTION_BACKENDS)}, got "
                         f"{attention!r}")
    why = backend_limit(attention, sliding_window=sliding_window, head_dim=head_dim,
                        page_size=page_size)
    if why is not None:
        raise ValueError(f"attention={attention!r} cannot run this model: {why}; use "
                         f"attention='jnp' (or 'auto')")
    return attention


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

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array,
               spec: AttentionSpec = DEFAULT_SPEC) -> tuple[jax.Array, "RaggedContext"]:
        """q [T, H, h], k/v [T, K, h] -> [T, H, h]. Writes before it reads."""
        cache_k, cache_v = write_kv(self.k, self.v, layer, k, v, self.meta.write_slots)
        out, cache_k, cache_v = ATTENTION_BACKENDS[self.backend](
            q, k, v, cache_k, cache_v, layer, self.meta, block_pages=self.block_pages,
            spec=spec)
        return out, dataclasses.replace(self, k=cache_k, v=cache_v)


def ragged_context(cache: KVCache, batch: RaggedBatch, *, backend: str,
                   block_pages: int) -> RaggedContext:
    meta = ragged_meta(batch, page_size=cache.page_size, block_pages=block_pages)
    return RaggedContext(k=cache.k, v=cache.v, meta=meta, backend=backend,
                         block_pages=block_pages)
