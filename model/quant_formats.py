"""Quantized kernels on the host: their formats, and round-to-nearest quantization in numpy.

A quantized kernel stores integer codes and, per group of codes, a scale and (optionally) a
minimum; each weight is `code * scale + min`. Groups run along the kernel's last contracted axis
(the axis a matmul sums over), `group` weights each; a format without a group has one scale per
output channel, over the whole contraction. Shapes, for a kernel `[*c, *out]` (contracted axes c,
output axes out, with optional stack axes in front of both: a layer axis, a routed expert
stack's expert axis):

    bits 8   codes  int8   [*c, *out]                  the kernel's own shape and axes
    bits 4   codes  uint8  [*c[:-1], c[-1] / 2, *out]  two codes a byte: in each group, code j
                                                       in the low nibble, code j + group / 2 in
                                                       the high one (GGUF's order in a Q4 block)
    bits 5, 6  codes uint8 [*c[:-1], c[-1] / 32 * U, *out]  per unit of 32 codes, U = 20 or 24
                                                       rows: 16 of nibbles (code j low, j + 16
                                                       high), then the codes' top bits (5: byte
                                                       i bit t is code 8 i + t's; 6: bits 2t..2t+1
                                                       of byte i are code 4 i + t's)
    grouped  scales, mins  [*c[:-1], c[-1] / group, *out]
    per-channel  scales    [*out]
    super-grouped  super_scales, super_mins  [*c[:-1], c[-1] / super_group, *out]  float32

Codes of 5 and 6 bits are stored plus `offset` (GGUF's Q5_0 and Q6_K codes are signed, -16..15
and -32..31), so that a kernel keeps a Q5/Q6 block's codes in the bits the file spends on them.

Scales and mins are floats (`scale_dtype` float32 or float16), or, in super groups of
`super_group` weights along the same axis (GGUF's K-quants: 256), small integers (uint8 or int8:
a K-quant block's 6- and 8-bit sub-scales) that multiply their super group's float32
`super_scales` and `super_mins` (the block's d and -dmin). A group's scale is then
`super_scale * scale` in float32 (`group_scales`), which for a file's float16 d and 8-bit
sub-scale is exact: the float32 scale GGUF's own dequantizer computes. Each weight costs 8 / group
bits of scale (and of min) and 32 / super_group of super scale (and of super min), against
32 / group for float32 scales.

A `QuantizedArray` holds the arrays of one kernel (numpy on the host, jax arrays on devices) and
its `QuantFormat`. A stack of layers whose kernels are kept in formats of different code widths
(a Q4_K_M file's `ffn_down`: Q4_K layers and Q6_K ones) is a `MixedArray`: one `QuantizedArray`
stack per format, and a `LayerMix` saying which part holds each layer and the one format that
would hold them all (`uniform_stack` widens every layer to it exactly, `widened`). The model code reads them through `meshserve.model.quantized_kernel`; the loaders
build them from float weights (`quantize`) or straight from GGUF blocks.

`SCHEMES` are the user's choices (`EngineConfig.quantization`): what float kernels become, and
which bit widths a GGUF's blocks are kept in (`KernelPlan`). "auto" keeps a GGUF's quantized
blocks exactly and leaves float weights float; the container depends on the platform
(`auto_keep_bits`): int8 on the CPU without native kernels, elsewhere the fewest bits of 4, 5, 6
and 8 that hold the codes.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

SCHEMES = ("none", "auto", "int8", "int4", "int4-g64")
SCALE_DTYPES = ("float32", "float16", "uint8", "int8")
INTEGER_SCALE_DTYPES = ("uint8", "int8")  # the scales of a format in super groups
ARRAY_NAMES = ("values", "scales", "mins", "super_scales", "super_mins")
INT8_MAX = 127
INT4_LEVELS = 15
PACK_UNIT = 32  # codes a unit of a 5- or 6-bit kernel packs along the contracted axis


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How one kernel is stored. `num_contracted` and `num_out` count the kernel's contracted and
    output axes (stack axes in front, a layer's or an expert's, are neither); `group` is None for
    per-channel scales. A code is its stored value minus `offset` (5 and 6 bits only). With
    `super_group` (a multiple of `group`), scales and mins are integers of `scale_dtype` (uint8
    or int8) times a float32 super scale and super min per `super_group` weights."""

    bits: int
    group: int | None
    num_contracted: int
    num_out: int
    has_mins: bool
    scale_dtype: str = "float32"
    offset: int = 0
    super_group: int | None = None

    def __post_init__(self):
        assert self.bits in (4, 5, 6, 8), self.bits
        assert self.scale_dtype in SCALE_DTYPES, self.scale_dtype
        assert (self.super_group is not None) == (self.scale_dtype in INTEGER_SCALE_DTYPES), \
            "integer scales are the ones that multiply a super scale"
        assert self.super_group is None or (
            self.group is not None and self.super_group % self.group == 0), self.super_group
        assert self.group is not None or (self.bits == 8 and not self.has_mins), \
            "per-channel scales are for symmetric int8"
        assert self.group is None or self.group % 2 == 0, self.group
        assert self.offset == 0 or self.is_packed, "only 5- and 6-bit codes are offset"
        assert not self.is_packed or PACK_UNIT % self.group == 0, self.group

    @property
    def code_dtype(self) -> Any:
        return np.int8 if self.bits == 8 else np.uint8

    @property
    def is_packed(self) -> bool:
        """Whether codes are 5 or 6 bits, packed in units of `PACK_UNIT` (`pack_codes`)."""
        return self.bits in (5, 6)

    @property
    def unit_rows(self) -> int:
        """Bytes a unit of 32 packed codes takes along the contracted axis (5 bits: 20)."""
        return PACK_UNIT // 2 + PACK_UNIT * (self.bits - 4) // 8

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "QuantFormat":
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """One quantized kernel: codes, scales, optional mins (numpy or jax arrays) and its format;
    in super groups (`format.super_group`), its float32 super scales and, with mins, super
    mins."""

    values: Any
    scales: Any
    mins: Any
    format: QuantFormat
    super_scales: Any = None
    super_mins: Any = None

    @classmethod
    def from_arrays(cls, named: Mapping[str, Any], fmt: QuantFormat) -> "QuantizedArray":
        """The kernel of the arrays `arrays()` names (those `fmt` lacks left out)."""
        return cls(format=fmt, **{name: named.get(name) for name in ARRAY_NAMES})

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float kernel it stands for."""
        shape = list(self.values.shape)
        axis = last_contracted_axis(self.format)
        if self.format.bits == 4:
            shape[axis] *= 2
        elif self.format.is_packed:
            shape[axis] = shape[axis] // self.format.unit_rows * PACK_UNIT
        return tuple(shape)

    def arrays(self) -> dict[str, Any]:
        """Its arrays by name ("values", "scales" and those of "mins", "super_scales" and
        "super_mins" it has), as `stored_shapes` names them."""
        return {name: getattr(self, name) for name in ARRAY_NAMES
                if getattr(self, name) is not None}

    def map(self, fn) -> "QuantizedArray":
        """The same kernel with `fn` applied to each of its arrays (to place, cast or slice
        them)."""
        return dataclasses.replace(self, **{name: fn(a) for name, a in self.arrays().items()})

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in self.arrays().values())


@dataclasses.dataclass(frozen=True)
class LayerMix:
    """How a stack of layers whose kernels are of different formats is held: one stack of
    kernels per format (a part), and for each layer the part that holds it (`part_of`); a
    layer's index in its part counts the earlier layers of the same part. `uniform` is the one
    format that holds every layer exactly (`widened`), for where a stack must be one array (a
    pipeline's stages split the layer axis)."""

    formats: tuple[QuantFormat, ...]
    part_of: tuple[int, ...]
    uniform: QuantFormat

    def __post_init__(self):
        assert len(self.formats) >= 2 and set(self.part_of) == set(range(len(self.formats)))

    @property
    def index(self) -> tuple[int, ...]:
        """Each layer's index in its part."""
        seen = [0] * len(self.formats)
        index = []
        for part in self.part_of:
            index.append(seen[part])
            seen[part] += 1
        return tuple(index)

    def layers(self, part: int) -> tuple[int, ...]:
        """The layers part `part` holds, in order."""
        return tuple(i for i, p in enumerate(self.part_of) if p == part)

    def to_json(self) -> dict[str, Any]:
        return {"mixed": {"formats": [f.to_json() for f in self.formats],
                          "part_of": list(self.part_of), "uniform": self.uniform.to_json()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LayerMix":
        data = data["mixed"]
        return cls(formats=tuple(QuantFormat.from_json(f) for f in data["formats"]),
                   part_of=tuple(data["part_of"]),
                   uniform=QuantFormat.from_json(data["uniform"]))


def format_from_json(data: dict[str, Any]) -> "QuantFormat | LayerMix":
    """A format `to_json` wrote: a `LayerMix`'s, or a `QuantFormat`'s."""
    return LayerMix.from_json(data) if "mixed" in data else QuantFormat.from_json(data)


@dataclasses.dataclass(frozen=True)
class MixedArray:
    """A stack of layers' kernels of different formats (a Q4_K_M file's `ffn_down`: Q4_K
    layers and Q6_K ones), held as one `QuantizedArray` stack per format, `parts`, each
    spending its own format's bits; `format` says which layer each part holds."""

    parts: tuple[QuantizedArray, ...]
    format: LayerMix

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float stack it stands for: [num_layers, *one layer's]."""
        return (len(self.format.part_of), *self.parts[0].shape[1:])

    def arrays(self) -> dict[str, Any]:
        """Every part's arrays, named "parts/{part}/{name}" (the paths a model holds them at)."""
        return {f"parts/{p}/{name}": a for p, part in enumerate(self.parts)
                for name, a in part.arrays().items()}

    @classmethod
    def from_arrays(cls, named: Mapping[str, Any], mix: LayerMix) -> "MixedArray":
        return cls(parts=tuple(QuantizedArray.from_arrays(
            {name: named.get(f"parts/{p}/{name}") for name in ARRAY_NAMES}, fmt)
            for p, fmt in enumerate(mix.formats)), format=mix)

    def map(self, fn) -> "MixedArray":
        return dataclasses.replace(self, parts=tuple(part.map(fn) for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def layer(self, i: int) -> QuantizedArray:
        """Layer `i`'s kernel, in its part's format."""
        part = self.parts[self.format.part_of[i]]
        return part.map(lambda a: a[self.format.index[i]])


def widened(q: QuantizedArray, fmt: QuantFormat, xp: Any = np) -> QuantizedArray:
    """`q` in `fmt`, a format that holds its codes (more bits or a wider offset), a group that
    divides q's, mins where q has none (zero) and super groups where q has them (or float32
    scales per group): every weight's `code * scale + min` unchanged, so the float32 weights
    `dequantize` gives are q's, bit for bit."""
    old = q.format
    assert old.group is not None and fmt.group is not None and old.group % fmt.group == 0
    factor = old.group // fmt.group
    axis = q.values.ndim + last_contracted_axis(old)
    codes = unpacked_codes(q, xp)  # [..., n, group, *out]
    codes = codes.reshape(*codes.shape[:axis], codes.shape[axis] * factor, fmt.group,
                          *codes.shape[axis + 2:])
    spread = lambda a, n: None if a is None else xp.repeat(a, n, axis=axis)  # noqa: E731
    if fmt.super_group is None:
        scales, mins = group_scales(q, xp)
        supers, super_mins = None, None
    else:
        assert old.super_group is not None and old.super_group % fmt.super_group == 0
        scales, mins = q.scales, q.mins
        supers = spread(q.super_scales, old.super_group // fmt.super_group)
        super_mins = spread(q.super_mins, old.super_group // fmt.super_group)
    scales, mins = spread(scales, factor), spread(mins, factor)
    if fmt.has_mins and mins is None:
        mins = xp.zeros_like(scales)
        super_mins = None if supers is None else xp.zeros_like(supers)
    assert fmt.has_mins or mins is None
    return from_codes(codes, scales, mins, fmt, xp, super_scales=supers, super_mins=super_mins)


def uniform_stack(m: MixedArray, xp: Any = np) -> QuantizedArray:
    """A mixed stack as one `QuantizedArray` stack in `m.format.uniform`: every layer widened
    to it (the weights unchanged), in layer order."""
    parts = [widened(part, m.format.uniform, xp) for part in m.parts]
    index = m.format.index
    layers = [parts[p].map(lambda a, i=index[i]: a[i]) for i, p in enumerate(m.format.part_of)]
    return QuantizedArray.from_arrays(
        {name: xp.stack([q.arrays()[name] for q in layers]) for name in layers[0].arrays()},
        m.format.uniform)


def stored_shapes(fmt: "QuantFormat | LayerMix", shape: tuple[int, ...]
                  ) -> dict[str, tuple[int, ...]]:
    """The shape of each array of a kernel of float shape `shape` stored in `fmt` (a mixed
    stack's by "parts/{part}/{name}")."""
    if isinstance(fmt, LayerMix):
        return {f"parts/{p}/{name}": s for p, part in enumerate(fmt.formats)
                for name, s in stored_shapes(part, (len(fmt.layers(p)), *shape[1:])).items()}
    shape = tuple(shape)
    axis = len(shape) + last_contracted_axis(fmt)
    rows = {8: shape[axis], 4: shape[axis] // 2}.get(
        fmt.bits, shape[axis] // PACK_UNIT * fmt.unit_rows)
    values = shape[:axis] + (rows,) + shape[axis + 1:]
    if fmt.group is None:
        scales = shape[:axis + 1 - fmt.num_contracted] + shape[axis + 1:]
    else:
        scales = shape[:axis] + (shape[axis] // fmt.group,) + shape[axis + 1:]
    named = {"values": values, "scales": scales}
    if fmt.has_mins:
        named["mins"] = scales
    if fmt.super_group is not None:
        named["super_scales"] = shape[:axis] + (shape[axis] // fmt.super_group,) + shape[axis + 1:]
        if fmt.has_mins:
            named["super_mins"] = named["super_scales"]
    return named


def stored_dtypes(fmt: "QuantFormat | LayerMix") -> dict[str, str]:
    if isinstance(fmt, LayerMix):
        return {f"parts/{p}/{name}": d for p, part in enumerate(fmt.formats)
                for name, d in stored_dtypes(part).items()}
    named = {"values": np.dtype(fmt.code_dtype).name, "scales": fmt.scale_dtype}
    if fmt.has_mins:
        named["mins"] = fmt.scale_dtype
    if fmt.super_group is not None:
        named["super_scales"] = "float32"
        if fmt.has_mins:
            named["super_mins"] = "float32"
    return named


def describe(fmt: "QuantFormat | LayerMix") -> str:
    """One line of what `fmt` holds, as the tools print it ("4 bits, groups of 32, mins, uint8
    scales x float32 per 256"; a mixed stack's parts joined by " + ", each with its count of
    layers)."""
    if isinstance(fmt, LayerMix):
        return " + ".join(f"{len(fmt.layers(p))} layers of {describe(part)}"
                          for p, part in enumerate(fmt.formats))
    if fmt.group is None:
        return f"{fmt.bits} bits, a {fmt.scale_dtype} scale per output channel"
    supers = f" x float32 per {fmt.super_group}" if fmt.super_group else ""
    offset = f", codes offset by {fmt.offset}" if fmt.offset else ""
    return (f"{fmt.bits} bits, groups of {fmt.group}, {'mins, ' if fmt.has_mins else ''}"
            f"{fmt.scale_dtype} scales{supers}{offset}")


def last_contracted_axis(fmt: QuantFormat) -> int:
    """The axis groups run along, counted from the end (so a layer axis in front changes
    nothing)."""
    return -(fmt.num_out + 1)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What loading does with one kernel: its GGUF blocks are kept in the first of `keep_bits`
    their codes fit (a stack of layers in the first that fits every layer's codes); otherwise
    its float weights become `fmt` (None: they stay float)."""

    fmt: QuantFormat | None
    keep_bits: tuple[int, ...]
    num_contracted: int
    num_out: int


def auto_keep_bits(platform: str, *, native: bool = False) -> tuple[int, ...]:
    """The bit widths "auto" keeps a GGUF's blocks in on `platform` ("cpu", "gpu", "tpu"), the
    first that fits. On the CPU without native kernels, int8 containers: XLA:CPU streams int8
    codes into its dot faster than it unpacks int4's nibbles (docs/benchmarks.md), and a 4-bit
    code is held exactly in 8 bits, so the function is the same. With native kernels (which
    read packed codes themselves) and elsewhere, the file's own widths, for their bytes."""
    return (8,) if platform == "cpu" and not native else (4, 5, 6, 8)


def scheme_plan(scheme: str, num_contracted: int, num_out: int, *,
                platform: str, native: bool = False) -> KernelPlan | None:
    """The plan of `scheme` for one kernel on `platform`; None for "none"."""
    fmt = scheme_format(scheme, num_contracted, num_out)
    if scheme == "none":
        return None
    keep = auto_keep_bits(platform, native=native) if scheme == "auto" else (fmt.bits,)
    return KernelPlan(fmt=fmt, keep_bits=keep, num_contracted=num_contracted, num_out=num_out)


def check_scheme(scheme: str) -> None:
    """Raises ValueError, naming the schemes, unless `scheme` is one of them."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not supported; use one of {SCHEMES}")


def scheme_format(scheme: str, num_contracted: int, num_out: int) -> QuantFormat | None:
    """The format scheme `scheme` gives a float kernel; None for "none" and "auto"."""
    check_scheme(scheme)
    if scheme in ("none", "auto"):
        return None
    if scheme == "int8":
        return QuantFormat(bits=8, group=None, num_contracted=num_contracted, num_out=num_out,
                           has_mins=False)
    group = 64 if scheme == "int4-g64" else 32
    return QuantFormat(bits=4, group=group, num_contracted=num_contracted, num_out=num_out,
                       has_mins=True, scale_dtype="float16")


def check_groups(fmt: QuantFormat, shape: tuple[int, ...], name: str) -> None:
    """Raises ValueError when `fmt` cannot hold a kernel of `shape`."""
    length = shape[last_contracted_axis(fmt)]
    step = fmt.group if fmt.group is not None else (2 if fmt.bits == 4 else 1)
    step = PACK_UNIT if fmt.is_packed else step
    step = fmt.super_group or step
    if length % step:
        raise ValueError(f"{name}: its contracted axis of {length} does not divide into groups "
                         f"of {step}; quantize it with another scheme or leave it unquantized")


# -- quantizing float kernels (round to nearest) ----------------------------------------------


def quantize(kernel: Any, fmt: QuantFormat, xp: Any = np) -> QuantizedArray:
    """`kernel` [*stack, *c, *out] quantized to `fmt` by rounding to nearest. `xp` is numpy, or
    jax.numpy for arrays already on a device.

    Symmetric int8 (no mins) takes max |w| / 127 as its scale; int4 spans each group's range
    [min, max] in 15 steps, like GGUF's Q4_1. Scales and mins are rounded to their storage dtype
    first, so that codes are chosen against the values the kernel is read with."""
    assert (fmt.bits, fmt.has_mins) in ((8, False), (4, True)), "quantize makes int8 or int4"
    check_groups(fmt, tuple(kernel.shape), "kernel")
    grouped = _grouped(xp.asarray(kernel, dtype=np.float32), fmt)  # [..., n, group, *out]
    axes = _reduce_axes(grouped, fmt)
    if fmt.bits == 8:
        scale = _stored(xp.abs(grouped).max(axis=axes, keepdims=True) / INT8_MAX, fmt)
        codes = xp.clip(_rounded(xp, grouped, scale), -INT8_MAX, INT8_MAX)
        return from_codes(codes, _squeeze(scale, fmt), None, fmt, xp)
    low = _stored(grouped.min(axis=axes, keepdims=True), fmt)
    scale = _stored((grouped.max(axis=axes, keepdims=True) - low) / INT4_LEVELS, fmt)
    codes = xp.clip(_rounded(xp, grouped - low, scale), 0, INT4_LEVELS)
    return from_codes(codes, _squeeze(scale, fmt), _squeeze(low, fmt), fmt, xp)


def from_codes(codes: Any, scales: Any, mins: Any, fmt: QuantFormat, xp: Any = np, *,
               super_scales: Any = None, super_mins: Any = None) -> QuantizedArray:
    """A `QuantizedArray` from codes in the grouped layout of `_grouped` (one code an element),
    or per channel in the kernel's own shape, packing two int4 codes a byte, and 5 or 6 bits a
    code in units of 32 (`pack_codes`); in super groups, with their super scales and mins."""
    if fmt.group is None:
        values = codes.astype(fmt.code_dtype)
    elif fmt.is_packed:
        values = pack_codes(xp, _ungrouped(codes, fmt), fmt)
    else:
        values = _packed(xp, codes, fmt) if fmt.bits == 4 else codes.astype(fmt.code_dtype)
        values = _ungrouped(values, fmt)
    assert (super_scales is not None) == (fmt.super_group is not None)
    assert (super_mins is not None) == (fmt.super_group is not None and fmt.has_mins)
    as_float32 = lambda a: None if a is None else a.astype(np.float32)  # noqa: E731
    return QuantizedArray(values=values, scales=scales.astype(fmt.scale_dtype),
                          mins=None if mins is None else mins.astype(fmt.scale_dtype), format=fmt,
                          super_scales=as_float32(super_scales), super_mins=as_float32(super_mins))


def dequantize(q: "QuantizedArray | MixedArray", xp: Any = np) -> Any:
    """The float32 kernel `q` stands for: the reference the compiled matmul is held to."""
    if isinstance(q, MixedArray):
        return xp.stack([dequantize(q.layer(i), xp) for i in range(len(q.format.part_of))])
    fmt = q.format
    codes = unpacked_codes(q, xp).astype(np.float32)  # grouped layout, or the kernel per channel
    scales, mins = group_scales(q, xp)
    if fmt.group is None:
        return codes * scales.reshape(scales.shape[:-fmt.num_out] + (1,) * fmt.num_contracted
                                      + scales.shape[-fmt.num_out:])
    axis = last_contracted_axis(fmt)
    w = codes * xp.expand_dims(scales, axis)
    if mins is not None:
        w = w + xp.expand_dims(mins, axis)
    return _ungrouped(w, fmt)


def group_scales(q: QuantizedArray, xp: Any = np) -> tuple[Any, Any]:
    """Each group's scale and min in float32, `[..., c[-1] / group, *out]` (per channel, the
    scales `[..., *out]`; no mins: None): as stored, or in super groups each group's integer
    scale (min) times its super group's float32 one, the product a K-quant's dequantizer
    computes (`d * sc` and `-dmin * m`, both exact in float32)."""
    fmt = q.format
    scales = q.scales.astype(np.float32)
    mins = None if q.mins is None else q.mins.astype(np.float32)
    if fmt.super_group is None:
        return scales, mins
    axis = q.scales.ndim + last_contracted_axis(fmt)
    spread = lambda a: xp.repeat(a, fmt.super_group // fmt.group, axis=axis)  # noqa: E731
    scales = spread(q.super_scales) * scales
    if mins is not None:
        mins = spread(q.super_mins) * mins
    return scales, mins


def unpacked_codes(q: QuantizedArray, xp: Any = np) -> Any:
    """One code an element: `[..., n, group, *out]` when grouped, else the kernel's shape."""
    fmt = q.format
    if fmt.group is None:
        return q.values
    if fmt.is_packed:
        return _grouped(unpack_codes(xp, q.values, fmt), fmt)
    grouped = _grouped(q.values, fmt, width=fmt.group // 2 if fmt.bits == 4 else fmt.group)
    if fmt.bits == 8:
        return grouped
    axis = last_contracted_axis(fmt)
    return xp.concatenate([grouped & 15, grouped >> 4], axis=axis)


def _grouped(w: Any, fmt: QuantFormat, width: int | None = None) -> Any:
    """Splits the last contracted axis into `(n, width)`, width = the group by default."""
    if fmt.group is None:
        return w
    width = width or fmt.group
    axis = w.ndim + last_contracted_axis(fmt)
    return w.reshape(w.shape[:axis] + (w.shape[axis] // width, width) + w.shape[axis + 1:])


def _ungrouped(w: Any, fmt: QuantFormat) -> Any:
    """Merges the `(n, width)` pair of `_grouped` back into one axis."""
    axis = w.ndim + last_contracted_axis(fmt) - 1
    return w.reshape(w.shape[:axis] + (w.shape[axis] * w.shape[axis + 1],) + w.shape[axis + 2:])


def _reduce_axes(grouped: Any, fmt: QuantFormat) -> tuple[int, ...]:
    """The axes one scale covers: the group's own axis, or every contracted axis."""
    if fmt.group is not None:
        return (grouped.ndim + last_contracted_axis(fmt),)
    first = grouped.ndim - fmt.num_out - fmt.num_contracted
    return tuple(range(first, grouped.ndim - fmt.num_out))


def _squeeze(a: Any, fmt: QuantFormat) -> Any:
    """Drops the axes a scale was broadcast over."""
    if fmt.group is not None:
        return a.reshape(a.shape[:a.ndim + last_contracted_axis(fmt)]
                         + a.shape[a.ndim + last_contracted_axis(fmt) + 1:])
    first = a.ndim - fmt.num_out - fmt.num_contracted
    return a.reshape(a.shape[:first] + a.shape[a.ndim - fmt.num_out:])


def _stored(a: Any, fmt: QuantFormat) -> Any:
    """`a` as it will be read back: rounded through the storage dtype of scales."""
    return a.astype(fmt.scale_dtype).astype(np.float32)


def _rounded(xp: Any, w: Any, scale: Any) -> Any:
    safe = xp.where(scale == 0, 1.0, scale)
    return xp.where(scale == 0, 0.0, xp.round(w / safe))


def _packed(xp: Any, codes: Any, fmt: QuantFormat) -> Any:
    """int4 codes `[..., n, group, *out]` -> bytes `[..., n, group / 2, *out]`."""
    axis = codes.ndim + last_contracted_axis(fmt)
    low, high = xp.split(codes.astype(np.uint8), 2, axis=axis)
    return low | (high << 4)


def pack_codes(xp: Any, codes: Any, fmt: QuantFormat) -> Any:
    """5- or 6-bit codes `[..., K, *out]` (one code an element, signed as `fmt.offset` says) ->
    bytes `[..., K / 32 * U, *out]`: per unit of 32 codes, 16 rows of nibbles (code j in the
    low nibble, j + 16 in the high one), then the top bits, 8 codes a byte (5 bits) or 4 (6)."""
    axis = codes.ndim + last_contracted_axis(fmt)
    stored = (codes + fmt.offset).astype(np.uint8)
    units = _split(stored, axis, PACK_UNIT)  # [..., K / 32, 32, *out]
    first, second = xp.split(units, 2, axis=axis + 1)
    nibbles = (first & 15) | ((second & 15) << 4)
    width = fmt.bits - 4  # top bits per code
    per_byte = 8 // width
    top = _split(units >> 4, axis + 1, per_byte)  # [..., K / 32, 32 / per_byte, per_byte, *out]
    shifts = (np.arange(per_byte, dtype=np.uint8) * width).reshape(
        (per_byte,) + (1,) * fmt.num_out)
    high = (top << shifts).sum(axis=axis + 2, dtype=np.uint8)
    packed = xp.concatenate([nibbles, high], axis=axis + 1)  # [..., K / 32, U, *out]
    return _merged(packed, axis)


def unpack_codes(xp: Any, values: Any, fmt: QuantFormat) -> Any:
    """`pack_codes` undone: bytes `[..., K / 32 * U, *out]` -> codes `[..., K, *out]` (int16)."""
    axis = values.ndim + last_contracted_axis(fmt)
    units = _split(values, axis, fmt.unit_rows)  # [..., K / 32, U, *out]
    nibbles, high = xp.split(units, [PACK_UNIT // 2], axis=axis + 1)
    low = xp.concatenate([nibbles & 15, nibbles >> 4], axis=axis + 1)  # [..., K / 32, 32, *out]
    width = fmt.bits - 4
    per_byte = 8 // width
    shifts = (np.arange(per_byte, dtype=np.uint8) * width).reshape(
        (per_byte,) + (1,) * fmt.num_out)
    top = (xp.expand_dims(high, axis + 2) >> shifts) & ((1 << width) - 1)
    top = _merged(top, axis + 1)  # [..., K / 32, 32, *out]
    codes = low.astype(np.int16) | (top.astype(np.int16) << 4)
    return _merged(codes - fmt.offset, axis)


def _split(a: Any, axis: int, width: int) -> Any:
    """Axis `axis` of `a` split into `(n, width)`."""
    return a.reshape(a.shape[:axis] + (a.shape[axis] // width, width) + a.shape[axis + 1:])


def _merged(a: Any, axis: int) -> Any:
    """Axes `axis` and `axis + 1` of `a` merged into one."""
    return a.reshape(a.shape[:axis] + (a.shape[axis] * a.shape[axis + 1],) + a.shape[axis + 2:])
