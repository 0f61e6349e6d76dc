"""Paged attention against the dense reference, on random pages and page tables."""

import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.model.attention import (MASK_VALUE, dense_attention, paged_attention, write_kv)


def _scatter_into_pages(values, page_table, num_pages, page_size):
    """values [B, S, K, h] -> pages [1, K, P, page_size, h] laid out by page_table."""
    batch, seq, kv_heads, head_dim = values.shape
    pages = np.zeros((1, kv_heads, num_pages, page_size, head_dim), np.float32)
    for b in range(batch):
        for pos in range(seq):
            pages[0, :, page_table[b, pos // page_size], pos % page_size] = values[b, pos]
    return jnp.asarray(pages)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_equals_dense_on_shuffled_pages(page_size):
    rng = np.random.default_rng(page_size)
    batch, seq, heads, kv_heads, head_dim = 3, 37, 6, 2, 8
    pages_per_seq = -(-seq // page_size)
    num_pages = 1 + batch * pages_per_seq
    ids = rng.permutation(np.arange(1, num_pages))  # page 0 stays the dummy
    page_table = ids.reshape(batch, pages_per_seq).astype(np.int32)
    q = rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, head_dim)).astype(np.float32)
    lengths = np.array([37, 20, 1])
    pos = np.arange(seq)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    want = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))

    cache_k = _scatter_into_pages(k, page_table, num_pages, page_size)
    cache_v = _scatter_into_pages(v, page_table, num_pages, page_size)
    key_pos = np.arange(pages_per_seq * page_size)
    paged_mask = (key_pos[None, None, :] <= pos[None, :, None]) & (
        key_pos[None, None, :] < lengths[:, None, None])
    got = paged_attention(jnp.asarray(q), cache_k, cache_v, jnp.int32(0), jnp.asarray(page_table),
                          jnp.asarray(paged_mask))
    for b, n in enumerate(lengths):  # rows past a sequence's length are padding
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-5)


def test_fully_masked_rows_are_finite():
    q = jnp.ones((1, 2, 2, 4))
    k = v = jnp.ones((1, 3, 1, 4))
    out = dense_attention(q, k, v, jnp.zeros((1, 2, 3), bool))
    assert np.isfinite(np.asarray(out)).all()
    assert MASK_VALUE < -1e20


def test_write_kv_touches_only_given_slots_of_given_layer():
    cache = jnp.zeros((2, 1, 4, 2, 3))
    k = jnp.arange(6, dtype=jnp.float32).reshape(2, 1, 3) + 1
    new_k, new_v = write_kv(cache, cache, jnp.int32(1), k, -k, jnp.array([3, 6]))
    new_k = np.asarray(new_k)
    assert not new_k[0].any()  # other layer untouched
    np.testing.assert_array_equal(new_k[1, 0, 1, 1], [1, 2, 3])  # slot 3 = page 1, offset 1
    np.testing.assert_array_equal(new_k[1, 0, 3, 0], [4, 5, 6])  # slot 6 = page 3, offset 0
    assert np.count_nonzero(new_k) == 6
    np.testing.assert_array_equal(np.asarray(new_v)[1, 0, 1, 1], [-1, -2, -3])
