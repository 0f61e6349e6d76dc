"""The ragged attention backends against dense attention, on a mixed flat batch of tokens.

One batch holds a decode, a chunk that follows a cached context longer than one context block,
a fresh prompt and padding slots, over shuffled pages. Each backend must give, for every real
token, what dense causal attention over its own sequence gives; with a layer's `AttentionSpec`
(a sliding window, soft-capped scores, a query scale) too, or the backend refuses it by name.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.model.attention import (ATTENTION_BACKENDS, DEFAULT_SPEC, AttentionSpec, RaggedBatch,
                                       choose_backend, dense_attention, ragged_attention_pallas_gpu,
                                       ragged_meta, window_mask, write_kv)
from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import RunnerConfig

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


def _dense_reference(q_all, k_all, v_all, spec=DEFAULT_SPEC):
    """Each sequence's new tokens under dense causal attention over its whole context (inside
    the spec's window)."""
    outs = []
    for (cached, new), q, k, v in zip(SEQUENCES, q_all, k_all, v_all):
        total = cached + new
        q_full = np.zeros((1, total, HEADS, HEAD_DIM), np.float32)
        q_full[0, cached:] = q
        pos = np.arange(total)
        mask = (pos[None, :, None] >= pos[None, None, :]) & window_mask(
            jnp.asarray(pos[None]), total, spec)
        out = dense_attention(jnp.asarray(q_full), jnp.asarray(k[None]), jnp.asarray(v[None]),
                              jnp.asarray(mask), spec)
        outs.append(np.asarray(out)[0, cached:])
    return np.concatenate(outs)


def _run(backend, spec=DEFAULT_SPEC, poison=None):
    """The backend's output on `_case()`, and the dense reference. `poison` names pages, as
    (sequence, page index) pairs, whose cached K and V become NaN: a backend that reads one
    (even to mask it) returns NaN."""
    batch, (q, k, v), cache_k, cache_v, sequences = _case()
    for seq, index in poison or ():
        page = batch.page_table[seq, index]
        cache_k, cache_v = (c.at[:, :, page].set(jnp.nan) for c in (cache_k, cache_v))
    meta = ragged_meta(jax.tree.map(jnp.asarray, batch), page_size=PAGE_SIZE,
                       block_pages=BLOCK_PAGES)
    layer = jnp.int32(0)
    cache_k, cache_v = write_kv(cache_k, cache_v, layer, jnp.asarray(k), jnp.asarray(v),
                                meta.write_slots)
    got, kept_k, kept_v = backend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache_k,
                                  cache_v, layer, meta, block_pages=BLOCK_PAGES, spec=spec)
    np.testing.assert_array_equal(kept_k, cache_k)  # the caches come back untouched
    np.testing.assert_array_equal(kept_v, cache_v)
    num_real = sum(n for _, n in SEQUENCES)
    return np.asarray(got), num_real, _dense_reference(*sequences, spec=spec)


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


# Gemma-like: a 5-token window (narrower than a block of 8), scores capped at 3, a query scale of
# its own.
SLIDING = AttentionSpec(window=jnp.int32(5), scale=0.3, softcap=3.0)


def test_portable_backend_keeps_to_a_sliding_window_with_soft_capped_scores():
    got, num_real, want = _run(ATTENTION_BACKENDS["jnp"], SLIDING)
    np.testing.assert_allclose(got[:num_real], want, atol=1e-5, rtol=1e-5)
    full, _, _ = _run(ATTENTION_BACKENDS["jnp"], AttentionSpec(scale=0.3, softcap=3.0))
    assert np.abs(full[:num_real] - got[:num_real]).max() > 1e-2  # the window mattered


def test_portable_backend_never_reads_pages_behind_every_window():
    """The decode at position 30 sees keys 26..30, so its blocks 0-2 (pages 0-5) are never
    read; the chunk at 21..26 sees keys from 17 on, so its blocks 0-1 (pages 0-3) are not
    either. Poisoned with NaN, they would turn the output to NaN if read."""
    behind = [(0, i) for i in range(6)] + [(1, i) for i in range(4)]
    got, num_real, want = _run(ATTENTION_BACKENDS["jnp"], SLIDING, poison=behind)
    np.testing.assert_allclose(got[:num_real], want, atol=1e-5, rtol=1e-5)
    one_more, _, _ = _run(ATTENTION_BACKENDS["jnp"], SLIDING, poison=behind + [(0, 6)])
    assert np.isnan(one_more[0]).all()  # page 6 holds keys 24..27: inside the decode's window


def test_pallas_gpu_backend_soft_caps_scores():
    interpret = jax.default_backend() != "gpu"
    spec = AttentionSpec(scale=0.3, softcap=3.0)
    got, num_real, want = _run(functools.partial(ragged_attention_pallas_gpu,
                                                 interpret=interpret), spec)
    tolerance = 1e-5 if interpret else 2e-2
    np.testing.assert_allclose(got[:num_real], want, atol=tolerance, rtol=tolerance)


def test_pallas_gpu_kernel_raises_rather_than_ignore_a_window():
    """Not an assert, which `python -O` strips: a window reaching the kernel is an error."""
    with pytest.raises(ValueError, match="cannot apply a sliding window"):
        _run(functools.partial(ragged_attention_pallas_gpu, interpret=True), SLIDING)


def test_pallas_gpu_backend_is_refused_for_what_it_cannot_run_by_name_on_every_platform():
    """A window (the kernel masks by length only) and tiles that are not powers of two."""
    fits = dict(sliding_window=0, head_dim=64, page_size=16)
    for platform in ("cpu", "gpu"):
        assert choose_backend("pallas-gpu", platform=platform, **fits) == "pallas-gpu"
        for change, named in [(dict(sliding_window=8), "sliding window of 8 tokens"),
                              (dict(head_dim=96), "head_dim is 96"),
                              (dict(page_size=24), "page_size .* got 24")]:
            with pytest.raises(ValueError, match=f"attention='pallas-gpu' cannot run this "
                                                 f"model: .*{named}.*use attention='jnp'"):
                choose_backend("pallas-gpu", platform=platform, **fits | change)
    assert choose_backend("jnp", platform="gpu", **fits | dict(sliding_window=8)) == "jnp"


def test_auto_picks_the_gpu_kernel_only_on_a_gpu_and_only_where_it_can_run():
    fits = dict(sliding_window=0, head_dim=64, page_size=16)
    assert choose_backend("auto", platform="gpu", **fits) == "pallas-gpu"
    for platform in ("cpu", "tpu"):
        assert choose_backend("auto", platform=platform, **fits) == "jnp"
    for change in (dict(sliding_window=8), dict(head_dim=80), dict(page_size=12)):
        assert choose_backend("auto", platform="gpu", **fits | change) == "jnp"


def test_the_runner_config_settles_the_backend_for_the_models_window():
    """`RunnerConfig.backend` hands `choose_backend` the model's window, and none when no layer
    slides (a window the layer types leave unused)."""
    llama = ModelConfig.preset("tiny-llama")
    windowed = llama.replace(sliding_window=8)
    unused = llama.replace(sliding_window=8, layer_types=("full", "full"))
    assert RunnerConfig().backend(llama, platform="gpu") == "pallas-gpu"
    assert RunnerConfig().backend(windowed, platform="gpu") == "jnp"
    assert RunnerConfig().backend(unused, platform="gpu") == "pallas-gpu"
    assert RunnerConfig().backend(windowed, platform="cpu") == "jnp"
    with pytest.raises(ValueError, match="attention='pallas-gpu'.*sliding_window=8"):
        RunnerConfig(attention="pallas-gpu").backend(windowed, platform="cpu")
