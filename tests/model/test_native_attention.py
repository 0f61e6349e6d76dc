"""The native attention kernel over the paged KV cache (`native/paged_attention.cc`): with native
kernels on, the portable backend gives what its XLA path gives (the step's own keys scored
densely, the cached context through its loops), on one ragged step mixing decodes, a prefill
chunk after cached context, a fresh prompt and padding slots, over scattered pages of several
layers, with grouped query heads, a sliding window and soft-capped scores; it reads the step's
own keys from the pages the step wrote them to, so the program scores no token against the whole
step; padding slots get zeros; and inside a layer scan it reads the caches where they lie, never
a copy. Skipped, with the reason, where no C++ compiler can build it."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.model import native_dot
from meshserve.model.attention import AttentionSpec, KVCache, RaggedBatch, ragged_context

try:
    native_dot.ensure_registered()
except native_dot.NativeUnavailable as err:  # no compiler: the option is refused, nothing else
    pytest.skip(str(err), allow_module_level=True)

# Pages of 16 tokens: the kernel's AVX-512 path takes a page's scores 16 keys at a time.
LAYERS, KV_HEADS, GROUPS, HEAD_DIM, PAGE_SIZE, BLOCK_PAGES, MAX_PAGES = 3, 2, 3, 16, 16, 2, 8
# (cached tokens, new tokens) per sequence: decodes after short and long contexts (ending
# mid-page), a chunk after 21 cached tokens, a fresh prompt.
SEQUENCES = [(40, 1), (21, 6), (0, 5), (9, 1), (33, 1)]
NUM_SLOTS = 18  # 14 real tokens and 4 padding slots


def _step(seed=0):
    """One ragged step over caches of random values everywhere (pages past a sequence's length
    and the dummy page included, so a key read that should not be changes the output): the
    batch, the step's q [T, H, h], k and v [T, K, h], and the caches [L, K, P, S, h]."""
    rng = np.random.default_rng(seed)
    totals = [c + n for c, n in SEQUENCES]
    num_pages = 1 + sum(-(-t // PAGE_SIZE) for t in totals) + 3  # 3 pages nobody owns
    ids = iter(rng.permutation(np.arange(1, num_pages)))  # page 0 stays the dummy
    page_table = np.zeros((len(SEQUENCES), MAX_PAGES), np.int32)
    flat = {name: np.zeros(NUM_SLOTS, np.int32)
            for name in ("tokens", "positions", "token_seq", "is_real", "write_slots")}
    flat["token_seq"][:] = len(SEQUENCES) - 1
    start = 0
    for s, ((cached, new), total) in enumerate(zip(SEQUENCES, totals)):
        pages = np.array([next(ids) for _ in range(-(-total // PAGE_SIZE))])
        page_table[s, :len(pages)] = pages
        span = slice(start, start + new)
        positions = np.arange(cached, total)
        flat["positions"][span], flat["token_seq"][span], flat["is_real"][span] = positions, s, 1
        flat["write_slots"][span] = (pages[positions // PAGE_SIZE] * PAGE_SIZE
                                     + positions % PAGE_SIZE)
        start += new
    batch = RaggedBatch(**flat, kv_lens=np.array(totals, np.int32),
                        num_new=np.array([n for _, n in SEQUENCES], np.int32),
                        last=np.zeros(len(SEQUENCES), np.int32), page_table=page_table)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    cache_shape = (LAYERS, KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    return (batch, normal(NUM_SLOTS, KV_HEADS * GROUPS, HEAD_DIM),
            normal(NUM_SLOTS, KV_HEADS, HEAD_DIM), normal(NUM_SLOTS, KV_HEADS, HEAD_DIM),
            normal(*cache_shape), normal(*cache_shape))


def _attend(batch, q, k, v, cache_k, cache_v, layer, window, *, native, softcap):
    """One layer's attention of the step (its k and v written first), traced with native
    kernels on or off."""
    spec = AttentionSpec(window=window, softcap=softcap)
    with native_dot.enabled(native):
        context = ragged_context(KVCache(cache_k, cache_v), batch, backend="jnp",
                                 block_pages=BLOCK_PAGES)
        out, context = context.attend(q, k, v, layer, spec)
    return out, context.k, context.v


@pytest.mark.parametrize("window, softcap", [(None, 0.0), (20, 2.0)])
def test_native_attention_equals_the_xla_path(window, softcap):
    batch, q, k, v, cache_k, cache_v = _step()
    window = None if window is None else jnp.int32(window)
    run = {native: jax.jit(functools.partial(_attend, native=native, softcap=softcap))
           for native in (True, False)}
    for layer in (0, 2):
        native, cache_k_native, _ = run[True](batch, q, k, v, cache_k, cache_v,
                                              jnp.int32(layer), window)
        loops, cache_k_loops, _ = run[False](batch, q, k, v, cache_k, cache_v,
                                             jnp.int32(layer), window)
        # Padding slots see no key at all: the XLA path's outputs there are any uniform mix (of
        # the masked keys of their query block), the kernel's zeros.
        real = batch.is_real > 0
        loops = np.asarray(loops)[real]
        np.testing.assert_allclose(np.asarray(native)[real], loops, rtol=0,
                                   atol=1e-5 * np.abs(loops).max())
        np.testing.assert_array_equal(np.asarray(native)[~real], 0.0)
        np.testing.assert_array_equal(np.asarray(cache_k_native), np.asarray(cache_k_loops))


def test_native_attention_scores_no_token_against_the_whole_step():
    """The step's own keys come from their pages: with native kernels on, the program holds no
    [T, K, G, T] scores (every token against every slot of the step), which the XLA path
    computes; without them it does."""
    batch, q, k, v, cache_k, cache_v = _step()
    scores = f"f32[{NUM_SLOTS},{KV_HEADS},{GROUPS},{NUM_SLOTS}]"
    for native in (True, False):
        hlo = jax.jit(functools.partial(_attend, native=native, softcap=0.0)).lower(
            batch, q, k, v, cache_k, cache_v, jnp.int32(1), None).compile().as_text()
        assert (scores in hlo) == (not native), native


def test_native_attention_reads_the_layer_scans_caches_in_place():
    """Attention in every layer of a loop that carries the caches (as the layer scan does):
    the compiled program calls the kernel on them and never copies a cache."""
    batch, q, k, v, cache_k, cache_v = _step()

    def layers(cache_k, cache_v):
        def layer(i, state):
            out, cache_k, cache_v = _attend(batch, state[0], k, v, *state[1:], i, None,
                                            native=True, softcap=0.0)
            return out, cache_k, cache_v
        return jax.lax.fori_loop(0, LAYERS, layer, (q, cache_k, cache_v))

    hlo = jax.jit(layers, donate_argnums=(0, 1)).lower(cache_k, cache_v).compile().as_text()
    assert native_dot.ATTENTION_TARGET in hlo
    cache_type = "f32[" + ",".join(map(str, cache_k.shape)) + "]"
    copies = [line for line in hlo.splitlines()
              if re.search(r"\bcopy(-start)?\(", line) and cache_type in line.split("=")[1]]
    assert not copies, copies
