"""Checkpoint loaders: a GGUF file or an HF safetensors directory -> `(ModelConfig, params)`.

`params` maps "/"-joined names to numpy arrays in meshserve's canonical layout, which
`expected_shapes(config)` defines and the model code reads. Invariants of every loader's result:

- the keys are exactly those of `expected_shapes(config)`, with exactly those shapes; per-layer
  weights are stacked on a leading layer axis;
- kernels are laid out input first (`[D, H, h]`, `[F, D]`, ...), never as HF's `[out, in]`;
- Q and K follow HF's rotate_half RoPE layout: GGUF llama files, whose Q and K rows llama.cpp
  permutes for its interleaved RoPE, are un-permuted here (qwen2, qwen3, gemma2, gemma3 and phi3
  GGUF files are not permuted);
- every array has the requested dtype and is finite: each is checked as it is assembled, and
  `check_params` checks the key set and shapes before a loader returns.

Loaders assemble one canonical tensor at a time. With `place`, each finished tensor is handed to
`place(config, key, array)` at once and only its result is kept (the sharded loader puts it on
the mesh, each device receiving its shard), so the host never holds more than one full tensor.

Quantized GGUF tensors are dequantized to float32 with `gguf.quants` and then cast. With
`plans` (what a quantization scheme does with each kernel, `KernelPlan` in
`meshserve.model.quantization`), a kernel comes straight from the file's blocks when their codes
fit one of the plan's bit widths (`meshserve.model.gguf_blocks`), and otherwise from its float
weights, quantized as they are assembled (or left float, when the plan has no format). This module imports neither jax nor flax; the model module places the
arrays on devices.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import gguf
import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open

from meshserve.model.config import ModelConfig, gguf_longrope
from meshserve.model.gguf_blocks import CanonicalLayout, decode_blocks, kernel_format
from meshserve.model.quantization import KernelPlan, QuantFormat, QuantizedArray, quantize

NUMPY_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}

_GGML = gguf.GGMLQuantizationType
GGUF_TYPES = (
    _GGML.F32, _GGML.F16, _GGML.BF16, _GGML.Q8_0, _GGML.Q4_0, _GGML.Q4_1, _GGML.Q5_0, _GGML.Q5_1,
    _GGML.Q2_K, _GGML.Q3_K, _GGML.Q4_K, _GGML.Q5_K, _GGML.Q6_K,
)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_LISTED_NAMES = 5

Convert = Callable[[np.ndarray], np.ndarray]
Params = dict[str, np.ndarray | QuantizedArray]
Place = Callable[[ModelConfig, str, np.ndarray | QuantizedArray], Any]
# What a quantization scheme does with each kernel of a config.
Plans = Callable[[ModelConfig], Mapping[str, KernelPlan]]


# --- The canonical layout ---------------------------------------------------------------------


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every param key of `config`'s model and its shape; per-layer keys start with "layers/"."""
    if config.arch == "gpt2":
        return _gpt2_shapes(config)
    return _llama_shapes(config)


def _llama_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    H, K, h = c.num_heads, c.num_kv_heads, c.head_dim
    shapes = {
        "embed/embedding": (V, D),
        "layers/attn_norm/scale": (L, D),
        "layers/attn/q/kernel": (L, D, H, h),
        "layers/attn/k/kernel": (L, D, K, h),
        "layers/attn/v/kernel": (L, D, K, h),
    }
    if c.qk_norm:
        shapes.update({"layers/attn/q_norm/scale": (L, h), "layers/attn/k_norm/scale": (L, h)})
    if c.qkv_bias:
        shapes.update({
            "layers/attn/q/bias": (L, H, h),
            "layers/attn/k/bias": (L, K, h),
            "layers/attn/v/bias": (L, K, h),
        })
    if c.sandwich_norms:
        shapes.update({"layers/post_attn_norm/scale": (L, D),
                       "layers/post_mlp_norm/scale": (L, D)})
    shapes.update({
        "layers/attn/o/kernel": (L, H, h, D),
        "layers/mlp_norm/scale": (L, D),
    })
    if c.moe is None:
        shapes.update({
            "layers/mlp/gate/kernel": (L, D, F),
            "layers/mlp/up/kernel": (L, D, F),
            "layers/mlp/down/kernel": (L, F, D),
        })
    else:
        shapes.update(moe_shapes(c))
    shapes["final_norm/scale"] = (D,)
    if not c.tie_embeddings:
        shapes["lm_head/kernel"] = (D, V)
    return shapes


