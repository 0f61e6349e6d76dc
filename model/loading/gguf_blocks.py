"""GGUF's quantized blocks read as quantized kernels, never through float values.

A GGUF block type stores, per block of weights along a row (the input axis of an `[out, in]`
Linear weight, or of each expert's in a mixture's `[E, out, in]` stack), integer codes and a
scale (and for some types a minimum), so that each weight is `code * scale + min`.
`decode_blocks` reads those fields of one tensor as they are: codes one a byte `[*rows, in]`,
scales and mins `[*rows, in / group]`, in float16 where the file stores them so and in float32
where a K-quant multiplies two stored fields (the products are exact in float32, and computed
exactly as `gguf.quants` computes them):

    type   codes        group  scale          min
    Q8_0   -128..127    32     d (f16)        -
    Q4_0   0..15        32     d (f16)        -8 d
    Q4_1   0..15        32     d (f16)        m (f16)
    Q5_0   -16..15      32     d (f16)        -
    Q5_1   0..31        32     d (f16)        m (f16)
    Q4_K   0..15        32     d * sc (f32)   -dmin * m (f32)
    Q5_K   0..31        32     d * sc (f32)   -dmin * m (f32)
    Q6_K   -32..31      16     d * sc (f32)   -

A tensor whose codes fit one of the plan's bit widths (`kept_format`: Q8_0 in 8 bits, Q4 types
in 4, Q5 in 5, Q6_K in 6, or all in 8 where the platform keeps int8) becomes a `QuantizedArray`
with the same codes, scales and mins (`CanonicalLayout.quantized`), moved into the canonical
kernel layout by the same index permutation as its float weights (an expert stack
`[E, out, in]` becomes `[E, in, out]`, its blocks with it): so it computes exactly what the
float path computes from the dequantized file. The layers of one stacked kernel may be of
different types (Q4_K_M files mix Q4_K and Q6_K in `ffn_down`, and in `ffn_down_exps`):
`kept_format` gives one format that holds each exactly, and `regrouped` re-expresses a layer's
blocks in it (scales repeated over a finer group, zero mins). Other types (Q2_K, Q3_K, the IQ types) are not read here; the loader
dequantizes them and quantizes the floats instead.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import gguf
import numpy as np

from meshserve.model.quant_formats import PACK_UNIT, QuantFormat, QuantizedArray, from_codes

_GGML = gguf.GGMLQuantizationType
QK_K = 256


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One tensor's block fields: codes `[*rows, in]` (int16, one per weight), scales and mins
    `[*rows, in / group]`."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    group: int


@dataclasses.dataclass(frozen=True)
class BlockType:
    group: int
    code_range: tuple[int, int]
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    has_mins: bool = False
    scale_dtype: str = "float16"  # float32 where a K-quant's scale is a product of two fields


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes, a little-endian uint32 -> [..., 32] bits."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)


def _q8_0(b):
    return np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16), _f16(b[..., :2]), None


def _q4_0(b):
    d = _f16(b[..., :2])
    return _nibbles(b[..., 2:]), d, d * np.float16(-8)


def _q4_1(b):
    return _nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4])


def _q5_0(b):
    return _nibbles(b[..., 6:]) + (_high_bits(b[..., 2:6]) << 4) - 16, _f16(b[..., :2]), None


def _q5_1(b):
    return _nibbles(b[..., 8:]) + (_high_bits(b[..., 4:8]) << 4), _f16(b[..., :2]), \
        _f16(b[..., 2:4])


def _k_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K and Q5_K: per sub-block of 32, the scale d * sc and the minimum -dmin * m."""
    d = _f16(b[..., :2]).astype(np.float32)[..., None]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    shape = b.shape[:-1]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    sc, m = sc.reshape(*shape, 8), m.reshape(*shape, 8)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low bits: each 32 bytes hold sub-block 2c in low and 2c + 1 in high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).reshape(*qs.shape[:-1], QK_K)


def _q4_k(b):
    scales, mins = _k_scales(b)
    return _k_nibbles(b[..., 16:]), scales, mins


def _q5_k(b):
    scales, mins = _k_scales(b)
    qh = b[..., 16:48]  # bit i of byte j is the fifth bit of weight 32 i + j
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    codes = _k_nibbles(b[..., 48:]) + (high.reshape(*b.shape[:-1], QK_K).astype(np.int16) << 4)
    return codes, scales, mins


