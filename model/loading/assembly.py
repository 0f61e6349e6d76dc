"""Assembling canonical params from a checkpoint, one canonical tensor at a time.

`plan_slots` turns a family's `CheckpointLayout` into slots: one per canonical param (per layer,
if stacked), each naming the tensor that fills it and its conversion; `assemble` reads every
slot into arrays of the config's dtype. Before reading anything it checks that every slot's
tensor exists with the shape its conversion expects and that the checkpoint holds no tensor the
layout does not account for. Each finished array is checked finite, and with `place` it is
handed to `place(config, key, array)` at once and only its result is kept (the sharded loader
puts it on the mesh, each device receiving its shard), so the host never holds more than one
full tensor.

With `plans` (what a quantization scheme does with each kernel, `KernelPlan` in
`meshserve.model.quant_formats`), a kernel comes straight from the file's blocks when their codes
fit one of the plan's bit widths (`meshserve.model.loading.gguf_blocks`), and otherwise from its
float weights, quantized as they are assembled (or left float, when the plan has no format).

This module imports neither jax nor flax; the model module places the arrays on devices.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from meshserve.model.canonical import (Checkpoint, CheckpointLayout, Conversion, check_finite,
                                       expected_shapes, numpy_dtype)
from meshserve.model.config import ModelConfig
from meshserve.model.loading.gguf_blocks import (CanonicalLayout, float_scales_format, kept_format,
                                                 regrouped)
from meshserve.model.quant_formats import (KernelPlan, LayerMix, MixedArray, QuantFormat,
                                           QuantizedArray, quantize)

MAX_LISTED_NAMES = 5

Params = dict[str, np.ndarray | QuantizedArray | MixedArray]
Place = Callable[[ModelConfig, str, np.ndarray | QuantizedArray], Any]
# What a quantization scheme does with each kernel of a config.
Plans = Callable[[ModelConfig], Mapping[str, KernelPlan]]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One checkpoint tensor and the place in params it fills."""

    key: str
    layer: int | None
    source: str
    conversion: Conversion


def plan_slots(layout: CheckpointLayout) -> list[Slot]:
    """One slot per expected param (per layer if stacked): filling every slot fills all params."""
    config, names, conversions = layout.config, layout.names, layout.conversions
    slots = []
    for key in expected_shapes(config):
        if key.startswith("layers/"):
            slots.extend(
                Slot(key, i, names[key].format(i=i), conversions[key])
                for i in range(config.num_layers)
            )
        else:
            slots.append(Slot(key, None, names[key], conversions[key]))
    return slots


def assemble(
    config: ModelConfig, slots: list[Slot], checkpoint: Checkpoint, ignored: Callable[[str], bool],
    place: Place | None = None, plans: Plans | None = None,
) -> Params:
    """Reads every slot's tensor into stacked arrays of the config's dtype, one key at a time
    (the kernels `plans` names quantized, `assemble_quantized`); each finished key is checked,
    then handed to `place` when given."""
    require_sources(slots, checkpoint)
    reject_unknown(slots, checkpoint, ignored)
    require_source_shapes(slots, checkpoint)
    dtype = numpy_dtype(config.dtype)
    shapes = expected_shapes(config)
    kernel_plans = plans(config) if plans is not None else {}
    params = {}
    for key, key_slots in itertools.groupby(slots, key=lambda slot: slot.key):
        key_slots = list(key_slots)
        plan = kernel_plans.get(key)
        array = (None if plan is None
                 else assemble_quantized(key_slots, checkpoint, plan, shapes[key]))
        if array is None:
            array = _read_float(key, key_slots, checkpoint, shapes[key], dtype)
        check_finite(key, array)
        params[key] = array if place is None else place(config, key, array)
    return params


def _read_float(key: str, slots: list[Slot], checkpoint: Checkpoint, shape: tuple[int, ...],
                dtype) -> np.ndarray:
    """One key's float array: a single tensor as its conversion gives it (not copied again,
    unless it is a read-only view of the file), stacked layers into one array."""
    if slots[0].layer is None:
        slot = slots[0]
        array = np.asarray(slot.conversion.convert(checkpoint.read(slot.source)), dtype)
        if not array.flags.writeable:  # a view of the file itself: the params own theirs
            array = array.copy()
        if array.shape != shape:
            raise ValueError(f"{slot.source} converts to shape {array.shape}, expected {shape} "
                             f"for {key}")
        return array
    array = np.empty(shape, dtype)
    for slot in slots:
        array[slot.layer] = slot.conversion.convert(checkpoint.read(slot.source))
    return array


