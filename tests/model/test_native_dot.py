"""The native quantized dot (`native_kernels`): the same values as `quantized_matmul`'s jnp path
for every grouped int8 layout a GGUF's blocks are kept in, at one row and at several, inside a
layer scan (reading each layer's codes in place from the stacks), and an engine with it on gives
the tokens of one without. Skipped, with the reason,
where no C++ compiler can build it."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.model import native_dot
from meshserve.model.quant_formats import (QuantFormat, QuantizedArray, dequantize, from_codes,
                                           group_scales, unpacked_codes)
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
    # the same blocks packed in the bits a file spends on them: Q4_1 (and the int4 schemes'
    # groups of 64), Q5_0 (signed, stored plus 16), Q5_1, Q6_K (plus 32), Q6_K with Q4_K
    "4-bit": QuantFormat(bits=4, group=32, num_contracted=1, num_out=1, has_mins=True,
                         scale_dtype="float16"),
    "4-bit-g64": QuantFormat(bits=4, group=64, num_contracted=1, num_out=1, has_mins=True,
                             scale_dtype="float16"),
    "5-bit": QuantFormat(bits=5, group=32, num_contracted=1, num_out=1, has_mins=False,
                         scale_dtype="float16", offset=16),
    "5-bit-mins": QuantFormat(bits=5, group=32, num_contracted=1, num_out=1, has_mins=True,
                              scale_dtype="float16"),
    "6-bit": QuantFormat(bits=6, group=16, num_contracted=1, num_out=1, has_mins=False,
                         offset=32),
    "6-bit-mins": QuantFormat(bits=6, group=16, num_contracted=1, num_out=1, has_mins=True,
                              offset=32),
}


def _code_range(fmt: QuantFormat) -> tuple[int, int]:
    if fmt.bits == 8:
        return (0, 15) if fmt.has_mins else (-127, 127)
    return -fmt.offset, (1 << fmt.bits) - 1 - fmt.offset


def _kernel(fmt: QuantFormat, k: int, n: int, layers: tuple[int, ...] = (), seed: int = 0):
    rng = np.random.default_rng(seed)
    low, high = _code_range(fmt)
    codes = rng.integers(low, high + 1, (*layers, k // fmt.group, fmt.group, n))
    scales = rng.uniform(0.001, 0.02, (*layers, k // fmt.group, n))
    mins = -8 * scales if fmt.has_mins else None
    return from_codes(codes, scales, mins, fmt).map(jnp.asarray)


def _target(fmt: QuantFormat) -> str:
    return native_dot.TARGET if fmt.bits == 8 else native_dot.PACKED_TARGET


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 13])
def test_native_dot_matches_the_jnp_path(name, rows):
    """600 outputs: ranges of 256, 256 and 88 (whole blocks of 32 in registers, a ragged rest),
    on XLA's threads; 1 row, 3 rows (one at a time), 13 (8 + 4 + 1)."""
    q = _kernel(FORMATS[name], 128, 600)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 128)), jnp.float32)
    want = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q)).lower(x, q)
    assert _target(FORMATS[name]) in lowered.as_text()
    got = lowered.compile()(x, q)
    _assert_within_x_rounding(got, want, x, dequantize(q.map(np.asarray)), q.format.group)