def _q6_k(b):
    ql, qh = b[..., :128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)[..., None]
    shape = b.shape[:-1]
    low = (ql.reshape(*shape, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
    high = (qh.reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    codes = (low.reshape(*shape, 2, 4, 32).astype(np.int16)
             | (high.reshape(*shape, 2, 4, 32).astype(np.int16) << 4)) - 32
    return codes.reshape(*shape, QK_K), d * sc, None


BLOCK_TYPES: dict[_GGML, BlockType] = {
    _GGML.Q8_0: BlockType(32, (-128, 127), _q8_0),
    _GGML.Q4_0: BlockType(32, (0, 15), _q4_0, has_mins=True),
    _GGML.Q4_1: BlockType(32, (0, 15), _q4_1, has_mins=True),
    _GGML.Q5_0: BlockType(32, (-16, 15), _q5_0),
    _GGML.Q5_1: BlockType(32, (0, 31), _q5_1, has_mins=True),
    _GGML.Q4_K: BlockType(32, (0, 15), _q4_k, has_mins=True, scale_dtype="float32"),
    _GGML.Q5_K: BlockType(32, (0, 31), _q5_k, has_mins=True, scale_dtype="float32"),
    _GGML.Q6_K: BlockType(16, (-32, 31), _q6_k, scale_dtype="float32"),
}


def decode_blocks(raw: np.ndarray, qtype: _GGML, shape: tuple[int, ...]) -> Blocks:
    """The block fields of one tensor's bytes `raw` ([*rows, row bytes], as
    `meshserve.model.gguf_reader` maps them) for its `[*rows, in]` shape (`[out, in]`, or an
    expert stack's `[E, out, in]`)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *rows, width = shape
    blocks = np.asarray(raw).reshape(*rows, width // block_size, type_size)
    codes, scales, mins = BLOCK_TYPES[qtype].decode(blocks)
    group = BLOCK_TYPES[qtype].group
    groups = (*rows, width // group)
    return Blocks(codes=codes.reshape(shape), scales=scales.reshape(groups),
                  mins=None if mins is None else mins.reshape(groups), group=group)


def kept_format(qtypes: Sequence[_GGML], keep_bits: Sequence[int], num_contracted: int,
                num_out: int, length: int) -> QuantFormat | None:
    """The format that keeps the blocks of tensors of `qtypes` (one a layer of a stacked kernel,
    which a Q4_K_M file mixes: Q4_K with Q6_K in `ffn_down`) exactly, in the first of
    `keep_bits` that holds every layer's codes; None when none does, or a block type is not
    read here. `length` is the kernel's last contracted axis (5 and 6 bits pack units of 32
    along it). Layers of different types share the finest group (block groups are 16 or 32, so
    it divides the others), mins when any has them, float32 scales when any needs them (float16
    values are exact in float32), and the codes' union range."""
    kinds = [BLOCK_TYPES.get(qtype) for qtype in qtypes]
    if not kinds or None in kinds:
        return None
    low = min(kind.code_range[0] for kind in kinds)
    high = max(kind.code_range[1] for kind in kinds)
    for bits in keep_bits:
        offset = code_offset(low, high, bits)
        if offset is None or (bits in (5, 6) and length % PACK_UNIT):
            continue
        return QuantFormat(bits=bits, group=math.gcd(*(kind.group for kind in kinds)),
                           num_contracted=num_contracted, num_out=num_out,
                           has_mins=any(kind.has_mins for kind in kinds),
                           scale_dtype="float32" if any(kind.scale_dtype == "float32"
                                                        for kind in kinds) else "float16",
                           offset=offset)
    return None


def code_offset(low: int, high: int, bits: int) -> int | None:
    """What a `bits`-bit kernel adds to codes `low..high` to store them (int8 codes are signed,
    int4 unsigned, 5- and 6-bit ones shifted up to 0); None when they do not fit."""
    if bits == 8:
        return 0 if -128 <= low and high <= 127 else None
    offset = 0 if bits == 4 else max(0, -low)
    return offset if low + offset >= 0 and high + offset < 1 << bits else None


def regrouped(blocks: Blocks, fmt: QuantFormat) -> Blocks:
    """`blocks` in `fmt`'s (finer or equal) group, with zero mins where `fmt` has mins and the
    blocks have none: every weight's `code * scale + min` unchanged."""
    if blocks.group == fmt.group and (blocks.mins is not None) == fmt.has_mins:
        return blocks
    factor = blocks.group // fmt.group
    assert factor * fmt.group == blocks.group, (blocks.group, fmt.group)
    scales = np.repeat(blocks.scales, factor, axis=-1)
    if blocks.mins is not None:
        mins = np.repeat(blocks.mins, factor, axis=-1)
    else:
        mins = np.zeros_like(scales) if fmt.has_mins else None
    return Blocks(codes=blocks.codes, scales=scales, mins=mins, group=fmt.group)


class CanonicalLayout:
    """Where the blocks of an `[*rows, in]` tensor land in its canonical kernel `[*c, *out]`
    (`[E, in, out]` for an expert stack).

    `convert` is the tensor's float conversion (row permutation, transpose, reshape), an index
    permutation; applied to an index array it tells, for every group of the canonical kernel,
    which block of the source row it came from."""

    def __init__(self, convert: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...],
                 fmt: QuantFormat):
        size, width = math.prod(shape), shape[-1]
        self.convert, self.fmt = convert, fmt
        dtype = np.int32 if size < 2**31 else np.int64
        index = convert(np.arange(size, dtype=dtype).reshape(shape))
        axis = index.ndim - fmt.num_out - 1
        first = np.take(index, np.arange(0, index.shape[axis], fmt.group), axis=axis)
        last = np.take(index, np.arange(fmt.group - 1, index.shape[axis], fmt.group), axis=axis)
        if np.any(first % fmt.group) or np.any(last - first != fmt.group - 1):
            raise ValueError("the tensor's blocks do not line up with its kernel's groups")
        rows, columns = np.divmod(first, width)  # rows counts every row of every expert
        self.block_index = rows * (width // fmt.group) + columns // fmt.group  # [*c', *out]

    def quantized(self, blocks: Blocks) -> QuantizedArray:
        """The blocks as a kernel in the canonical layout: codes moved like weights, scales and
        mins like the first weight of their block."""
        take = lambda a: None if a is None else a.reshape(-1)[self.block_index]  # noqa: E731
        codes = self.convert(blocks.codes)  # [*c, *out]
        axis = codes.ndim - self.fmt.num_out - 1
        grouped = codes.reshape(*codes.shape[:axis], codes.shape[axis] // self.fmt.group,
                                self.fmt.group, *codes.shape[axis + 1:])
        return from_codes(grouped, take(blocks.scales), take(blocks.mins), self.fmt)
