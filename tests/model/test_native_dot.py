"""The native quantized dot (`native_kernels`): the same values as `quantized_matmul`'s jnp path
for every grouped int8 layout a GGUF's blocks are kept in, at one row and at several, inside a
layer scan, and an engine with it on gives the tokens of one without. Skipped, with the reason,
where no C++ compiler can build it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshserve.model import native_dot
from meshserve.model.quant_formats import QuantFormat, from_codes
from meshserve.model.quantized_kernel import QuantizedKernel, quantized_matmul

try:
    native_dot.ensure_registered()
except native_dot.NativeUnavailable as err:  # no compiler: the option is refused, nothing else
    pytest.skip(str(err), allow_module_level=True)

FORMATS = {  # Q8_0; Q4_1/Q4_K-like with minimums; Q6_K's groups of 16 with float32 scales
    "q8_0": QuantFormat(bits=8, group=32, num_contracted=1, num_out=1, has_mins=False,
                        scale_dtype="float16"),
    "mins": QuantFormat(bits=8, group=32, num_contracted=1, num_out=1, has_mins=True,
                        scale_dtype="float16"),
    "q6_k": QuantFormat(bits=8, group=16, num_contracted=1, num_out=1, has_mins=False),
}


def _kernel(fmt: QuantFormat, k: int, n: int, layers: tuple[int, ...] = (), seed: int = 0):
    rng = np.random.default_rng(seed)
    low, high = (0, 15) if fmt.has_mins else (-127, 127)
    codes = rng.integers(low, high + 1, (*layers, k // fmt.group, fmt.group, n))
    scales = rng.uniform(0.001, 0.02, (*layers, k // fmt.group, n))
    mins = -8 * scales if fmt.has_mins else None
    return from_codes(codes, scales, mins, fmt).map(jnp.asarray)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("n", [96, 100])  # 100: outputs that do not fill a block of 32
def test_native_dot_matches_the_jnp_path(name, rows, n):
    q = _kernel(FORMATS[name], 128, n)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 128)), jnp.float32)
    want = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q)).lower(x, q)
    assert native_dot.TARGET in lowered.as_text()
    got = lowered.compile()(x, q)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_the_native_dot_runs_inside_a_layer_scan_and_shows_in_the_hlo():
    q = _kernel(FORMATS["mins"], 64, 64, layers=(3,))
    x = jnp.ones((2, 64), jnp.float32)

    def scanned():  # a function of its own for each trace: jax caches traces by function
        return lambda x, q: jax.lax.scan(
            lambda h, w: (h + 0.01 * quantized_matmul("nd,df->nf", h, w), None), x, q)[0]

    want = jax.jit(scanned())(x, q)
    with native_dot.enabled():
        lowered = jax.jit(scanned()).lower(x, q)
    assert native_dot.TARGET in lowered.as_text()
    np.testing.assert_allclose(lowered.compile()(x, q), want, rtol=2e-5, atol=2e-5)


def test_a_format_the_kernel_does_not_serve_keeps_the_jnp_path():
    """Per-channel int8 (the `int8` scheme) and int4 are left to XLA."""
    per_channel = QuantFormat(bits=8, group=None, num_contracted=1, num_out=1, has_mins=False)
    int4 = QuantFormat(bits=4, group=32, num_contracted=1, num_out=1, has_mins=True,
                       scale_dtype="float16")
    x = jnp.ones((1, 64), jnp.float32)
    for fmt in (per_channel, int4):
        q = from_codes(np.ones((64, 32) if fmt.group is None else (2, 32, 32), np.int64),
                       np.full((32,) if fmt.group is None else (2, 32), 0.01),
                       None if not fmt.has_mins else np.zeros((2, 32)), fmt).map(jnp.asarray)
        assert not native_dot.serves(x, q)


def test_an_engine_with_native_kernels_gives_the_tokens_of_one_without():
    """llama.cpp's tiny Llama-style GGUF (Q4_0 .. Q8_0 kernels kept in int8 containers, groups
    of 32, with and without minimums; a tied Q8_0 table): greedy tokens equal, logprobs to
    float rounding."""
    from pathlib import Path

    from meshserve.batching.sampling import SamplingParams
    from meshserve.model.loading.pretrained import load_pretrained
    from meshserve.serving.engine.core import Engine
    from meshserve.serving.engine.engine_config import EngineConfig

    path = Path(__file__).parents[1] / "golden" / "gguf-llama" / "tiny-llama.gguf"
    prompts = [[1, 45, 99, 200, 7], [1, 300, 12], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    outputs = []
    for native in (False, True):
        # With native kernels the tied Q8_0 table is kept in its blocks on the CPU too: the
        # head reads its codes through the native table kernel.
        model = load_pretrained(str(path), quantization="auto", native_kernels=native).model
        assert isinstance(model.embed.embedding, QuantizedKernel) == native
        engine = Engine.from_model(model, None, EngineConfig(
            max_num_seqs=4, max_model_len=64, num_pages=32, page_size=8, warmup=False,
            native_kernels=native))
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                    logprobs=1)) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
        outputs.append([done[i] for i in ids])
    for plain, native in zip(*outputs):
        assert list(native.token_ids) == list(plain.token_ids)
        np.testing.assert_allclose(native.cumulative_logprob, plain.cumulative_logprob,
                                   rtol=1e-4, atol=1e-4)


def test_native_kernels_are_refused_on_a_mesh():
    from meshserve.serving.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="one CPU device"):
        EngineConfig(mesh="model=2", native_kernels=True)


@pytest.mark.parametrize("has_mins", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_native_table_head_matches_the_jnp_path(has_mins, rows):
    from meshserve.model.quantized_table import table_logits

    fmt = QuantFormat(bits=8, group=32, num_contracted=1, num_out=0, has_mins=has_mins,
                      scale_dtype="float16")
    rng = np.random.default_rng(2)
    codes = rng.integers(0 if has_mins else -127, 16 if has_mins else 128, (100, 2, 32))
    scales = rng.uniform(0.001, 0.02, (100, 2))
    table = from_codes(codes, scales, -8 * scales if has_mins else None, fmt).map(jnp.asarray)
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    want = jax.jit(lambda x, t: table_logits(x, t))(x, table)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, t: table_logits(x, t)).lower(x, table)
    assert native_dot.TABLE_TARGET in lowered.as_text()
    np.testing.assert_allclose(lowered.compile()(x, table), want, rtol=2e-5, atol=2e-5)