def _x_rounding_bound(x: np.ndarray, w: np.ndarray, g: int, finer: float = 1) -> np.ndarray:
    """The most the kernels' integer path may move each output [M, N]: it rounds every
    row of x per group of the kernel's G to a step of 1/32512 of the group's largest |x| (16
    bits; `finer` times smaller for rows kept to more bits), an error of at most half a step a
    value, so output (m, j) moves at most the sum over groups of that half step times the
    group's sum of |w[k, j]|; plus float32 rounding of the sums, relative to the sum of |x w|
    (both paths sum ~K products)."""
    k, n = w.shape
    half_step = np.abs(x).reshape(len(x), k // g, g).max(-1) / 32512 / 2 / finer  # [M, K / G]
    weight = np.abs(w).reshape(k // g, g, n).sum(1)  # [K / G, N]
    return half_step @ weight + 1e-6 * (np.abs(x) @ np.abs(w))


def _assert_within_x_rounding(got, want, x, w, g: int, finer: float = 1) -> None:
    """`got` [M, N] against `want` for x [M, K] and the dequantized kernel w [K, N] (groups
    of g along K)."""
    got, want, x, w = (np.asarray(a, np.float64) for a in (got, want, x, w))
    bound = _x_rounding_bound(x, w, g, finer)
    worst = np.abs(got - want) / bound
    assert worst.max() <= 1.0, f"output {np.unravel_index(worst.argmax(), worst.shape)} is off " \
                               f"by {worst.max():.2f}x the rounding bound"


CASES = {  # Q4_1 (mins of their own), Q4_0 (-8 d), Q4 in groups of 64, Q5_0, Q5_1, Q6_K; Q8_0
    "q4_1": (FORMATS["4-bit"], "random"),
    "q4_0": (FORMATS["4-bit"], "-8 d"),
    "q4-g64": (FORMATS["4-bit-g64"], "random"),
    "q5_0": (FORMATS["5-bit"], None),
    "q5_1": (FORMATS["5-bit-mins"], "random"),
    "q6_k": (FORMATS["6-bit"], None),
    "q6-mins": (FORMATS["6-bit-mins"], "random"),
    # groups of 8: the float path (the integer one takes groups of 16 to 64), its float16
    # scales (some subnormal) converted in the kernel
    "q4-g8": (dataclasses.replace(FORMATS["4-bit"], group=8), "random"),
    # int8 codes [K, N]: Q8_0, with minimums, in groups of 16 and of 48
    "q8_0": (FORMATS["q8_0"], None),
    "q8-mins": (FORMATS["mins"], "random"),
    "q8-g16": (FORMATS["q6_k"], None),
    "q8-g48": (dataclasses.replace(FORMATS["q8_0"], group=48), None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [1, 4, 9, 16, 17, 40, 130])
@pytest.mark.parametrize("n", [611, 45])
def test_kernels_are_off_the_float_path_by_x_rounding_at_most(case, rows, n):
    """Packed and int8 codes (float16 scales as a file's blocks keep them, float32 for Q6_K) at
    decode row counts (1; 4 and 16, blocks of four rows; 9, blocks and one alone) and a prefill
    chunk's (17 and 40: blocks of four and a rest; 130: two chunks of rows, 68 and 62), where
    the kernel takes them (`max_rows`; beyond, XLA's dot), and odd widths: 611 outputs (at one
    row, ranges of 256, 256 and 99; at several, blocks of 64 columns; a ragged one last) and 45
    (one ragged block). x has a group of zeros and values far apart in size. With AVX-512 VNNI
    the kernels round x to 16 bits per group (integer dots), so they are held to the bound that
    rounding allows, which a lost bit of x, a column or a code out of place would exceed many
    times; without, the float path is well inside it."""
    fmt, mins = CASES[case]
    rng = np.random.default_rng(4)
    k = 192  # three units of 64 codes, six of 32
    low, high = _code_range(fmt)
    codes = rng.integers(low, high + 1, (k // fmt.group, fmt.group, n))
    scales = rng.uniform(0.001, 0.02, (k // fmt.group, n))
    if fmt.group == 8:
        scales = 10 ** rng.uniform(-6.5, -1.7, scales.shape)
    if mins == "random":
        mins = rng.uniform(-0.2, 0.05, scales.shape)
    elif mins == "-8 d":
        mins = -8 * scales
    q = from_codes(codes, scales, mins, fmt).map(jnp.asarray)
    x = rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 30.0], (rows, k))
    x[0, :64] = 0.0  # whole groups of zeros
    x = jnp.asarray(x, jnp.float32)
    want = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q)).lower(x, q)
    assert (_target(fmt) in lowered.as_text()) == (rows <= native_dot.max_rows(fmt))
    _assert_within_x_rounding(lowered.compile()(x, q), want, x, dequantize(q.map(np.asarray)),
                              fmt.group)


@pytest.mark.parametrize("case", ["q4_1", "q6_k", "q8_0"])
def test_a_row_with_a_massive_activation_is_rounded_to_24_bits(case):
    """A row whose largest |x| is hundreds of times the rest (a massive activation: SmolLM2's
    down projection sees them at a prompt's first token), among rows that run in blocks of four:
    16 bits of its groups' largest |x| would leave the other values of a group a few bits, so
    the several-row kernels keep it to 24 (8 more, `kWide` in the kernel) and hold it to a bound
    256 times finer; the other rows keep theirs."""
    fmt, mins = CASES[case]
    rng = np.random.default_rng(5)
    k, n, rows = 192, 70, 9
    low, high = _code_range(fmt)
    codes = rng.integers(low, high + 1, (k // fmt.group, fmt.group, n))
    scales = rng.uniform(0.001, 0.02, (k // fmt.group, n))
    q = from_codes(codes, scales, -8 * scales if mins else None, fmt).map(jnp.asarray)
    x = rng.standard_normal((rows, k))
    wide = np.array([1, 6, 7])  # a pair and one alone
    x[wide, [37, 100, 191]] = [3000.0, -800.0, 5000.0]
    x = jnp.asarray(x, jnp.float32)
    want = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    with native_dot.enabled():
        got = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    w = dequantize(q.map(np.asarray))
    _assert_within_x_rounding(got[wide], want[wide], x[wide], w, fmt.group, finer=256)
    _assert_within_x_rounding(got, want, x, w, fmt.group)


@pytest.mark.parametrize("case", ["q4_1", "q8_0"])
def test_a_nan_in_x_reaches_its_rows_outputs_as_on_the_float_path(case):
    q = _kernel(CASES[case][0], 128, 64)
    x = np.random.default_rng(5).standard_normal((2, 128)).astype(np.float32)
    x[1, 40] = np.nan
    with native_dot.enabled():
        got = np.asarray(jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q))
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()


SUPER_FORMATS = {  # K-quants kept in their sub-scales: Q4_K alone, Q4_K with Q6_K, a Q6_K table
    "q4_k": QuantFormat(bits=4, group=32, num_contracted=1, num_out=1, has_mins=True,
                        scale_dtype="uint8", super_group=256),
    "q4_k+q6_k": QuantFormat(bits=6, group=16, num_contracted=1, num_out=1, has_mins=True,
                             scale_dtype="int8", offset=32, super_group=256),
    "q6_k int8": QuantFormat(bits=8, group=16, num_contracted=1, num_out=1, has_mins=False,
                             scale_dtype="int8", super_group=256),
}


def _super_kernel(fmt: QuantFormat, k: int, n: int, seed: int = 0):
    """Random codes, 6-bit sub-scales (and mins) and float16-valued super scales (and
    -dmin): a K-quant kernel."""
    rng = np.random.default_rng(seed)
    low, high = _code_range(fmt)
    codes = rng.integers(low, high + 1, (k // fmt.group, fmt.group, n))
    scales = rng.integers(0, 64, (k // fmt.group, n))
    mins = rng.integers(0, 64, (k // fmt.group, n)) if fmt.has_mins else None
    supers = rng.uniform(1e-4, 1e-3, (2, k // fmt.super_group, n)).astype(np.float16)
    q = from_codes(codes, scales, mins, fmt, super_scales=supers[0],
                   super_mins=-supers[1] if fmt.has_mins else None)
    return q.map(jnp.asarray)


@pytest.mark.parametrize("name", list(SUPER_FORMATS))
@pytest.mark.parametrize("rows", [1, 13])
def test_super_group_scales_reach_the_kernel_as_their_float32_products(name, rows):
    """A kernel in super groups runs natively, its scales multiplied out to float32 right
    before the call: the very floats a kernel of float32 scales per group holds, so the two
    give equal outputs; and the jnp path's within the bound of x's rounding."""
    fmt = SUPER_FORMATS[name]
    q = _super_kernel(fmt, 512, 96)
    scales, mins = group_scales(q, jnp)
    old = from_codes(np.asarray(unpacked_codes(q, jnp)), np.asarray(scales),
                     None if mins is None else np.asarray(mins),
                     dataclasses.replace(fmt, scale_dtype="float32", super_group=None))
    old = old.map(jnp.asarray)
    np.testing.assert_array_equal(dequantize(old, xp=jnp), dequantize(q, xp=jnp))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 512)), jnp.float32)
    want = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, q)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q)).lower(x, q)
        got_old = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))(x, old)
    assert _target(fmt) in lowered.as_text()
    got = lowered.compile()(x, q)
    np.testing.assert_array_equal(got, got_old)
    _assert_within_x_rounding(got, want, x, dequantize(q.map(np.asarray)), fmt.group)


@pytest.mark.parametrize("bits", [8, 5])
def test_attention_kernels_of_several_axes_run_as_matrices(bits):
    """q's kernel [D, H, hd] (two output axes) and o's [H, hd, D] (two contracted axes, groups
    along hd) run natively, as the matrices their layouts already are."""
    fmt = FORMATS["q8_0" if bits == 8 else "5-bit"]
    rng = np.random.default_rng(3)
    low, high = _code_range(fmt)
    q_fmt = dataclasses.replace(fmt, num_out=2)
    o_fmt = dataclasses.replace(fmt, num_contracted=2)
    q_kernel = from_codes(rng.integers(low, high + 1, (64 // 32, 32, 4, 32)),
                          rng.uniform(0.001, 0.02, (2, 4, 32)), None, q_fmt).map(jnp.asarray)
    o_kernel = from_codes(rng.integers(low, high + 1, (4, 32 // 32, 32, 64)),
                          rng.uniform(0.001, 0.02, (4, 1, 64)), None, o_fmt).map(jnp.asarray)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)

    def attention():  # a function of its own for each trace: jax caches traces by function
        return lambda x, wq, wo: quantized_matmul(
            "nqh,qhd->nd", quantized_matmul("nd,dqh->nqh", x, wq), wo)

    with native_dot.enabled():
        lowered = jax.jit(attention()).lower(x, q_kernel, o_kernel)
    assert lowered.as_text().count(_target(fmt)) == 2
    # x is rounded before each dot: each kernel on its own, within that rounding
    for spec, h, kernel in (("nd,dqh->nqh", x, q_kernel),
                            ("nqh,qhd->nd", quantized_matmul("nd,dqh->nqh", x, q_kernel),
                             o_kernel)):
        plain = quantized_matmul(spec, h, kernel)
        with native_dot.enabled():
            native = jax.jit(lambda h, w, spec=spec: quantized_matmul(spec, h, w))(h, kernel)
        w = dequantize(kernel.map(np.asarray))
        k = math.prod(w.shape[:kernel.format.num_contracted])
        _assert_within_x_rounding(native.reshape(3, -1), plain.reshape(3, -1), h.reshape(3, -1),
                                  w.reshape(k, -1), kernel.format.group)


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
    """Per-channel int8 (the `int8` scheme) and bfloat16 activations are left to XLA."""
    per_channel = QuantFormat(bits=8, group=None, num_contracted=1, num_out=1, has_mins=False)
    q = from_codes(np.ones((64, 32), np.int64), np.full((32,), 0.01), None,
                   per_channel).map(jnp.asarray)
    assert native_dot.matmul("nd,df->nf", jnp.ones((1, 64), jnp.float32), q) is None
    grouped = _kernel(FORMATS["4-bit"], 64, 32)
    assert native_dot.matmul("nd,df->nf", jnp.ones((1, 64), jnp.bfloat16), grouped) is None
    # the float kernels (groups of 8, which the integer dots do not take) serve a decode step's
    # rows; more (a prefill chunk) go to XLA's dot
    float_only = _kernel(dataclasses.replace(FORMATS["4-bit"], group=8), 64, 32)
    assert native_dot.max_rows(float_only.format) == 16
    many = jnp.ones((17, 64), jnp.float32)
    assert native_dot.matmul("nd,df->nf", many, float_only) is None
    assert native_dot.matmul("nd,df->nf", many[:16], float_only) is not None
    # where the integer dots serve a format (the kernels are built for this CPU: AVX-512 VNNI and
    # BW), prefill chunks of up to 512 rows run natively; elsewhere 16 rows, as the float kernels
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    if {"avx512_vnni", "avx512bw"} <= set(flags):
        assert native_dot.max_rows(grouped.format) >= 512
        assert native_dot.matmul("nd,df->nf", jnp.ones((512, 64), jnp.float32),
                                 grouped) is not None
    else:
        assert native_dot.max_rows(grouped.format) == 16


def test_an_engine_with_native_kernels_gives_the_tokens_of_one_without():
    """llama.cpp's tiny Llama-style GGUF (Q4_0 .. Q8_0 kernels kept in int8 containers, groups
    of 32, with and without minimums; a tied Q8_0 table): greedy tokens equal, logprobs to
    float rounding."""
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
@pytest.mark.parametrize("rows", [1, 9, 16, 33])
@pytest.mark.parametrize("vocab, dim", [(101, 64), (300, 640)])
def test_the_native_table_head_matches_the_jnp_path(has_mins, rows, vocab, dim):
    """One row (each row's codes straight into its dot, in floats: to float rounding) and 9 to
    33 (blocks of 16 rows of the table, the last one ragged, against four rows of x at a time,
    then one; with AVX-512 VNNI through integer dots, so within the bound of x's rounding; with
    AMX against blocks of 16 rows of x, the last one ragged). 300 rows of 640 split into ranges
    on XLA's threads."""
    fmt = QuantFormat(bits=8, group=32, num_contracted=1, num_out=0, has_mins=has_mins,
                      scale_dtype="float16")
    rng = np.random.default_rng(2)
    codes = rng.integers(0 if has_mins else -127, 16 if has_mins else 128,
                         (vocab, dim // 32, 32))
    scales = rng.uniform(0.001, 0.02, (vocab, dim // 32))
    table = from_codes(codes, scales, -8 * scales if has_mins else None, fmt).map(jnp.asarray)
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.float32)
    _assert_native_table_head(x, table)


@pytest.mark.parametrize("rows", [1, 9])
def test_the_native_table_head_reads_a_k_quant_table(rows):
    """A Q6_K table kept in 8 bits with its int8 sub-scales and a float32 d per 256: the head's
    native kernel gets their products, and gives the jnp path's logits (at one row exactly as
    the float path sums, at several through integer dots, within the bound of x's rounding)."""
    fmt = dataclasses.replace(SUPER_FORMATS["q6_k int8"], num_out=0)
    rng = np.random.default_rng(4)
    table = from_codes(rng.integers(-32, 32, (101, 16, 16)), rng.integers(-128, 128, (101, 16)),
                       None, fmt, super_scales=rng.uniform(1e-5, 1e-4, (101, 1)))
    table = table.map(jnp.asarray)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    _assert_native_table_head(x, table)


@pytest.mark.parametrize("has_mins", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 16])
def test_the_native_table_head_reads_float16_scales_in_place(has_mins, rows):
    """A Q8_0 table's float16 scales (and mins) reach the table kernel as they are, no float32
    copy written before the call, and give exactly the logits of the same scales in float32
    (37 rows of the table: two blocks of 16 and a ragged one)."""
    fmt = QuantFormat(bits=8, group=32, num_contracted=1, num_out=0, has_mins=has_mins,
                      scale_dtype="float16")
    rng = np.random.default_rng(5)
    scales = rng.uniform(0.001, 0.02, (37, 4))
    half = from_codes(rng.integers(-127, 128, (37, 4, 32)), scales,
                      -8 * scales if has_mins else None, fmt).map(jnp.asarray)
    assert half.scales.dtype == jnp.float16
    wide = half.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.float16 else a)
    x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
    head = jax.jit(native_dot.table_dot)
    lowered = head.lower(x, half)
    call = next(line for line in lowered.as_text().splitlines()
                if native_dot.TABLE_TARGET in line)
    assert "xf16>" in call and "convert" not in lowered.as_text()
    np.testing.assert_array_equal(lowered.compile()(x, half), head(x, wide))


def _assert_native_table_head(x, table) -> None:
    """The head through the native table kernel against the jnp path: at one row the float
    path's sums (within 2e-5), at several the integer dots (within the bound of x's rounding)."""
    from meshserve.model.quantized_table import table_logits

    want = jax.jit(lambda x, t: table_logits(x, t))(x, table)
    with native_dot.enabled():
        lowered = jax.jit(lambda x, t: table_logits(x, t)).lower(x, table)
    assert native_dot.TABLE_TARGET in lowered.as_text()
    got = lowered.compile()(x, table)
    if x.shape[0] == 1:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    else:
        _assert_within_x_rounding(got, want, x, dequantize(table.map(np.asarray)).T,
                                  table.format.group)


def test_native_kernels_are_on_by_default_where_they_run_and_off_elsewhere():
    assert native_dot.resolve(None) and native_dot.resolve(True)
    assert not native_dot.resolve(False)
    assert not native_dot.resolve(None, num_devices=2)  # a mesh: XLA's dots, split
    with pytest.raises(native_dot.NativeUnavailable, match="one CPU device"):
        native_dot.resolve(True, num_devices=2)


def test_without_a_compiler_the_default_is_off_and_asking_for_them_says_why(tmp_path):
    """A compiler that fails (here /bin/false as $CXX): unset turns native kernels off with a
    warning; asked for, they are refused with the build's error."""
    import os
    import subprocess
    import sys

    script = (
        "from meshserve.model import native_dot\n"
        "assert native_dot.resolve(None) is False\n"
        "try:\n"
        "    native_dot.resolve(True)\n"
        "except native_dot.NativeUnavailable as err:\n"
        "    print('refused:', err)\n")
    env = {**os.environ, "CXX": "/bin/false", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("refused: building grouped_dot.cc, paged_attention.cc with /bin/false failed"
            in result.stdout)
    assert "native kernels are off" in result.stderr


def _stack(fmt: QuantFormat, k: int, n: int, layers: int) -> QuantizedArray:
    """`layers` random kernels of `fmt` stacked, as a model's layers hold them [L, K, N]."""
    make = _super_kernel if fmt.super_group is not None else _kernel
    return jax.tree.map(lambda *a: jnp.stack(a), *(make(fmt, k, n, seed=i)
                                                   for i in range(layers)))


@pytest.mark.parametrize("name", ["4-bit", "6-bit", "q8_0", "q4_k"])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_layer_of_a_stack_is_read_in_place_as_that_layers_kernel(name, rows):
    """Given every layer's kernel stacked and an index, each layer kernel reads that layer's
    codes where they lie: bit for bit what the call on the layer's own arrays gives, for packed
    codes with float16 scales (read in place too) and float32 ones, int8 codes (their float16
    scales made float32 for the layer alone) and super groups (the layer's float32 products);
    an index outside the stack is an error."""
    fmt = {**FORMATS, **SUPER_FORMATS}[name]
    stack = _stack(fmt, 256, 96, layers=3)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((rows, 256)), jnp.float32)
    with native_dot.enabled():
        at = jax.jit(lambda x, s, i: native_dot.matmul("nd,df->nf", x, s, i)).lower(
            x, stack, jnp.int32(0))
        own = jax.jit(lambda x, q: native_dot.matmul("nd,df->nf", x, q))
        assert _target(fmt) in at.as_text()
        at = at.compile()
        for layer in range(3):
            np.testing.assert_array_equal(at(x, stack, jnp.int32(layer)),
                                          own(x, stack.map(lambda a: a[layer])))
    for outside in (3, -1):
        # raised by the call, or by the read of its result when the call ran asynchronously
        with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                           match=f"layer index {outside} is outside the stack of 3"):
            np.asarray(at(x, stack, jnp.int32(outside)))


def test_a_models_layers_read_their_kernels_in_place_from_the_stacks(monkeypatch):
    """A tiny Llama with native kernels, its kernels 4-bit with float16 scales, its MLP's up
    Q8_0 and its down Q4_K (super groups): the layer scan hands the kernels their whole stacks
    and the layer's index, so the compiled program slices no codes, and its logits are bit for
    bit those of the scan slicing each layer's kernels out (as it does without native
    kernels)."""
    from meshserve.model import transformer
    from meshserve.model.config import ModelConfig
    from meshserve.model.executor.steps import forward_dense
    from meshserve.model.quantized_weights import install, quantize_model, quantized_arrays

    config = ModelConfig.preset("tiny-llama", hidden_size=256, intermediate_size=256,
                                head_dim=32)
    model = transformer.create_model(config)
    install(model, {"layers/mlp/up/kernel": _stack(FORMATS["q8_0"], 256, 256, layers=2),
                    "layers/mlp/down/kernel": _stack(SUPER_FORMATS["q4_k"], 256, 256, layers=2)})
    quantize_model(model, "int4")  # the rest
    graphdef, params = nnx.split(model)
    tokens, lengths = jnp.asarray([[3, 17, 200, 41]], jnp.int32), jnp.asarray([4], jnp.int32)

    def compiled():  # a function of its own for each trace: jax caches traces by function
        with native_dot.enabled():
            return jax.jit(functools.partial(forward_dense, graphdef)).lower(
                params, tokens, lengths).compile()

    in_place = compiled()
    monkeypatch.setattr(transformer, "layer_stacked_kernels", lambda layers, native: frozenset())
    sliced = compiled()
    # the shapes of one layer's codes, as a slice of a stack would have them: s8[1,256,256], ...
    hlo_type = {"int8": "s8", "uint8": "u8"}
    codes = {f"{hlo_type[str(q.values.dtype)]}[1,{','.join(map(str, q.values.shape[1:]))}]"
             for q in quantized_arrays(model).values()}

    def slices(program) -> set[str]:  # the types of the slices a compiled program takes
        return set(re.findall(r"= (\w+\[[0-9,]*\])\S* dynamic-slice\(", program.as_text()))

    assert codes <= slices(sliced) and not codes & slices(in_place)
    np.testing.assert_array_equal(in_place(params, tokens, lengths),
                                  sliced(params, tokens, lengths))
