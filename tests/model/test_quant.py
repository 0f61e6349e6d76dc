"""Quantized kernels: the matmul against a float reference, the compiled HLO, GGUF blocks read
straight into kernels against gguf's own dequantizer, and load-time quantization."""

from __future__ import annotations

import dataclasses
import functools
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.model.config import ModelConfig
from meshserve.model.executor.steps import forward_dense
from meshserve.model.layers import Dense
from meshserve.model.loading import load_gguf
from meshserve.model.loading.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from meshserve.model.loading.gguf_blocks import (BLOCK_TYPES, CanonicalLayout, decode_blocks,
                                                 float_scaled, float_scales_format, kept_format,
                                                 regrouped)
from meshserve.model.loading.pretrained import scheme_plans
from meshserve.model.quant_formats import (LayerMix, MixedArray, QuantFormat, QuantizedArray,
                                           auto_keep_bits, describe, dequantize, from_codes,
                                           quantize, scheme_format, uniform_stack, widened)
from meshserve.model.quantized_kernel import QuantizedKernel, quantized_matmul
from meshserve.model.quantized_weights import quantize_model, quantized_arrays, weight_bytes
from meshserve.model.transformer import create_model, model_from_params
from tests.model.test_loaders import (gguf_llama_metadata, gguf_llama_tensors,
                                      hf_llama_tensors, write_gguf)

GGML = gguf.GGMLQuantizationType

# (spec, kernel shape, logical axes, contracted axes): every kind of Dense the models hold.
DENSES = [
    ("nd,dqh->nqh", (64, 4, 32), ("embed", "heads", "head_dim"), 1),  # q, k, v
    ("nqh,qhd->nd", (4, 32, 64), ("heads", "head_dim", "embed"), 2),  # o
    ("nf,fd->nd", (128, 64), ("ffw", "embed"), 1),  # down
    ("...d,dv->...v", (64, 96), ("embed", "vocab"), 1),  # an untied lm_head
]
GROUPED_INT8 = QuantFormat(bits=8, group=32, num_contracted=1, num_out=1, has_mins=True,
                           scale_dtype="float16")


def _kernel(q: QuantizedArray, axes) -> QuantizedKernel:
    return QuantizedKernel(q.map(jnp.asarray), axes)


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-g64"])
@pytest.mark.parametrize("spec, shape, axes, contracted", DENSES)
def test_quantized_matmul_matches_the_dequantized_kernel(spec, shape, axes, contracted, scheme):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    fmt = scheme_format(scheme, contracted, len(shape) - contracted)
    if shape[-(fmt.num_out + 1)] % (fmt.group or 1):
        pytest.skip("the contracted axis does not divide into groups of 64")
    q = quantize(w, fmt)
    w_hat = dequantize(q)
    # Round to nearest: each weight within half a step of its group's grid.
    step = 2 * np.abs(w).max() / 254 if fmt.bits == 8 else (w.max() - w.min()) / 15
    assert np.abs(w_hat - w).max() <= step / 2 + 1e-3
    x = jnp.asarray(rng.standard_normal((5, *shape[:contracted])).astype(np.float32))
    y = jax.jit(lambda x: quantized_matmul(spec, x, _kernel(q, axes)))(x)
    np.testing.assert_allclose(y, np.einsum(spec, np.asarray(x), w_hat), rtol=1e-5, atol=2e-5)


def test_grouped_int8_with_minimums_matches_its_values():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 32, (4, 32, 48))  # [n, group, out]: Q5_1's range
    scales = rng.uniform(0.01, 0.02, (4, 48)).astype(np.float16)
    mins = rng.uniform(-0.2, 0.0, (4, 48)).astype(np.float16)
    q = from_codes(codes, scales, mins, GROUPED_INT8)
    w = codes * scales[:, None].astype(np.float32) + mins[:, None].astype(np.float32)
    np.testing.assert_array_equal(dequantize(q), w.reshape(128, 48))
    x = rng.standard_normal((3, 128)).astype(np.float32)
    y = quantized_matmul("nf,fd->nd", jnp.asarray(x), _kernel(q, ("ffw", "embed")))
    np.testing.assert_allclose(y, x @ w.reshape(128, 48), rtol=1e-5, atol=1e-5)