def assemble_quantized(slots: list[Slot], checkpoint: Checkpoint, plan: KernelPlan,
                       shape: tuple[int, ...]) -> QuantizedArray | MixedArray | None:
    """One kernel (every layer of it, of float shape `shape`) as a `QuantizedArray`: kept in the
    file's own blocks when every layer's block type fits one of the plan's bit widths (GGUF);
    a stack whose layers' codes keep in different widths (a Q4_K_M file's Q4_K and Q6_K
    layers of `ffn_down`) as a `MixedArray`, one stack per format, so each layer spends its
    own type's bits (layers whose codes keep in one width, as every layer in int8 containers,
    share one format that holds them all: they would save only some scale bytes). Else
    quantized to the plan's format from its float weights, one layer at a time (so too a kernel
    whose blocks do not line up with its groups); None when the plan leaves float weights
    float. Each format's block layout is computed once."""
    kept = _lined_up(slots[0], _kept_format(slots, checkpoint, plan, shape))
    if kept is not None:
        if slots[0].layer is None:
            return _kept_layers(slots, checkpoint, *kept)
        own = [_kept_format([slot], checkpoint, plan, shape) for slot in slots]
        lined_up = {fmt: _lined_up(slots[0], fmt) for fmt in dict.fromkeys(own)}
        if None in lined_up.values() or len({f.bits for f, _ in lined_up.values()}) == 1:
            return _kept_layers(slots, checkpoint, *kept)  # codes of one width: one stack
        layouts = {}  # each part's format -> where its blocks land
        for fmt, layout in (lined_up[fmt] for fmt in own):
            layouts.setdefault(fmt, layout)
        formats = tuple(layouts)
        part_of = tuple(formats.index(lined_up[fmt][0]) for fmt in own)
        mix = LayerMix(formats=formats, part_of=part_of, uniform=kept[0])
        return MixedArray(parts=tuple(
            _kept_layers([slots[i] for i in mix.layers(p)], checkpoint, fmt, layouts[fmt])
            for p, fmt in enumerate(formats)), format=mix)
    if plan.fmt is None:
        return None
    layers = [quantize(slot.conversion.convert(checkpoint.read(slot.source)), plan.fmt)
              for slot in slots]
    return layers[0] if slots[0].layer is None else _stacked(layers)


def _kept_layers(slots: list[Slot], checkpoint: Checkpoint, fmt: QuantFormat,
                 layout: CanonicalLayout) -> QuantizedArray:
    """The slots' own blocks in `fmt`, placed by `layout` (stacked, when the slots are
    layers)."""
    layers = [layout.quantized(regrouped(checkpoint.read_blocks(slot.source), fmt))
              for slot in slots]
    return layers[0] if slots[0].layer is None else _stacked(layers)


def _stacked(layers: list[QuantizedArray]) -> QuantizedArray:
    return QuantizedArray.from_arrays(
        {name: np.stack([q.arrays()[name] for q in layers]) for name in layers[0].arrays()},
        layers[0].format)


def _lined_up(slot: Slot, fmt: QuantFormat | None
              ) -> tuple[QuantFormat, CanonicalLayout] | None:
    """`fmt`, or with float32 scales where the slot's super-blocks would split over the
    kernel's super groups, with where its blocks land (`_layout`); None where its blocks do not
    line up with the groups at all."""
    if fmt is None:
        return None
    layout = _layout(slot, fmt)
    if layout is None and fmt.super_group is not None:
        fmt = float_scales_format(fmt)
        layout = _layout(slot, fmt)
    return None if layout is None else (fmt, layout)


def _layout(slot: Slot, fmt: QuantFormat) -> CanonicalLayout | None:
    """Where the slot's blocks land in its kernel, or None when the conversion splits blocks
    over the kernel's groups (an `attn_output` whose blocks of 32 cross heads of 16 or 48):
    such a kernel cannot be kept, and is read like a float one."""
    try:
        return CanonicalLayout(slot.conversion.convert, slot.conversion.source_shape, fmt)
    except ValueError:
        return None


def _kept_format(slots: list[Slot], checkpoint: Checkpoint, plan: KernelPlan,
                 shape: tuple[int, ...]) -> QuantFormat | None:
    """The format the slots' own blocks keep, in the first of the plan's bit widths where every
    layer's blocks fit."""
    qtype = getattr(checkpoint, "qtype", None)
    if qtype is None:
        return None
    return kept_format([qtype(slot.source) for slot in slots], plan.keep_bits,
                       plan.num_contracted, plan.num_out, shape[-(plan.num_out + 1)])


def require_sources(slots: list[Slot], checkpoint: Checkpoint) -> None:
    missing = [slot for slot in slots if slot.source not in checkpoint.names]
    if missing:
        raise ValueError(
            f"{checkpoint.origin} lacks tensor {missing[0].source!r} (for {missing[0].key}); "
            f"{len(missing)} needed tensors are missing in all. The checkpoint does not match "
            "its config (architecture, layer count, biases, tied embeddings)."
        )


def reject_unknown(
    slots: list[Slot], checkpoint: Checkpoint, ignored: Callable[[str], bool]
) -> None:
    used = {slot.source for slot in slots}
    unknown = sorted(name for name in checkpoint.names if name not in used and not ignored(name))
    if unknown:
        raise ValueError(
            f"{checkpoint.origin} has {len(unknown)} tensors that its config does not account for, "
            f"e.g. {unknown[:MAX_LISTED_NAMES]}. The checkpoint uses features meshserve does not "
            "support, or its config does not match it."
        )


def require_source_shapes(slots: list[Slot], checkpoint: Checkpoint) -> None:
    for slot in slots:
        actual = checkpoint.shape(slot.source)
        if actual != slot.conversion.source_shape:
            raise ValueError(
                f"{checkpoint.origin}: tensor {slot.source!r} has shape {actual}, but the config "
                f"implies {slot.conversion.source_shape} (for {slot.key}). The config "
                "(hidden size, heads, head_dim, vocab, ...) does not match the weights."
            )


def require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
