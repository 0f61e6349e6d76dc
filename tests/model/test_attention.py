"""The dense reference attention and the paged cache's writes (the ragged backends against the
reference: test_ragged_attention.py)."""

import jax.numpy as jnp
import numpy as np

from meshserve.model.attention import MASK_VALUE, dense_attention, write_kv


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