def _f32_buffers(hlo: str) -> list[int]:
    """Element counts of every f32 array an instruction (not a parameter) of the compiled HLO
    produces."""
    return [int(np.prod([int(d) for d in shape.split(",") if d]))
            for line in hlo.splitlines() if "parameter(" not in line
            for shape in re.findall(r"= f32\[([\d,]*)\]", line)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dequantized_values_stay_within_one_layer(scheme):
    """SmolLM2's down projection in a scan of 4 layers: an int8 kernel is dequantized one layer
    at a time (never the stacked kernel: the conversion is not hoisted out of the scan), an
    int4 kernel half a layer at a time. The float matmul of the converted stack is the control:
    it does materialise the whole stack."""
    layers, rows, cols = 4, 1536, 576
    stacked, one_layer = layers * rows * cols, rows * cols
    x = jnp.ones((4, rows), jnp.float32)
    codes = jnp.ones((layers, rows, cols), jnp.int8)
    naive = jax.jit(lambda x, w: jax.lax.scan(
        lambda h, w: (h + jnp.tile(h @ w, 3)[:, :rows], None), x, w.astype(jnp.float32))[0])
    assert max(_f32_buffers(naive.lower(x, codes).compile().as_text())) == stacked
    w = np.random.default_rng(0).standard_normal((layers, rows, cols)).astype(np.float32)
    kernel = _kernel(quantize(w, scheme_format(scheme, 1, 1)), ("layers", "ffw", "embed"))
    graphdef, state = nnx.split(kernel)

    def scanned(x, state):
        def layer(h, s):
            y = quantized_matmul("nf,fd->nd", h, nnx.merge(graphdef, s))
            return h + jnp.tile(y, 3)[:, :rows], None
        return jax.lax.scan(layer, x, state)[0]

    biggest = max(_f32_buffers(jax.jit(scanned).lower(x, state).compile().as_text()))
    assert biggest == (one_layer if scheme == "int8" else one_layer // 2)


# -- GGUF blocks -------------------------------------------------------------------------------


def random_blocks(qtype: GGML, rows: int, width: int, seed: int = 0,
                  scale: float = 0.05) -> np.ndarray:
    """Random bytes of a tensor of `qtype`, with every float16 field set to a sane value (within
    +-scale)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, width // block_size, type_size), dtype=np.uint8)
    halves = {GGML.Q6_K: [208], GGML.Q4_K: [0, 2], GGML.Q5_K: [0, 2]}.get(qtype, [0])
    if qtype in (GGML.Q4_1, GGML.Q5_1):
        halves = [0, 2]
    for offset in halves:
        values = rng.uniform(-scale, scale, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_block_fields_give_what_gguf_dequantizes(qtype):
    """Codes, and scales and mins per group (a K-quant's as float32 products of its integer
    sub-scales and its super-block's d and -dmin, `float_scaled`), give gguf's values."""
    raw = random_blocks(qtype, 6, 512)
    blocks = decode_blocks(raw, qtype, (6, 512))
    low, high = BLOCK_TYPES[qtype].code_range
    assert low <= blocks.codes.min() and blocks.codes.max() <= high
    assert blocks.codes.min() < low + 4 and blocks.codes.max() > high - 4  # the range is used
    if BLOCK_TYPES[qtype].super_block:  # integer sub-scales, a float32 d (and -dmin) per 256
        assert blocks.scales.dtype == np.dtype(BLOCK_TYPES[qtype].scale_dtype)
        assert blocks.super_scales.shape == (6, 2) and blocks.super_scales.dtype == np.float32
        assert blocks.scales.max() > (60 if qtype != GGML.Q6_K else 120)  # 6 bits, or 8
        blocks = float_scaled(blocks)
    scales = np.repeat(blocks.scales.astype(np.float32), blocks.group, axis=1)
    values = blocks.codes.astype(np.float32) * scales
    if blocks.mins is not None:
        values = values + np.repeat(blocks.mins.astype(np.float32), blocks.group, axis=1)
    np.testing.assert_array_equal(values, gguf.quants.dequantize(raw, qtype))


TINY_256 = dict(D=256, F=512, L=2, H=4, K=2, V=64)
KERNEL_TYPES = {  # one GGUF block type per kernel, every layer alike
    "attn_q": GGML.Q4_0, "attn_k": GGML.Q4_1, "attn_v": GGML.Q5_0, "attn_output": GGML.Q5_1,
    "ffn_gate": GGML.Q4_K, "ffn_up": GGML.Q5_K, "ffn_down": GGML.Q6_K,
}


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """A GGUF whose kernels are each in another block type, Q/K permuted llama.cpp's way, the
    embedding in Q8_0, and, as in a Q4_K_M file, two kernels whose layers differ:
    blk.1.ffn_up in Q8_0 where blk.0's is Q5_K, blk.1.ffn_down in Q4_K where blk.0's is Q6_K."""
    d = TINY_256
    hf = {"hidden_size": d["D"], "intermediate_size": d["F"], "num_hidden_layers": d["L"],
          "num_attention_heads": d["H"], "num_key_value_heads": d["K"], "vocab_size": d["V"],
          "tie_word_embeddings": True, "model_type": "llama"}
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=d["L"], H=d["H"], K=d["K"],
                                 permute=True)
    for name in list(tensors):
        kind = name.split(".")[-2]
        qtype = KERNEL_TYPES.get(kind, GGML.Q8_0 if name == "token_embd.weight" else None)
        if name == "blk.1.ffn_up.weight":
            qtype = GGML.Q8_0
        if name == "blk.1.ffn_down.weight":
            qtype = GGML.Q4_K
        if qtype is not None:
            tensors[name] = (gguf.quants.quantize(tensors[name].astype(np.float32), qtype)
                             if qtype in (GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1)
                             else random_blocks(qtype, *tensors[name].shape, seed=len(name)),
                             qtype)
    path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
    return write_gguf(path, "llama", gguf_llama_metadata("llama", **d), tensors)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gguf_blocks_load_into_kernels_exactly(quantized_gguf, scheme):
    """Every kernel whose block type fits the scheme's bits is read without loss: its values
    equal the float loader's (which dequantizes with gguf); the rest are quantized floats. On a
    GPU the tied Q8_0 embedding table is kept in its blocks under both (int4's schemes keep a
    table in 8 bits rather than leave it float)."""
    _, floats = load_gguf(quantized_gguf)
    config, params = load_gguf(quantized_gguf, plans=scheme_plans(scheme, platform="gpu"))
    kept = {"int8": {"q", "k", "v", "o", "gate", "up", "down"}, "int4": {"q", "k", "gate"}}[scheme]
    table = params.pop("embed/embedding")
    assert (table.format.bits, table.format.group, table.format.num_out) == (8, 32, 0)
    np.testing.assert_array_equal(dequantize(table), floats["embed/embedding"])
    for key, value in params.items():
        if not key.endswith("/kernel"):
            assert not isinstance(value, QuantizedArray)
            continue
        assert isinstance(value, QuantizedArray) and value.format.bits == (8 if scheme == "int8"
                                                                           else 4)
        name = key.split("/")[-2]
        if name in kept:
            np.testing.assert_array_equal(dequantize(value), floats[key], err_msg=key)
        else:  # v, o, down and up (Q5_K and Q8_0) do not fit 4 bits: requantized
            assert value.format == scheme_format(scheme, value.format.num_contracted,
                                                 value.format.num_out), key
            tolerance = 0.02 if scheme == "int8" else 0.15
            assert np.abs(dequantize(value) - floats[key]).max() < tolerance * np.abs(
                floats[key]).max(), key
    model = model_from_params(config, {**params, "embed/embedding": table})
    assert set(quantized_arrays(model)) == {k for k in params if k.endswith("/kernel")} | {
        "embed/embedding"}


FILE_BITS = {"q": 4, "k": 4, "gate": 4, "v": 5, "o": 5, "up": (5, 8), "down": (6, 4), "embed": 8}


@pytest.mark.parametrize("platform, native, want_bits", [
    ("gpu", False, FILE_BITS),
    ("cpu", True, FILE_BITS),
    ("cpu", False, {"q": 8, "k": 8, "gate": 8, "v": 8, "o": 8, "up": 8, "down": 8}),
])
def test_auto_keeps_every_block_type_that_fits_and_leaves_the_rest_float(quantized_gguf,
                                                                         platform, native,
                                                                         want_bits):
    """auto on a GPU, and on the CPU with native kernels: each block type in the bits its codes
    take (Q4 types in 4, Q5_0 and Q5_1 in 5, Q6_K in 6, Q8_0 in 8); a kernel whose layers mix
    block types as a mixed stack, each layer in its own type's format: up Q5_K (5 bits, uint8
    sub-scales per 256) then Q8_0 (float16 scales), down Q6_K (6 bits offset by 32, int8
    sub-scales) then Q4_K. On the CPU without them every block in int8 containers, a mixed
    kernel in one format that holds both: up with mins and float32 scales, down with groups of
    16, mins, int8 sub-scales and a float32 super scale per 256. Exactly, either way; no kernel
    of a quantized file stays float. Its tied Q8_0 embedding table is kept on a GPU and with
    native kernels; on the CPU without them, where the LM head reads a float table faster, it
    is dequantized."""
    _, floats = load_gguf(quantized_gguf)
    _, params = load_gguf(quantized_gguf, plans=scheme_plans("auto", platform=platform,
                                                             native=native))
    formats = {key.split("/")[-2]: value.format for key, value in params.items()
               if isinstance(value, (QuantizedArray, MixedArray))}
    bits = {name: tuple(f.bits for f in fmt.formats) if isinstance(fmt, LayerMix) else fmt.bits
            for name, fmt in formats.items()}
    assert bits == want_bits
    shape = lambda f: (f.bits, f.group, f.has_mins, f.scale_dtype, f.super_group)  # noqa: E731
    assert (formats["gate"].scale_dtype, formats["gate"].super_group) == ("uint8", 256)  # Q4_K
    down, up = formats["down"], formats["up"]
    if isinstance(down, LayerMix):
        assert [shape(f) for f in down.formats] == [(6, 16, False, "int8", 256),
                                                    (4, 32, True, "uint8", 256)]
        assert [shape(f) for f in up.formats] == [(5, 32, True, "uint8", 256),
                                                  (8, 32, False, "float16", None)]
        assert down.part_of == up.part_of == (0, 1)
        down, up = down.uniform, up.uniform  # the one format that would hold each
    # down: Q6_K's groups of 16 without mins and Q4_K's of 32 with them, in one format
    assert (down.group, down.has_mins, down.scale_dtype, down.super_group) == (16, True, "int8",
                                                                               256)
    # up: Q5_K with Q8_0, whose float16 scales have no super-block: float32 scales per group
    assert (up.group, up.has_mins, up.scale_dtype, up.super_group) == (32, True, "float32", None)
    if want_bits["v"] == 5:  # Q5_0's signed codes stored from 0; Q5_1's are unsigned
        assert (formats["v"].offset, formats["o"].offset,
                formats["down"].formats[0].offset) == (16, 0, 32)
    for key, value in params.items():
        want = floats[key]
        got = dequantize(value) if isinstance(value, (QuantizedArray, MixedArray)) else value
        np.testing.assert_array_equal(got, want, err_msg=key)


K_QUANT_STACKS = [(GGML.Q4_K,), (GGML.Q5_K,), (GGML.Q6_K,), (GGML.Q4_K, GGML.Q6_K),
                  (GGML.Q6_K, GGML.Q5_K, GGML.Q4_K)]


@pytest.mark.parametrize("qtypes", K_QUANT_STACKS, ids=lambda t: "+".join(q.name for q in t))
@pytest.mark.parametrize("keep_bits", [(4, 5, 6, 8), (8,)])
def test_super_groups_hold_the_weights_that_float32_scales_do(qtypes, keep_bits):
    """K-quant layers (one type, and stacks that mix them as Q4_K_M does) kept in integer
    sub-scales times a float32 scale per super group dequantize bit for bit to what the same
    blocks give with a float32 scale per group (the format before super groups), and to gguf's
    values; in fewer bytes. The jnp matmul of either gives the same floats."""
    rows, width = 48, 512
    raws = [random_blocks(qtype, rows, width, seed=i) for i, qtype in enumerate(qtypes)]
    fmt = kept_format(qtypes, keep_bits, 1, 1, width)
    assert fmt.super_group == 256
    assert fmt.scale_dtype == ("int8" if GGML.Q6_K in qtypes else "uint8")
    old = float_scales_format(fmt)
    to_kernel = lambda w: w.T  # noqa: E731 - [out, in] -> [in, out]
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, width)), jnp.float32)
    matmul = jax.jit(lambda x, q: quantized_matmul("nd,df->nf", x, q))
    for raw, qtype in zip(raws, qtypes):
        blocks = decode_blocks(raw, qtype, (rows, width))
        new_q = CanonicalLayout(to_kernel, (rows, width), fmt).quantized(regrouped(blocks, fmt))
        old_q = CanonicalLayout(to_kernel, (rows, width), old).quantized(regrouped(blocks, old))
        assert new_q.super_scales.shape == (2, rows) and new_q.scales.dtype == fmt.scale_dtype
        assert np.array_equal(dequantize(new_q), dequantize(old_q)), qtype.name
        assert np.array_equal(dequantize(new_q), gguf.quants.dequantize(raw, qtype).T)
        assert np.array_equal(dequantize(new_q.map(jnp.asarray), xp=jnp), dequantize(new_q))
        assert new_q.nbytes < old_q.nbytes
        np.testing.assert_array_equal(matmul(x, new_q.map(jnp.asarray)),
                                      matmul(x, old_q.map(jnp.asarray)))


def test_a_super_group_follows_the_kernels_axis_and_otherwise_float32_scales_are_kept():
    """Along an axis of 128 (attention's o with heads of 128: its last contracted axis) a super
    group is the 128 weights of a super-block that it holds, the block's d repeated over each;
    along 32 a super group would hold one group, so float32 scales per group are smaller; a
    stack with a non-K-quant layer keeps float32 scales too."""
    q4k = kept_format([GGML.Q4_K], (4,), 2, 1, 128)
    assert (q4k.super_group, q4k.scale_dtype) == (128, "uint8")
    assert kept_format([GGML.Q4_K], (4,), 2, 1, 32).super_group is None
    mixed = kept_format([GGML.Q4_K, GGML.Q4_0], (4,), 1, 1, 256)
    assert (mixed.super_group, mixed.scale_dtype) == (None, "float32")
    raw = random_blocks(GGML.Q4_K, 8, 512, seed=3)
    blocks = decode_blocks(raw, GGML.Q4_K, (8, 512))
    # [out, in] -> o's [H, hd, out] with heads of 128: each super-block spans two heads
    to_kernel = lambda w: w.T.reshape(4, 128, 8)  # noqa: E731
    q = CanonicalLayout(to_kernel, (8, 512), q4k).quantized(regrouped(blocks, q4k))
    assert q.super_scales.shape == (4, 1, 8) and q.scales.shape == (4, 4, 8)
    np.testing.assert_array_equal(dequantize(q), to_kernel(gguf.quants.dequantize(raw,
                                                                                  GGML.Q4_K)))


def test_super_groups_that_cross_super_blocks_are_refused_by_the_layout():
    """A conversion that interleaves two super-blocks' groups (whole groups of 32, so each
    group is still one block's) cannot keep one super scale per super group: the layout says
    so, and the loader then keeps float32 scales per group. Reversing the groups' order keeps
    each super group within one super-block, and is kept."""
    fmt = kept_format([GGML.Q4_K], (4,), 1, 1, 512)

    def interleaved(w):  # [out, in] -> [in, out], groups 0, 8, 1, 9, ... of the row
        return w.T.reshape(2, 8, 32, -1).transpose(1, 0, 2, 3).reshape(512, -1)

    def reversed_groups(w):  # [out, in] -> [in, out], groups 15, 14, ... of the row
        return w.T.reshape(16, 32, -1)[::-1].reshape(512, -1)

    with pytest.raises(ValueError, match="super-blocks do not line up"):
        CanonicalLayout(interleaved, (8, 512), fmt)
    CanonicalLayout(interleaved, (8, 512), float_scales_format(fmt))
    raw = random_blocks(GGML.Q4_K, 8, 512, seed=4)
    blocks = decode_blocks(raw, GGML.Q4_K, (8, 512))
    q = CanonicalLayout(reversed_groups, (8, 512), fmt).quantized(regrouped(blocks, fmt))
    np.testing.assert_array_equal(dequantize(q), reversed_groups(
        gguf.quants.dequantize(raw, GGML.Q4_K)))


Q4_K_M_DIMS = dict(D=256, F=512, L=8, H=2, K=1, V=256)  # heads of 128, as Llama 3 8B's


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule for the layers a Q4_K_M file spends Q6_K on in attn_v and ffn_down."""
    return (layer < num_layers // 8 or layer >= 7 * num_layers // 8
            or (layer - num_layers // 8) % 3 == 2)


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A GGUF laid out as llama.cpp's Q4_K_M lays out a Llama: every kernel Q4_K, but attn_v
    and ffn_down Q6_K on the layers `use_more_bits` picks (0, 3, 6 and 7 of 8), and the tied
    embedding Q6_K; random K-quant blocks with weights of about 0.05 (gguf's package cannot
    quantize to them)."""
    d = Q4_K_M_DIMS
    hf = {"hidden_size": d["D"], "intermediate_size": d["F"], "num_hidden_layers": d["L"],
          "num_attention_heads": d["H"], "num_key_value_heads": d["K"], "vocab_size": d["V"],
          "tie_word_embeddings": True, "model_type": "llama"}
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=d["L"], H=d["H"], K=d["K"],
                                 permute=True)
    for seed, name in enumerate(list(tensors)):
        parts = name.split(".")
        if name == "token_embd.weight":
            qtype = GGML.Q6_K
        elif parts[0] == "blk" and parts[2] != "attn_norm" and parts[2] != "ffn_norm":
            more = parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), d["L"])
            qtype = GGML.Q6_K if more else GGML.Q4_K
        else:
            continue
        tensors[name] = random_blocks(qtype, *tensors[name].shape, seed=seed, scale=2e-4), qtype
    path = tmp_path_factory.mktemp("gguf") / "q4_k_m.gguf"
    return write_gguf(path, "llama", gguf_llama_metadata("llama", **d), tensors)


def test_a_q4_k_m_files_kernels_keep_the_files_scales(q4_k_m_gguf):
    """auto, as the engine loads on the CPU with native kernels: every kernel kept exactly,
    its K-quant scales as the file's integer sub-scales times a float32 d (and -dmin) per
    super group, and their bytes against the file's tensors (arithmetic of the formats, bits a
    weight):
    - q, k, gate, up (Q4_K): 4 codes + 0.5 sub-scales and mins + 0.25 d and dmin = 4.75
      against the file's 4.5, 1.056x (with float32 scales per group they were 6, 1.33x);
    - o (Q4_K along heads of 128: a super group of 128) 5.0, 1.111x;
    - v and down (Q4_K and Q6_K layers in one stack): a mixed stack, the Q4_K layers at 4.75
      and the Q6_K ones in their own 6 bits, int8 sub-scales per 16 and a float32 d per 256,
      6.625 against 6.5625: 1.028x together (one stack in the union of both, 6-bit codes for
      every layer with groups of 16 and mins, was 7.25 bits a weight, 1.311x);
    - the tied Q6_K table, read by the native head in 8-bit containers: 8.625 against 6.5625.
    """
    reader = gguf.GGUFReader(str(q4_k_m_gguf))
    file_bytes = {}
    for tensor in reader.tensors:
        kind = tensor.name.split(".")[-2]
        file_bytes[kind] = file_bytes.get(kind, 0) + int(tensor.n_bytes)
    _, floats = load_gguf(q4_k_m_gguf)
    _, params = load_gguf(q4_k_m_gguf, plans=scheme_plans("auto", platform="cpu", native=True))
    tensor_of = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                 "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
                 "embed": "token_embd"}
    nbytes, formats = {}, {}
    for key, value in params.items():
        if not isinstance(value, (QuantizedArray, MixedArray)):
            assert not key.endswith(("/kernel", "/embedding")), key  # no kernel left float
            continue
        np.testing.assert_array_equal(dequantize(value), floats[key], err_msg=key)
        name = key.split("/")[-2]
        formats[name], nbytes[name] = value.format, value.nbytes
    assert set(formats) == set(tensor_of)
    ratio = {name: nbytes[name] / file_bytes[tensor_of[name]] for name in nbytes}
    shape = lambda f: (f.bits, f.group, f.has_mins, f.scale_dtype, f.super_group)  # noqa: E731
    for name in ("q", "k", "gate", "up"):
        assert shape(formats[name]) == (4, 32, True, "uint8", 256), name
        assert ratio[name] == pytest.approx(4.75 / 4.5), name
    assert shape(formats["o"]) == (4, 32, True, "uint8", 128)
    assert ratio["o"] == pytest.approx(5.0 / 4.5)
    more = tuple(use_more_bits(i, Q4_K_M_DIMS["L"]) for i in range(Q4_K_M_DIMS["L"]))
    for name in ("v", "down"):  # 4 of 8 layers Q6_K (6.5625 bits), 4 Q4_K (4.5)
        mix = formats[name]
        assert isinstance(mix, LayerMix), name
        assert [shape(f) for f in mix.formats] == [(6, 16, False, "int8", 256),
                                                   (4, 32, True, "uint8", 256)], name
        assert mix.part_of == tuple(0 if m else 1 for m in more), name  # layer 0 is Q6_K
        assert shape(mix.uniform) == (6, 16, True, "int8", 256), name
        assert ratio[name] == pytest.approx((6.625 + 4.75) / (6.5625 + 4.5)), name
    assert describe(formats["down"]) == (
        "4 layers of 6 bits, groups of 16, int8 scales x float32 per 256, codes offset by 32 "
        "+ 4 layers of 4 bits, groups of 32, mins, uint8 scales x float32 per 256")
    assert shape(formats["embed"]) == (8, 16, False, "int8", 256)
    assert ratio["embed"] == pytest.approx(8.625 / 6.5625)
    # Every kernel: 1.053x; with the table, 1.087x (one stack of the union's bits for v and
    # down: 1.143x and 1.166x).
    kernels = [n for n in nbytes if n != "embed"]
    assert sum(nbytes[n] for n in kernels) / sum(file_bytes[tensor_of[n]] for n in kernels) \
        == pytest.approx((360448 * 4.75 + 65536 * 5.0 + 163840 * (6.625 + 4.75) / 2)
                         / (425984 * 4.5 + 163840 * (6.5625 + 4.5) / 2))
    assert sum(nbytes.values()) / sum(file_bytes.values()) < 1.1


def test_a_mixed_stack_widens_to_one_format_exactly(q4_k_m_gguf):
    """Where a mixed stack must be one array (pipeline stages), `uniform_stack` re-expresses
    every layer in the format that holds them all: the same float32 weights, bit for bit, and
    the union format's bytes."""
    _, params = load_gguf(q4_k_m_gguf, plans=scheme_plans("auto", platform="cpu", native=True))
    mixed = params["layers/mlp/down/kernel"]
    one = uniform_stack(mixed)
    assert one.format == mixed.format.uniform and one.shape == mixed.shape
    np.testing.assert_array_equal(dequantize(one), dequantize(mixed))
    for i in range(len(mixed.format.part_of)):  # and layer by layer, against each part
        np.testing.assert_array_equal(dequantize(one.map(lambda a: a[i])),
                                      dequantize(mixed.layer(i)))
    assert one.nbytes / mixed.nbytes == pytest.approx(7.25 / ((6.625 + 4.75) / 2))


@pytest.mark.parametrize("native", [False, True])
def test_a_models_mixed_stacks_compute_what_one_format_computes(q4_k_m_gguf, native):
    """The Q4_K_M-like model (v and down mixed stacks) and, as the scan's first weight, k made
    a mixed stack too (its layers 0, 3 and 6 widened to 6 bits): each layer's projections run
    in the branch of its part, one switch a mixed kernel and layer, and give the logits of the
    same model with every mixed stack widened to one format, within summation order (through
    XLA's dots) or the native kernels' rounding of x to 16 bits per group (both formats round
    the same x; measured 4e-5 and 7e-4 of logits up to 9)."""
    from meshserve.model import native_dot
    from meshserve.model.quantized_weights import uniform_layers

    config, params = load_gguf(q4_k_m_gguf, plans=scheme_plans("auto", platform="cpu",
                                                               native=True))
    k = params["layers/attn/k/kernel"]
    wide = dataclasses.replace(k.format, bits=6, offset=0)
    part_of = tuple(int(i % 3 != 0) for i in range(config.num_layers))
    mix = LayerMix(formats=(wide, k.format), part_of=part_of, uniform=wide)
    layers = [[i for i, p in enumerate(part_of) if p == part] for part in (0, 1)]
    params["layers/attn/k/kernel"] = MixedArray(parts=(
        widened(k.map(lambda a: a[np.asarray(layers[0])]), wide),
        k.map(lambda a: a[np.asarray(layers[1])])), format=mix)
    np.testing.assert_array_equal(dequantize(params["layers/attn/k/kernel"]), dequantize(k))
    tokens = jnp.asarray([[3, 17, 200, 41, 5, 9], [7, 1, 2, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([6, 3], jnp.int32)

    def logits(model):
        graphdef, state = nnx.split(model)
        with native_dot.enabled(native):
            program = jax.jit(functools.partial(forward_dense, graphdef)).lower(
                state, tokens, lengths)
            return np.asarray(program.compile()(state, tokens, lengths)), program.as_text()

    mixed, text = logits(model_from_params(config, params))
    one, one_text = logits(uniform_layers(model_from_params(config, params)))
    assert text.count("stablehlo.case") == 3 and "stablehlo.case" not in one_text  # k, v, down
    np.testing.assert_allclose(mixed, one, rtol=0, atol=(1e-3 if native else 1e-4))


def test_super_groups_round_trip_through_a_checkpoint(q4_k_m_gguf, tmp_path):
    """A checkpoint stores a kernel's super scales and mins beside its codes and integer
    scales, a mixed stack's part by part, and its manifest the formats (a mixed stack's with
    the layers of each part); loading it back gives every array bit for bit."""
    config, params = load_gguf(q4_k_m_gguf, plans=scheme_plans("auto", platform="cpu",
                                                               native=True))
    model = model_from_params(config, params)
    directory = save_checkpoint(model, None, tmp_path / "ckpt")
    manifest = read_manifest(directory)
    assert manifest.quantized["layers/mlp/up/kernel"].super_group == 256
    assert "layers/mlp/up/kernel/super_mins" in manifest.params
    assert manifest.quantized["layers/mlp/down/kernel"] == params["layers/mlp/down/kernel"].format
    assert "layers/mlp/down/kernel/parts/1/super_mins" in manifest.params  # the Q4_K layers'
    assert "layers/mlp/down/kernel/parts/0/mins" not in manifest.params  # Q6_K has none
    _, restored, _ = load_checkpoint(directory)
    for key, q in quantized_arrays(model).items():
        back = quantized_arrays(restored)[key]
        assert back.format == q.format and set(back.arrays()) == set(q.arrays()), key
        for name, array in q.arrays().items():
            np.testing.assert_array_equal(np.asarray(back.arrays()[name]), np.asarray(array))
            assert back.arrays()[name].dtype == array.dtype, (key, name)


@pytest.mark.slow
def test_gemma_3_270m_weight_bytes_against_its_file():
    """The real Gemma 3 270M Q4_K_M as the engine loads it on the CPU (auto, native kernels):
    its Q4_K attention output in super groups, its ffn_down's Q6_K and Q4_K layers and its
    attn_v's Q8_0 and Q5_0 layers each in their own format (mixed stacks), no kernel float,
    and its weight bytes against the file's tensor bytes (printed; the Q8_0 table, 73% of the
    file, is held as it is): 1.003x (one stack in the union's bits for down and v: 1.024x)."""
    from meshserve.model import gguf_reader
    from meshserve.model.loading.hub import resolve_model
    from meshserve.model.loading.pretrained import load_pretrained

    files = resolve_model("gemma-3-270m")
    file_bytes = sum(t.data.nbytes for t in gguf_reader.open_gguf(files.path).tensors.values())
    model = load_pretrained(str(files.path), quantization="auto", native_kernels=True).model
    formats = {key: q.format for key, q in quantized_arrays(model).items()}
    assert len(formats) == 8  # the seven kernels and the table
    shape = lambda f: (f.bits, f.group, f.scale_dtype, f.super_group)  # noqa: E731
    assert shape(formats["layers/attn/o/kernel"]) == (4, 32, "uint8", 256)
    down, v = formats["layers/mlp/down/kernel"], formats["layers/attn/v/kernel"]
    assert [shape(f) for f in down.formats] == [(6, 16, "int8", 256), (4, 32, "uint8", 256)]
    assert [(f.bits, f.scale_dtype) for f in v.formats] == [(8, "float16"), (5, "float16")]
    assert down.part_of.count(0) == v.part_of.count(0) == 9  # of 18 layers
    ratio = weight_bytes(model) / file_bytes
    print(f"gemma-3-270m: {weight_bytes(model):,} bytes of weights, {file_bytes:,} in the "
          f"file's tensors, {ratio:.3f}x")
    assert ratio < 1.01


def test_auto_follows_the_default_backend():
    """auto keeps a file's blocks in the default backend's widths; an untied model's table,
    only gathered, in the file's own bits on every backend."""
    plans = scheme_plans("auto")(ModelConfig.preset("tiny-llama", head_dim=32,
                                                    tie_embeddings=False))
    table = plans.pop("embed/embedding")
    assert {plan.keep_bits for plan in plans.values()} == {auto_keep_bits(jax.default_backend())}
    assert table.keep_bits == auto_keep_bits("gpu")


def test_int4_model_computes_the_float_models_function(quantized_gguf):
    """A model of quantized kernels gives the logits of the float model of the same weights, up
    to summation order."""
    config, quantized = load_gguf(quantized_gguf, plans=scheme_plans("int4"))
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % config.vocab_size)
    lengths = jnp.asarray([6, 4], jnp.int32)
    # The same weights as floats (the kept kernels equal the float loader's, as shown above).
    floats = {k: dequantize(v) if isinstance(v, QuantizedArray) else v
              for k, v in quantized.items()}
    logits = [forward_dense(*nnx.split(model_from_params(config, p)), tokens, lengths)
              for p in (floats, quantized)]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-3)


def test_quantize_model_replaces_float_kernels_and_shrinks_the_weights():
    config = ModelConfig.preset("tiny-llama", head_dim=32)
    model = create_model(config)
    before = weight_bytes(model)
    quantize_model(model, "int4")
    assert set(quantized_arrays(model)) == {
        "layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel",
        "layers/attn/o/kernel", "layers/mlp/gate/kernel", "layers/mlp/up/kernel",
        "layers/mlp/down/kernel"}
    assert not isinstance(model.lm_head.kernel, QuantizedKernel)  # the LM head stays float
    assert weight_bytes(model) < 0.6 * before  # the embedding, LM head and norms stay float


def test_a_mixtures_experts_are_quantized_and_its_router_stays_float():
    """Attention and the routed experts (one kernel per expert, stacked) are quantized; the
    router stays float, so routing stays the float model's."""
    model = quantize_model(create_model(ModelConfig.preset("tiny-mixtral")), "int8")
    assert set(quantized_arrays(model)) == {
        "layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel",
        "layers/attn/o/kernel", "layers/mlp/experts/gate", "layers/mlp/experts/up",
        "layers/mlp/experts/down"}
    assert not isinstance(model.layers.mlp.router.kernel, QuantizedKernel)
    gate = quantized_arrays(model)["layers/mlp/experts/gate"]
    assert gate.values.shape == (2, 4, 64, 128) and gate.scales.shape == (2, 4, 128)
    plans = scheme_plans("auto")(ModelConfig.preset("tiny-mixtral"))
    assert set(quantized_arrays(model)) <= set(plans) and "layers/mlp/router/kernel" not in plans


def test_a_kernel_that_does_not_divide_into_groups_is_refused():
    model = create_model(ModelConfig.preset("tiny-llama"))  # head_dim 16: o's groups of 32 fail
    with pytest.raises(ValueError, match="layers/attn/o/kernel: its contracted axis of 16"):
        quantize_model(model, "int4")


def test_unknown_scheme_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        scheme_plans("int3")


@pytest.mark.parametrize("scheme", ["auto", "int8"])
def test_blocks_that_cross_heads_load_as_floats(tmp_path, scheme):
    """Heads of 16 (llama2.c's stories models have 48): each Q8_0 block of `attn_output`'s rows
    spans two heads, which its kernel `[heads, head_dim, embed]` holds apart, so the blocks
    cannot be kept; the kernel loads as a float one would (left float under auto, quantized
    from float under int8) and the other kernels are kept."""
    d = dict(D=64, F=128, L=1, H=4, K=2, V=64)
    hf = {"hidden_size": d["D"], "intermediate_size": d["F"], "num_hidden_layers": d["L"],
          "num_attention_heads": d["H"], "num_key_value_heads": d["K"], "vocab_size": d["V"],
          "tie_word_embeddings": True, "model_type": "llama"}
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=d["L"], H=d["H"], K=d["K"],
                                 permute=True)
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_up.weight"):
        tensors[name] = (gguf.quants.quantize(tensors[name].astype(np.float32), GGML.Q8_0),
                         GGML.Q8_0)
    path = write_gguf(tmp_path / "heads-of-16.gguf", "llama", gguf_llama_metadata("llama", **d),
                      tensors)
    _, floats = load_gguf(path)
    _, params = load_gguf(path, plans=scheme_plans(scheme, platform="cpu"))
    np.testing.assert_array_equal(dequantize(params["layers/mlp/up/kernel"]),
                                  floats["layers/mlp/up/kernel"])
    o = params["layers/attn/o/kernel"]
    if scheme == "auto":
        np.testing.assert_array_equal(o, floats["layers/attn/o/kernel"])
    else:
        assert o.format == scheme_format("int8", 2, 1)
