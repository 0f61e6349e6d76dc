"""PEFT LoRA adapter directories: `adapter_config.json` and `adapter_model.safetensors`, and
`load_lora`, a directory -> `LoraAdapter` (canonical A and scaled B per projection).

PEFT names each tensor after the module it adapts, under the base model's own HF names:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

`LORA_MODULES` maps the module names of the llama architecture's families (Llama, Mistral,
Qwen2, Qwen3, Gemma, SmolLM2) to meshserve's projections (`meshserve.model.lora.LORA_TARGETS`).
Each tensor becomes the canonical layout the way the base kernels do (input first, heads split
out of the flat rows: `meshserve.model.families.llama`), stacked over layers:

    A  [L, in..., r]          lora_A.weight, transposed
    B  [L, r, out...] * s     lora_B.weight, transposed, times the scaling s

with s = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. A layer the adapter leaves
out (`layers_to_transform`) holds zeros.

What the slabs cannot serve is refused by name, with a `ValueError` that says what to change:
DoRA, `modules_to_save`, biases, per-module ranks or alphas, modules other than those above, a
projection the model does not have (a mixture's experts), a rank above `max_lora_rank`, tensors
whose shapes are not the model's, missing files and malformed configs.

This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from meshserve.model.canonical import expected_shapes, numpy_dtype
from meshserve.model.config import ModelConfig
from meshserve.model.loading.hf_files import SafetensorsCheckpoint

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF module name -> (meshserve projection, how many leading axes of its kernel are inputs).
LORA_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("layers/attn/q", 1),
    "k_proj": ("layers/attn/k", 1),
    "v_proj": ("layers/attn/v", 1),
    "o_proj": ("layers/attn/o", 2),
    "gate_proj": ("layers/mlp/gate", 1),
    "up_proj": ("layers/mlp/up", 1),
    "down_proj": ("layers/mlp/down", 1),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight")

# adapter_config.json fields the slabs cannot serve when set: field -> what it is.
REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained copies of modules (modules_to_save)",
    "lora_bias": "a bias on lora_B",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "fan_in_fan_out": "Conv1D-layout weights (fan_in_fan_out)",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated layers",
    "target_parameters": "adapted parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
}


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter, read and checked: its rank, its scaling (already in B) and, per projection
    path, A [L, in..., r] and scaled B [L, r, out...] in the model's dtype."""

    path: str
    rank: int
    scaling: float
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_lora(path: str | Path, config: ModelConfig, *, max_rank: int,
              head_multiple: int = 1) -> LoraAdapter:
    """Reads a PEFT LoRA directory for a model of `config`; refuses (ValueError, naming the
    field or file) what the slabs cannot serve (see the module docstring).

    `head_multiple` > 1: `config`'s head counts may have been padded up to a multiple of it (the
    mesh's `model` axis: `meshserve.sharding.head_padding`). The adapter's tensors then have
    the heads of the unpadded model, and any head count that pads to `config`'s is taken (the
    served model no longer knows its own); the arrays come back with those heads, and loading
    them into a slot pads them as the kernels were padded."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"lora_path {str(directory)!r} is not a directory; give the directory "
                         f"that save_pretrained wrote ({CONFIG_FILE}, {WEIGHTS_FILE})")
    fields = read_adapter_config(directory)
    rank, alpha = _rank_and_alpha(fields, directory)
    if rank > max_rank:
        raise ValueError(f"{directory / CONFIG_FILE}: rank r={rank} exceeds max_lora_rank="
                         f"{max_rank}; raise max_lora_rank to at least {rank}")
    _check_target_modules(fields.get("target_modules"), directory)
    scaling = alpha / math.sqrt(rank) if fields.get("use_rslora") else alpha / rank
    weights = _read_weights(directory, config, rank, scaling, fields.get("layers_to_transform"),
                            head_multiple)
    return LoraAdapter(path=str(directory), rank=rank, scaling=scaling, weights=weights)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name -> (in, out) features of its `nn.Linear` in a model of `config`: what
    lora_A [r, in] and lora_B [out, r] must be."""
    shapes = expected_shapes(config)
    found = {}
    for module, (target, num_inputs) in LORA_MODULES.items():
        kernel = shapes.get(f"{target}/kernel")
        if kernel is not None:
            found[module] = (math.prod(kernel[1:1 + num_inputs]),
                             math.prod(kernel[1 + num_inputs:]))
    return found


