"""Head padding: zero-weight heads appended so the head counts divide `model`, exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.model.config import ModelConfig
from meshserve.model.executor.steps import forward_dense
from meshserve.model.transformer import model_from_params
from meshserve.sharding.head_padding import (needs_head_padding, pad_array, pad_heads,
                                             padded_config, padded_head_counts)
from meshserve.sharding.layout import prepare
from tests.conftest import random_params

# SmolLM2-135M attention (9 heads, 3 kv heads, head_dim 64, width 576) with a short stack and a
# small vocabulary, so the dense reference stays fast.
SMOLLM2_SHAPES = dict(num_layers=2, vocab_size=1024)
# Weight scale per model width: 0.12 * sqrt(64 / width) keeps the activations of width 576 as
# large as those of the width-64 tiny models. At 0.12 the SmolLM2-shaped logits reach 12 and the
# float32 rounding of the longer head contraction alone moves them by 4e-5.
WEIGHT_SCALE = {"smollm2-135m": 0.04}

PADDED_CASES = [
    ("tiny-llama", {}, 4),
    ("tiny-llama", {"qkv_bias": True}, 4),
    ("smollm2-135m", SMOLLM2_SHAPES, 2),
    ("smollm2-135m", SMOLLM2_SHAPES, 4),
]


@pytest.mark.parametrize("preset,model_size,want", [
    ("tiny-llama", 1, (4, 2)),
    ("tiny-llama", 2, (4, 2)),
    ("tiny-llama", 4, (8, 4)),
    ("smollm2-135m", 2, (12, 4)),
    ("smollm2-135m", 3, (9, 3)),
    ("smollm2-135m", 4, (12, 4)),
    ("smollm2-135m", 8, (24, 8)),
    ("llama-2-70b", 8, (64, 8)),
    ("llama-2-70b", 16, (128, 16)),
])
def test_padded_head_counts(preset, model_size, want):
    config = ModelConfig.preset(preset)
    assert padded_head_counts(config, model_size) == want
    assert needs_head_padding(config, model_size) == (want != (config.num_heads,
                                                              config.num_kv_heads))
    heads, kv_heads = want
    assert kv_heads % model_size == 0 and heads % model_size == 0
    assert heads // kv_heads == config.num_heads // config.num_kv_heads  # group size kept
    padded = padded_config(config, model_size)
    assert (padded.num_heads, padded.num_kv_heads) == want
    assert padded.replace(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads) == config


def test_gpt2_heads_are_never_padded():
    config = ModelConfig.preset("tiny-gpt2")
    assert padded_config(config, 2) is config
    with pytest.raises(ValueError, match="head padding needs grouped-query attention"):
        padded_config(config, 3)


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray])
def test_pad_array_appends_zeros_on_head_axes_only(as_array):
    padded = padded_config(ModelConfig.preset("smollm2-135m"), 4)  # 12 heads, 4 kv heads
    value = as_array(np.arange(2 * 5 * 9 * 3, dtype=np.float32).reshape(2, 5, 9, 3) + 1)
    out = pad_array(value, ("layers", "embed", "heads", "head_dim"), padded)
    assert type(out) is type(value)
    assert out.shape == (2, 5, 12, 3)
    np.testing.assert_array_equal(np.asarray(out)[:, :, :9], np.asarray(value))
    assert not np.asarray(out)[:, :, 9:].any()
    kv = as_array(np.ones((5, 3, 3), np.float32))
    assert pad_array(kv, ("embed", "kv_heads", "head_dim"), padded).shape == (5, 4, 3)
    norm = as_array(np.ones((2, 5), np.float32))
    assert pad_array(norm, ("layers", "embed"), padded) is norm


def test_pad_heads_returns_the_model_itself_when_heads_divide():
    model = _model("tiny-llama")
    assert pad_heads(model, 2) is model
    assert pad_heads(model, 1) is model


@pytest.mark.parametrize("preset,overrides,model_size", PADDED_CASES)
def test_padded_weights_are_zero_and_real_weights_unchanged(preset, overrides, model_size):
    model = _model(preset, **overrides)
    padded = pad_heads(model, model_size)
    c, p = model.config, padded.config
    assert (p.num_heads, p.num_kv_heads) == padded_head_counts(c, model_size)
    assert (p.num_heads, p.num_kv_heads) != (c.num_heads, c.num_kv_heads)
    assert p.replace(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads) == c

    before, after = _flat(model), _flat(padded)
    assert set(before) == set(after)
    grown = set()
    for key, (axes, old) in before.items():
        new_axes, new = after[key]
        assert new_axes == axes, key
        sizes = {"heads": p.num_heads, "kv_heads": p.num_kv_heads}
        assert new.shape == tuple(sizes.get(a, d) for a, d in zip(axes, old.shape)), key
        real = tuple(slice(0, d) for d in old.shape)
        np.testing.assert_array_equal(new[real], old, err_msg=key)
        mask = np.ones(new.shape, bool)
        mask[real] = False
        assert not new[mask].any(), f"{key}: padding is not zero"
        if new.shape != old.shape:
            grown.add(key)
    want = {"layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel",
            "layers/attn/o/kernel"}
    if c.qkv_bias:
        want |= {"layers/attn/q/bias", "layers/attn/k/bias", "layers/attn/v/bias"}
    assert grown == want


@pytest.mark.parametrize("preset,overrides,model_size", PADDED_CASES)
def test_padded_model_logits_equal_the_unpadded_model(preset, overrides, model_size):
    model = _model(preset, **overrides)
    padded = pad_heads(model, model_size)
    tokens, lengths = _tokens(model.config)
    want = _dense_logits(model, tokens, lengths)
    got = _dense_logits(padded, tokens, lengths)
    assert np.abs(want).max() > 0.1  # logits that differ clearly between tokens
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset,overrides,mesh", [
    ("tiny-llama", {}, "model=4"),
    ("tiny-gpt2", {}, "model=4"),
    ("smollm2-135m", SMOLLM2_SHAPES, "model=2"),
])
def test_padded_and_sharded_model_logits_equal_the_single_device_model(preset, overrides, mesh):
    model = _model(preset, **overrides)
    prepared = prepare(model, mesh)
    tokens, lengths = _tokens(model.config)
    want = _dense_logits(model, tokens, lengths)
    graphdef, state = nnx.split(prepared.model)
    params = jax.device_put(state, prepared.layout.params)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
    got = jax.jit(functools.partial(forward_dense, graphdef))(params, tokens, lengths)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def _model(preset, **overrides):
    config = ModelConfig.preset(preset, **overrides)
    return model_from_params(config, random_params(config, scale=WEIGHT_SCALE.get(preset, 0.12)))


def _flat(model) -> dict[str, tuple[tuple, np.ndarray]]:
    _, state = nnx.split(model)
    return {"/".join(map(str, path)): (tuple(var.axes), np.asarray(var[...]))
            for path, var in nnx.to_flat_state(state)}


def _tokens(config):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, config.vocab_size, (2, 12), dtype=np.int32)
    lengths = np.array([12, 7], np.int32)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def _dense_logits(model, tokens, lengths) -> np.ndarray:
    graphdef, params = nnx.split(model)
    logits = jax.jit(functools.partial(forward_dense, graphdef))(params, tokens, lengths)
    return np.asarray(logits)
