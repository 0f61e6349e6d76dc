"""The ragged attention backends against dense attention, on a mixed flat batch of tokens.

One batch holds a decode, a chunk that follows a cached context longer than one context block,
a fresh prompt and padding slots, over shuffled pages. Each backend must give, for every real
token, what dense causal attention over its own sequence gives.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.model.attention import (ATTENTION_BACKENDS, RaggedBatch, dense_attention,
                                       ragged_attention_pallas_gpu, ragged_meta, write_kv)

PAGE_SIZE, HEADS, KV_HEADS, HEAD_DIM, BLOCK_PAGES, MAX_PAGES = 4, 6, 2, 16, 2, 16
# (cached tokens, new tokens) per sequence: a decode, a chunk after 21 cached tokens (three
# context blocks of 8), a fresh prompt of 9.
SEQUENCES = [(30, 1), (21, 6), (0, 9)]
NUM_SLOTS = 20  # 16 real tokens and 4 padding slots


def _case(seed=0):
    rng = np.random.default_rng(seed)
    totals = [c + n for c, n in SEQUENCES]
    num_pages = 1 + sum(-(-t // PAGE_SIZE) for t in totals)
    ids = iter(rng.permutation(np.arange(1, num_pages)))  # page 0 stays the dummy
    k_all = [rng.standard_normal((t, KV_HEADS, HEAD_DIM)).astype(np.float32) for t in totals]
    v_all = [rng.standard_normal((t, KV_HEADS, HEAD_DIM)).astype(np.float32) for t in totals]
    q_all = [rng.standard_normal((n, HEADS, HEAD_DIM)).astype(np.float32) for _, n in SEQUENCES]
    cache = np.zeros((2, 1, KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), np.float32)  # K, V
    page_table = np.zeros((len(SEQUENCES), MAX_PAGES), np.int32)
    flat = {name: np.zeros(NUM_SLOTS, np.int32)
            for name in ("tokens", "positions", "token_seq", "is_real", "write_slots")}
    q, k, v = (np.zeros((NUM_SLOTS, h, HEAD_DIM), np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
    start = 0
    for s, ((cached, new), total) in enumerate(zip(SEQUENCES, totals)):
        pages = [next(ids) for _ in range(-(-total // PAGE_SIZE))]
        page_table[s, :len(pages)] = pages
        for pos in range(cached):  # the context earlier steps wrote
            cache[:, 0, :, pages[pos // PAGE_SIZE], pos % PAGE_SIZE] = k_all[s][pos], v_all[s][pos]
        span = slice(start, start + new)
        positions = np.arange(cached, total)
        flat["positions"][span], flat["token_seq"][span], flat["is_real"][span] = positions, s, 1
        flat["write_slots"][span] = (np.array(pages)[positions // PAGE_SIZE] * PAGE_SIZE
                                     + positions % PAGE_SIZE)
        q[span], k[span], v[span] = q_all[s], k_all[s][cached:], v_all[s][cached:]
        start += new
    batch = RaggedBatch(**flat, kv_lens=np.array(totals, np.int32),
                        num_new=np.array([n for _, n in SEQUENCES], np.int32),
                        last=np.zeros(len(SEQUENCES), np.int32), page_table=page_table)
    return batch, (q, k, v), jnp.asarray(cache[0]), jnp.asarray(cache[1]), (q_all, k_all, v_all)


def _dense_reference(q_all, k_all, v_all):
    """Each sequence's new tokens under dense causal attention over its whole context."""
    outs = []
    for (cached, new), q, k, v in zip(SEQUENCES, q_all, k_all, v_all):
        total = cached + new
        q_full = np.zeros((1, total, HEADS, HEAD_DIM), np.float32)
        q_full[0, cached:] = q
        pos = np.arange(total)
        mask = pos[None, :, None] >= pos[None, None, :]
        out = dense_attention(jnp.asarray(q_full), jnp.asarray(k[None]), jnp.asarray(v[None]),
                              jnp.asarray(mask))
        outs.append(np.asarray(out)[0, cached:])
    return np.concatenate(outs)


def _run(backend):
    batch, (q, k, v), cache_k, cache_v, sequences = _case()
    meta = ragged_meta(jax.tree.map(jnp.asarray, batch), page_size=PAGE_SIZE,
                       block_pages=BLOCK_PAGES)
    layer = jnp.int32(0)
    cache_k, cache_v = write_kv(cache_k, cache_v, layer, jnp.asarray(k), jnp.asarray(v),
                                meta.write_slots)
    got, kept_k, kept_v = backend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache_k,
                                  cache_v, layer, meta, block_pages=BLOCK_PAGES)
    np.testing.assert_array_equal(kept_k, cache_k)  # the caches come back untouched
    np.testing.assert_array_equal(kept_v, cache_v)
    num_real = sum(n for _, n in SEQUENCES)
    return np.asarray(got), num_real, _dense_reference(*sequences)


def test_portable_backend_equals_dense_attention():
    got, num_real, want = _run(ATTENTION_BACKENDS["jnp"])
    np.testing.assert_allclose(got[:num_real], want, atol=1e-5, rtol=1e-5)
    assert np.isfinite(got).all()  # padding slots too


def test_portable_backend_reads_only_the_blocks_the_longest_context_needs():
    batch, *_ = _case()
    meta = ragged_meta(jax.tree.map(jnp.asarray, batch), page_size=PAGE_SIZE,
                       block_pages=BLOCK_PAGES)
    # The longest cached context is 30 tokens: 4 blocks of 8, not the table's 16 pages / 2.
    assert int(meta.num_context_blocks) == 4
    np.testing.assert_array_equal(np.asarray(meta.cached_lens)[:16], [30] + [21] * 6 + [0] * 9)


def test_pallas_gpu_backend_equals_dense_attention():
    """On an NVIDIA GPU the Triton kernel itself; elsewhere the same kernel in Pallas's interpret
    mode, which checks its inputs (per-token page tables, lengths, the pre-scaled q)."""
    interpret = jax.default_backend() != "gpu"
    got, num_real, want = _run(functools.partial(ragged_attention_pallas_gpu, interpret=interpret))
    tolerance = 1e-5 if interpret else 2e-2  # the GPU's f32 dots may run as TF32
    np.testing.assert_allclose(got[:num_real], want, atol=tolerance, rtol=tolerance)