def moe_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The mixture-of-experts MLP of every layer (`meshserve.model.moe`)."""
    L, D, F, E = c.num_layers, c.hidden_size, c.intermediate_size, c.moe.num_experts
    shapes = {
        "layers/mlp/router/kernel": (L, D, E),
        "layers/mlp/experts/gate": (L, E, D, F),
        "layers/mlp/experts/up": (L, E, D, F),
        "layers/mlp/experts/down": (L, E, F, D),
    }
    S = c.moe.shared_expert_size
    if S:
        shapes.update({
            "layers/mlp/shared/gate/kernel": (L, D, S),
            "layers/mlp/shared/up/kernel": (L, D, S),
            "layers/mlp/shared/down/kernel": (L, S, D),
            "layers/mlp/shared/scale/kernel": (L, D, 1),
        })
    return shapes


def _gpt2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    P, H, h = c.max_position_embeddings, c.num_heads, c.head_dim
    return {
        "embed/embedding": (V, D),
        "pos_embed/embedding": (P, D),
        "layers/attn_norm/scale": (L, D),
        "layers/attn_norm/bias": (L, D),
        "layers/attn/qkv/kernel": (L, D, 3, H, h),
        "layers/attn/qkv/bias": (L, 3, H, h),
        "layers/attn/o/kernel": (L, H, h, D),
        "layers/attn/o/bias": (L, D),
        "layers/mlp_norm/scale": (L, D),
        "layers/mlp_norm/bias": (L, D),
        "layers/mlp/up/kernel": (L, D, F),
        "layers/mlp/up/bias": (L, F),
        "layers/mlp/down/kernel": (L, F, D),
        "layers/mlp/down/bias": (L, D),
        "final_norm/scale": (D,),
        "final_norm/bias": (D,),
    }


def check_params(config: ModelConfig, params: Mapping[str, Any], *,
                 values: bool = True) -> None:
    """Raises ValueError unless `params` has exactly `config`'s keys and shapes, all finite
    (finiteness only with `values`, for host arrays)."""
    expected = expected_shapes(config)
    missing = [key for key in expected if key not in params]
    if missing:
        raise ValueError(
            f"params lack {missing[0]!r} (expected shape {expected[missing[0]]}); "
            f"{len(missing)} expected keys are missing in all"
        )
    extra = [key for key in params if key not in expected]
    if extra:
        raise ValueError(
            f"params have key {extra[0]!r} (shape {np.shape(params[extra[0]])}) that a "
            f"{config.arch} config with qkv_bias={config.qkv_bias}, "
            f"tie_embeddings={config.tie_embeddings} does not use"
        )
    for key, shape in expected.items():
        actual = _shape(params[key])
        if actual != shape:
            raise ValueError(f"param {key!r} has shape {actual}, but the config expects {shape}")
        if values:
            check_finite(key, params[key])


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, QuantizedArray) else tuple(np.shape(value))


def check_finite(key: str, array: np.ndarray | QuantizedArray) -> None:
    if isinstance(array, QuantizedArray):
        for part in (array.scales, array.mins):
            if part is not None:
                check_finite(key, part)
        return
    if not np.isfinite(array).all():
        raise ValueError(
            f"param {key!r} has NaN or infinite values; the checkpoint is damaged, or its "
            f"values overflow {np.asarray(array).dtype} (load it as float32 or bfloat16)"
        )


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype that stores params of meshserve dtype `dtype`."""
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {tuple(NUMPY_DTYPES)}")
    return NUMPY_DTYPES[dtype]


def require_dtype(dtype: str) -> None:
    """Fails fast, before any file is read, on a dtype meshserve cannot store params in."""
    numpy_dtype(dtype)


# --- Conversions from checkpoint layout to canonical layout -------------------------------------


@dataclasses.dataclass(frozen=True)
class Conversion:
    """How one checkpoint tensor becomes one canonical param (one layer of it, if stacked)."""

    source_shape: tuple[int, ...]
    convert: Convert


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _transposed(w: np.ndarray) -> np.ndarray:
    return w.T


def _reshaped(*shape: int) -> Convert:
    return lambda w: w.reshape(shape)


