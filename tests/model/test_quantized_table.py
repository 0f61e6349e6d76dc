"""An embedding table kept in quantized blocks: rows and the tied LM head read from its codes equal
the dequantized float table's, the head never writes the whole table out in float, and a model
holding one gives the tokens of the same model with the float table, on one device, on meshes and
through a checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.model import quantized_table
from meshserve.model.config import ModelConfig
from meshserve.model.executor.steps import forward_dense
from meshserve.model.loading import load_gguf
from meshserve.model.loading.checkpoint import load_checkpoint, save_checkpoint
from meshserve.model.quant_formats import (QuantFormat, QuantizedArray, dequantize, from_codes,
                                           quantize)
from meshserve.model.quantized_table import table_logits, table_rows
from meshserve.model.quantized_weights import kernel_formats, quantized_arrays, weight_bytes
from meshserve.model.loading.pretrained import scheme_plans
from meshserve.model.transformer import abstract_model, model_from_params
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.engine_config import EngineConfig
from tests.conftest import random_params
from tests.model.test_quant import _f32_buffers
from tests.serving.test_meshes import ENGINE, _assert_same, _run, _tiny_requests

# The layouts a GGUF table arrives in: Q8_0 (groups of 32, float16 scales), Q6_K-like (groups of
# 16, float32 scales), a mixed kernel's common format (mins), a 4-bit one (Q4_0 on a GPU), and
# Q6_K as a file's K-quant table is kept (int8 sub-scales times a float32 scale per 64 here).
FORMATS = {
    "q8_0": QuantFormat(bits=8, group=32, num_contracted=1, num_out=0, has_mins=False,
                        scale_dtype="float16"),
    "q6_k": QuantFormat(bits=8, group=16, num_contracted=1, num_out=0, has_mins=False),
    "mins": QuantFormat(bits=8, group=16, num_contracted=1, num_out=0, has_mins=True),
    "int4": QuantFormat(bits=4, group=32, num_contracted=1, num_out=0, has_mins=True,
                        scale_dtype="float16"),
    "q6_k super": QuantFormat(bits=8, group=16, num_contracted=1, num_out=0, has_mins=False,
                              scale_dtype="int8", super_group=64),
}


def _table(fmt: QuantFormat, vocab: int = 100, dim: int = 64, seed: int = 0):
    """A random quantized table [vocab, dim] in `fmt`, from random codes, scales and mins."""
    rng = np.random.default_rng(seed)
    low, high = (-127, 127) if fmt.bits == 8 and not fmt.has_mins else (0, 2 ** fmt.bits - 1)
    codes = rng.integers(low, high + 1, (vocab, dim // fmt.group, fmt.group))
    if fmt.super_group:  # 8-bit sub-scales, a float32 scale per super group
        return from_codes(codes, rng.integers(-128, 128, (vocab, dim // fmt.group)), None, fmt,
                          super_scales=rng.uniform(1e-5, 1e-4, (vocab, dim // fmt.super_group)))
    scales = rng.uniform(0.001, 0.02, (vocab, dim // fmt.group))
    mins = -rng.uniform(0.0, 0.1, scales.shape) if fmt.has_mins else None
    return from_codes(codes, scales, mins, fmt)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 5])
def test_rows_and_logits_match_the_dequantized_table(name, rows, monkeypatch):
    """Chunks of 16 rows of the vocabulary: 100 = six chunks and a tail of four."""
    monkeypatch.setattr(quantized_table, "CHUNK_BYTES", 16 * 64 * 4)
    q = _table(FORMATS[name])
    table = dequantize(q)
    ids = np.array([[3, 99], [0, 42]], np.int32)
    got = jax.jit(lambda ids: table_rows(q.map(jnp.asarray), ids, jnp.float32))(ids)
    np.testing.assert_allclose(got, table[ids], rtol=1e-6, atol=1e-7)  # a fused multiply-add
    x = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
    logits = jax.jit(lambda x: table_logits(x, q.map(jnp.asarray)))(x)
    assert logits.shape == (rows, 100)
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_the_head_never_writes_the_whole_table_in_float(rows):
    """One chunk of the table is dequantized at a time, for one row as for several. The plain
    product of the dequantized table is the control: XLA holds the whole table in float."""
    vocab, dim = 8192, 256
    q = _table(FORMATS["q8_0"], vocab, dim).map(jnp.asarray)
    x = jnp.ones((rows, dim), jnp.float32)
    naive = jax.jit(lambda x, q: x @ dequantize(q, xp=jnp).T)
    assert max(_f32_buffers(naive.lower(x, q).compile().as_text())) == vocab * dim
    chunk = quantized_table.CHUNK_BYTES // (dim * 4)
    biggest = max(_f32_buffers(jax.jit(table_logits).lower(x, q).compile().as_text()))
    assert biggest <= max(chunk * dim, rows * vocab), biggest


@pytest.mark.parametrize("tied, platform, kept", [
    (True, "gpu", True), (True, "cpu", False), (False, "cpu", True), (False, "gpu", True)])
def test_a_files_table_is_kept_unless_the_cpus_head_reads_it(tied, platform, kept):
    """Loading keeps a table's blocks (in 8 bits: Q8_0 does not fit int4's 4) except a tied one
    on the CPU, whose LM head reads a float table faster; an untied model's table is only
    gathered, so it is kept everywhere, under auto in the file's own bits (a step dequantizes
    only its rows)."""
    model = abstract_model(ModelConfig.preset("tiny-llama", head_dim=32, tie_embeddings=tied))
    for scheme in ("auto", "int8", "int4"):
        plans = scheme_plans(scheme, platform=platform)(model.config)
        assert ("embed/embedding" in plans) == kept, scheme
        if kept:
            assert plans["embed/embedding"].fmt is None  # a float table stays float
            assert 8 in plans["embed/embedding"].keep_bits
            if scheme == "auto" and not tied:
                assert plans["embed/embedding"].keep_bits == (4, 5, 6, 8)


# -- a model holding a quantized table ----------------------------------------------------------

CONFIG = ModelConfig.preset("tiny-llama", head_dim=32, num_layers=3, tie_embeddings=True)
REQUESTS = _tiny_requests()[:2]


@pytest.fixture(scope="module")
def models():
    """(the model with its table in Q8_0-like blocks, the same model with those values as a
    float table, the first one's outputs on one device)."""
    params = random_params(CONFIG)
    q = quantize(params["embed/embedding"], FORMATS["q8_0"])
    quantized = model_from_params(CONFIG, {**params, "embed/embedding": q})
    floats = model_from_params(CONFIG, {**params, "embed/embedding": dequantize(q)})
    return quantized, floats, _outputs(quantized)


def _outputs(model, mesh: str | None = None) -> list:
    return _run(Engine.from_model(model, None, EngineConfig(mesh=mesh, **ENGINE)), REQUESTS)


def test_a_quantized_table_gives_the_float_tables_tokens(models):
    quantized, floats, want = models
    assert set(quantized_arrays(quantized)) == {"embed/embedding"}
    assert weight_bytes(quantized) < weight_bytes(floats) - 0.7 * 512 * 64 * 4
    _assert_same(_outputs(floats), want)


@pytest.mark.slow
def test_a_quantized_table_on_a_mesh_gives_one_devices_tokens(models):
    """Split over `model`, the codes and scales split by vocabulary rows alike; over stages, the
    first stage gathers rows and the last reads the head from the same codes."""
    quantized, _, want = models
    _assert_same(_outputs(quantized, "stage=2,model=2"), want)


def test_a_quantized_table_round_trips_a_checkpoint(models, tmp_path):
    quantized, _, _ = models
    directory = save_checkpoint(quantized, None, tmp_path / "ckpt")
    _, restored, _ = load_checkpoint(directory)
    want, back = quantized_arrays(quantized)["embed/embedding"], quantized_arrays(restored)[
        "embed/embedding"]
    assert back.format == want.format
    for name, array in want.arrays().items():
        np.testing.assert_array_equal(np.asarray(back.arrays()[name]), np.asarray(array))


def test_an_untied_head_is_kept_on_a_gpu_and_float_on_the_cpu():
    """The untied head's kernel, like a tied table, is kept in a file's blocks only where the
    head reads codes as fast as floats; no scheme quantizes it, so a float head stays float."""
    model = abstract_model(ModelConfig.preset("tiny-llama", head_dim=32, tie_embeddings=False))
    for scheme in ("auto", "int8", "int4"):
        assert "lm_head/kernel" in scheme_plans(scheme, platform="gpu")(model.config)
        assert "lm_head/kernel" not in scheme_plans(scheme, platform="cpu")(model.config)
    assert "lm_head/kernel" not in kernel_formats(model, "int8")


def test_a_files_untied_head_kept_computes_the_float_heads_logits():
    """llama.cpp's Q4_K_M of a tiny Mistral-style model (its head in Q8_0, its table in Q5_0),
    loaded with a GPU's plans, and with the CPU's with native kernels: head and table stay in
    their blocks, exactly (the table in its own 5 bits on both: it is only gathered), and the
    model gives the logits of the same file read as floats."""
    path = Path(__file__).parents[1] / "golden" / "gguf-llama" / "tiny-mistral-q4km.gguf"
    _, floats = load_gguf(path)
    for plans in (scheme_plans("auto", platform="gpu"),
                  scheme_plans("auto", platform="cpu", native=True)):
        config, params = load_gguf(path, plans=plans)
        for key in ("lm_head/kernel", "embed/embedding"):
            assert isinstance(params[key], QuantizedArray), key
            np.testing.assert_array_equal(dequantize(params[key]), floats[key], err_msg=key)
        assert (params["embed/embedding"].format.bits, params["lm_head/kernel"].format.bits) \
            == (5, 8)
        tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % config.vocab_size)
        lengths = jnp.asarray([6, 4], jnp.int32)
        logits = [forward_dense(*nnx.split(model_from_params(config, p)), tokens, lengths)
                  for p in (floats, params)]
        np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)
