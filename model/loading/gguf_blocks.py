"""GGUF's quantized blocks read as quantized kernels, never through float values.

A GGUF block type stores, per block of weights along a row (the input axis of an `[out, in]`
Linear weight, or of each expert's in a mixture's `[E, out, in]` stack), integer codes and a
scale (and for some types a minimum), so that each weight is `code * scale + min`.
`decode_blocks` reads those fields of one tensor as they are: codes one a byte `[*rows, in]`,
scales and mins `[*rows, in / group]`, in float16 where the file stores them so. A K-quant
stores them in two levels: per sub-block of 16 or 32 weights a 6-bit (Q4_K, Q5_K) or 8-bit
(Q6_K) integer scale `sc` (and minimum `m`), per super-block of 256 a float16 `d` (and `dmin`);
those are read as integers `[*rows, in / group]` and float32 super scales `[*rows, in / 256]`
(`d`, and `-dmin` as the super min), whose products `d * sc` and `-dmin * m` are the float32
scale and min `gguf.quants` computes (exact in float32):

    type   codes        group  scale                    min                         kept in
    Q8_0   -128..127    32     d (f16)                  -                           8
    Q4_0   0..15        32     d (f16)                  -8 d                        4, 8
    Q4_1   0..15        32     d (f16)                  m (f16)                     4, 8
    Q5_0   -16..15      32     d (f16)                  -                           5, 8
    Q5_1   0..31        32     d (f16)                  m (f16)                     5, 8
    Q4_K   0..15        32     sc (uint8) x d per 256   m (uint8) x -dmin per 256   4, 8
    Q5_K   0..31        32     sc (uint8) x d per 256   m (uint8) x -dmin per 256   5, 8
    Q6_K   -32..31      16     sc (int8) x d per 256    -                           6, 8

A tensor whose codes fit one of the plan's bit widths (`kept_format`: Q8_0 in 8 bits, Q4 types
in 4, Q5 in 5, Q6_K in 6, or all in 8 where the platform keeps int8) becomes a `QuantizedArray`
with the same codes, scales and mins (`CanonicalLayout.quantized`), moved into the canonical
kernel layout by the same index permutation as its float weights (an expert stack
`[E, out, in]` becomes `[E, in, out]`, its blocks with it): so it computes exactly what the
float path computes from the dequantized file. A K-quant kernel keeps its integer sub-scales and
a float32 super scale (and super min) per super group of 256 weights along the kernel's last
contracted axis (fewer where that axis is shorter, as attention's `o` with heads of 64 or 128:
the super scale repeated over each), so its scales cost close to what the file spends: a Q4_K or
Q5_K weight 0.5 + 0.25 bits of scales and mins against the file's 0.5 (4.75 bits a Q4_K
weight against the file's 4.5), a Q6_K weight 0.5 + 0.125 against 0.5625. Where a super group
would not span two groups (an axis of 32 for Q4_K), or a layer is not a K-quant, or the
kernel's conversion scatters a super-block's groups over several super groups, they are float32
products per group instead (`float_scaled`, `float_scales_format`): 2 bits a weight for a Q4_K's
scale and min.

The layers of one stacked kernel may be of different types (Q4_K_M files mix Q4_K and Q6_K in
`ffn_down`, and in `ffn_down_exps`). Where their codes keep in different widths the loader holds
each type's layers in a stack of their own, in their own format (`MixedArray`,
`meshserve.model.loading.assembly`), so a Q4_K layer spends 4.75 bits a weight and a Q6_K one
6.625. `kept_format` of all the layers' types gives the one format that holds each exactly (a
mixed stack's `uniform`, for where the layer axis must be one array), and `regrouped`
re-expresses a layer's blocks in it (scales repeated over a finer group, zero mins, Q4_K's uint8
sub-scales as int8 beside Q6_K's): 6-bit codes and groups of 16 with mins for Q4_K with Q6_K,
7.25 bits a weight. Other types (Q2_K, Q3_K, the IQ types) are not read here; the loader
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
    `[*rows, in / group]`; for a K-quant the scales and mins are integers and each multiplies
    its super group's float32 super scale (super min), `[*rows, in / super_group]`."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    group: int
    super_scales: np.ndarray | None = None
    super_mins: np.ndarray | None = None
    super_group: int | None = None


@dataclasses.dataclass(frozen=True)
class BlockType:
    group: int
    code_range: tuple[int, int]
    decode: Callable[[np.ndarray], tuple[np.ndarray | None, ...]]
    has_mins: bool = False
    scale_dtype: str = "float16"  # a K-quant's sub-scales: uint8 (6 bits) or int8
    super_block: int | None = None  # a K-quant's: weights per float16 d (and dmin)


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


def _k_scales(b) -> tuple[np.ndarray, ...]:
    """Q4_K and Q5_K: per sub-block of 32 the 6-bit scale sc and minimum m (uint8), per block
    of 256 d and -dmin (float32 `[..., 1]`)."""
    d = _f16(b[..., :2]).astype(np.float32)[..., None]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    shape = b.shape[:-1]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    return sc.reshape(*shape, 8), m.reshape(*shape, 8), d, -dmin


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low bits: each 32 bytes hold sub-block 2c in low and 2c + 1 in high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).reshape(*qs.shape[:-1], QK_K)


def _q4_k(b):
    sc, m, d, minus_dmin = _k_scales(b)
    return _k_nibbles(b[..., 16:]), sc, m, d, minus_dmin


def _q5_k(b):
    sc, m, d, minus_dmin = _k_scales(b)
    qh = b[..., 16:48]  # bit i of byte j is the fifth bit of weight 32 i + j
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    codes = _k_nibbles(b[..., 48:]) + (high.reshape(*b.shape[:-1], QK_K).astype(np.int16) << 4)
    return codes, sc, m, d, minus_dmin


def _q6_k(b):
    ql, qh = b[..., :128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    d = _f16(b[..., 208:210]).astype(np.float32)[..., None]
    shape = b.shape[:-1]
    low = (ql.reshape(*shape, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
    high = (qh.reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    codes = (low.reshape(*shape, 2, 4, 32).astype(np.int16)
             | (high.reshape(*shape, 2, 4, 32).astype(np.int16) << 4)) - 32
    return codes.reshape(*shape, QK_K), sc, None, d, None


BLOCK_TYPES: dict[_GGML, BlockType] = {
    _GGML.Q8_0: BlockType(32, (-128, 127), _q8_0),
    _GGML.Q4_0: BlockType(32, (0, 15), _q4_0, has_mins=True),
    _GGML.Q4_1: BlockType(32, (0, 15), _q4_1, has_mins=True),
    _GGML.Q5_0: BlockType(32, (-16, 15), _q5_0),
    _GGML.Q5_1: BlockType(32, (0, 31), _q5_1, has_mins=True),
    _GGML.Q4_K: BlockType(32, (0, 15), _q4_k, has_mins=True, scale_dtype="uint8",
                          super_block=QK_K),
    _GGML.Q5_K: BlockType(32, (0, 31), _q5_k, has_mins=True, scale_dtype="uint8",
                          super_block=QK_K),
    _GGML.Q6_K: BlockType(16, (-32, 31), _q6_k, scale_dtype="int8", super_block=QK_K),
}


def decode_blocks(raw: np.ndarray, qtype: _GGML, shape: tuple[int, ...]) -> Blocks:
    """The block fields of one tensor's bytes `raw` ([*rows, row bytes], as
    `meshserve.model.gguf_reader` maps them) for its `[*rows, in]` shape (`[out, in]`, or an
    expert stack's `[E, out, in]`)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *rows, width = shape
    blocks = np.asarray(raw).reshape(*rows, width // block_size, type_size)
    kind = BLOCK_TYPES[qtype]
    codes, scales, mins, *supers = kind.decode(blocks)
    groups = (*rows, width // kind.group)
    fields = Blocks(codes=codes.reshape(shape), scales=scales.reshape(groups),
                    mins=None if mins is None else mins.reshape(groups), group=kind.group)
    if kind.super_block is None:
        return fields
    super_scales, super_mins = supers
    super_groups = (*rows, width // kind.super_block)
    return dataclasses.replace(
        fields, super_scales=super_scales.reshape(super_groups),
        super_mins=None if super_mins is None else super_mins.reshape(super_groups),
        super_group=kind.super_block)


def float_scaled(blocks: Blocks) -> Blocks:
    """`blocks` with a float32 scale and min per group: a K-quant's products `d * sc` and
    `-dmin * m`, as `gguf.quants` computes them (exact in float32); others as they are."""
    if blocks.super_scales is None:
        return blocks
    spread = lambda a: np.repeat(a, blocks.super_group // blocks.group, axis=-1)  # noqa: E731
    scales = spread(blocks.super_scales) * blocks.scales.astype(np.float32)
    mins = (None if blocks.mins is None
            else spread(blocks.super_mins) * blocks.mins.astype(np.float32))
    return Blocks(codes=blocks.codes, scales=scales, mins=mins, group=blocks.group)


def kept_format(qtypes: Sequence[_GGML], keep_bits: Sequence[int], num_contracted: int,
                num_out: int, length: int) -> QuantFormat | None:
    """The format that keeps the blocks of tensors of `qtypes` (one a layer of a stacked kernel,
    which a Q4_K_M file mixes: Q4_K with Q6_K in `ffn_down`) exactly, in the first of
    `keep_bits` that holds every layer's codes; None when none does, or a block type is not
    read here. `length` is the kernel's last contracted axis (5 and 6 bits pack units of 32
    along it). Layers of different types share the finest group (block groups are 16 or 32, so
    it divides the others), mins when any has them, the codes' union range, and the scales of
    `_scale_fields`."""
    kinds = [BLOCK_TYPES.get(qtype) for qtype in qtypes]
    if not kinds or None in kinds:
        return None
    low = min(kind.code_range[0] for kind in kinds)
    high = max(kind.code_range[1] for kind in kinds)
    group = math.gcd(*(kind.group for kind in kinds))
    for bits in keep_bits:
        offset = code_offset(low, high, bits)
        if offset is None or (bits in (5, 6) and length % PACK_UNIT):
            continue
        return QuantFormat(bits=bits, group=group, num_contracted=num_contracted,
                           num_out=num_out, has_mins=any(kind.has_mins for kind in kinds),
                           offset=offset, **_scale_fields(kinds, group, length))
    return None


def _scale_fields(kinds: Sequence[BlockType], group: int, length: int) -> dict:
    """How a kept format stores the scales of layers of `kinds`: where every layer is a K-quant,
    their integer sub-scales (uint8, or int8 where any is Q6_K's) times a float32 super scale
    per super group, the most weights of one super-block of 256 that the kernel's last
    contracted axis of `length` holds, whenever that is fewer bytes than float32 scales (a
    super group of two groups or more); else float32 scales (the K-quants' products, exact),
    or float16 where every layer stores its scales so (float16 values are exact in float32)."""
    if all(kind.super_block for kind in kinds):
        super_group = math.gcd(QK_K, length)
        if super_group > group:
            unsigned = all(kind.scale_dtype == "uint8" for kind in kinds)
            return {"scale_dtype": "uint8" if unsigned else "int8", "super_group": super_group}
    float16 = all(kind.scale_dtype == "float16" for kind in kinds)
    return {"scale_dtype": "float16" if float16 else "float32"}


def float_scales_format(fmt: QuantFormat) -> QuantFormat:
    """`fmt` with float32 scales per group instead of super groups: what a K-quant kernel is
    kept in where its super-blocks do not line up with the kernel's super groups."""
    return dataclasses.replace(fmt, scale_dtype="float32", super_group=None)


def code_offset(low: int, high: int, bits: int) -> int | None:
    """What a `bits`-bit kernel adds to codes `low..high` to store them (int8 codes are signed,
    int4 unsigned, 5- and 6-bit ones shifted up to 0); None when they do not fit."""
    if bits == 8:
        return 0 if -128 <= low and high <= 127 else None
    offset = 0 if bits == 4 else max(0, -low)
    return offset if low + offset >= 0 and high + offset < 1 << bits else None


def regrouped(blocks: Blocks, fmt: QuantFormat) -> Blocks:
    """`blocks` in `fmt`'s (finer or equal) group, with zero mins where `fmt` has mins and the
    blocks have none, and in its super groups (super scales repeated over a super group finer
    than the block's, zero super mins with the zero mins), or with float32 scales where `fmt`
    has no super groups (`float_scaled`): every weight's `code * scale + min` unchanged."""
    if fmt.super_group is None:
        blocks = float_scaled(blocks)
    factor = blocks.group // fmt.group
    assert factor * fmt.group == blocks.group, (blocks.group, fmt.group)
    scales, mins = _repeated(blocks.scales, blocks.mins, factor, fmt.has_mins)
    if fmt.super_group is None:
        return Blocks(codes=blocks.codes, scales=scales, mins=mins, group=fmt.group)
    spread = blocks.super_group // fmt.super_group
    assert spread * fmt.super_group == blocks.super_group, (blocks.super_group, fmt.super_group)
    super_scales, super_mins = _repeated(blocks.super_scales, blocks.super_mins, spread,
                                         fmt.has_mins)
    return Blocks(codes=blocks.codes, scales=scales, mins=mins, group=fmt.group,
                  super_scales=super_scales, super_mins=super_mins, super_group=fmt.super_group)


def _repeated(scales: np.ndarray, mins: np.ndarray | None, factor: int, has_mins: bool
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales and mins each repeated `factor` times along the last axis (a finer group); no
    mins become zeros where the format has them."""
    scales = np.repeat(scales, factor, axis=-1)
    if mins is not None:
        return scales, np.repeat(mins, factor, axis=-1)
    return scales, np.zeros_like(scales) if has_mins else None


class CanonicalLayout:
    """Where the blocks of an `[*rows, in]` tensor land in its canonical kernel `[*c, *out]`
    (`[E, in, out]` for an expert stack).

    `convert` is the tensor's float conversion (row permutation, transpose, reshape), an index
    permutation; applied to an index array it tells, for every group of the canonical kernel,
    which block of the source row it came from, and, in super groups, which super group."""

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
        self.super_index = None
        if fmt.super_group is not None:
            # Each super group's weights must come from one super group of a source row, whose
            # index (row * width / super_group + column / super_group) is their index over it.
            sources = index // fmt.super_group  # width divides into super groups
            sources = sources.reshape(*index.shape[:axis], index.shape[axis] // fmt.super_group,
                                      fmt.super_group, *index.shape[axis + 1:])
            self.super_index = np.take(sources, 0, axis=axis + 1)  # [*c'', *out]
            if np.any(sources != np.expand_dims(self.super_index, axis + 1)):
                raise ValueError("the tensor's super-blocks do not line up with its kernel's "
                                 "super groups")

    def quantized(self, blocks: Blocks) -> QuantizedArray:
        """The blocks as a kernel in the canonical layout: codes moved like weights, scales and
        mins like the first weight of their block, super scales and mins like the first weight
        of their super group."""
        take = lambda a, index: None if a is None else a.reshape(-1)[index]  # noqa: E731
        codes = self.convert(blocks.codes)  # [*c, *out]
        axis = codes.ndim - self.fmt.num_out - 1
        grouped = codes.reshape(*codes.shape[:axis], codes.shape[axis] // self.fmt.group,
                                self.fmt.group, *codes.shape[axis + 1:])
        return from_codes(grouped, take(blocks.scales, self.block_index),
                          take(blocks.mins, self.block_index), self.fmt,
                          super_scales=take(blocks.super_scales, self.super_index),
                          super_mins=take(blocks.super_mins, self.super_index))