def write_lora(directory: str | Path, config: ModelConfig,
               weights: Mapping[str, tuple[np.ndarray, np.ndarray]], *, lora_alpha: float
               ) -> Path:
    """A PEFT LoRA directory for a model of `config`, as `save_pretrained` writes one: per HF
    module name, lora_A [L, r, in] and lora_B [L, out, r] (PEFT's orientation, every layer).
    `load_lora` reads it back, and PEFT's `PeftModel.from_pretrained` loads it."""
    from safetensors.numpy import save_file

    shapes = module_shapes(config)
    ranks = {a.shape[1] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"every module needs the same rank, got {sorted(ranks)}")
    (rank,) = ranks
    tensors = {}
    for module, (a, b) in weights.items():
        if module not in shapes:
            raise ValueError(f"{config.name} has no {module}; it has {sorted(shapes)}")
        fan_in, fan_out = shapes[module]
        if a.shape != (config.num_layers, rank, fan_in) or \
                b.shape != (config.num_layers, fan_out, rank):
            raise ValueError(f"{module}: lora_A must be {(config.num_layers, rank, fan_in)} and "
                             f"lora_B {(config.num_layers, fan_out, rank)}, got {a.shape} and "
                             f"{b.shape}")
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        for layer in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer], np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer], np.float32)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": lora_alpha,
        "target_modules": sorted(weights), "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": config.name}, indent=2) + "\n")
    return directory


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """The checked fields of `adapter_config.json`: a LoRA config using nothing refused."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory} has no {CONFIG_FILE}; save the adapter with PEFT's "
                         "save_pretrained")
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(fields, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(fields).__name__}")
    if fields.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type is {fields['peft_type']!r}; only LORA adapters "
                         "are served")
    for field, what in REFUSED_FIELDS.items():
        if fields.get(field):
            raise ValueError(f"{path}: {field} is set, but {what} is not supported; train the "
                             f"adapter without it")
    if fields.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias is {fields['bias']!r}; only bias 'none' is supported "
                         "(LoRA biases are not served)")
    return fields


def _rank_and_alpha(fields: Mapping[str, Any], directory: Path) -> tuple[int, float]:
    path = directory / CONFIG_FILE
    rank, alpha = fields.get("r"), fields.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{path}: r must be an int >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _check_target_modules(targets: Any, directory: Path) -> None:
    """A list of module names must name only `LORA_MODULES`; a pattern (a string) is checked
    module by module against the tensors instead."""
    if isinstance(targets, str):
        return
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{directory / CONFIG_FILE}: target_modules must be a list of module "
                         f"names or a pattern, got {targets!r}")
    unknown = [name for name in targets if name not in LORA_MODULES]
    if unknown:
        raise ValueError(f"{directory / CONFIG_FILE}: target_modules {unknown} are not "
                         f"supported; LoRA can modify {sorted(LORA_MODULES)}")


def _read_weights(directory: Path, config: ModelConfig, rank: int, scaling: float,
                  layers_to_transform: Any, head_multiple: int
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every projection's stacked A and scaled B, from the safetensors file."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if (directory / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{directory} has no {WEIGHTS_FILE}{other}")
    layers = _adapted_layers(layers_to_transform, config, directory)
    dtype = numpy_dtype(config.dtype)
    with ExitStack() as stack:
        checkpoint = SafetensorsCheckpoint(path, [path], stack)
        found = _tensor_names(checkpoint.names, config, path)
        shapes = expected_shapes(_unpadded(config, checkpoint, found, head_multiple))
        weights = {}
        for module, names in sorted(found.items()):
            target, num_inputs = LORA_MODULES[module]
            kernel = shapes.get(f"{target}/kernel")
            if kernel is None:
                raise ValueError(f"{path}: the adapter modifies {module}, which this model "
                                 f"({config.name}) does not have")
            ins, outs = kernel[1:1 + num_inputs], kernel[1 + num_inputs:]
            missing = [(layer, ab) for layer in layers for ab in "AB" if (layer, ab) not in names]
            if missing:
                layer, ab = missing[0]
                raise ValueError(f"{path}: {module} has no lora_{ab} tensor for layer {layer}; "
                                 "the file is incomplete")
            a = np.zeros((config.num_layers, *ins, rank), dtype)
            b = np.zeros((config.num_layers, rank, *outs), dtype)
            for layer in layers:
                lora_a = _tensor(checkpoint, names[layer, "A"], (rank, math.prod(ins)))
                lora_b = _tensor(checkpoint, names[layer, "B"], (math.prod(outs), rank))
                a[layer] = lora_a.T.reshape(*ins, rank)
                b[layer] = (lora_b.T * scaling).reshape(rank, *outs)
            weights[target] = (a, b)
    if not weights:
        raise ValueError(f"{path} holds no LoRA tensors")
    return weights


def _unpadded(config: ModelConfig, checkpoint: SafetensorsCheckpoint,
              found: Mapping[str, Mapping[tuple[int, str], str]], multiple: int) -> ModelConfig:
    """`config` with the head counts of the adapter's own model: those its first attention
    tensor spells, when they pad up to `config`'s (a multiple of `multiple`); else `config`, whose
    shapes then name the mismatch."""
    if multiple == 1:
        return config
    group, h = config.num_heads // config.num_kv_heads, config.head_dim
    heads_axis = {"k_proj": ("B", 0, h), "v_proj": ("B", 0, h), "q_proj": ("B", 0, group * h),
                  "o_proj": ("A", 1, group * h)}  # the tensor and axis that hold heads * h
    for module, (ab, axis, per_kv_head) in heads_axis.items():
        names = [name for (_, which), name in found.get(module, {}).items() if which == ab]
        if names:
            size = checkpoint.shape(names[0])[axis]
            kv_heads = size // per_kv_head
            if size % per_kv_head == 0 and kv_heads >= 1 \
                    and -(-kv_heads // multiple) * multiple == config.num_kv_heads:
                return config.replace(num_heads=kv_heads * group, num_kv_heads=kv_heads)
            return config
    return config


def _adapted_layers(layers_to_transform: Any, config: ModelConfig, directory: Path) -> list[int]:
    if layers_to_transform is None:
        return list(range(config.num_layers))
    layers = [layers_to_transform] if isinstance(layers_to_transform, int) \
        else layers_to_transform
    if not isinstance(layers, list) or not all(
            isinstance(i, int) and 0 <= i < config.num_layers for i in layers):
        raise ValueError(f"{directory / CONFIG_FILE}: layers_to_transform must list layers of "
                         f"0..{config.num_layers - 1}, got {layers_to_transform!r}")
    return sorted(set(layers))


def _tensor_names(names: frozenset[str], config: ModelConfig, path: Path
                  ) -> dict[str, dict[tuple[int, str], str]]:
    """module -> {(layer, "A" or "B"): tensor name}; any other tensor is refused by name."""
    found: dict[str, dict[tuple[int, str], str]] = {}
    for name in sorted(names):
        match = _KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{path}: tensor {name!r} is not a LoRA weight of a supported "
                             f"module ({sorted(LORA_MODULES)} of model.layers)")
        layer, parent, module, ab = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_MODULES or (parent == "mlp") != module.endswith(
                ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{path}: tensor {name!r} modifies {parent}.{module}, which is "
                             f"not supported; LoRA can modify {sorted(LORA_MODULES)}")
        if layer >= config.num_layers:
            raise ValueError(f"{path}: tensor {name!r} is for layer {layer}, but the model has "
                             f"{config.num_layers} layers; the adapter is for another model")
        found.setdefault(module, {})[layer, ab] = name
    return found


def _tensor(checkpoint: SafetensorsCheckpoint, name: str, shape: tuple[int, int]) -> np.ndarray:
    """The tensor as float32, checked against the shape the model needs."""
    actual = checkpoint.shape(name)
    if actual != shape:
        raise ValueError(f"{checkpoint.origin}: tensor {name!r} has shape {actual}, but this "
                         f"model needs {shape}; the adapter is for another model or rank")
    value = np.asarray(checkpoint.read(name), np.float32)
    if not np.isfinite(value).all():
        raise ValueError(f"{checkpoint.origin}: tensor {name!r} has NaN or infinite values")
    return value