def _transposed_reshaped(*shape: int) -> Convert:
    return lambda w: w.T.reshape(shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute(w, n_heads)` of Q/K rows: interleaved RoPE -> rotate_half.

    llama.cpp reorders each head's rows from `(2, h/2)` to `(h/2, 2)`; this reorders them back.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(n_heads: int, then: Convert) -> Convert:
    return lambda w: then(unpermute_rows(w, n_heads))


def llama_conversions(c: ModelConfig, *, permuted_qk: bool) -> dict[str, Conversion]:
    """Conversions from `[out, in]` Linear weights (HF, and GGUF after dequantizing)."""
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    H, K, h = c.num_heads, c.num_kv_heads, c.head_dim
    q, k = _transposed_reshaped(D, H, h), _transposed_reshaped(D, K, h)
    if permuted_qk:
        q, k = _unpermuted(H, q), _unpermuted(K, k)
    return {
        "embed/embedding": Conversion((V, D), _identity),
        "layers/attn_norm/scale": Conversion((D,), _identity),
        "layers/attn/q/kernel": Conversion((H * h, D), q),
        "layers/attn/k/kernel": Conversion((K * h, D), k),
        "layers/attn/v/kernel": Conversion((K * h, D), _transposed_reshaped(D, K, h)),
        "layers/attn/q_norm/scale": Conversion((h,), _identity),
        "layers/attn/k_norm/scale": Conversion((h,), _identity),
        "layers/attn/q/bias": Conversion((H * h,), _reshaped(H, h)),
        "layers/attn/k/bias": Conversion((K * h,), _reshaped(K, h)),
        "layers/attn/v/bias": Conversion((K * h,), _reshaped(K, h)),
        "layers/attn/o/kernel": Conversion((D, H * h), _transposed_reshaped(H, h, D)),
        "layers/mlp_norm/scale": Conversion((D,), _identity),
        "layers/mlp/gate/kernel": Conversion((F, D), _transposed),
        "layers/mlp/up/kernel": Conversion((F, D), _transposed),
        "layers/mlp/down/kernel": Conversion((D, F), _transposed),
        "final_norm/scale": Conversion((D,), _identity),
        "lm_head/kernel": Conversion((V, D), _transposed),
    }


def gpt2_conversions(c: ModelConfig, *, conv1d: bool) -> dict[str, Conversion]:
    """Conversions from HF GPT-2 Conv1D weights (`[in, out]`) or GGUF gpt2 weights (`[out, in]`)."""
    D, F, V, P = c.hidden_size, c.intermediate_size, c.vocab_size, c.max_position_embeddings
    H, h = c.num_heads, c.head_dim

    def linear(in_dim: int, out_dim: int, *canonical: int) -> Conversion:
        if conv1d:
            return Conversion((in_dim, out_dim), _reshaped(*canonical))
        return Conversion((out_dim, in_dim), _transposed_reshaped(*canonical))

    return {
        "embed/embedding": Conversion((V, D), _identity),
        "pos_embed/embedding": Conversion((P, D), _identity),
        "layers/attn_norm/scale": Conversion((D,), _identity),
        "layers/attn_norm/bias": Conversion((D,), _identity),
        "layers/attn/qkv/kernel": linear(D, 3 * D, D, 3, H, h),
        "layers/attn/qkv/bias": Conversion((3 * D,), _reshaped(3, H, h)),
        "layers/attn/o/kernel": linear(D, D, H, h, D),
        "layers/attn/o/bias": Conversion((D,), _identity),
        "layers/mlp_norm/scale": Conversion((D,), _identity),
        "layers/mlp_norm/bias": Conversion((D,), _identity),
        "layers/mlp/up/kernel": linear(D, F, D, F),
        "layers/mlp/up/bias": Conversion((F,), _identity),
        "layers/mlp/down/kernel": linear(F, D, F, D),
        "layers/mlp/down/bias": Conversion((D,), _identity),
        "final_norm/scale": Conversion((D,), _identity),
        "final_norm/bias": Conversion((D,), _identity),
    }


# --- Assembly ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """One checkpoint tensor and the place in params it fills."""

    key: str
    layer: int | None
    source: str
    conversion: Conversion


def plan_slots(
    config: ModelConfig, names: Mapping[str, str], conversions: Mapping[str, Conversion]
) -> list[Slot]:
    """One slot per expected param (per layer if stacked): filling every slot fills all params.

    `names` maps each canonical key to its checkpoint tensor name, with `{i}` for the layer.
    """
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


class Checkpoint(Protocol):
    """The tensors of one checkpoint: their names and shapes, and a way to read each one."""

    origin: str
    names: frozenset[str]

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...


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
        array = None if plan is None else assemble_quantized(key_slots, checkpoint, plan)
        if array is None:
            array = np.empty(shapes[key], dtype)
            for slot in key_slots:
                target = array if slot.layer is None else array[slot.layer]
                target[...] = slot.conversion.convert(checkpoint.read(slot.source))
        check_finite(key, array)
        params[key] = array if place is None else place(config, key, array)
    return params


def assemble_quantized(slots: list[Slot], checkpoint: Checkpoint, plan: KernelPlan
                       ) -> QuantizedArray | None:
    """One kernel (every layer of it) as a `QuantizedArray`: kept in the file's own blocks when
    every layer's block type fits one of the plan's bit widths with one format (GGUF), else
    quantized to the plan's format from its float weights, one layer at a time; None when the
    plan leaves float weights float."""
    kept = _kept_format(slots, checkpoint, plan)
    if kept is not None:
        layout = CanonicalLayout(slots[0].conversion.convert, slots[0].conversion.source_shape,
                                 kept)
        layers = [layout.quantized(checkpoint.read_blocks(slot.source)) for slot in slots]
    elif plan.fmt is not None:
        layers = [quantize(slot.conversion.convert(checkpoint.read(slot.source)), plan.fmt)
                  for slot in slots]
    else:
        return None
    if slots[0].layer is None:
        return layers[0]
    stack = lambda name: np.stack([getattr(q, name) for q in layers])  # noqa: E731
    return QuantizedArray(values=stack("values"), scales=stack("scales"),
                          mins=None if layers[0].mins is None else stack("mins"),
                          format=layers[0].format)


def _kept_format(slots: list[Slot], checkpoint: Checkpoint, plan: KernelPlan
                 ) -> QuantFormat | None:
    """The format the slots' own blocks keep, in the first of the plan's bit widths where they
    all keep one."""
    qtype = getattr(checkpoint, "qtype", None)
    if qtype is None:
        return None
    for bits in plan.keep_bits:
        kept = {kernel_format(qtype(slot.source), bits, plan.num_contracted, plan.num_out)
                for slot in slots}
        if len(kept) == 1 and None not in kept:
            return kept.pop()
    return None


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


# --- GGUF -------------------------------------------------------------------------------------

GGUF_LLAMA_NAMES = {
    "embed/embedding": "token_embd.weight",
    "layers/attn_norm/scale": "blk.{i}.attn_norm.weight",
    "layers/attn/q/kernel": "blk.{i}.attn_q.weight",
    "layers/attn/k/kernel": "blk.{i}.attn_k.weight",
    "layers/attn/v/kernel": "blk.{i}.attn_v.weight",
    "layers/attn/q_norm/scale": "blk.{i}.attn_q_norm.weight",
    "layers/attn/k_norm/scale": "blk.{i}.attn_k_norm.weight",
    "layers/attn/q/bias": "blk.{i}.attn_q.bias",
    "layers/attn/k/bias": "blk.{i}.attn_k.bias",
    "layers/attn/v/bias": "blk.{i}.attn_v.bias",
    "layers/attn/o/kernel": "blk.{i}.attn_output.weight",
    "layers/mlp_norm/scale": "blk.{i}.ffn_norm.weight",
    "layers/mlp/gate/kernel": "blk.{i}.ffn_gate.weight",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/down/kernel": "blk.{i}.ffn_down.weight",
    "final_norm/scale": "output_norm.weight",
    "lm_head/kernel": "output.weight",
}

GGUF_GPT2_NAMES = {
    "embed/embedding": "token_embd.weight",
    "pos_embed/embedding": "position_embd.weight",
    "layers/attn_norm/scale": "blk.{i}.attn_norm.weight",
    "layers/attn_norm/bias": "blk.{i}.attn_norm.bias",
    "layers/attn/qkv/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/qkv/bias": "blk.{i}.attn_qkv.bias",
    "layers/attn/o/kernel": "blk.{i}.attn_output.weight",
    "layers/attn/o/bias": "blk.{i}.attn_output.bias",
    "layers/mlp_norm/scale": "blk.{i}.ffn_norm.weight",
    "layers/mlp_norm/bias": "blk.{i}.ffn_norm.bias",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/up/bias": "blk.{i}.ffn_up.bias",
    "layers/mlp/down/kernel": "blk.{i}.ffn_down.weight",
    "layers/mlp/down/bias": "blk.{i}.ffn_down.bias",
    "final_norm/scale": "output_norm.weight",
    "final_norm/bias": "output_norm.bias",
}

# llama.cpp's GPT-2 converter writes the tied head as `output.weight`, a copy of `token_embd`.
GGUF_GPT2_IGNORED = frozenset({"output.weight"})
GGUF_LLAMA_IGNORED: frozenset[str] = frozenset()
GGUF_ROPE_FACTORS = "rope_freqs.weight"


class GGUFCheckpoint:
    """The tensors of an open GGUF file, dequantized to float32 `[out, in]` on read."""

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self.origin = str(path)
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        self.names = frozenset(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def qtype(self, name: str) -> gguf.GGMLQuantizationType:
        return self._tensors[name].tensor_type

    def read_blocks(self, name: str):
        """The tensor's block fields, not dequantized (`meshserve.model.gguf_blocks`)."""
        tensor = self._tensors[name]
        return decode_blocks(np.asarray(tensor.data), tensor.tensor_type, self.shape(name))

    def read(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        # A plain ndarray view of the memmap spares gguf's row loop numpy.memmap's slicing overhead.
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return values.reshape(self.shape(name))


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32", place: Place | None = None,
              plans: Plans | None = None) -> tuple[ModelConfig, Params]:
    """Loads a llama (Mixtral too), qwen2, qwen2moe, qwen3moe, qwen3, gemma2, gemma3, phi3 or
    gpt2 GGUF file into a config and canonical params (the kernels `plans` names quantized,
    kept in the file's blocks where they fit)."""
    path = Path(path)
    require_dtype(dtype)
    reader = open_gguf(path)
    checkpoint = GGUFCheckpoint(path, reader)
    require_supported_types(checkpoint)
    fields = gguf_metadata(reader, checkpoint)
    arch = fields.get("general.architecture")
    tied = arch == "gpt2" or GGUF_LLAMA_NAMES["lm_head/kernel"] not in checkpoint.names
    config = ModelConfig.from_gguf_fields(fields, tie_embeddings=tied, dtype=dtype)
    if config.arch == "gpt2":
        slots = plan_slots(config, GGUF_GPT2_NAMES, gpt2_conversions(config, conv1d=False))
        params = assemble(config, slots, checkpoint, GGUF_GPT2_IGNORED.__contains__, place,
                          plans)
    elif arch in GGUF_FAMILY_NAMES:
        config = with_gguf_rope_factors(config, fields, checkpoint)
        names, conversions = gguf_family_layout(config, arch)
        slots = plan_slots(config, names, conversions)
        params = assemble(config, slots, checkpoint, GGUF_FAMILY_IGNORED.__contains__, place,
                          plans)
    else:
        reject_rope_factors(checkpoint)
        conversions = llama_conversions(config, permuted_qk=arch == "llama")
        conversions |= moe_conversions(config, gguf=True)
        slots = plan_slots(config, GGUF_LLAMA_NAMES | GGUF_MOE_NAMES, conversions)
        params = assemble(config, slots, checkpoint, GGUF_LLAMA_IGNORED.__contains__, place,
                          plans)
    if place is None:  # placed tensors were checked one by one, before placing
        check_params(config, params, values=False)
    return config, params


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Opens a GGUF file, turning the reader's low-level failures into one clear error.

    The reader of the file last opened is kept while the file is unchanged: parsing the
    metadata (a 49k-token vocabulary and its merges) takes seconds, and loading a model reads it
    twice, for the weights and for the tokenizer.
    """
    path = Path(path)
    require_file(path)
    stat = path.stat()
    return _read_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    del size, mtime_ns  # part of the cache key only: a rewritten file is read again
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as err:
        raise ValueError(
            f"{path} is not a readable GGUF file; it is corrupt or truncated ({err}). "
            "Download it again."
        ) from err


def gguf_metadata(reader: gguf.GGUFReader, checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """The metadata fields as plain values, plus the vocab size if the file omits it.

    The tokenizer's array fields (tokens, merges) are skipped: they are large and the config
    needs only their length, which the embedding's row count also gives. Other arrays are small
    (a sliding-window pattern, one flag per layer) and kept.
    """
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types and (field.types[0] != gguf.GGUFValueType.ARRAY
                            or not name.startswith("tokenizer."))
    }
    vocab_key = f"{fields.get('general.architecture')}.vocab_size"
    embedding = GGUF_LLAMA_NAMES["embed/embedding"]
    if vocab_key not in fields and embedding in checkpoint.names:
        fields[vocab_key] = checkpoint.shape(embedding)[0]
    return fields


def require_supported_types(checkpoint: GGUFCheckpoint) -> None:
    for name in sorted(checkpoint.names):
        qtype = checkpoint.qtype(name)
        if qtype not in GGUF_TYPES:
            raise ValueError(
                f"{checkpoint.origin}: tensor {name!r} has GGUF type {qtype.name}, "
                f"which meshserve cannot dequantize; supported: "
                f"{', '.join(t.name for t in GGUF_TYPES)}. Use a GGUF quantized with one of those."
            )


def reject_rope_factors(checkpoint: GGUFCheckpoint) -> None:
    if GGUF_ROPE_FACTORS in checkpoint.names:
        raise ValueError(
            f"{checkpoint.origin} carries per-dimension RoPE frequency factors "
            f"({GGUF_ROPE_FACTORS!r}, Llama 3.1-style scaling), which meshserve does not read "
            "from GGUF; load the HF safetensors checkpoint of this model instead."
        )


# --- HF safetensors ---------------------------------------------------------------------------

HF_LLAMA_NAMES = {
    "embed/embedding": "model.embed_tokens.weight",
    "layers/attn_norm/scale": "model.layers.{i}.input_layernorm.weight",
    "layers/attn/q/kernel": "model.layers.{i}.self_attn.q_proj.weight",
    "layers/attn/k/kernel": "model.layers.{i}.self_attn.k_proj.weight",
    "layers/attn/v/kernel": "model.layers.{i}.self_attn.v_proj.weight",
    "layers/attn/q_norm/scale": "model.layers.{i}.self_attn.q_norm.weight",
    "layers/attn/k_norm/scale": "model.layers.{i}.self_attn.k_norm.weight",
    "layers/attn/q/bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers/attn/k/bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers/attn/v/bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers/attn/o/kernel": "model.layers.{i}.self_attn.o_proj.weight",
    "layers/mlp_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/mlp/gate/kernel": "model.layers.{i}.mlp.gate_proj.weight",
    "layers/mlp/up/kernel": "model.layers.{i}.mlp.up_proj.weight",
    "layers/mlp/down/kernel": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm/scale": "model.norm.weight",
    "lm_head/kernel": "lm_head.weight",
}

HF_GPT2_NAMES = {
    "embed/embedding": "wte.weight",
    "pos_embed/embedding": "wpe.weight",
    "layers/attn_norm/scale": "h.{i}.ln_1.weight",
    "layers/attn_norm/bias": "h.{i}.ln_1.bias",
    "layers/attn/qkv/kernel": "h.{i}.attn.c_attn.weight",
    "layers/attn/qkv/bias": "h.{i}.attn.c_attn.bias",
    "layers/attn/o/kernel": "h.{i}.attn.c_proj.weight",
    "layers/attn/o/bias": "h.{i}.attn.c_proj.bias",
    "layers/mlp_norm/scale": "h.{i}.ln_2.weight",
    "layers/mlp_norm/bias": "h.{i}.ln_2.bias",
    "layers/mlp/up/kernel": "h.{i}.mlp.c_fc.weight",
    "layers/mlp/up/bias": "h.{i}.mlp.c_fc.bias",
    "layers/mlp/down/kernel": "h.{i}.mlp.c_proj.weight",
    "layers/mlp/down/bias": "h.{i}.mlp.c_proj.bias",
    "final_norm/scale": "ln_f.weight",
    "final_norm/bias": "ln_f.bias",
}

HF_GPT2_PREFIX = "transformer."
# Buffers HF saves next to the weights: RoPE frequencies, GPT-2's causal-mask constants.
HF_BUFFER_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class SafetensorsCheckpoint:
    """The tensors of one or more safetensors files, read as numpy arrays (bf16 included)."""

    def __init__(self, origin: Path, files: list[Path], stack: ExitStack):
        self.origin = str(origin)
        self._handles: dict[str, Any] = {}
        self._files: dict[str, Path] = {}
        self._headers: dict[Path, SafetensorsHeader] = {}
        for file in files:
            handle = stack.enter_context(open_safetensors(file))
            for name in handle.keys():
                self._handles[name] = handle
                self._files[name] = file
        self.names = frozenset(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        handle = self._handles[name]
        if handle.get_slice(name).get_dtype() == "BF16":
            return read_bf16(self._header(self._files[name]), name)
        return handle.get_tensor(name)

    def _header(self, path: Path) -> "SafetensorsHeader":
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path]


def open_safetensors(path: Path) -> Any:
    """Opens a safetensors file for numpy, turning a bad header into one clear error."""
    require_file(path)
    try:
        return safe_open(path, framework="numpy")
    except safetensors.SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file; it is corrupt or truncated ({err}). "
            "Download or save it again."
        ) from err


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: per tensor its dtype, shape and byte range in the data."""

    path: Path
    tensors: dict[str, Any]
    data_start: int


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parses the header: an 8-byte little-endian length, then that many bytes of JSON."""
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        tensors = json.loads(handle.read(length))
    return SafetensorsHeader(path, tensors, 8 + length)


def read_bf16(header: SafetensorsHeader, name: str) -> np.ndarray:
    """Maps one bfloat16 tensor straight from the file: safetensors' numpy API has no bf16."""
    info = header.tensors[name]
    begin, end = info["data_offsets"]
    raw = np.memmap(header.path, dtype=np.uint16, mode="r", offset=header.data_start + begin,
                    shape=((end - begin) // 2,))
    return raw.view(ml_dtypes.bfloat16).reshape(info["shape"])


def load_hf(directory: str | os.PathLike, *, dtype: str = "float32",
            place: Place | None = None, plans: Plans | None = None
            ) -> tuple[ModelConfig, Params]:
    """Loads an HF llama, qwen2, mistral, mixtral, qwen2_moe, qwen3_moe, qwen3, gemma2,
    gemma3_text, phi3 or gpt2 safetensors directory into a config and params (the kernels
    `plans` names quantized as they are read)."""
    directory = Path(directory)
    require_dtype(dtype)
    if not directory.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    hf_config = read_hf_config(directory)
    config = ModelConfig.from_hf(hf_config, dtype=dtype)
    with ExitStack() as stack:
        checkpoint = SafetensorsCheckpoint(directory, safetensors_files(directory), stack)
        if config.arch == "gpt2":
            names = hf_gpt2_names(checkpoint)
            slots = plan_slots(config, names, gpt2_conversions(config, conv1d=True))
            params = assemble(config, slots, checkpoint, is_hf_gpt2_extra, place, plans)
        else:
            require_lm_head(config, checkpoint)
            names, conversions = hf_llama_layout(config, hf_config)
            slots = plan_slots(config, names, conversions)
            checkpoint = stacked_experts(config, slots, checkpoint)
            params = assemble(config, slots, checkpoint, hf_llama_extra(config), place, plans)
    if place is None:  # placed tensors were checked one by one, before placing
        check_params(config, params, values=False)
    return config, params


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    require_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err}); restore the model's config.json"
        ) from err


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: the index's shards, or its one safetensors file."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [directory / shard for shard in sorted(set(weight_map.values()))]
    if (directory / SAFETENSORS_FILE).is_file():
        return [directory / SAFETENSORS_FILE]
    found = sorted(directory.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if found:
        raise FileNotFoundError(
            f"{directory} has {len(found)} safetensors files but no {SAFETENSORS_INDEX}; "
            "add the index that lists the shards"
        )
    raise FileNotFoundError(
        f"{directory} has no safetensors weights ({SAFETENSORS_FILE} or {SAFETENSORS_INDEX}); "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )


def hf_gpt2_names(checkpoint: Checkpoint) -> dict[str, str]:
    """GPT-2 tensor names, with the `transformer.` prefix if the checkpoint uses it."""
    uses_prefix = HF_GPT2_PREFIX + HF_GPT2_NAMES["embed/embedding"] in checkpoint.names
    prefix = HF_GPT2_PREFIX if uses_prefix else ""
    return {key: prefix + name for key, name in HF_GPT2_NAMES.items()}


def require_lm_head(config: ModelConfig, checkpoint: Checkpoint) -> None:
    if not config.tie_embeddings and HF_LLAMA_NAMES["lm_head/kernel"] not in checkpoint.names:
        raise ValueError(
            f"{checkpoint.origin}: config.json sets tie_word_embeddings to false, but the "
            f"checkpoint has no {HF_LLAMA_NAMES['lm_head/kernel']!r}. Set tie_word_embeddings to "
            "true if the model shares its embedding with the output head, or add the missing shard."
        )


def is_hf_buffer(name: str) -> bool:
    return name.endswith(HF_BUFFER_SUFFIXES)


def is_hf_gpt2_extra(name: str) -> bool:
    """GPT-2 buffers, and the head HF may save although GPT-2 always ties it to `wte`."""
    return is_hf_buffer(name) or name == HF_LLAMA_NAMES["lm_head/kernel"]


def hf_llama_extra(config: ModelConfig) -> Callable[[str], bool]:
    """Buffers, and the head when tied (then it is a copy of the embedding)."""
    head = HF_LLAMA_NAMES["lm_head/kernel"]
    return lambda name: is_hf_buffer(name) or (config.tie_embeddings and name == head)


# --- Dense families: Qwen3, Gemma 2 and 3, Phi-3 ----------------------------------------------
#
# Each family's names and conversions beyond Llama's. HF: Gemma's `post_attention_layernorm` is
# the norm after attention (Llama's is the one before the MLP); Phi-3 fuses q, k and v into one
# `qkv_proj` and gate and up into one `gate_up_proj` (gate first), split here by rows. GGUF
# (llama.cpp's converter): Gemma norms are stored as 1 + w, Phi-3 keeps both fusions (`attn_qkv`,
# `ffn_up`) and carries its LongRoPE factors as tensors; none of these permutes Q and K.

HF_GEMMA_NAMES = {
    "layers/post_attn_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/mlp_norm/scale": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers/post_mlp_norm/scale": "model.layers.{i}.post_feedforward_layernorm.weight",
}
HF_PHI3_NAMES = {
    "layers/attn/q/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/attn/k/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/attn/v/kernel": "model.layers.{i}.self_attn.qkv_proj.weight",
    "layers/mlp/gate/kernel": "model.layers.{i}.mlp.gate_up_proj.weight",
    "layers/mlp/up/kernel": "model.layers.{i}.mlp.gate_up_proj.weight",
}
# Qwen3's (and Gemma 3's) q/k norms are in HF_LLAMA_NAMES and GGUF_LLAMA_NAMES already.
HF_FAMILY_NAMES = {"gemma2": HF_GEMMA_NAMES, "gemma3_text": HF_GEMMA_NAMES,
                   "phi3": HF_PHI3_NAMES}

GGUF_GEMMA_NAMES = {
    "layers/post_attn_norm/scale": "blk.{i}.post_attention_norm.weight",
    "layers/post_mlp_norm/scale": "blk.{i}.post_ffw_norm.weight",
}
GGUF_PHI3_NAMES = {
    "layers/attn/q/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/k/kernel": "blk.{i}.attn_qkv.weight",
    "layers/attn/v/kernel": "blk.{i}.attn_qkv.weight",
    "layers/mlp/gate/kernel": "blk.{i}.ffn_up.weight",
    "layers/mlp/up/kernel": "blk.{i}.ffn_up.weight",
}
GGUF_FAMILY_NAMES = {"qwen3": {}, "gemma2": GGUF_GEMMA_NAMES, "gemma3": GGUF_GEMMA_NAMES,
                     "phi3": GGUF_PHI3_NAMES}
GGUF_PHI3_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
# Read into the config, not the params.
GGUF_FAMILY_IGNORED = frozenset(GGUF_PHI3_ROPE_FACTORS)


def hf_llama_layout(config: ModelConfig, hf_config: Mapping[str, Any]
                    ) -> tuple[dict[str, str], dict[str, Conversion]]:
    """Tensor names and conversions of an HF llama-architecture checkpoint: Llama's, its
    family's, and its experts' when it has them."""
    model_type = hf_config.get("model_type", "llama")
    names = HF_LLAMA_NAMES | HF_FAMILY_NAMES.get(model_type, {}) | hf_moe_names(config, hf_config)
    conversions = (llama_conversions(config, permuted_qk=False) | family_conversions(config)
                   | moe_conversions(config))
    if model_type == "phi3":
        conversions |= fused_conversions(config)
    return names, conversions


def gguf_family_layout(config: ModelConfig, arch: str
                       ) -> tuple[dict[str, str], dict[str, Conversion]]:
    """Tensor names and conversions of a llama.cpp GGUF of the family `arch`."""
    names = GGUF_LLAMA_NAMES | GGUF_FAMILY_NAMES[arch]
    conversions = llama_conversions(config, permuted_qk=False) | family_conversions(config)
    if arch == "phi3":
        conversions |= fused_conversions(config)
    if arch in ("gemma2", "gemma3"):
        conversions = {key: _less_one(conv) if _is_norm(key) else conv
                       for key, conv in conversions.items()}
    return names, conversions


def family_conversions(c: ModelConfig) -> dict[str, Conversion]:
    """The sandwich norms: vectors, kept as they are."""
    D = c.hidden_size
    return {
        "layers/post_attn_norm/scale": Conversion((D,), _identity),
        "layers/post_mlp_norm/scale": Conversion((D,), _identity),
    }


def fused_conversions(c: ModelConfig) -> dict[str, Conversion]:
    """Phi-3's fused `[out, in]` weights, each canonical param taking its rows: q, k, v of
    [(H + 2K) h, D], and gate then up of [2F, D]."""
    D, F, H, K, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    qkv, gate_up = ((H + 2 * K) * h, D), (2 * F, D)
    q_end, k_end = H * h, (H + K) * h
    return {
        "layers/attn/q/kernel": Conversion(qkv, _rows(0, q_end, _transposed_reshaped(D, H, h))),
        "layers/attn/k/kernel": Conversion(qkv, _rows(q_end, k_end,
                                                      _transposed_reshaped(D, K, h))),
        "layers/attn/v/kernel": Conversion(qkv, _rows(k_end, qkv[0],
                                                      _transposed_reshaped(D, K, h))),
        "layers/mlp/gate/kernel": Conversion(gate_up, _rows(0, F, _transposed)),
        "layers/mlp/up/kernel": Conversion(gate_up, _rows(F, 2 * F, _transposed)),
    }


def _rows(start: int, stop: int, then: Convert) -> Convert:
    return lambda w: then(w[start:stop])


def _is_norm(key: str) -> bool:
    return key.endswith("norm/scale")


def _less_one(conversion: Conversion) -> Conversion:
    """llama.cpp stores Gemma's norm weights as 1 + w; the canonical layout keeps w."""
    return Conversion(conversion.source_shape, lambda w: conversion.convert(w) - 1.0)


def with_gguf_rope_factors(config: ModelConfig, fields: Mapping[str, Any],
                           checkpoint: "GGUFCheckpoint") -> ModelConfig:
    """Phi-3's LongRoPE, whose factors a GGUF carries as two tensors."""
    short, long = GGUF_PHI3_ROPE_FACTORS
    if short not in checkpoint.names:
        return config
    scaling = gguf_longrope(fields, checkpoint.read(short).reshape(-1),
                            checkpoint.read(long).reshape(-1))
    return config.replace(rope_scaling=scaling)


# --- Dispatch ---------------------------------------------------------------------------------


def load_weights(files: Any, *, dtype: str = "float32", place: Place | None = None,
                 plans: Plans | None = None) -> tuple[ModelConfig, Params]:
    """Loads `files` (anything with `.kind` "gguf" | "hf" and `.path`, or a plain path)."""
    kind, path = weights_kind_and_path(files)
    if kind == "gguf":
        return load_gguf(path, dtype=dtype, place=place, plans=plans)
    if kind == "hf":
        return load_hf(path, dtype=dtype, place=place, plans=plans)
    raise ValueError(
        f"cannot load weights of kind {kind!r} from {path}; load_weights reads 'gguf' files and "
        "'hf' safetensors directories"
    )


def weights_kind_and_path(files: Any) -> tuple[str, Path]:
    """`(kind, path)` of a ModelFiles-like object, or of a path: a .gguf file or an HF directory."""
    if not isinstance(files, (str, os.PathLike)):
        return files.kind, Path(files.path)
    path = Path(files)
    if path.is_dir():
        return "hf", path
    if path.suffix == ".gguf":
        return "gguf", path
    require_file(path)
    raise ValueError(f"{path} is neither a .gguf file nor an HF safetensors directory")


def require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")



# --- Mixtures of experts ------------------------------------------------------------------------
# HF saves one tensor per expert ({e} below); they are read as one stacked [E, ...] tensor
# (`StackedExperts`). GGUF files hold them stacked already (`ffn_*_exps`, [E, out, in]).

HF_MIXTRAL_NAMES = {
    "layers/mlp/router/kernel": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers/mlp/experts/gate": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w1.weight",
    "layers/mlp/experts/up": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w3.weight",
    "layers/mlp/experts/down": "model.layers.{i}.block_sparse_moe.experts.{{e}}.w2.weight",
}

HF_QWEN_MOE_NAMES = {
    "layers/mlp/router/kernel": "model.layers.{i}.mlp.gate.weight",
    "layers/mlp/experts/gate": "model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight",
    "layers/mlp/experts/up": "model.layers.{i}.mlp.experts.{{e}}.up_proj.weight",
    "layers/mlp/experts/down": "model.layers.{i}.mlp.experts.{{e}}.down_proj.weight",
    "layers/mlp/shared/gate/kernel": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "layers/mlp/shared/up/kernel": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "layers/mlp/shared/down/kernel": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "layers/mlp/shared/scale/kernel": "model.layers.{i}.mlp.shared_expert_gate.weight",
}

GGUF_MOE_NAMES = {
    "layers/mlp/router/kernel": "blk.{i}.ffn_gate_inp.weight",
    "layers/mlp/experts/gate": "blk.{i}.ffn_gate_exps.weight",
    "layers/mlp/experts/up": "blk.{i}.ffn_up_exps.weight",
    "layers/mlp/experts/down": "blk.{i}.ffn_down_exps.weight",
    "layers/mlp/shared/gate/kernel": "blk.{i}.ffn_gate_shexp.weight",
    "layers/mlp/shared/up/kernel": "blk.{i}.ffn_up_shexp.weight",
    "layers/mlp/shared/down/kernel": "blk.{i}.ffn_down_shexp.weight",
    "layers/mlp/shared/scale/kernel": "blk.{i}.ffn_gate_inp_shexp.weight",
}


def hf_moe_names(config: ModelConfig, hf_config: Mapping[str, Any]) -> dict[str, str]:
    """The expert tensors' names of an HF mixture (none for a dense model)."""
    if config.moe is None:
        return {}
    return HF_MIXTRAL_NAMES if hf_config.get("model_type") == "mixtral" else HF_QWEN_MOE_NAMES


def _swap_last_two(w: np.ndarray) -> np.ndarray:
    return w.swapaxes(-1, -2)


def moe_conversions(c: ModelConfig, *, gguf: bool = False) -> dict[str, Conversion]:
    """Conversions from stacked `[E, out, in]` expert weights and `[out, in]` Linear weights."""
    if c.moe is None:
        return {}
    D, F, E, S = c.hidden_size, c.intermediate_size, c.moe.num_experts, c.moe.shared_expert_size
    # llama.cpp keeps the shared expert's gate as a vector [D]; HF as a Linear [1, D].
    scale = Conversion((D,), _reshaped(D, 1)) if gguf else Conversion((1, D), _transposed)
    return {
        "layers/mlp/router/kernel": Conversion((E, D), _transposed),
        "layers/mlp/experts/gate": Conversion((E, F, D), _swap_last_two),
        "layers/mlp/experts/up": Conversion((E, F, D), _swap_last_two),
        "layers/mlp/experts/down": Conversion((E, D, F), _swap_last_two),
        "layers/mlp/shared/gate/kernel": Conversion((S, D), _transposed),
        "layers/mlp/shared/up/kernel": Conversion((S, D), _transposed),
        "layers/mlp/shared/down/kernel": Conversion((D, S), _transposed),
        "layers/mlp/shared/scale/kernel": scale,
    }


class StackedExperts:
    """A checkpoint in which each `{e}` name of `stacked` reads as the [E, ...] stack of its
    experts' tensors (`name.format(e=j)`), and those tensors are no longer listed on their own."""

    def __init__(self, checkpoint: Checkpoint, stacked: set[str], num_experts: int):
        self.origin = checkpoint.origin
        self._inner = checkpoint
        self._parts = {name: [name.format(e=j) for j in range(num_experts)] for name in stacked
                       if all(name.format(e=j) in checkpoint.names for j in range(num_experts))}
        consumed = {part for parts in self._parts.values() for part in parts}
        self.names = frozenset((checkpoint.names - consumed) | set(self._parts))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return self._inner.shape(name)
        shapes = {part: self._inner.shape(part) for part in self._parts[name]}
        first = self._parts[name][0]
        for part, shape in shapes.items():
            if shape != shapes[first]:
                raise ValueError(f"{self.origin}: expert tensor {part!r} has shape {shape}, but "
                                 f"{first!r} has {shapes[first]}; every expert must have one shape")
        return (len(shapes), *shapes[first])

    def read(self, name: str) -> np.ndarray:
        if name not in self._parts:
            return self._inner.read(name)
        return np.stack([self._inner.read(part) for part in self._parts[name]])


def stacked_experts(config: ModelConfig, slots: list[Slot], checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint`, reading the per-expert tensors of `slots` stacked (as it is without experts)."""
    if config.moe is None:
        return checkpoint
    stacked = {slot.source for slot in slots if "{e}" in slot.source}
    return StackedExperts(checkpoint, stacked, config.moe.num_experts)
